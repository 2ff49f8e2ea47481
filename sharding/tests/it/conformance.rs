//! The sharding conformance runner: applies the oracle's pass rules (see
//! `testdata/oracle/README.md`) to one JSON record. Shared by the `sharding_conformance` example
//! and the integration test. Beyond the oracle's own rules 1–6 it checks XLA's predicates,
//! `num_devices` and `is_fully_replicated` (rule 7), and shards a real array against the
//! record's index map and `device_put` outcome (rule 8).

use meshwork_sharding::{
    AxisType, DimSpec, Error, HloSharding, Mesh, Mode, NamedSharding, PartitionSpec, ShardIndex,
    Sharding, SubgroupType, TileAssignment, assemble, shard,
};
use meshwork_types::DeviceId;
use ndarray::{ArrayD, IxDyn, Slice};
use serde_json::Value;

/// The oracle's normalised class for one of our errors.
pub(crate) fn class(error: &Error) -> &'static str {
    match error {
        Error::DuplicateSpecAxis { .. } => "duplicate_axis",
        Error::UnknownSpecAxis { .. } => "unknown_axis",
        Error::UnreducedAxisType { .. } => "unreduced_axis_type",
        Error::SpecLongerThanRank { .. }
        | Error::SpecTooLong { .. }
        | Error::RankMismatch { .. } => "rank_mismatch",
        Error::UnconstrainedEntry { .. } => "unconstrained_unsupported",
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
    let (hlo, mut assignment, named) = if rec["kind"] == "named" {
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
        check_fully_replicated(rec, named.is_fully_replicated(), bad);
        let Some(hlo) = expect_stage(rec, "hlo", named.to_hlo(shape.len()), bad) else {
            return Ok(());
        };
        (hlo, mesh.devices().to_vec(), Some(named))
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
        (hlo, assignment, None)
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
            check_fully_replicated(rec, named_devices.is_fully_replicated(), bad);
            check_shard_shape(rec, &named_devices, &shape, bad);
            check_formula(rec, &named_devices, &shape, bad)?;
            if !rec["device_put"].is_null() {
                bad.push("jax puts data on a tile/device count mismatch".to_owned());
            }
            return Ok(());
        }
        Err(e) => {
            bad.push(format!("binding to the device assignment failed: {e}"));
            return Ok(());
        }
    };
    if named.is_none() {
        check_fully_replicated(rec, sharding.is_fully_replicated(), bad);
    }
    check_shard_shape(rec, &sharding, &shape, bad);
    let map = sharding.index_map(&shape, Mode::Strict);
    if let Some(map) = expect_stage(rec, "devices_indices_map", map, bad) {
        let ours = jax_indices(&sharding, &shape, &map);
        if rec["indices"] != ours {
            bad.push(format!("indices differ: ours {ours}"));
        }
        // What placing data takes: a NamedSharding bound for the array's rank (which
        // refuses what JAX's device_put refuses), or the GSPMD sharding itself.
        let placed = match &named {
            Some(named) => named.to_sharding(shape.len()),
            None => Ok(sharding.clone()),
        };
        check_data(rec, &sharding, placed, &shape, bad)?;
    } else if !rec["device_put"].is_null() {
        bad.push("jax cross-checks device_put where we have no index map".to_owned());
    }
    check_formula(rec, &sharding, &shape, bad)
}

/// `is_fully_replicated`, where the record has it.
fn check_fully_replicated(rec: &Value, ours: bool, bad: &mut Vec<String>) {
    if let Some(jax) = rec["is_fully_replicated"].as_bool()
        && jax != ours
    {
        bad.push(format!("is_fully_replicated: jax {jax}, ours {ours}"));
    }
}

/// The outcome of sharding a real array (`0..n` in the global shape) with the crate's
/// `shard` and assembling it back, in the terms of the record's `device_put`.
#[derive(Debug, PartialEq)]
struct Put {
    /// Shards placed; a maximal sharding counts every device of the assignment, as JAX
    /// puts the whole array on each.
    num_shards: usize,
    /// Every shard's device and region are the ones the record's `indices` list.
    matches_indices_map: bool,
    /// Every shard's data is the slice of the array that the record's `indices` name for
    /// its device.
    all_data_ok: bool,
    /// Assembling the shards gives the array back.
    reassembled_ok: bool,
}

/// Rule 8: shards a real array and checks every device's block against the slice the
/// record's index map names for that device, and assembles it back. Where the record
/// cross-checked JAX's `device_put`, placing data must succeed or fail as it did (with
/// its error class), and the outcome must equal JAX's flags and shard count; where it
/// did not, every check must simply hold.
fn check_data(
    rec: &Value,
    sharding: &Sharding,
    placed: Result<Sharding, Error>,
    shape: &[usize],
    bad: &mut Vec<String>,
) -> Res<()> {
    let ours = put_real_array(rec, sharding, shape)?;
    let put = &rec["device_put"];
    match (put["ok"].as_bool(), placed) {
        (None, _) => {
            let all_ok = Put { num_shards: ours.num_shards, ..put_ok() };
            if ours != all_ok {
                bad.push(format!("sharding a real array: {ours:?}"));
            }
        }
        (Some(true), Ok(placed)) => {
            if &placed != sharding {
                bad.push(format!("data is placed by {placed:?}, indexed by {sharding:?}"));
            }
            let jax = Put {
                num_shards: put["num_shards"].as_u64().ok_or("device_put.num_shards")? as usize,
                matches_indices_map: put["matches_indices_map"] == true,
                all_data_ok: put["all_data_ok"] == true,
                reassembled_ok: put["reassembled_ok"] == true,
            };
            if ours != jax {
                bad.push(format!("device_put: jax {jax:?}, ours {ours:?}"));
            }
        }
        (Some(true), Err(e)) => {
            bad.push(format!("device_put: jax places the data, we fail with {e}"));
        }
        (Some(false), Ok(_)) => bad.push(format!(
            "device_put: jax fails with {}, we place the data",
            put["error"]["class"]
        )),
        (Some(false), Err(e)) => {
            if put["error"]["class"] != class(&e) {
                bad.push(format!(
                    "device_put: jax fails with {}, we with {} ({e})",
                    put["error"]["class"],
                    class(&e)
                ));
            }
        }
    }
    Ok(())
}

fn put_ok() -> Put {
    Put { num_shards: 0, matches_indices_map: true, all_data_ok: true, reassembled_ok: true }
}

/// Shards `0..n` laid out in `shape` with the crate's `shard`, compares each shard with
/// the record's `indices`, and assembles the shards back with the crate's `assemble`.
fn put_real_array(rec: &Value, sharding: &Sharding, shape: &[usize]) -> Res<Put> {
    let n: usize = shape.iter().product();
    let global =
        ArrayD::from_shape_vec(IxDyn(shape), (0..n as u64).collect()).map_err(|e| e.to_string())?;
    let shards = shard(&global.view(), sharding, Mode::Strict).map_err(|e| e.to_string())?;
    let indices = rec["indices"].as_array().ok_or("record without indices")?;
    let jax_region = |device: DeviceId| -> Res<Option<Vec<std::ops::Range<usize>>>> {
        let Some(entry) = indices.iter().find(|e| e["device"] == device.0) else {
            return Ok(None);
        };
        let ranges = entry["index"].as_array().ok_or("index is not a list")?;
        let ranges = ranges
            .iter()
            .map(|r| match usizes(r)?[..] {
                [start, stop] => Ok(start..stop),
                _ => Err(format!("not a [start, stop] pair: {r}")),
            })
            .collect::<Res<Vec<_>>>()?;
        Ok(Some(ranges))
    };
    let mut put = Put {
        num_shards: if matches!(sharding.hlo(), HloSharding::Maximal { .. }) {
            sharding.device_assignment().len()
        } else {
            shards.len()
        },
        ..put_ok()
    };
    if put.num_shards != indices.len() {
        put.matches_indices_map = false;
    }
    for s in &shards {
        let Some(region) = jax_region(s.device)? else {
            put.matches_indices_map = false;
            put.all_data_ok = false;
            continue;
        };
        put.matches_indices_map &= s.ranges == region;
        let want = global.slice_each_axis(|axis| Slice::from(region[axis.axis.index()].clone()));
        put.all_data_ok &= s.data == want;
    }
    let views: Vec<_> = shards.iter().map(|s| s.data.view()).collect();
    put.reassembled_ok =
        assemble(&views, sharding, shape, Mode::Strict).is_ok_and(|back| back == global);
    Ok(put)
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
    // XLA's predicates and device count (a tuple record has only `is_tuple`).
    let flags: [(&str, Value); 7] = [
        ("is_tuple", hlo.is_tuple().into()),
        ("is_replicated", hlo.is_replicated().into()),
        ("is_maximal", hlo.is_tile_maximal().into()),
        ("is_manual", hlo.is_manual().into()),
        ("is_tiled", hlo.is_tiled().into()),
        ("is_unreduced", hlo.is_unreduced().into()),
        ("num_devices", hlo.num_devices().into()),
    ];
    for (field, ours) in flags {
        if !hd[field].is_null() && hd[field] != ours {
            bad.push(format!("{field}: xla {}, ours {ours}", hd[field]));
        }
    }
    if hd["is_tuple"] == false {
        for field in ["is_replicated", "is_maximal", "num_devices"] {
            if hd[field].is_null() {
                bad.push(format!("record without hlo_sharding.{field}"));
            }
        }
    }
    // Without tiles, XLA's tile assignment is `[0]` and empty, or `[1]` naming the
    // maximal device.
    let untiled = match hlo {
        HloSharding::Maximal { device } => Some((vec![1], vec![*device])),
        HloSharding::Replicated | HloSharding::Manual | HloSharding::Unreduced => {
            Some((vec![0], vec![]))
        }
        _ => None,
    };
    if let Some((dims, devices)) = untiled
        && (hd["tile_assignment_dimensions"] != serde_json::json!(dims)
            || hd["tile_assignment_devices"] != serde_json::json!(devices))
    {
        bad.push(format!(
            "tile assignment {dims:?} {devices:?}, xla {} {}",
            hd["tile_assignment_dimensions"], hd["tile_assignment_devices"]
        ));
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
