//! Deviceless compiles for NVIDIA GPUs with the CUDA plugin (`MESHWORK_CUDA_PLUGIN`:
//! `jax-cuda13-pjrt`'s `xla_cuda_plugin.so` in its pip layout, which `cargo xtask
//! cuda-aot` installs), on a machine with no GPU. A missing plugin fails these tests.

use meshwork_program::{Builder, Program};
use meshwork_xla::lower::LowerOptions;
use meshwork_xla::target::{Target, TargetSession};
use meshwork_xla::{Error, Plugin, find, hlo};

fn cuda() -> Plugin {
    let path = std::env::var_os("MESHWORK_CUDA_PLUGIN")
        .expect("set MESHWORK_CUDA_PLUGIN to jax-cuda13-pjrt's xla_cuda_plugin.so");
    find::load(std::path::Path::new(&path)).unwrap_or_else(|e| panic!("{e}"))
}

/// `tanh(x · w)` summed over the replicas: `[rows, k] x [k, n]`.
fn matmul_all_reduced(rows: usize, k: usize, n: usize, replicas: usize) -> Program {
    let mut b = Builder::new();
    let x = b.param("x", format!("f32[{rows},{k}]").parse().unwrap()).unwrap();
    let w = b.param("w", format!("f32[{k},{n}]").parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let z = if replicas > 1 {
        let groups = vec![(0..replicas).collect::<Vec<_>>()];
        b.all_reduce(z, meshwork_types::ReduceOp::Sum, &groups).unwrap()
    } else {
        z
    };
    b.finish(&[z]).unwrap()
}

#[test]
fn one_h100_compiles_a_program_and_reports_its_memory() {
    let session = TargetSession::new(&cuda(), Target::parse("h100").unwrap()).unwrap();
    assert!(session.device_kind().contains("H100"), "{}", session.device_kind());
    let program = matmul_all_reduced(1024, 512, 256, 1);
    let compiled = session.compile(&program, &LowerOptions::default()).unwrap();
    let m = compiled.memory;
    // Arguments: 1024·512 + 512·256 f32; output 1024·256 f32 (XLA's own figures).
    assert_eq!(m.arguments, 4 * (1024 * 512 + 512 * 256));
    assert_eq!(m.outputs, 4 * 1024 * 256);
    assert!(m.peak >= m.arguments + m.outputs, "{m:?}");
    // Cached: the same module is not compiled again.
    session.compile(&program, &LowerOptions::default()).unwrap();
    assert_eq!(session.compiles(), 1);
    let (format, hlo) = compiled.executable.optimized_program().unwrap();
    assert_eq!(format, "hlo_with_config");
    assert!(!hlo.is_empty());
}

#[test]
fn eight_h100s_compile_the_replicated_program_with_its_all_reduce() {
    let session = TargetSession::new(&cuda(), Target::parse("h100x8").unwrap()).unwrap();
    let program = matmul_all_reduced(256, 128, 64, 8);
    let options = LowerOptions { replicas: 8, ..LowerOptions::default() };
    let compiled = session.compile(&program, &options).unwrap();
    let (_, module) = compiled.executable.optimized_program().unwrap();
    let ops = hlo::collectives(&module).unwrap();
    assert!(ops.iter().any(|c| c.bytes == 4 * 256 * 64), "{ops:?}");
    // Two hosts of four compile the same module.
    let hosts = TargetSession::new(&cuda(), Target::parse("2xh100x4").unwrap()).unwrap();
    assert_eq!(
        hosts.compile(&program, &options).unwrap().memory.arguments,
        compiled.memory.arguments
    );
}

#[test]
fn a_program_needing_more_devices_than_the_target_is_refused() {
    let session = TargetSession::new(&cuda(), Target::parse("h100x2").unwrap()).unwrap();
    let options = LowerOptions { replicas: 4, ..LowerOptions::default() };
    let e = session.compile(&matmul_all_reduced(8, 8, 8, 4), &options).unwrap_err();
    assert!(e.to_string().contains("has 2 devices; the program needs 4"), "{e}");
}

#[test]
fn a_config_the_plugin_cannot_parse_is_its_typed_error() {
    // Passes meshwork's checks, fails the plugin's text-proto parser.
    let text = format!("{}\nnot_a_field: 1\n", meshwork_xla::target::GPUS[0].config);
    let target = Target::parse("h100").unwrap().with_config(text, "bad.txtpb").unwrap();
    match TargetSession::new(&cuda(), target) {
        Err(Error::Target(m)) => assert!(m.contains("made no topology"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_a100_config_compiles_too() {
    let session = TargetSession::new(&cuda(), Target::parse("a100").unwrap()).unwrap();
    assert!(session.device_kind().contains("A100"), "{}", session.device_kind());
    let compiled =
        session.compile(&matmul_all_reduced(64, 64, 64, 1), &LowerOptions::default()).unwrap();
    assert!(compiled.memory.peak > 0);
}

/// `sum(attention(q, k, v))` and its gradients, heads `[B,H,T,D]` of `dtype`.
fn attention_step(dtype: &str, d: usize) -> Program {
    use meshwork_program::AttentionSpec;
    let mut b = Builder::new();
    let spec: meshwork_types::TensorSpec = format!("{dtype}[2,4,128,{d}]").parse().unwrap();
    let q = b.param("q", spec.clone()).unwrap();
    let k = b.param("k", spec.clone()).unwrap();
    let v = b.param("v", spec).unwrap();
    let a = AttentionSpec { scale: (d as f64).powf(-0.5), divide: false, causal: true };
    let out = b.attention(q, k, v, a).unwrap();
    let out = b.convert(out, meshwork_types::DType::F32).unwrap();
    let loss = b.reduce_sum(out, &[0, 1, 2, 3], false).unwrap();
    let forward = b.finish(&[loss]).unwrap();
    let wrt: Vec<meshwork_program::Value> = (0..3).map(meshwork_program::Value).collect();
    meshwork_program::grad(&forward, forward.results()[0], &wrt).unwrap()
}

#[test]
fn cudnn_attention_compiles_forward_and_backward_for_an_h100() {
    let session = TargetSession::new(&cuda(), Target::parse("h100").unwrap()).unwrap();
    let options = LowerOptions { cudnn_attention: true, ..LowerOptions::default() };
    let compiled = session.compile(&attention_step("bf16", 64), &options).unwrap();
    let text = &compiled.lowered.text;
    // One forward call and one backward call serve all three gradients.
    assert_eq!(text.matches("__cudnn$fmhaSoftmaxBackward").count(), 1, "{text}");
    assert_eq!(text.matches("__cudnn$fmhaSoftmax\"").count(), 1, "{text}");
    let (_, hlo) = compiled.executable.optimized_program().unwrap();
    let has = |needle: &[u8]| hlo.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"__cudnn$fmhaSoftmaxBackward") && has(b"__cudnn$fmhaSoftmax"));
    // Lowered plainly, the same step holds no cuDNN call.
    let plain = session.compile(&attention_step("bf16", 64), &LowerOptions::default()).unwrap();
    let (_, hlo) = plain.executable.optimized_program().unwrap();
    assert!(!hlo.windows(7).any(|w| w == b"__cudnn"));
}

/// Eight MLP blocks `x + gelu(x · w1) · w2` on `[2048, 1024]` activations (the
/// backward pass reads `x · w1` and its gelu), the loss their sum, and the gradient of
/// the weights: each block a recomputed region with `remat`.
fn blocks(remat: bool) -> Program {
    let mut b = Builder::new();
    let mut x = b.param("x", "f32[2048,1024]".parse().unwrap()).unwrap();
    let mut weights = Vec::new();
    let mut regions = Vec::new();
    for i in 0..16 {
        weights.push(b.param(&format!("w{i}"), "f32[1024,1024]".parse().unwrap()).unwrap());
    }
    for (i, w) in weights.chunks(2).enumerate() {
        x = b
            .scope(&format!("block{i}"), |b| {
                let z = b.matmul(x, w[0])?;
                let h = b.gelu(z)?;
                let y = b.matmul(h, w[1])?;
                b.add(x, y)
            })
            .unwrap();
        regions.push(b.scope_spans().last().unwrap().1.clone());
    }
    let loss = b.reduce_sum(x, &[0, 1], false).unwrap();
    let forward = b.finish(&[loss]).unwrap();
    let regions = if remat { regions } else { Vec::new() };
    meshwork_program::grad_remat(&forward, forward.results()[0], &weights, &regions).unwrap()
}

/// Rematerialized blocks stay recomputed through XLA's optimizations: the recomputed
/// work reads its inputs through optimization barriers, so XLA's CSE cannot merge it
/// back into the forward pass's (which would keep every activation). The eight
/// recomputed products are in the optimized module beside the 47 of the step.
#[test]
fn rematerialized_blocks_survive_xlas_cse() {
    let session = TargetSession::new(&cuda(), Target::parse("h100").unwrap()).unwrap();
    let products = |remat: bool| {
        let c = session.compile(&blocks(remat), &LowerOptions::default()).unwrap();
        assert_eq!(c.lowered.text.contains("optimization_barrier"), remat);
        let (_, hlo) = c.executable.optimized_program().unwrap();
        // Each product is one fusion of kind `gemm_fusion` (the word alone; the
        // fusions' own names extend it).
        let word = b"gemm_fusion";
        hlo.windows(word.len() + 1)
            .filter(|w| {
                let next = w[word.len()];
                w.starts_with(word) && !(next.is_ascii_alphanumeric() || b"_.".contains(&next))
            })
            .count()
    };
    let (kept, recomputed) = (products(false), products(true));
    assert!(kept >= 47, "{kept} products kept");
    assert_eq!(recomputed, kept + 8, "{recomputed} products with remat, {kept} without");
}
