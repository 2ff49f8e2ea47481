//! The sharding conformance runner: applies the oracle's pass rules (see
//! `testdata/oracle/README.md`) to one JSON record. Shared by the `sharding_conformance` example
//! and the integration test.

use meshwork_sharding::{
    AxisType, DimSpec, Error, HloSharding, Mesh, Mode, NamedSharding, PartitionSpec, ShardIndex,
    Sharding, SubgroupType, TileAssignment,
};
use meshwork_types::DeviceId;
use serde_json::Value;

/// The oracle's normalised class for one of our errors.
pub(crate) fn class(error: &Error) -> &'static str {
    match error {
        Error::DuplicateSpecAxis { .. } => "duplicate_axis",
        Error::UnknownSpecAxis { .. } => "unknown_axis",
        Error::UnreducedAxisType { .. } => "unreduced_axis_type",
        Error::SpecLongerThanRank { .. } | Error::RankMismatch { .. } => "rank_mismatch",
        Error::Indivisible { .. } => "indivisible",
        Error::Unreduced => "unreduced_unsupported",
        Error::Manual => "manual_or_subgroup_unsupported",
        Error::Parse { .. } => "hlo_parse_error",
        Error::MeshAxisCount { .. }
        | Error::DuplicateMeshAxis { .. }
        | Error::EmptyMeshAxis { .. }
        | Error::MeshDeviceCount { .. }
        | Error::MeshTooLarge { .. }
        | Error::DuplicateDevice { .. } => "mesh_invalid",
        _ => "other",
    }
}

/// Checks one record; returns what disagreed (empty when it passes).
pub(crate) fn check(rec: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    if let Err(e) = check_inner(rec, &mut bad) {
        bad.push(e);
    }
    bad
}

type Res<T> = Result<T, String>;

fn stage_error<'a>(rec: &'a Value, stage: &str) -> Option<&'a str> {
    rec["errors"].as_array()?.iter().find(|e| e["stage"] == stage)?["class"].as_str()
}

fn usizes(v: &Value) -> Res<Vec<usize>> {
    v.as_array()
        .ok_or_else(|| format!("expected a list, got {v}"))?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize).ok_or_else(|| format!("not an int: {x}")))
        .collect()
}

fn strings(v: &Value) -> Res<Vec<String>> {
    v.as_array()
        .ok_or_else(|| format!("expected a list, got {v}"))?
        .iter()
        .map(|x| x.as_str().map(str::to_owned).ok_or_else(|| format!("not a string: {x}")))
        .collect()
}

fn devices(v: &Value) -> Res<Vec<DeviceId>> {
    Ok(usizes(v)?.into_iter().map(|d| DeviceId(d as u32)).collect())
}

fn subgroup_types(v: &Value) -> Res<Vec<SubgroupType>> {
    strings(v)?
        .iter()
        .map(|t| match t.as_str() {
            "MANUAL" => Ok(SubgroupType::Manual),
            "REPLICATED" => Ok(SubgroupType::Replicated),
            "UNREDUCED" => Ok(SubgroupType::Unreduced),
            other => Err(format!("unknown subgroup type {other}")),
        })
        .collect()
}

/// Compares an outcome with the record's error at `stage`. Returns the value when both
/// succeeded.
fn expect_stage<T>(
    rec: &Value,
    stage: &str,
    outcome: Result<T, Error>,
    bad: &mut Vec<String>,
) -> Option<T> {
    match (outcome, stage_error(rec, stage)) {
        (Ok(v), None) => Some(v),
        (Ok(_), Some(cls)) => {
            bad.push(format!("{stage}: jax fails with {cls}, we succeed"));
            None
        }
        (Err(e), None) => {
            bad.push(format!("{stage}: we fail with {e} ({}), jax succeeds", class(&e)));
            None
        }
        (Err(e), Some(cls)) => {
            if class(&e) != cls {
                bad.push(format!("{stage}: we fail with {} ({e}), jax with {cls}", class(&e)));
            }
            None
        }
    }
}

fn check_inner(rec: &Value, bad: &mut Vec<String>) -> Res<()> {
    let shape = usizes(&rec["global_shape"])?;
    let (hlo, mut assignment) = if rec["kind"] == "named" {
        let m = &rec["mesh"];
        let types = strings(&m["axis_types"])?
            .iter()
            .map(|t| match t.as_str() {
                "Explicit" => AxisType::Explicit,
                "Manual" => AxisType::Manual,
                _ => AxisType::Auto,
            })
            .collect();
        let mesh = Mesh::with_types(
            strings(&m["axis_names"])?,
            usizes(&m["shape"])?,
            types,
            devices(&m["device_ids"])?,
        );
        let Some(mesh) = expect_stage(rec, "mesh", mesh, bad) else {
            return Ok(());
        };
        let entries = rec["spec"]
            .as_array()
            .ok_or("spec is not a list")?
            .iter()
            .map(|e| match e {
                Value::Null => Ok(DimSpec::Replicated),
                Value::String(s) if s == "UNCONSTRAINED" => Ok(DimSpec::Unconstrained),
                Value::String(s) => Ok(DimSpec::Axes(vec![s.clone()])),
                list => Ok(DimSpec::Axes(strings(list)?)),
            })
            .collect::<Res<Vec<_>>>()?;
        let spec = PartitionSpec::new(entries)
            .with_unreduced(strings(&rec["unreduced"])?)
            .with_reduced(strings(&rec["reduced"])?);
        // The text form must roundtrip too.
        let reparsed: Result<PartitionSpec, _> = spec.to_string().parse();
        if reparsed.as_ref() != Ok(&spec) {
            bad.push(format!("spec text {spec} reparses as {reparsed:?}"));
        }
        let Some(named) =
            expect_stage(rec, "sharding", NamedSharding::new(mesh.clone(), spec), bad)
        else {
            return Ok(());
        };
        let Some(hlo) = expect_stage(rec, "hlo", named.to_hlo(shape.len()), bad) else {
            return Ok(());
        };
        (hlo, mesh.devices().to_vec())
    } else {
        let built: Result<HloSharding, Error> = match rec["subkind"].as_str().unwrap_or("") {
            "iota" => TileAssignment::iota(
                usizes(&rec["tile_dims"])?,
                &usizes(&rec["reshape_dims"])?,
                &usizes(&rec["transpose_perm"])?,
            )
            .and_then(|t| {
                HloSharding::subgroup(
                    t,
                    &subgroup_types(&rec["subgroup_types"]).unwrap_or_default(),
                )
            }),
            "explicit" => TileAssignment::explicit(
                usizes(&rec["tile_dims"])?,
                usizes(&rec["tile_assignment_flat"])?,
            )
            .and_then(|t| {
                HloSharding::subgroup(
                    t,
                    &subgroup_types(&rec["subgroup_types"]).unwrap_or_default(),
                )
            }),
            "replicated" => Ok(HloSharding::Replicated),
            "manual" => Ok(HloSharding::Manual),
            "tuple_leaf" => {
                rec["hlo_sharding"]["string"].as_str().ok_or("leaf without string")?.parse()
            }
            _ => rec["input_string"].as_str().ok_or("no input_string")?.parse(),
        };
        let Some(hlo) = expect_stage(rec, "hlo", built, bad) else {
            return Ok(());
        };
        let assignment = match &rec["device_assignment"] {
            Value::Null => devices(&rec["device_ids"])?,
            list => devices(list)?,
        };
        (hlo, assignment)
    };
    check_hlo(rec, &hlo, bad)?;
    if let HloSharding::Tuple(leaves) = &hlo {
        let records = rec["tuple_leaves"].as_array().ok_or("tuple without tuple_leaves")?;
        if records.len() != leaves.len() {
            bad.push(format!("tuple has {} leaves, record {}", leaves.len(), records.len()));
        }
        for (i, leaf) in records.iter().enumerate() {
            for b in check(leaf) {
                bad.push(format!("leaf {i}: {b}"));
            }
        }
        return Ok(());
    }
    let sharding = match Sharding::new(hlo.clone(), assignment.clone()) {
        Ok(s) => s,
        // JAX builds a GSPMDSharding whose tiles name fewer devices than its device
        // list, then fails `devices_indices_map` with a bare AssertionError (which the
        // generator labels manual_or_subgroup_unsupported). We refuse such a binding up
        // front; check that JAX's map failed, and check the shard shape and XLA's
        // regions over the devices the tiles do name.
        Err(Error::DeviceCountMismatch { sharding_devices, assignment_devices })
            if sharding_devices < assignment_devices =>
        {
            if stage_error(rec, "devices_indices_map").is_none() {
                bad.push("we refuse a tile/device count mismatch that jax maps".to_owned());
            }
            assignment.truncate(sharding_devices);
            let named_devices = Sharding::new(hlo, assignment).map_err(|e| e.to_string())?;
            check_shard_shape(rec, &named_devices, &shape, bad);
            check_formula(rec, &named_devices, &shape, bad)?;
            return Ok(());
        }
        Err(e) => {
            bad.push(format!("binding to the device assignment failed: {e}"));
            return Ok(());
        }
    };
    check_shard_shape(rec, &sharding, &shape, bad);
    let map = sharding.index_map(&shape, Mode::Strict);
    if let Some(map) = expect_stage(rec, "devices_indices_map", map, bad) {
        let ours = jax_indices(&sharding, &shape, &map);
        if rec["indices"] != ours {
            bad.push(format!("indices differ: ours {ours}"));
        }
    }
    check_formula(rec, &sharding, &shape, bad)
}

/// Rule 5: XLA's ceil-division regions, for every device the record lists.
fn check_formula(
    rec: &Value,
    sharding: &Sharding,
    shape: &[usize],
    bad: &mut Vec<String>,
) -> Res<()> {
    if let Some(formula) = rec["xla_formula"].as_array().filter(|f| !f.is_empty()) {
        match sharding.tile_regions(shape) {
            Err(e) => bad.push(format!("XLA tile regions failed: {e}")),
            Ok(regions) => {
                for entry in formula {
                    let device = DeviceId(entry["device"].as_u64().ok_or("device")? as u32);
                    let want = entry["index"].clone();
                    match regions.iter().find(|s| s.device == device) {
                        Some(s) if ranges_json(s) == want => {}
                        other => bad.push(format!(
                            "xla_formula: device {device} wants {want}, ours {other:?}"
                        )),
                    }
                }
                if regions.len() != formula.len() {
                    bad.push(format!(
                        "xla_formula lists {} devices, we {}",
                        formula.len(),
                        regions.len()
                    ));
                }
                // Where the uneven index map exists, it is exactly these regions.
                if let Ok(map) = sharding.index_map(shape, Mode::Uneven)
                    && map != regions
                {
                    bad.push("uneven index map differs from XLA's tile regions".to_owned());
                }
            }
        }
    }
    Ok(())
}

/// Rule 3: the strict shard shape, or the record's error class.
fn check_shard_shape(rec: &Value, sharding: &Sharding, shape: &[usize], bad: &mut Vec<String>) {
    let shard_shape = sharding.shard_shape(shape, Mode::Strict);
    if let Some(ss) = expect_stage(rec, "shard_shape", shard_shape, bad)
        && rec["shard_shape"] != serde_json::json!(ss)
    {
        bad.push(format!("shard_shape {ss:?}, jax {}", rec["shard_shape"]));
    }
}

fn ranges_json(s: &ShardIndex) -> Value {
    Value::Array(s.ranges.iter().map(|r| serde_json::json!([r.start, r.end])).collect())
}

/// JAX's `devices_indices_map` list for our index map: JAX lists a maximal sharding as
/// held whole by every device.
fn jax_indices(sharding: &Sharding, shape: &[usize], map: &[ShardIndex]) -> Value {
    let entries: Vec<Value> = if matches!(sharding.hlo(), HloSharding::Maximal { .. }) {
        let full: Vec<Value> = shape.iter().map(|&d| serde_json::json!([0, d])).collect();
        sharding
            .device_assignment()
            .iter()
            .enumerate()
            .map(|(i, d)| serde_json::json!({"device": d.0, "index": full, "replica_id": i}))
            .collect()
    } else {
        map.iter()
            .map(|s| serde_json::json!({"device": s.device.0, "index": ranges_json(s), "replica_id": s.replica_id}))
            .collect()
    };
    Value::Array(entries)
}

/// Rule 2: the printed string and the tile details.
fn check_hlo(rec: &Value, hlo: &HloSharding, bad: &mut Vec<String>) -> Res<()> {
    let hd = &rec["hlo_sharding"];
    let want = hd["string"].as_str().ok_or("record without hlo_sharding.string")?;
    let printed = hlo.to_string();
    if printed != want {
        bad.push(format!("printed {printed}, xla {want}"));
    }
    match hlo.to_string().parse::<HloSharding>() {
        Ok(back) if back == *hlo && back.to_string() == printed => {}
        other => bad.push(format!("print→parse of {printed} gives {other:?}")),
    }
    if let HloSharding::Tiled(tiled) = hlo {
        if hd["tile_assignment_dimensions"] != serde_json::json!(tiled.tiles().dims()) {
            bad.push(format!(
                "tile dims {:?}, xla {}",
                tiled.tiles().dims(),
                hd["tile_assignment_dimensions"]
            ));
        }
        if hd["tile_assignment_devices"] != serde_json::json!(tiled.tiles().devices()) {
            bad.push(format!(
                "tile devices {:?}, xla {}",
                tiled.tiles().devices(),
                hd["tile_assignment_devices"]
            ));
        }
        let types = subgroup_types(&hd["subgroup_types"])?;
        if types != tiled.subgroup_types()
            || hd["replicate_on_last_tile_dim"] != tiled.replicate_on_last_tile_dim()
        {
            bad.push(format!("subgroups {:?}, xla {types:?}", tiled.all_subgroup_types()));
        }
        if hd["is_tile_assignment_iota"] != tiled.tiles().iota_form().is_some() {
            bad.push("iota-ness differs".to_owned());
        }
    }
    Ok(())
}
