//! `meshwork inspect`: a model's training step as each device of a `data x model` mesh
//! runs it, and what its collectives cost; with `--backend xla`, the StableHLO module
//! XLA compiles for it; with `--json`, what three steps of the run really hold and move.

use std::collections::BTreeMap;

use meshwork_strategy::Strategy;

use crate::config::Config;
use crate::model::Layout;
use crate::{Error, Result};

/// The partitioned training step of the run `config` describes (planned as `train`
/// plans it: every flag checked, the memory estimated against `config.max_memory`
/// before anything is built) as text: the per-device program with its collectives,
/// then a summary of them. A mesh's step only (a pipeline is `--json`'s).
pub fn inspect(config: &Config) -> Result<String> {
    // Planned on the interpreter: the module XLA would compile is printed without a
    // plugin (and without the interpreter's cutting of attention into pieces).
    let xla = config.backend.is_xla();
    let planned = Config {
        backend: crate::config::BackendKind::Interpreter,
        blocking: if xla { Some(meshwork_nn::Blocking::default()) } else { config.blocking },
        ..config.clone()
    };
    let p = crate::plan::plan(&planned)?;
    let Layout::Mesh { data, model: m } = p.layout else {
        return Err(Error::usage(
            "--stages: inspect prints a mesh's step (add --json for a pipeline)",
        ));
    };
    let devices = p.layout.devices();
    let strategy = Strategy::data_parallel(devices).map_err(Error::failed)?;
    // The step the trainer compiles — its savers, the regions it recomputes, a LoRA
    // run's frozen base held with no optimizer state — its state left unset.
    let no_weights = std::collections::HashMap::new();
    let recipe = crate::steps::Recipe::of(&p, &no_weights);
    let (step, _, _) = crate::steps::mesh_step(&strategy, p.layout, &recipe, false)?;
    let part = step.compiled().partitioned();
    if xla {
        // The module XLA compiles for each device, its state donated step to step.
        let carry = step.compiled().carry_pairs();
        let options = meshwork_xla::lower::LowerOptions {
            replicas: devices,
            donate: carry,
            ..Default::default()
        };
        let lowered =
            meshwork_xla::lower::lower(part.program(), &options).map_err(Error::failed)?;
        return Ok(lowered.text);
    }
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for c in part.collectives() {
        *kinds.entry(format!("{} over {}", c.op, c.axes.join("+"))).or_default() += 1;
    }
    let mut out = format!("{part}\n");
    out += &format!(
        "# {}, batch {}, {}, {:?} on mesh {data}x{m}\n",
        p.net.describe(),
        p.batch,
        p.dtype,
        p.optimizer
    );
    out += &format!(
        "# a step runs {} collectives in {} launches ({}) and moves {:.3} MB between devices\n",
        part.collectives().len(),
        part.launches(),
        kinds.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", "),
        part.bytes_moved() as f64 / 1e6
    );
    Ok(out)
}

/// Steps `inspect --json` runs and measures.
const MEASURED_STEPS: usize = 3;

/// What a run of `config` really does, measured on its back end: it is planned as a
/// training run (every flag checked as `train` checks it), compiled, and run for 3
/// steps on the run's first batches; then the figures are read from the runtime — the
/// bytes each device holds of each weight and optimizer slot (its buffers' sizes),
/// the bytes moved per step (the back end's counts of what it uploaded, downloaded,
/// and what its collectives and transfers produced), and the compilations made. One
/// JSON object:
///
/// ```json
/// {"model": "...", "backend": "xla", "partitioner": "meshwork", "layout": "...",
///  "devices": [{"device": 0, "param_bytes": 0, "optimizer_bytes": 0}],
///  "weights": [{"name": "w1", "bytes": [[0, 1024]], "whole_bytes": 1024, "trains": true}],
///  "per_step": {"host_to_device_bytes": 0, "device_to_host_bytes": 0,
///               "collective_bytes": 0, "batch_bytes": 0},
///  "compiles": 1, "compiles_in_steps": 0, "steps": 3}
/// ```
///
/// `trains` is true for a trained weight, false for a frozen one (a base under a LoRA
/// adapter: no optimizer state, so `optimizer_bytes` are the adapter's alone) and for
/// optimizer state.
///
/// `compiles` counts every compilation of the run, `compiles_in_steps` those made
/// while the steps ran (none: everything is compiled before the first step).
///
/// `batch_bytes` is one step's batch. A step hands each device its part of the batch
/// (by the batch's layout: on a `1xM` mesh every device gets all of it, as
/// `jax.device_put` with `P('data')` does) and the learning rate and step count; that
/// is all `host_to_device_bytes` holds. `collective_bytes` sums each collective's
/// result over the devices (a placed program's: each transfer).
pub fn inspect_json(config: &Config) -> Result<String> {
    use crate::steps::{Recipe, start};
    let mut p = crate::plan::plan(config)?;
    let devices = p.layout.devices();
    let one_device = Layout::Mesh { data: 1, model: 1 };
    let init = p.take_init()?;
    let strategy = p.strategy()?;
    let compiles_before = strategy.backend().compiles();
    let recipe = Recipe::of(&p, &init);
    let mut run = start(&strategy, p.layout, &recipe)?;
    let compiled = strategy.backend().compiles();
    let before = run.traffic();
    let mut batch_bytes = 0;
    for s in 0..MEASURED_STEPS {
        let idx: Vec<usize> = (0..p.batch).map(|i| (s * p.batch + i) % p.rows.max(1)).collect();
        let feed = p.net.with_keys(p.examples.batch(&idx, p.dtype)?, p.seed, Some(s))?;
        batch_bytes = feed.iter().map(|t| t.byte_size() as u64).sum::<u64>();
        run.steps(&[feed], &[p.lr], s)?;
    }
    let after = run.traffic();
    let compiles = strategy.backend().compiles() - compiles_before;
    let held = run.held()?;
    let mut per_device: BTreeMap<usize, (u64, u64)> = (0..devices).map(|d| (d, (0, 0))).collect();
    for (name, at) in &held {
        for &(d, bytes) in at {
            let slot = per_device.entry(d).or_default();
            if name.starts_with("optimizer.") {
                slot.1 += bytes;
            } else {
                slot.0 += bytes;
            }
        }
    }
    // Each weight's whole size, from the one-device program (a slot's is its weight's).
    let (whole_program, _) = p.net.loss_program(p.batch, p.dtype, one_device)?;
    let whole = |name: &str| -> Option<usize> {
        let weight = name
            .strip_prefix("optimizer.")
            .and_then(|rest| rest.split_once('.').map(|(_, w)| w))
            .unwrap_or(name);
        let param = whole_program.params().iter().find(|q| q.name == weight)?;
        param.spec.byte_size().ok()
    };
    let steps = (after.steps - before.steps).max(1);
    let per_step = |a: u64, b: u64| (a - b) / steps;
    let partitioner = format!("{:?}", config.backend.partitioner());
    // The estimate --max-memory is checked against (the run's, without the check's
    // copy), and what --fsdp leaves whole.
    let estimate =
        p.net.memory_estimate(p.batch, p.steps_per_run, p.dtype, p.layout, false, p.savers);
    let whole_over_data: Vec<String> = match p.layout {
        Layout::Mesh { data, model } if p.savers.fsdp => p
            .net
            .weight_dims()
            .into_iter()
            .filter(|(name, dims)| p.net.fsdp_spec(name, dims, (data, model)).is_none())
            .map(|(name, _)| name)
            .collect(),
        _ => Vec::new(),
    };
    let json = serde_json::json!({
        "model": p.net.describe(),
        "savers": {
            "grad_accum": p.savers.micro,
            "remat": p.savers.remat,
            "fsdp": p.savers.fsdp,
            "fsdp_replicated": whole_over_data,
        },
        "memory": {
            "estimate": {
                "weights_bytes": estimate.weights,
                "activation_bytes": estimate.activations,
                "feed_bytes": estimate.feeds,
                "total_bytes": estimate.total(),
            },
            "step_peak_bytes": run.peak_bytes(),
            "device_peak_bytes": strategy.backend().device_peak_bytes(),
        },
        "backend": strategy.backend().name(),
        "partitioner": partitioner.to_lowercase(),
        "layout": p.layout.describe(),
        "devices": per_device.iter().map(|(d, (w, o))| serde_json::json!({
            "device": d, "param_bytes": w, "optimizer_bytes": o,
        })).collect::<Vec<_>>(),
        "weights": held.iter().map(|(name, at)| serde_json::json!({
            "name": name, "bytes": at, "whole_bytes": whole(name),
            "trains": !name.starts_with("optimizer.") && p.net.model().trains(name),
        })).collect::<Vec<_>>(),
        "per_step": {
            "host_to_device_bytes": per_step(after.host_to_device, before.host_to_device),
            "device_to_host_bytes": per_step(after.device_to_host, before.device_to_host),
            "collective_bytes": per_step(after.between_devices, before.between_devices),
            "batch_bytes": batch_bytes,
        },
        "collectives": run.collectives().into_iter().map(|(kind, (n, bytes))| serde_json::json!({
            "kind": kind, "count": n, "bytes": bytes,
        })).collect::<Vec<_>>(),
        "compiles": compiles,
        "compiles_in_steps": strategy.backend().compiles() - compiled,
        "steps": after.steps - before.steps,
    });
    serde_json::to_string_pretty(&json).map_err(Error::failed)
}
