//! `meshwork inspect --target T`: the run's training step compiled by XLA for GPUs that
//! are not here, what XLA says one device's program holds, whether that fits the
//! device, and a roofline of how fast the step would go.
//!
//! The roofline: a step takes at least its dot products' FLOPs at the tensor cores'
//! peak, or its compiled buffers' traffic at the memory's bandwidth, whichever is
//! longer, plus its collectives' bytes over the slowest link they cross (NVLink within
//! a host, the network between hosts), not overlapped. Peak rates are the GPU's
//! datasheet figures ([`meshwork_xla::target::Gpu`]).

use std::path::Path;

use meshwork_program::Program;
use meshwork_types::DType;

use crate::config::Config;
use crate::model::Layout;
use crate::{Error, Result};

/// The share of a device's memory XLA's GPU client may allocate by default
/// (`GpuAllocatorConfig::memory_fraction`): what a step's peak must fit in.
pub const MEMORY_FRACTION: f64 = 0.75;

/// How many GPUs the target `name` has (`h100x8`: 8), or why it names none.
pub fn target_devices(name: &str) -> Result<usize> {
    meshwork_xla::target::Target::parse(name)
        .map(|t| t.devices())
        .map_err(|e| Error::usage(e.to_string()))
}

/// The step of `config` (whose back end is a target) compiled for the target: its JSON
/// report, or its plain-text summary; `--optimized-hlo`'s file written when given.
pub fn inspect_target(config: &Config, json: bool, optimized_hlo: Option<&Path>) -> Result<String> {
    use crate::steps::{Recipe, mesh_step};
    if let Some(path) = optimized_hlo {
        crate::files::check_output("optimized-hlo", path, crate::files::Output::New)?;
    }
    let p = crate::plan::plan(config)?;
    let Some(target) = p.backend.target.clone() else {
        return Err(Error::usage("--optimized-hlo needs --target"));
    };
    let Layout::Mesh { data, model } = p.layout else {
        return Err(Error::usage(format!(
            "--target compiles a mesh's step; {} is a pipeline's",
            p.layout.describe()
        )));
    };
    let strategy = p.strategy()?;
    let none = std::collections::HashMap::new();
    let recipe = Recipe {
        net: &p.net,
        batch: p.batch,
        dtype: p.dtype,
        optimizer: p.optimizer,
        clip: p.clip,
        init: &none,
        savers: p.savers,
        precision: p.precision,
        loss_scale: p.loss_scale,
        blocking: p.blocking,
        shards: None,
    };
    let before = target.compiled().len();
    let started = std::time::Instant::now();
    let (step, _, _) = mesh_step(&strategy, p.layout, &recipe, false)?;
    let compile_seconds = started.elapsed().as_secs_f64();
    let compiled = target.compiled();
    let Some(main) = compiled[before..].iter().max_by_key(|c| c.memory.peak).cloned() else {
        return Err(Error::failed("the step compiled no program for the target"));
    };
    let t = target.session().target();
    let m = main.memory;
    let peak = if m.peak > 0 { m.peak } else { m.arguments + m.outputs - m.alias + m.temp };
    let usable = (t.device_memory() as f64 * MEMORY_FRACTION) as u64;
    let fits = peak <= usable;
    let (_, hlo) = main.executable.optimized_program().map_err(Error::failed)?;
    if let Some(path) = optimized_hlo {
        crate::files::write_new(path, &hlo).map_err(|e| {
            Error::flag("optimized-hlo", format!("cannot write {}: {e}", path.display()))
        })?;
    }
    let collectives = meshwork_xla::hlo::collectives(&hlo).map_err(Error::failed)?;
    let collective_bytes: u64 = collectives.iter().map(|c| c.bytes).sum();
    let attention = if hlo_has(&hlo, b"__cudnn$fmha") { "cudnn" } else { "xla" };
    // The roofline, per device.
    let devices = main.replicas * main.partitions;
    let flops = dot_flops(step.compiled().partitioned().program())
        .max(dot_flops(step.compiled().partitioned().global()) / devices.max(1) as f64);
    let half = matches!(p.precision, Some(DType::BF16 | DType::F16))
        || matches!(p.dtype, DType::BF16 | DType::F16);
    let peak_flops = if half { t.gpu.bf16_flops } else { t.gpu.f32_flops };
    let bytes = (m.arguments + m.outputs + 2 * m.temp) as f64;
    let link = if t.hosts > 1 { t.gpu.network_bandwidth } else { t.gpu.nvlink_bandwidth };
    let compute = flops / peak_flops;
    let memory = bytes / t.gpu.memory_bandwidth;
    let comm = if devices > 1 { collective_bytes as f64 / link } else { 0.0 };
    let step_seconds = compute.max(memory) + comm;
    let tokens = (p.batch * p.net.per_row().0) as f64;
    let tokens_per_second = tokens / step_seconds;
    let estimate = p.net.device_estimate(&crate::model::DeviceStep {
        batch: p.batch,
        dtype: p.dtype,
        precision: p.precision,
        layout: p.layout,
        savers: p.savers,
        optimizer: p.optimizer,
        fused_attention: p.blocking.fused_attention,
    });
    let ratio = estimate.total() / peak.max(1) as f64;
    if !json {
        let gb = |b: f64| b / 1e9;
        return Ok(format!(
            "{model} on {layout} for {name} ({kind}, {devices} devices in {hosts} host(s), {mem:.1} GB each)\n\
             compiled in {compile_seconds:.1} s: one device holds arguments {arg:.2} GB, outputs {out:.2} GB ({alias:.2} GB aliased), temporaries {tmp:.2} GB; peak {pk:.2} GB\n\
             {verdict}: the peak is {pct:.0}% of the {usable:.1} GB XLA's allocator takes ({frac:.0}% of the device)\n\
             meshwork's estimate {est:.2} GB ({ratio:.2}x XLA's peak); attention lowered by {attention}{note}\n\
             roofline: {tf:.1} TFLOP and {mb:.2} GB of memory traffic per device, {cb:.3} GB of collectives: {ms:.1} ms a step, {tps:.0} tokens/s\n",
            model = p.net.describe(),
            layout = p.layout.describe(),
            name = t.name(),
            kind = target.session().device_kind(),
            hosts = t.hosts,
            mem = gb(t.device_memory() as f64),
            arg = gb(m.arguments as f64),
            out = gb(m.outputs as f64),
            alias = gb(m.alias as f64),
            tmp = gb(m.temp as f64),
            pk = gb(peak as f64),
            verdict = if fits { "fits" } else { "does not fit" },
            pct = 100.0 * peak as f64 / usable.max(1) as f64,
            usable = gb(usable as f64),
            frac = 100.0 * MEMORY_FRACTION,
            est = gb(estimate.total()),
            note = p.attention_note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
            tf = flops / 1e12,
            mb = gb(bytes),
            cb = gb(collective_bytes as f64),
            ms = 1e3 * step_seconds,
            tps = tokens_per_second,
        ));
    }
    let json = serde_json::json!({
        "model": p.net.describe(),
        "layout": p.layout.describe(),
        "mesh": [data, model],
        "partitioner": format!("{:?}", config.backend.partitioner()).to_lowercase(),
        "savers": {"grad_accum": p.savers.micro, "remat": p.savers.remat, "fsdp": p.savers.fsdp},
        "dtype": p.dtype.to_string(),
        "precision": p.precision.map(|d| d.to_string()),
        "batch": p.batch,
        "target": {
            "name": t.name(),
            "gpu": t.gpu.description,
            "device_kind": target.session().device_kind(),
            "devices": t.devices(),
            "hosts": t.hosts,
            "device_memory_bytes": t.device_memory(),
        },
        "compiled": {
            "argument_bytes": m.arguments,
            "output_bytes": m.outputs,
            "alias_bytes": m.alias,
            "temp_bytes": m.temp,
            "peak_bytes": peak,
            "replicas": main.replicas,
            "partitions": main.partitions,
            "programs": compiled.len() - before,
            "seconds": compile_seconds,
        },
        "fits": fits,
        "fits_within_bytes": usable,
        "fits_rule": format!(
            "peak_bytes at most {MEMORY_FRACTION} of device_memory_bytes: XLA's GPU allocator takes that share by default (GpuAllocatorConfig::memory_fraction)"
        ),
        "attention": attention,
        "attention_note": p.attention_note,
        "memory": {
            "estimate": {
                "weights_bytes": estimate.weights,
                "activation_bytes": estimate.activations,
                "feed_bytes": estimate.feeds,
                "total_bytes": estimate.total(),
                "per": "device",
            },
            "estimate_over_compiled_peak": ratio,
        },
        "estimate": {
            "flops_per_step": flops,
            "bytes_per_step": bytes,
            "collective_bytes_per_step": collective_bytes,
            "step_seconds": step_seconds,
            "tokens_per_second": tokens_per_second,
            "per": "device (flops, bytes, collectives); the step's global batch (tokens/s)",
            "peak_flops": peak_flops,
            "memory_bandwidth": t.gpu.memory_bandwidth,
            "link_bandwidth": link,
            "sources": "NVIDIA datasheets, dense tensor-core rates (bf16/f16, or TF32 for f32); HBM bandwidth; NVLink per direction within a host, one InfiniBand port per GPU between hosts",
        },
    });
    serde_json::to_string_pretty(&json).map_err(Error::failed)
}

/// Whether the serialized module `hlo` holds `needle` (a custom call's target).
fn hlo_has(hlo: &[u8], needle: &[u8]) -> bool {
    hlo.windows(needle.len()).any(|w| w == needle)
}

/// The FLOPs of `program`'s products (dot products, convolutions and their gradients,
/// fused attention), 2 per multiply-add, as the placer's cost model counts them.
pub(crate) fn dot_flops(program: &Program) -> f64 {
    program.instrs().iter().map(|i| meshwork_partition::placed::work(program, i).matmul_flops).sum()
}
