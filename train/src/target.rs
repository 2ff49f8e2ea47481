//! `meshwork inspect --target T`: the run's training step compiled by XLA for GPUs that
//! are not here, what XLA says one device's program holds, whether that fits the
//! device, and a roofline of how fast the step would go.
//!
//! The roofline: a step takes at least its products' FLOPs at the tensor cores' peak,
//! or the least memory traffic its stored values need ([`fused_traffic_bytes`]) at the
//! memory's bandwidth, whichever is longer, plus what its collectives send over the
//! slowest link they cross (NVLink within a host, the network between hosts), not
//! overlapped. Peak rates are the GPU's datasheet figures
//! ([`meshwork_xla::target::Gpu`]). Meshwork's estimate of XLA's peak memory is the
//! per-device step's liveness with elementwise chains fused ([`fused_peak_bytes`]).

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
        return Err(Error::failed("inspect_target needs a --target back end"));
    };
    let Layout::Mesh { data, model } = p.layout else {
        return Err(Error::usage(format!(
            "--target compiles a mesh's step; {} is a pipeline's",
            p.layout.describe()
        )));
    };
    let strategy = p.strategy()?;
    let none = std::collections::HashMap::new();
    let recipe = Recipe::of(&p, &none);
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
    let peak = if m.peak > 0 {
        m.peak
    } else {
        (m.arguments + m.outputs).saturating_sub(m.alias) + m.temp
    };
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
    let per_device = step.compiled().partitioned().program();
    let bytes = fused_traffic_bytes(per_device) as f64;
    let link = if t.hosts > 1 { t.gpu.network_bandwidth } else { t.gpu.nvlink_bandwidth };
    let compute = flops / peak_flops;
    let memory = bytes / t.gpu.memory_bandwidth;
    let sent: f64 = collectives.iter().map(|c| link_bytes(&c.kind, c.bytes, devices)).sum();
    let comm = if devices > 1 { sent / link } else { 0.0 };
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
    let fused = fused_peak_bytes(per_device);
    // The per-device step's liveness by the interpreter's plan (no fusion, no
    // donation): what `inspect --json` calls `step_peak_bytes`.
    let planned = meshwork_program::fast::Executable::compile(
        step.compiled().partitioned().program(),
        meshwork_program::fast::Options::default(),
    )
    .peak_bytes();
    if !json {
        let b = |x: f64| human(x);
        return Ok(format!(
            "{model} on {layout} for {name} ({kind}, {devices} devices in {hosts} host(s), {mem} each)\n\
             compiled in {compile_seconds:.1} s: one device holds arguments {arg}, outputs {out} ({alias} aliased), temporaries {tmp}; peak {pk}\n\
             {verdict}: the peak is {pct:.1}% of the {usable} XLA's allocator takes ({frac:.0}% of the device)\n\
             meshwork's estimate {est} ({fratio:.2}x XLA's peak; by the model's counts {formula}); attention lowered by {attention}{note}\n\
             roofline (a bound): {tf:.3} TFLOP and {mb} of memory traffic per device, {cb} of collectives: {ms:.2} ms a step, {tps:.0} tokens/s\n",
            model = p.net.describe(),
            layout = p.layout.describe(),
            name = t.name(),
            kind = target.session().device_kind(),
            hosts = t.hosts,
            mem = b(t.device_memory() as f64),
            arg = b(m.arguments as f64),
            out = b(m.outputs as f64),
            alias = b(m.alias as f64),
            tmp = b(m.temp as f64),
            pk = b(peak as f64),
            verdict = if fits { "fits" } else { "does not fit" },
            pct = 100.0 * peak as f64 / usable.max(1) as f64,
            usable = b(usable as f64),
            frac = 100.0 * MEMORY_FRACTION,
            est = b(fused as f64),
            fratio = fused as f64 / peak.max(1) as f64,
            formula = b(estimate.total()),
            note = p.attention_note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
            tf = flops / 1e12,
            mb = b(bytes),
            cb = b(collective_bytes as f64),
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
                "total_bytes": fused,
                "per": "device",
                "method": "the per-device step's liveness with elementwise and shape ops fused into their readers, as XLA fuses them",
            },
            "estimate_over_compiled_peak": fused as f64 / peak.max(1) as f64,
            "breakdown": {
                "weights_bytes": estimate.weights,
                "activation_bytes": estimate.activations,
                "feed_bytes": estimate.feeds,
                "total_bytes": estimate.total(),
                "method": "weights, gradients and optimizer slots by their layouts, and the model's per-row activation count",
            },
            "breakdown_over_compiled_peak": ratio,
            "step_peak_bytes": planned,
        },
        "estimate": {
            "flops_per_step": flops,
            "bytes_per_step": bytes,
            "collective_bytes_per_step": collective_bytes,
            "link_bytes_per_step": sent,
            "step_seconds": step_seconds,
            "tokens_per_second": tokens_per_second,
            "per": "device (flops, bytes, collectives); the step's global batch (tokens/s)",
            "peak_flops": peak_flops,
            "memory_bandwidth": t.gpu.memory_bandwidth,
            "link_bandwidth": link,
            "method": "max(flops / peak_flops, bytes / memory_bandwidth) + link_bytes / link_bandwidth: flops of the per-device program's products; bytes each stored value written and read once, elementwise chains fused (the least a step moves); collectives' bytes from XLA's optimized module, sent as ring algorithms send them (groups taken as all devices), not overlapped",
            "sources": "NVIDIA datasheets, dense tensor-core rates (bf16/f16, or TF32 for f32); HBM bandwidth; NVLink per direction within a host, one InfiniBand port per GPU between hosts",
        },
    });
    serde_json::to_string_pretty(&json).map_err(Error::failed)
}

/// How XLA would store `program`'s values if, as it does, chains of elementwise and
/// shape ops are fused into what reads them: whether each value is fused (unary,
/// binary, compare, select, convert, broadcast, reshape, transpose, slice, pad,
/// constants: never stored, its readers reading what it reads) and the stored values
/// each value stands for (itself, or what its fused chain reads).
fn fusion(program: &Program) -> (Vec<bool>, Vec<Vec<usize>>) {
    use meshwork_program::Op;
    let np = program.params().len();
    let mut fused = vec![false; program.num_values()];
    let mut sources: Vec<Vec<usize>> = (0..np).map(|k| vec![k]).collect();
    for (i, instr) in program.instrs().iter().enumerate() {
        let k = np + i;
        fused[k] = matches!(
            instr.op,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Compare(_)
                | Op::Select
                | Op::ThreefryUniform
                | Op::Convert { .. }
                | Op::BroadcastTo { .. }
                | Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Slice { .. }
                | Op::Pad { .. }
                | Op::Constant { .. }
                | Op::Iota { .. }
        );
        if !fused[k] {
            sources.push(vec![k]);
            continue;
        }
        let mut s: Vec<usize> =
            instr.args.iter().flat_map(|a| sources[a.index()].clone()).collect();
        s.sort_unstable();
        s.dedup();
        sources.push(s);
    }
    (fused, sources)
}

/// The bytes of value `k` of `program`.
fn value_bytes(program: &Program, k: usize) -> u64 {
    program
        .spec(meshwork_program::Value(k as u32))
        .and_then(|s| s.byte_size().ok())
        .map_or(0, |b| b as u64)
}

/// The most bytes one device's step holds at once under [`fusion`]: every stored
/// value (a product, a reduction, a softmax, attention, a collective's result) from its
/// instruction to its last read — a fused chain's reader reading what the chain reads —
/// and a result to the end; each parameter until its last read (a donated weight's
/// buffer is reused by its update). Meshwork's estimate of XLA's peak from the program
/// alone.
pub(crate) fn fused_peak_bytes(program: &Program) -> u64 {
    let np = program.params().len();
    let n = program.num_values();
    let (fused, sources) = fusion(program);
    let mut last = vec![0usize; n];
    for (i, instr) in program.instrs().iter().enumerate() {
        if fused[np + i] {
            continue;
        }
        for a in &instr.args {
            for &src in &sources[a.index()] {
                last[src] = last[src].max(np + i);
            }
        }
    }
    for r in program.results() {
        for &src in &sources[r.index()] {
            last[src] = usize::MAX;
        }
    }
    let mut frees: Vec<Vec<usize>> = vec![Vec::new(); n];
    for k in 0..n {
        if !fused[k] && last[k] != usize::MAX && last[k] >= np {
            frees[last[k]].push(k);
        }
    }
    let mut live: u64 = (0..np).map(|k| value_bytes(program, k)).sum();
    let mut peak = live;
    for (k, freed) in frees.iter().enumerate().skip(np) {
        if !fused[k] {
            live += value_bytes(program, k);
            peak = peak.max(live);
        }
        for &f in freed {
            live = live.saturating_sub(value_bytes(program, f));
        }
    }
    peak
}

/// The least bytes one device's step moves to and from its memory under [`fusion`]:
/// each stored value written once and read once (by whichever stored instruction reads
/// it first: XLA's multi-output fusions let the readers of one value share that read),
/// each parameter read once. A roofline's memory side: no step moves less.
pub(crate) fn fused_traffic_bytes(program: &Program) -> u64 {
    let np = program.params().len();
    let (fused, sources) = fusion(program);
    let mut read = vec![false; program.num_values()];
    let mut total = 0u64;
    for (i, instr) in program.instrs().iter().enumerate() {
        if fused[np + i] {
            continue;
        }
        total += value_bytes(program, np + i);
        for a in &instr.args {
            for &k in &sources[a.index()] {
                if !read[k] {
                    read[k] = true;
                    total += value_bytes(program, k);
                }
            }
        }
    }
    total
}

/// The bytes a collective of `kind` whose result is `bytes` on each device sends from
/// each device over `n` devices, as ring algorithms move them: an all-reduce
/// `2(n−1)/n` of its result, an all-gather and an all-to-all `(n−1)/n`, a
/// reduce-scatter `n−1` times its result (a `1/n` share of what it reduces), a
/// permute its result.
fn link_bytes(kind: &str, bytes: u64, n: usize) -> f64 {
    let (b, n) = (bytes as f64, n.max(1) as f64);
    match kind {
        "all-reduce" => 2.0 * (n - 1.0) / n * b,
        "all-gather" | "all-to-all" => (n - 1.0) / n * b,
        "reduce-scatter" => (n - 1.0) * b,
        _ => b,
    }
}

/// `bytes` for a person: `512 B`, `1.50 MB`, `3.16 GB`.
fn human(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} KB", b / 1e3),
        b => format!("{b:.0} B"),
    }
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

#[cfg(test)]
mod tests {
    use meshwork_program::Builder;

    use super::*;

    /// A fused chain stores nothing but keeps what it reads live until its reader:
    /// `exp(x)` costs no bytes, and `x` lives until `reduce_sum(exp(x))`.
    #[test]
    fn fused_chains_store_nothing_and_extend_what_they_read() {
        let mut b = Builder::new();
        let x = b.param("x", "f32[1000]".parse().unwrap()).unwrap();
        let w = b.param("w", "f32[1000]".parse().unwrap()).unwrap();
        let a = b.exp(x).unwrap();
        let p = b.dot_general(w, w, &[0], &[0], &[], &[]).unwrap();
        let s = b.reduce_sum(a, &[0], false).unwrap();
        let program = b.finish(&[s, p]).unwrap();
        // Both inputs (8000 B) and the product (4 B) at once; `w` then goes, `x` only
        // after the sum reads its fused `exp`.
        assert_eq!(fused_peak_bytes(&program), 8004);
        // Traffic: each stored value written (4 + 4 B) and what it reads (w, and x
        // through the fused exp: 4000 B each), once.
        assert_eq!(fused_traffic_bytes(&program), 8008);
        // A value read by two products is read once.
        let mut b = Builder::new();
        let x = b.param("x", "f32[1000]".parse().unwrap()).unwrap();
        let p = b.dot_general(x, x, &[0], &[0], &[], &[]).unwrap();
        let q = b.reduce_sum(x, &[0], false).unwrap();
        let twice = b.finish(&[p, q]).unwrap();
        assert_eq!(fused_traffic_bytes(&twice), 4008);
        // Unfused, `exp(x)` is stored too (the interpreter's plan).
        let plan = meshwork_program::fast::Executable::compile(
            &program,
            meshwork_program::fast::Options::default(),
        );
        assert!(plan.peak_bytes() >= 12_000, "{}", plan.peak_bytes());
    }

    #[test]
    fn collectives_send_what_ring_algorithms_send() {
        // 8 devices, 800 bytes each: an all-reduce sends 2·7/8 of it, a reduce-scatter
        // whose share is 800 sends the 7 other shares.
        assert_eq!(link_bytes("all-reduce", 800, 8), 1400.0);
        assert_eq!(link_bytes("all-gather", 800, 8), 700.0);
        assert_eq!(link_bytes("reduce-scatter", 800, 8), 5600.0);
        assert_eq!(link_bytes("collective-permute", 800, 8), 800.0);
        assert_eq!(link_bytes("all-reduce", 800, 1), 0.0);
    }

    #[test]
    fn bytes_read_as_a_person_writes_them() {
        assert_eq!(human(512.0), "512 B");
        assert_eq!(human(1536.0), "1.5 KB");
        assert_eq!(human(1.5e6), "1.50 MB");
        assert_eq!(human(3.16e9), "3.16 GB");
    }
}
