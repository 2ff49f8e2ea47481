//! `meshwork shard`, `reshard` and `place`: look at shardings and placements.

use meshwork_strategy::placer::{self, DeviceSet, PlacerOptions};
use meshwork_strategy::sharding::{
    HloSharding, Mesh, Mode, NamedSharding, PartitionSpec, ReshardPlan, Sharding, visualize,
};
use meshwork_strategy::types::DType;

use crate::args::{self, Args, Usage};

pub(crate) const HELP: &str = "\
meshwork shard --shape 8,8 --mesh 2x4 --axes a,b --spec \"P('a','b')\"
    Draws which device holds which block, prints the shard shape and the XLA sharding.
    --spec takes a JAX PartitionSpec over the named mesh axes, or an XLA sharding such
    as \"{devices=[2,4]<=[8]}\" over the mesh's devices.

meshwork reshard --shape 8,8 --mesh 2x4 --axes a,b --from SPEC --to SPEC [--dtype f32]
    The transfer plan between two shardings: transfers, and elements and bytes moved
    against the array's total.

meshwork place GRAPH.json --devices CPU:0,CPU:1,GPU:0 [--ops CATALOG.json] [--soft]
                [--dot] [--explain NODE]
    Places a graph ({\"nodes\": [...]}, TensorFlow's placer rules) and prints node, op and
    device. The op catalog comes from --ops or the graph file's \"op_catalog\". Short
    device names get the /job:localhost/replica:0/task:0/device: prefix.
";

fn bad(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

fn need<'a>(a: &'a Args, flag: &str) -> Result<&'a str, Usage> {
    a.get(flag).ok_or_else(|| Usage(format!("--{flag} is required; see `meshwork help shard`")))
}

/// The mesh from `--mesh 2x4 --axes a,b`.
fn mesh(a: &Args) -> Result<Mesh, Usage> {
    let sizes: Vec<usize> = need(a, "mesh")?
        .split(['x', 'X', ','])
        .map(|d| {
            d.trim().parse().map_err(|_| {
                bad(
                    "mesh",
                    format!("{:?} is not a mesh like 2x4", a.get("mesh").unwrap_or_default()),
                )
            })
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<&str> = need(a, "axes")?.split(',').map(str::trim).collect();
    if names.len() != sizes.len() {
        return Err(bad(
            "axes",
            format!("{} names for the {} dims of --mesh", names.len(), sizes.len()),
        ));
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

pub(crate) fn shard(argv: &[String]) -> Result<(), Usage> {
    let a = Args::parse(argv, &["shape", "mesh", "axes", "spec"], &[])?;
    let shape = args::dims("shape", need(&a, "shape")?)?;
    let mesh = mesh(&a)?;
    let s = sharding("spec", need(&a, "spec")?, &mesh, shape.len())?;
    let picture = visualize(&s, &shape, Mode::Strict).map_err(|e| bad("spec", e))?;
    println!("{picture}");
    let shard = s.shard_shape(&shape, Mode::Strict).map_err(|e| bad("shape", e))?;
    println!("shard shape: {shard:?} of {shape:?}");
    println!("XLA sharding: {}", s.hlo());
    Ok(())
}

pub(crate) fn reshard(argv: &[String]) -> Result<(), Usage> {
    let a = Args::parse(argv, &["shape", "mesh", "axes", "from", "to", "dtype"], &[])?;
    let shape = args::dims("shape", need(&a, "shape")?)?;
    let mesh = mesh(&a)?;
    let from = sharding("from", need(&a, "from")?, &mesh, shape.len())?;
    let to = sharding("to", need(&a, "to")?, &mesh, shape.len())?;
    let dtype: DType = a.get("dtype").unwrap_or("f32").parse().map_err(|e| bad("dtype", e))?;
    let plan = ReshardPlan::new(&from, &to, &shape, Mode::Strict).map_err(|e| bad("to", e))?;
    let local = plan.transfers().iter().filter(|t| t.is_local()).count();
    let (moved, total) = (plan.elements_moved(), plan.total_elements());
    let size = dtype.size_in_bytes();
    println!("reshard {shape:?} {dtype}: {} -> {}", from.hlo(), to.hlo());
    println!(
        "  transfers      {} ({local} local copies, {} between devices)",
        plan.transfers().len(),
        plan.transfers().len() - local
    );
    println!(
        "  moved          {moved} of {total} elements ({:.1}%), {} of {} bytes",
        100.0 * moved as f64 / total.max(1) as f64,
        plan.bytes_moved(size),
        total * size
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

pub(crate) fn place(argv: &[String]) -> Result<(), Usage> {
    let a = Args::parse(argv, &["devices", "ops", "explain"], &["dot", "soft"])?;
    let path = match a.positional.as_slice() {
        [p] => p,
        [] => return Err(Usage("place needs a GRAPH.json; see `meshwork help place`".into())),
        more => return Err(Usage(format!("place takes one GRAPH.json, got {}", more.len()))),
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| Usage(format!("cannot read {path}: {e}")))?;
    let graph = placer::graph_from_json(&text).map_err(|e| Usage(format!("{path}: {e}")))?;
    let catalog_text = match a.get("ops") {
        Some(p) => {
            std::fs::read_to_string(p).map_err(|e| bad("ops", format!("cannot read {p}: {e}")))?
        }
        None => text.clone(),
    };
    let value: serde_json::Value =
        serde_json::from_str(&catalog_text).map_err(|e| bad("ops", e))?;
    let catalog = match a.get("ops") {
        Some(_) => value.get("op_catalog").cloned().unwrap_or(value),
        None => value.get("op_catalog").or_else(|| value.get("ops")).cloned().ok_or_else(|| {
            Usage(format!(
                "{path} has no \"op_catalog\"; give the op catalog with --ops CATALOG.json"
            ))
        })?,
    };
    let catalog = serde_json::from_value(catalog)
        .map_err(|e| bad("ops", format!("not an op catalog: {e}")))?;
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
            .map_err(|e| bad("explain", e))?;
        println!("{why}");
        return Ok(());
    }
    let placement = placer::place(&graph, &devices, &registry, options)
        .map_err(|e| Usage(format!("{path}: {e}")))?;
    if a.on("dot") {
        print!("{}", placer::to_dot(&graph, &devices, &placement));
        return Ok(());
    }
    let width = graph.nodes().map(|(_, n)| n.name.len()).max().unwrap_or(4).max(4);
    let op_width = graph.nodes().map(|(_, n)| n.op.len()).max().unwrap_or(2).max(2);
    println!("{:width$}  {:op_width$}  device", "node", "op");
    for (id, n) in graph.nodes() {
        println!(
            "{:width$}  {:op_width$}  {}",
            n.name,
            n.op,
            devices.devices()[placement.device(id)].name()
        );
    }
    Ok(())
}
