//! `meshwork shard`, `reshard` and `place`: look at shardings and placements.
//!
//! Every failure is one line naming the flag (or argument) at fault, status 2; output
//! goes through [`out`], so a closed pipe ends the command quietly.

use std::path::Path;

use meshwork_placer::{self as placer, DeviceSet, PlacerOptions};
use meshwork_sharding::{
    HloSharding, Mesh, Mode, NamedSharding, PartitionSpec, Sharding, describe, describe_reshard,
};
use meshwork_types::{DType, Shape};

use crate::args::{PlaceArgs, ReshardArgs, ShardArgs};
use crate::out::{Exit, out, outln};

/// The largest array `shard` and `reshard` take: 2^48 elements (1 PiB as f32). Their
/// plans never allocate per element, but counts past this are typing mistakes, and
/// keeping under it keeps every count and byte total far from overflow.
const MAX_ELEMENTS: usize = 1 << 48;

/// The largest mesh `shard` and `reshard` take: a reshard plan compares every target
/// shard with every source region, so its time grows with the square of the devices.
const MAX_MESH_DEVICES: usize = 8192;

/// The largest file `place` reads (a graph or an op catalog).
const MAX_FILE_BYTES: u64 = 64 << 20;

fn bad(flag: &str, e: impl std::fmt::Display) -> Exit {
    Exit::Usage(format!("--{flag}: {e}"))
}

/// The error as one line: an underlying message that spans lines (a parser quoting its
/// input, say) has its lines joined with "; ".
fn one_line(exit: Exit) -> Exit {
    match exit {
        Exit::Usage(message) => Exit::Usage(
            message
                .replace('\r', " ")
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("; "),
        ),
        other => other,
    }
}

/// `8,8` → `[8, 8]`.
fn dims(flag: &str, text: &str) -> Result<Vec<usize>, Exit> {
    text.split(',')
        .map(|d| {
            d.trim()
                .parse()
                .map_err(|_| bad(flag, format!("{text:?} is not a list of sizes like 8,8")))
        })
        .collect()
}

/// The array shape from `--shape`, refused when its element count overflows or passes
/// [`MAX_ELEMENTS`] — before anything is built from it.
fn array_shape(text: &str, command: &str) -> Result<Shape, Exit> {
    let dims = dims("shape", text)?;
    let shape = Shape::new(&dims).map_err(|e| bad("shape", e))?;
    if shape.num_elements() > MAX_ELEMENTS {
        return Err(bad(
            "shape",
            format!(
                "{dims:?} has {} elements; {command} takes arrays of at most 2^48 ({MAX_ELEMENTS}) elements",
                shape.num_elements()
            ),
        ));
    }
    Ok(shape)
}

/// The mesh from `--mesh 2x4 --axes a,b`.
fn mesh(text: &str, axes: &str, command: &str) -> Result<Mesh, Exit> {
    let sizes: Vec<usize> = text
        .split(['x', 'X', ','])
        .map(|d| {
            d.trim().parse().map_err(|_| bad("mesh", format!("{text:?} is not a mesh like 2x4")))
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<&str> = axes.split(',').map(str::trim).collect();
    if names.len() != sizes.len() {
        return Err(bad(
            "axes",
            format!("{} names for the {} dims of --mesh", names.len(), sizes.len()),
        ));
    }
    if let Some(i) = names.iter().position(|n| n.is_empty()) {
        return Err(bad("axes", format!("axis {} has an empty name", i + 1)));
    }
    if let Some(i) = (1..names.len()).find(|&i| names[..i].contains(&names[i])) {
        return Err(bad("axes", format!("axis name {:?} appears twice", names[i])));
    }
    match sizes.iter().try_fold(1usize, |n, &s| n.checked_mul(s)) {
        Some(n) if n <= MAX_MESH_DEVICES => {}
        _ => {
            return Err(bad(
                "mesh",
                format!(
                    "{text:?} has more than {MAX_MESH_DEVICES} devices, the most {command} takes"
                ),
            ));
        }
    }
    let axes: Vec<(&str, usize)> = names.iter().copied().zip(sizes).collect();
    Mesh::iota(&axes).map_err(|e| bad("mesh", e))
}

/// A PartitionSpec or an XLA sharding over `mesh`'s devices.
fn sharding(flag: &str, text: &str, mesh: &Mesh, rank: usize) -> Result<Sharding, Exit> {
    if text.trim_start().starts_with('{') {
        let hlo: HloSharding = text.parse().map_err(|e| bad(flag, e))?;
        Sharding::new(hlo, mesh.devices().to_vec()).map_err(|e| bad(flag, e))
    } else {
        let spec: PartitionSpec = text.parse().map_err(|e| bad(flag, e))?;
        let named = NamedSharding::new(mesh.clone(), spec).map_err(|e| bad(flag, e))?;
        named.to_sharding(rank).map_err(|e| bad(flag, e))
    }
}

/// `meshwork shard`.
pub(crate) fn shard(a: &ShardArgs) -> Result<(), Exit> {
    run_shard(a).map_err(one_line)
}

fn run_shard(a: &ShardArgs) -> Result<(), Exit> {
    let shape = array_shape(&a.array.shape, "shard")?;
    let dims = shape.dims();
    let mesh = mesh(&a.array.mesh, &a.array.axes, "shard")?;
    let s = sharding("spec", &a.spec, &mesh, dims.len())?;
    out(format_args!("{}", describe(&s, dims).map_err(|e| bad("spec", e))?))
}

/// `meshwork reshard`.
pub(crate) fn reshard(a: &ReshardArgs) -> Result<(), Exit> {
    run_reshard(a).map_err(one_line)
}

fn run_reshard(a: &ReshardArgs) -> Result<(), Exit> {
    let shape = array_shape(&a.array.shape, "reshard")?;
    let dims = shape.dims();
    let dtype: DType = a.dtype.parse().map_err(|e| bad("dtype", e))?;
    shape.byte_size(dtype).map_err(|e| bad("shape", e))?;
    let mesh = mesh(&a.array.mesh, &a.array.axes, "reshard")?;
    let from = sharding("from", &a.from, &mesh, dims.len())?;
    let to = sharding("to", &a.to, &mesh, dims.len())?;
    // Each sharding is checked on its own first, so the error names the flag at fault.
    from.index_map(dims, Mode::Strict).map_err(|e| bad("from", e))?;
    to.index_map(dims, Mode::Strict).map_err(|e| bad("to", e))?;
    let text = describe_reshard(&from, &to, dims, dtype).map_err(|e| bad("to", e))?;
    out(format_args!("{text}"))
}

fn full_name(d: &str) -> String {
    if d.starts_with('/') {
        d.to_string()
    } else {
        format!("/job:localhost/replica:0/task:0/device:{d}")
    }
}

/// Reads a JSON file named by `what` (`GRAPH.json` or `--ops`) as text: a regular
/// file of at most [`MAX_FILE_BYTES`] (a FIFO or device is refused without waiting).
fn read_json_file(what: &str, path: &Path) -> Result<String, Exit> {
    let bytes = meshwork_train::files::read_input(what, path, MAX_FILE_BYTES).map_err(|e| {
        let m = e.to_string();
        if m.ends_with("-byte limit") {
            Exit::Usage(format!(
                "{what}: {} is larger than {} MiB, the most meshwork place reads",
                path.display(),
                MAX_FILE_BYTES >> 20
            ))
        } else {
            Exit::Usage(m)
        }
    })?;
    String::from_utf8(bytes)
        .map_err(|e| Exit::Usage(format!("{what}: {} is not UTF-8 text ({e})", path.display())))
}

/// `meshwork place`.
pub(crate) fn place(a: &PlaceArgs) -> Result<(), Exit> {
    run_place(a).map_err(one_line)
}

fn run_place(a: &PlaceArgs) -> Result<(), Exit> {
    let graph_path = a.graph.as_path();
    let path = graph_path.display();
    let text = read_json_file("GRAPH.json", graph_path)?;
    let graph = placer::graph_from_json(&text).map_err(|e| Exit::Usage(format!("{path}: {e}")))?;
    // The node is looked for first: whether it exists depends on the graph alone.
    if let Some(node) = a.explain.as_deref()
        && graph.id(node).is_none()
    {
        return Err(bad("explain", format!("no node {node:?} in {path}")));
    }
    let catalog = match a.ops.as_deref() {
        Some(p) => {
            let catalog_text = read_json_file("--ops", p)?;
            let p = p.display();
            let value: serde_json::Value =
                serde_json::from_str(&catalog_text).map_err(|e| bad("ops", format!("{p}: {e}")))?;
            value.get("op_catalog").cloned().unwrap_or(value)
        }
        None => {
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Exit::Usage(format!("{path}: {e}")))?;
            value.get("op_catalog").or_else(|| value.get("ops")).cloned().ok_or_else(|| {
                Exit::Usage(format!(
                    "{path} has no \"op_catalog\"; give the op catalog with --ops CATALOG.json"
                ))
            })?
        }
    };
    let catalog = serde_json::from_value(catalog).map_err(|e| match a.ops.as_deref() {
        Some(p) => bad("ops", format!("{} is not an op catalog: {e}", p.display())),
        None => Exit::Usage(format!("{path}: its \"op_catalog\" is not an op catalog: {e}")),
    })?;
    let registry = placer::registry_from_catalog(&catalog);
    let names: Vec<String> = a.devices.split(',').map(|d| full_name(d.trim())).collect();
    let devices = DeviceSet::new(&names).map_err(|e| bad("devices", e))?;
    let options = PlacerOptions { allow_soft_placement: a.soft, ..PlacerOptions::default() };
    if let Some(node) = a.explain.as_deref() {
        let why = placer::explain(&graph, &devices, &registry, options, node)
            .map_err(|e| Exit::Usage(format!("{path}: {e}")))?;
        outln!("{why}");
        return Ok(());
    }
    let placement = placer::place(&graph, &devices, &registry, options)
        .map_err(|e| Exit::Usage(format!("{path}: {e}")))?;
    if a.dot {
        out(format_args!("{}", placer::to_dot(&graph, &devices, &placement)))?;
        return Ok(());
    }
    out(format_args!("{}", placer::table(&graph, &devices, &placement)))
}
