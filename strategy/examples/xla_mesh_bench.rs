//! The benchmark transformer (V256 T128 D256 H8 L4 F1024, f32, batch 16, Adam) on the
//! meshes 1x1, 2x1, 1x2 and 2x2 of CPU PJRT devices, in one run, four ways:
//!
//! - the interpreter, meshwork's partitioner (`Strategy::data_parallel(D·M)`);
//! - XLA with meshwork's partitioner: the per-device programs compiled with
//!   `num_replicas = D·M` ([`Partitioner::Meshwork`]);
//! - XLA with XLA's partitioner: the global step with Megatron's shardings as
//!   `mhlo.sharding` ([`Partitioner::Xla`]);
//! - JAX's `jit` + `NamedSharding` of the same model on as many forced host devices
//!   (`strategy/benches/jax/transformer_train_jax.py`), on jaxlib's own CPU client and
//!   on the plugin meshwork loads (`on_pjrt_plugin.py`: the same XLA build as
//!   meshwork's columns).
//!
//! Tokens/s are medians of 5 timed runs (after one untimed run) of `steps=N` steps (5
//! by default), each run all its steps in one host call. Beside them, the bytes a step
//! moves between devices: each collective's result on each device, as the runtime
//! counted it (the interpreter's collectives; the collectives in the HLO XLA compiled),
//! and meshwork's wire bytes (bandwidth-optimal algorithms) beside the minimum the
//! shardings need in the same measure (`spmd_bench`'s: every weight's local gradient
//! all-reduced over `data`, two all-reduces per block each way over `model`).
//!
//! ```text
//! MESHWORK_PJRT_PLUGIN=/path/to/plugin.so TF_CPP_MIN_LOG_LEVEL=2 \
//!     cargo run --release -p meshwork-strategy --example xla_mesh_bench [-- steps=N nojax DxM…]
//! ```
//!
//! (the meshes named, or all four; JAX still runs all four, as its script does;
//! `nointerp` and `noxlapart` skip those columns).

#![allow(clippy::print_stdout, missing_docs)]

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Instant;

use common::Model;
use meshwork_strategy::Strategy;
use meshwork_strategy::backend::{Partitioner, Xla};
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::{Mesh, PartitionSpec};

const MESHES: [(usize, usize); 4] = [(1, 1), (2, 1), (1, 2), (2, 2)];

/// One way of running a mesh: its rate, the collectives' result bytes per step, and
/// meshwork's wire bytes per step.
struct Timed {
    rate: f64,
    results: u64,
    wire: u64,
}

/// Times `model` over `shardings` on `strategy`: 1 untimed and 5 timed runs from the
/// same initial state, each one host call (`run_steps`); the median rate and what a
/// step moved between devices.
fn time(
    strategy: &Strategy,
    model: &Model,
    shardings: &Shardings,
) -> Result<Timed, meshwork_strategy::Error> {
    let mut step = strategy.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        shardings,
    )?;
    let wire = step.compiled().partitioned().bytes_moved();
    let lrs = vec![model.lr; model.batches.len()];
    let mut rates = Vec::new();
    let before = step.compiled().traffic();
    for run in 0..6 {
        for (name, t) in &model.init {
            step.set(name, t)?;
        }
        step.reset_optimizer()?;
        let t0 = Instant::now();
        step.run_steps(&model.batches, &lrs)?;
        let dt = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push((model.batches.len() * model.per_step) as f64 / dt);
        }
    }
    let after = step.compiled().traffic();
    let steps = (after.steps - before.steps).max(1);
    let results = (after.between_devices - before.between_devices) / steps;
    Ok(Timed { rate: common::median(rates), results, wire })
}

/// The bandwidth-optimal all-reduce cost of `bytes` per device over `k` devices,
/// summed over the `devices` of the mesh (the partitioner's convention).
fn all_reduce_bytes(bytes: u64, k: u64, devices: u64) -> u64 {
    if k <= 1 { 0 } else { 2 * (k - 1) * bytes / k * devices }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: usize =
        args.iter().find_map(|a| a.strip_prefix("steps=")?.parse().ok()).unwrap_or(5);
    let flag = |f: &str| args.iter().any(|a| a == f);
    // JAX's script on jaxlib's CPU client, and on the plugin meshwork loads.
    let jax_run = |wrapper: Option<&str>| -> Option<Vec<String>> {
        if flag("nojax") {
            return None;
        }
        let dir = format!("{}/benches/jax", env!("CARGO_MANIFEST_DIR"));
        let mut cmd = std::process::Command::new("python3");
        match wrapper {
            Some(w) => cmd.arg(format!("{dir}/{w}")).arg("transformer_train_jax.py"),
            None => cmd.arg(format!("{dir}/transformer_train_jax.py")),
        };
        cmd.arg(steps.to_string())
            .env("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(String::from).collect())
    };
    let jax_lines = jax_run(None);
    let jax_plugin_lines = jax_run(Some("on_pjrt_plugin.py"));
    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None)?)?;
    let meshwork_xla = Arc::new(Xla::with_devices(&plugin, 4)?);
    let xla_xla = Arc::new(Xla::with_devices(&plugin, 4)?.with_partitioner(Partitioner::Xla));
    let model = common::TRANSFORMER;
    let batch = 16;
    let train = common::transformer_model(batch, steps)?;
    let program = train.program.clone();
    println!(
        "Transformer V{} T{} D{} H{} L{} F{}, f32, batch {batch}, Adam, {steps} steps per run, \
         median of 5 runs ({} cores; XLA: PJRT {}.{} CPU devices)",
        model.vocab,
        model.seq,
        model.dim,
        model.heads,
        model.layers,
        model.ffn,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        plugin.version().0,
        plugin.version().1,
    );
    println!(
        "  mesh  tokens/s: interpreter  XLA+meshwork  XLA+XLA-part       JAX  JAX-on-plugin   \
         vs JAX (mw, xla)   vs JAX-on-plugin   collective MB/step (interp, mw, xla)   wire MB/step  minimum"
    );
    let named: Vec<(usize, usize)> =
        MESHES.into_iter().filter(|(d, m)| args.iter().any(|a| *a == format!("{d}x{m}"))).collect();
    for (d, m) in if named.is_empty() { MESHES.to_vec() } else { named } {
        let mesh = Mesh::iota(&[("data", d), ("model", m)])?;
        let mut shardings = Shardings::new(mesh).with("rows", "P('data')")?;
        for p in &program.params()[1..] {
            shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
        }
        let n = d * m;
        let skipped = Timed { rate: f64::NAN, results: 0, wire: 0 };
        let interp = if flag("nointerp") {
            skipped
        } else {
            time(&Strategy::data_parallel(n)?, &train, &shardings)?
        };
        let on_mw = time(
            &Strategy::data_parallel(n)?.with_backend(meshwork_xla.clone()),
            &train,
            &shardings,
        )?;
        let on_xla = if flag("noxlapart") {
            Timed { rate: f64::NAN, results: 0, wire: 0 }
        } else {
            time(&Strategy::data_parallel(n)?.with_backend(xla_xla.clone()), &train, &shardings)?
        };
        let devices = n as u64;
        let mut minimum = 0;
        for p in &program.params()[1..] {
            let split = megatron_spec(&p.name, p.spec.shape.rank()) != PartitionSpec::replicated();
            let local = (p.spec.shape.num_elements() * 4 / if split { m } else { 1 }) as u64;
            minimum += all_reduce_bytes(local, d as u64, devices);
        }
        let act = (batch / d * model.seq * model.dim * 4) as u64;
        minimum += 4 * model.layers as u64 * all_reduce_bytes(act, m as u64, devices);
        let against = |jax: Option<f64>| match jax {
            Some(j) => {
                (format!("{j:>9.0}"), format!("{:>6.2}x {:>6.2}x", on_mw.rate / j, on_xla.rate / j))
            }
            None => (format!("{:>9}", "no JAX"), format!("{:>14}", "-")),
        };
        let (j, vs) = against(common::jax_figure(&jax_lines, d, m));
        let (jp, vsp) = against(common::jax_figure(&jax_plugin_lines, d, m));
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "  {d}x{m}  {:>21.0}  {:>12.0}  {:>12.0}  {j}  {jp:>13}   {vs}   {vsp:>16}   \
             {:>12.2} {:>7.2} {:>7.2}   {:>19.2}  {:>7.2}",
            interp.rate,
            on_mw.rate,
            on_xla.rate,
            mb(interp.results),
            mb(on_mw.results),
            mb(on_xla.results),
            mb(on_mw.wire),
            mb(minimum),
        );
    }
    Ok(())
}
