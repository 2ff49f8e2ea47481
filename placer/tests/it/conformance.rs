//! The placer conformance runner: replays TF oracle cases (see
//! `testdata/oracle/README.md`). Shared by the `placer_conformance` example and the tests.
//! A placement must match TF's node by node; an error must match TF's class, blamed node,
//! the pair of nodes and the merge conflict TF's message names.

use std::collections::BTreeMap;

use meshwork_placer::{
    DeviceSet, Error, GraphJson, OpJson, PlacerOptions, Registry, place, registry_from_catalog,
};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Header {
    op_catalog: BTreeMap<String, OpJson>,
}

/// The registry of the header line.
pub(crate) fn registry(header: &str) -> Result<Registry, String> {
    let header: Header = serde_json::from_str(header).map_err(|e| format!("header: {e}"))?;
    Ok(registry_from_catalog(&header.op_catalog))
}

/// Checks one case; returns what disagreed (empty when it passes).
pub(crate) fn check(registry: &Registry, line: &str) -> Vec<String> {
    match check_inner(registry, line) {
        Ok(bad) => bad,
        Err(e) => vec![e],
    }
}

fn check_inner(registry: &Registry, line: &str) -> Result<Vec<String>, String> {
    let case: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let graph_json: GraphJson =
        serde_json::from_value(serde_json::json!({ "nodes": case["nodes"] }))
            .map_err(|e| e.to_string())?;
    let graph = graph_json.to_graph().map_err(|e| format!("graph: {e}"))?;
    let names: Vec<String> =
        serde_json::from_value(case["devices"].clone()).map_err(|e| e.to_string())?;
    let devices = DeviceSet::new(&names).map_err(|e| format!("devices: {e}"))?;
    let options = PlacerOptions {
        allow_soft_placement: case["config"]["allow_soft_placement"].as_bool().unwrap_or(false),
        log_device_placement: false,
    };
    let want = &case["result"];
    let got = place(&graph, &devices, registry, options);
    let mut bad = Vec::new();
    match (want["status"].as_str(), got) {
        (Some("ok"), Ok(placement)) => {
            for (id, node) in graph.nodes() {
                let ours = devices.devices()[placement.device(id)].name();
                if want["placement"][&node.name] != ours {
                    bad.push(format!(
                        "{}: ours {ours}, tf {}",
                        node.name, want["placement"][&node.name]
                    ));
                }
            }
        }
        (Some("ok"), Err(e)) => bad.push(format!("tf places the graph, we fail: {e}")),
        (_, Ok(_)) => bad.push(format!(
            "tf fails with {} on {}, we place the graph",
            want["error_class"], want["error_node"]
        )),
        (_, Err(e)) => {
            if want["error_class"] != e.tf_class() {
                bad.push(format!("tf class {}, ours {} ({e})", want["error_class"], e.tf_class()));
            }
            let tf_node = want["error_node"].as_str();
            if tf_node != e.node() {
                bad.push(format!("tf blames {tf_node:?}, we blame {:?} ({e})", e.node()));
            }
            let message = want["message"].as_str().unwrap_or_default();
            // The second node: TF's message names a pair for colocation and
            // ref/resource-edge failures.
            let tf_pair = message_pair(message);
            let ours = e.node_pair();
            if tf_pair.as_ref().map(|(a, b)| (a.as_str(), b.as_str())) != ours {
                bad.push(format!("tf names nodes {tf_pair:?}, we name {ours:?} ({e})"));
            }
            // The merge conflict: the oracle's field (set for `cannot_colocate_merge`),
            // and the field and both names wherever the message has TF's merge error.
            let ours = e.merge_conflict();
            if let Some(field) = want["merge_conflict"].as_str()
                && ours.map(|c| c.field.plural()) != Some(field)
            {
                bad.push(format!("tf merge conflict in {field}, ours {ours:?} ({e})"));
            }
            let tf_merge = message_merge(message);
            let ours = ours.map(|c| (c.field.plural(), c.target.as_str(), c.other.as_str()));
            if tf_merge != ours {
                bad.push(format!("tf cannot merge {tf_merge:?}, we cannot merge {ours:?} ({e})"));
            }
            // A resource edge's two incompatible device names.
            if let (
                Some(tf_devices),
                Error::ResourceEdgeIncompatible { src_device, dst_device, .. },
            ) = (message_resource_devices(message), &e)
                && tf_devices != (src_device.as_str(), dst_device.as_str())
            {
                bad.push(format!("tf resource devices {tf_devices:?} ({e})"));
            }
        }
    }
    Ok(bad)
}

/// The text between `start` and the next `end` after it.
fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<(&'a str, &'a str)> {
    let from = text.find(start)? + start.len();
    let len = text[from..].find(end)?;
    Some((&text[from..from + len], &text[from + len + end.len()..]))
}

/// The pair of nodes in TF's `Cannot colocate nodes {{colocation_node A}} and
/// {{colocation_node B}}` or `The edge src node is name='A' (...), and the dst node is
/// name='B'`.
fn message_pair(message: &str) -> Option<(String, String)> {
    if let Some((a, rest)) = between(message, "Cannot colocate nodes {{colocation_node ", "}}") {
        let (b, _) = between(rest, " and {{colocation_node ", "}}")?;
        return Some((a.to_owned(), b.to_owned()));
    }
    let (a, rest) = between(message, "The edge src node is name='", "'")?;
    let (b, _) = between(rest, "the dst node is name='", "'")?;
    Some((a.to_owned(), b.to_owned()))
}

/// The field and the two names of TF's `Cannot merge devices with incompatible F: 'A'
/// and 'B'`.
fn message_merge(message: &str) -> Option<(&str, &str, &str)> {
    let (field, rest) = between(message, "Cannot merge devices with incompatible ", ": '")?;
    let (a, rest) = rest.split_once('\'')?;
    let (b, _) = between(rest, " and '", "'")?;
    Some((field, a, b))
}

/// The two device names of TF's `... with incompatible resource devices: A vs B.`.
fn message_resource_devices(message: &str) -> Option<(&str, &str)> {
    let (devices, _) = between(message, "incompatible resource devices: ", ". ")?;
    devices.split_once(" vs ")
}
