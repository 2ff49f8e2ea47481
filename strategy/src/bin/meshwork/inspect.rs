//! `meshwork shard`, `reshard` and `place`: look at shardings and placements.
//!
//! Every failure is one line naming the flag (or argument) at fault, status 2; output
//! goes through [`args::out`], so a closed pipe ends the command quietly.

use std::io::Read;
use std::ops::Range;

use meshwork_strategy::placer::{self, DeviceSet, PlacerOptions};
use meshwork_strategy::sharding::{
    HloSharding, Mesh, Mode, NamedSharding, PartitionSpec, ReshardPlan, ShardIndex, Sharding,
    visualize,
};
use meshwork_strategy::types::{DType, Shape};

use crate::args::{self, Args, Exit, Usage, outln};

pub(crate) const HELP: &str = "\
meshwork shard --shape 8,8 --mesh 2x4 --axes a,b --spec \"P('a','b')\"
    Prints the shard shape, the XLA sharding and the index map (each device and the
    index ranges it holds, with its replica id where several devices hold the same
    block), and for arrays of rank 1 or 2 draws which device holds which block (no
    picture is drawn for rank 3 and up). --spec takes a JAX PartitionSpec over the
    named mesh axes, no longer than the array's rank, or an XLA sharding such as
    \"{devices=[2,4]<=[8]}\" over the mesh's devices.

meshwork reshard --shape 8,8 --mesh 2x4 --axes a,b --from SPEC --to SPEC [--dtype f32]
    The transfer plan between two shardings: the box copies, and the elements and
    bytes that cross devices against the array's total (its elements, and its bytes
    at --dtype). More than 100% crosses when the target replicates blocks onto
    devices that lacked them.

    shard and reshard take arrays of at most 2^48 elements and meshes of at most 8192
    devices, and no positional argument.

meshwork place GRAPH.json --devices CPU:0,CPU:1,GPU:0 [--ops CATALOG.json] [--soft]
                [--dot] [--explain NODE]
    Places a graph ({\"nodes\": [...]}, TensorFlow's placer rules) and prints node, op and
    device. The op catalog comes from --ops or the graph file's \"op_catalog\". Short
    device names get the /job:localhost/replica:0/task:0/device: prefix. --explain
    says why NODE landed where it did. Files of at most 64 MiB are read.
";

/// The largest array `shard` and `reshard` take: 2^48 elements (1 PiB as f32). Their
/// plans never allocate per element, but counts past this are typing mistakes, and
/// keeping under it keeps every count and byte total far from overflow.
const MAX_ELEMENTS: usize = 1 << 48;

/// The largest mesh `shard` and `reshard` take: a reshard plan compares every target
/// shard with every source region, so its time grows with the square of the devices.
const MAX_DEVICES: usize = 8192;

/// The largest file `place` reads (a graph or an op catalog).
const MAX_FILE_BYTES: u64 = 64 << 20;

fn bad(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
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

fn need<'a>(a: &'a Args, flag: &str, command: &str) -> Result<&'a str, Usage> {
    a.get(flag).ok_or_else(|| Usage(format!("--{flag} is required; see `meshwork help {command}`")))
}

/// `shard` and `reshard` take flags only.
fn no_positional(a: &Args, command: &str) -> Result<(), Usage> {
    match a.positional.first() {
        None => Ok(()),
        Some(extra) => Err(Usage(format!(
            "{command} takes no positional argument, but got {extra:?}; see `meshwork help {command}`"
        ))),
    }
}

/// The array shape from `--shape`, refused when its element count overflows or passes
/// [`MAX_ELEMENTS`] — before anything is built from it.
fn array_shape(a: &Args, command: &str) -> Result<Shape, Usage> {
    let dims = args::dims("shape", need(a, "shape", command)?)?;
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
fn mesh(a: &Args, command: &str) -> Result<Mesh, Usage> {
    let text = need(a, "mesh", command)?;
    let sizes: Vec<usize> = text
        .split(['x', 'X', ','])
        .map(|d| {
            d.trim().parse().map_err(|_| bad("mesh", format!("{text:?} is not a mesh like 2x4")))
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<&str> = need(a, "axes", command)?.split(',').map(str::trim).collect();
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
        Some(n) if n <= MAX_DEVICES => {}
        _ => {
            return Err(bad(
                "mesh",
                format!("{text:?} has more than {MAX_DEVICES} devices, the most {command} takes"),
            ));
        }
    }
    let axes: Vec<(&str, usize)> = names.iter().copied().zip(sizes).collect();
    Mesh::iota(&axes).map_err(|e| bad("mesh", e))
}

/// A PartitionSpec or an XLA sharding over `mesh`'s devices.
fn sharding(flag: &str, text: &str, mesh: &Mesh, rank: usize) -> Result<Sharding, Usage> {
    if text.trim_start().starts_with('{') {
        let hlo: HloSharding = text.parse().map_err(|e| bad(flag, e))?;
        Sharding::new(hlo, mesh.devices().to_vec()).map_err(|e| bad(flag, e))
    } else {
        let spec: PartitionSpec = text.parse().map_err(|e| bad(flag, e))?;
        let named = NamedSharding::new(mesh.clone(), spec).map_err(|e| bad(flag, e))?;
        named.to_sharding(rank).map_err(|e| bad(flag, e))
    }
}

/// `[0:4, 4:8, 0:2]`.
fn ranges(r: &[Range<usize>]) -> String {
    let parts: Vec<String> = r.iter().map(|r| format!("{}:{}", r.start, r.end)).collect();
    format!("[{}]", parts.join(", "))
}

pub(crate) fn shard(argv: &[String]) -> Result<(), Exit> {
    run_shard(argv).map_err(one_line)
}

fn run_shard(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, &["shape", "mesh", "axes", "spec"], &[])?;
    no_positional(&a, "shard")?;
    let shape = array_shape(&a, "shard")?;
    let dims = shape.dims();
    let mesh = mesh(&a, "shard")?;
    let s = sharding("spec", need(&a, "spec", "shard")?, &mesh, dims.len())?;
    // Everything is computed before anything is printed: a failure prints no half.
    let shard = s.shard_shape(dims, Mode::Strict).map_err(|e| bad("spec", e))?;
    let map: Vec<ShardIndex> = s.index_map(dims, Mode::Strict).map_err(|e| bad("spec", e))?;
    let picture = match dims.len() {
        1 | 2 => Some(visualize(&s, dims, Mode::Strict).map_err(|e| bad("spec", e))?),
        _ => None,
    };
    match picture {
        Some(picture) => outln!("{picture}"),
        None => {
            outln!("(no picture for rank {}: only arrays of rank 1 and 2 are drawn)", dims.len())
        }
    }
    outln!("shard shape: {shard:?} of {dims:?}");
    outln!("XLA sharding: {}", s.hlo());
    let replicated = map.iter().any(|e| e.replica_id > 0);
    outln!(
        "index map ({} devices: the index ranges each holds{}):",
        map.len(),
        if replicated { ", and which copy of its block" } else { "" }
    );
    for e in &map {
        if replicated {
            outln!("  device {}: {} (replica {})", e.device.0, ranges(&e.ranges), e.replica_id);
        } else {
            outln!("  device {}: {}", e.device.0, ranges(&e.ranges));
        }
    }
    Ok(())
}

pub(crate) fn reshard(argv: &[String]) -> Result<(), Exit> {
    run_reshard(argv).map_err(one_line)
}

fn run_reshard(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, &["shape", "mesh", "axes", "from", "to", "dtype"], &[])?;
    no_positional(&a, "reshard")?;
    let shape = array_shape(&a, "reshard")?;
    let dims = shape.dims();
    let dtype: DType = a.get("dtype").unwrap_or("f32").parse().map_err(|e| bad("dtype", e))?;
    let array_bytes = shape.byte_size(dtype).map_err(|e| bad("shape", e))?;
    let mesh = mesh(&a, "reshard")?;
    let from = sharding("from", need(&a, "from", "reshard")?, &mesh, dims.len())?;
    let to = sharding("to", need(&a, "to", "reshard")?, &mesh, dims.len())?;
    // Each sharding is checked on its own first, so the error names the flag at fault.
    from.index_map(dims, Mode::Strict).map_err(|e| bad("from", e))?;
    to.index_map(dims, Mode::Strict).map_err(|e| bad("to", e))?;
    let plan = ReshardPlan::new(&from, &to, dims, Mode::Strict).map_err(|e| bad("to", e))?;
    // Sums in u128: a replicated target holds the array once per device.
    let size = dtype.size_in_bytes() as u128;
    let elements = |r: &[Range<usize>]| r.iter().map(|r| r.len() as u128).product::<u128>();
    let local = plan.transfers().iter().filter(|t| t.is_local()).count();
    let moved: u128 =
        plan.transfers().iter().filter(|t| !t.is_local()).map(|t| elements(&t.region)).sum();
    let held: u128 = plan.target_index().iter().map(|e| elements(&e.ranges)).sum();
    let total = shape.num_elements() as u128;
    outln!("reshard {dims:?} {dtype}: {} -> {}", from.hlo(), to.hlo());
    outln!("  array          {total} elements, {array_bytes} bytes");
    let copies = if total > 0 && held.is_multiple_of(total) {
        match held / total {
            1 => " (the array once)".to_string(),
            k => format!(" (the array {k} times over)"),
        }
    } else {
        String::new()
    };
    outln!(
        "  target shards  {held} elements, {} bytes on {} devices{copies}",
        held * size,
        plan.target_index().len()
    );
    outln!(
        "  transfers      {} ({local} local copies, {} between devices)",
        plan.transfers().len(),
        plan.transfers().len() - local
    );
    let keeps =
        if moved == 0 { "; nothing crosses devices: each device keeps what it holds" } else { "" };
    outln!(
        "  moved          {moved} of {total} elements ({:.1}%), {} of {array_bytes} bytes, against the array's total{keeps}",
        100.0 * moved as f64 / total.max(1) as f64,
        moved * size,
    );
    Ok(())
}

fn full_name(d: &str) -> String {
    if d.starts_with('/') {
        d.to_string()
    } else {
        format!("/job:localhost/replica:0/task:0/device:{d}")
    }
}

/// Reads a JSON file named by `what` (`GRAPH.json` or `--ops`) as text: at most
/// [`MAX_FILE_BYTES`], whatever the file is (a device such as /dev/zero included).
fn read_json_file(what: &str, path: &str) -> Result<String, Usage> {
    let fail = |e: std::io::Error| Usage(format!("{what}: cannot read {path:?}: {e}"));
    let file = std::fs::File::open(path).map_err(fail)?;
    let meta = file.metadata().map_err(fail)?;
    if meta.is_dir() {
        return Err(Usage(format!("{what}: {path:?} is a directory, not a JSON file")));
    }
    let too_big = || {
        Usage(format!(
            "{what}: {path:?} is larger than {} MiB, the most meshwork place reads",
            MAX_FILE_BYTES >> 20
        ))
    };
    if meta.is_file() && meta.len() > MAX_FILE_BYTES {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(fail)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big());
    }
    String::from_utf8(bytes).map_err(|e| Usage(format!("{what}: {path:?} is not UTF-8 text ({e})")))
}

pub(crate) fn place(argv: &[String]) -> Result<(), Exit> {
    run_place(argv).map_err(one_line)
}

fn run_place(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, &["devices", "ops", "explain"], &["dot", "soft"])?;
    let path = match a.positional.as_slice() {
        [p] => p,
        [] => {
            return Err(Usage("place needs a GRAPH.json; see `meshwork help place`".into()).into());
        }
        [_, extra, ..] => {
            return Err(Usage(format!(
                "place takes one GRAPH.json, but got a second positional argument {extra:?}; see `meshwork help place`"
            ))
            .into());
        }
    };
    let text = read_json_file("GRAPH.json", path)?;
    let graph = placer::graph_from_json(&text).map_err(|e| Usage(format!("{path}: {e}")))?;
    // The node is looked for first: whether it exists depends on the graph alone.
    if let Some(node) = a.get("explain")
        && graph.id(node).is_none()
    {
        return Err(bad("explain", format!("no node {node:?} in {path}")).into());
    }
    let catalog = match a.get("ops") {
        Some(p) => {
            let catalog_text = read_json_file("--ops", p)?;
            let value: serde_json::Value =
                serde_json::from_str(&catalog_text).map_err(|e| bad("ops", format!("{p}: {e}")))?;
            value.get("op_catalog").cloned().unwrap_or(value)
        }
        None => {
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Usage(format!("{path}: {e}")))?;
            value.get("op_catalog").or_else(|| value.get("ops")).cloned().ok_or_else(|| {
                Usage(format!(
                    "{path} has no \"op_catalog\"; give the op catalog with --ops CATALOG.json"
                ))
            })?
        }
    };
    let catalog = serde_json::from_value(catalog).map_err(|e| match a.get("ops") {
        Some(p) => bad("ops", format!("{p} is not an op catalog: {e}")),
        None => Usage(format!("{path}: its \"op_catalog\" is not an op catalog: {e}")),
    })?;
    let registry = placer::registry_from_catalog(&catalog);
    let names: Vec<String> = a
        .get("devices")
        .ok_or_else(|| Usage("--devices is required (like CPU:0,CPU:1,GPU:0)".into()))?
        .split(',')
        .map(|d| full_name(d.trim()))
        .collect();
    let devices = DeviceSet::new(&names).map_err(|e| bad("devices", e))?;
    let options = PlacerOptions { allow_soft_placement: a.on("soft"), ..PlacerOptions::default() };
    if let Some(node) = a.get("explain") {
        let why = placer::explain(&graph, &devices, &registry, options, node)
            .map_err(|e| Usage(format!("{path}: {e}")))?;
        outln!("{why}");
        return Ok(());
    }
    let placement = placer::place(&graph, &devices, &registry, options)
        .map_err(|e| Usage(format!("{path}: {e}")))?;
    if a.on("dot") {
        args::out(format_args!("{}", placer::to_dot(&graph, &devices, &placement)))?;
        return Ok(());
    }
    let width = graph.nodes().map(|(_, n)| n.name.len()).max().unwrap_or(4).max(4);
    let op_width = graph.nodes().map(|(_, n)| n.op.len()).max().unwrap_or(2).max(2);
    outln!("{:width$}  {:op_width$}  device", "node", "op");
    for (id, n) in graph.nodes() {
        outln!(
            "{:width$}  {:op_width$}  {}",
            n.name,
            n.op,
            devices.devices()[placement.device(id)].name()
        );
    }
    Ok(())
}
