//! The placer conformance runner: replays TF oracle cases (see
//! `testdata/oracle/README.md`). Shared by the `placer_conformance` example and the tests.

use std::collections::BTreeMap;

use meshwork_placer::{
    DeviceSet, GraphJson, OpJson, PlacerOptions, Registry, place, registry_from_catalog,
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
        }
    }
    Ok(bad)
}
