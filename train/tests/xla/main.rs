//! The trainer on XLA (`--backend xla`, a PJRT plugin named by `MESHWORK_PJRT_PLUGIN`):
//! JAX's transformer and MLP runs on XLA devices, every model checked step by step
//! against the interpreter, checkpoints moving between the back ends, and the
//! refusals. `test = false`: the README's `cargo test` has no plugin, so this binary
//! is built and run by `cargo xtask xla-test` and CI (`--test xla`), where a missing
//! plugin fails it.

// The helpers the `it` binary shares, not all of them used here.
#[path = "../it/commands.rs"]
mod commands;
#[allow(dead_code)]
#[path = "../it/common.rs"]
mod common;

use meshwork_train::{
    BackendKind, CheckOutcome, Config, Data, ModelKind, OptimizerKind, Partitioner,
};
use meshwork_types::DType;

use common::{assert_close, config, expected, losses, refused_with, run, testdata};

fn xla() -> BackendKind {
    BackendKind::Xla { plugin: None, partitioner: Partitioner::Meshwork }
}

fn xla_partitioned() -> BackendKind {
    BackendKind::Xla { plugin: None, partitioner: Partitioner::Xla }
}

/// JAX's reference command (its tokens and initial weights, 20 steps of 8 rows, f64)
/// on XLA.
fn reference_run(optimizer: OptimizerKind, lr: f64) -> Config {
    Config { backend: xla(), ..commands::reference_run(optimizer, lr) }
}

/// JAX's run on every mesh through XLA: meshwork's partitioner splits the step
/// (Megatron's shardings), XLA compiles the per-device program once with
/// `num_replicas = D·M` and runs it on that many CPU devices of one client.
#[test]
fn the_reference_transformer_matches_jax_on_xla_meshes() {
    // Each mesh with one optimizer, both optimizers on meshes splitting each axis (the
    // interpreter's tests run every pair).
    for (mesh, (optimizer, lr, key)) in [
        ((2, 1), ADAM),
        ((1, 2), SGD),
        ((2, 2), ADAM),
        ((2, 2), SGD),
        ((4, 1), SGD),
        ((1, 4), ADAM),
    ] {
        let report = run(&Config { mesh: Some(mesh), ..reference_run(optimizer, lr) });
        assert_close(&report.losses, &expected(key), 1e-9, &format!("xla {mesh:?} {key}"));
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    }
}

/// The reference run's Adam: optimizer, learning rate and JAX's losses.
const ADAM: (OptimizerKind, f64, &str) = (OptimizerKind::Adam, 0.01, "losses_adam");
/// The reference run's SGD.
const SGD: (OptimizerKind, f64, &str) = (OptimizerKind::Sgd, 0.1, "losses_sgd");

/// JAX's run on every mesh with XLA's partitioner: the global step compiled with
/// Megatron's shardings as `mhlo.sharding`, XLA inserting the collectives, as
/// `jax.jit` with `NamedSharding`s does.
#[test]
fn the_reference_transformer_matches_jax_with_xlas_partitioner() {
    for (mesh, (optimizer, lr, key)) in [
        ((1, 1), SGD),
        ((2, 1), ADAM),
        ((1, 2), ADAM),
        ((2, 2), SGD),
        ((2, 2), ADAM),
        ((4, 1), SGD),
        ((1, 4), SGD),
    ] {
        let report = run(&Config {
            mesh: Some(mesh),
            backend: xla_partitioned(),
            ..reference_run(optimizer, lr)
        });
        let what = format!("xla partitioner {mesh:?} {key}");
        assert_close(&report.losses, &expected(key), 1e-9, &what);
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    }
    refused_with(
        &Config { stages: Some(2), backend: xla_partitioned(), ..config(ModelKind::Mlp) },
        "--partitioner xla",
    );
}

/// JAX's run as pipelines through XLA: the placed stages, each segment of each stage
/// an executable on its device, activations and gradients copied device to device.
#[test]
fn the_reference_transformer_matches_jax_as_xla_pipelines() {
    // Each layout with one optimizer (the interpreter's tests run every pair).
    for ((replicas, stages, micro), (optimizer, lr, key)) in
        [((1, 2, 1), ADAM), ((1, 3, 1), SGD), ((1, 2, 4), SGD), ((2, 2, 2), ADAM)]
    {
        let report = run(&Config {
            mesh: Some((replicas, 1)),
            stages: Some(stages),
            microbatches: Some(micro),
            ..reference_run(optimizer, lr)
        });
        let what = format!("xla {replicas}x{stages} stages, {micro} micro-batches, {key}");
        assert_close(&report.losses, &expected(key), 1e-9, &what);
        assert!(report.layout.contains("pipeline"), "{}", report.layout);
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    }
}

#[test]
fn the_reference_transformer_matches_jax_on_xla() {
    for (optimizer, lr, key) in
        [(OptimizerKind::Adam, 0.01, "losses_adam"), (OptimizerKind::Sgd, 0.1, "losses_sgd")]
    {
        let report = run(&reference_run(optimizer, lr));
        assert_close(&report.losses, &expected(key), 1e-9, &format!("xla {key}"));
        assert!(report.layout.contains("XLA"), "{}", report.layout);
        // Checked step by step against the interpreter on one device.
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
        // Several steps per host call, and evaluated on held-out rows.
        let got = losses(&Config {
            steps_per_run: 4,
            eval_every: Some(5),
            ..reference_run(optimizer, lr)
        });
        assert_close(&got, &expected(key), 1e-9, &format!("xla 4 per call {key}"));
    }
}

#[test]
fn jaxs_mlp_case_matches_on_xla() {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("jax/losses.json")).unwrap()).unwrap();
    let jax = |key: &[&str]| -> Vec<f64> {
        serde_json::from_value(key.iter().fold(&json, |v, k| &v[*k]).clone()).unwrap()
    };
    let case = |optimizer: OptimizerKind, lr: f64| Config {
        data: Data::Npy { x: testdata("jax/x.npy"), y: testdata("jax/y.npy") },
        init: Some(testdata("jax/init.safetensors")),
        batch: Some(16),
        steps: Some(12),
        mesh: Some((1, 1)),
        optimizer: Some(optimizer),
        lr: Some(lr),
        backend: xla(),
        ..config(ModelKind::Mlp)
    };
    assert_close(&losses(&case(OptimizerKind::Sgd, 0.3)), &jax(&["losses"]), 1e-12, "sgd");
    let momentum = losses(&case(OptimizerKind::Momentum, 0.1));
    assert_close(&momentum, &jax(&["momentum", "losses"]), 1e-12, "momentum");
    let adamw = losses(&case(OptimizerKind::AdamW, 0.01));
    assert_close(&adamw, &jax(&["adamw", "losses"]), 1e-12, "adamw");
}

#[test]
fn every_model_trains_on_xla_as_on_the_interpreter() {
    for model in [ModelKind::Mlp, ModelKind::Cnn, ModelKind::Transformer] {
        for dtype in [DType::F32, DType::F64] {
            let on = |backend: BackendKind| Config {
                steps: Some(6),
                dtype: Some(dtype),
                mesh: Some((1, 1)),
                clip_norm: Some(1.0),
                warmup: 2,
                backend,
                ..config(model)
            };
            let report = run(&on(xla()));
            let want = losses(&on(BackendKind::Interpreter));
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
            assert_close(&report.losses, &want, tol, &format!("{model:?} {dtype}"));
            assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{model:?}");
        }
    }
}

/// Every model on a 2x1 mesh with each partitioner, and as a 2-stage pipeline of 2
/// micro-batches, through XLA: the interpreter's losses on the same layout (f64).
#[test]
fn every_model_trains_on_xla_meshes_and_pipelines_as_on_the_interpreter() {
    for model in [ModelKind::Mlp, ModelKind::Cnn, ModelKind::Transformer] {
        let layouts = [(Some((2, 1)), None, None), (Some((1, 1)), Some(2), Some(2))];
        for (mesh, stages, microbatches) in layouts {
            let on = |backend: BackendKind| Config {
                steps: Some(4),
                dtype: Some(DType::F64),
                mesh,
                stages,
                microbatches,
                backend,
                ..config(model)
            };
            let want = losses(&on(BackendKind::Interpreter));
            let backends: &[BackendKind] =
                if stages.is_some() { &[xla()] } else { &[xla(), xla_partitioned()] };
            for backend in backends {
                let what = format!("{model:?} {mesh:?} {stages:?} {backend:?}");
                let report = run(&on(backend.clone()));
                assert_close(&report.losses, &want, 1e-12, &what);
                assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{what}");
            }
        }
    }
}

#[test]
fn a_run_saved_on_xla_resumes_on_the_interpreter_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let base = |backend: BackendKind, steps: usize| Config {
        steps: Some(steps),
        mesh: Some((1, 1)),
        optimizer: Some(OptimizerKind::Adam),
        lr: Some(0.01),
        backend,
        ..config(ModelKind::Mlp)
    };
    let whole = losses(&base(BackendKind::Interpreter, 30));
    run(&Config {
        checkpoint_dir: Some(ck.clone()),
        checkpoint_every: Some(10),
        ..base(xla(), 10)
    });
    let middle = run(&Config {
        resume: Some(ck.join("step-00000010")),
        checkpoint_dir: Some(dir.path().join("ck2")),
        ..base(BackendKind::Interpreter, 20)
    });
    let last = run(&Config { resume: Some(dir.path().join("ck2")), ..base(xla(), 30) });
    assert_close(&middle.losses, &whole[10..20], 1e-12, "interpreter after xla");
    assert_close(&last.losses, &whole[20..30], 1e-12, "xla after the interpreter");
}

#[test]
fn xla_refuses_a_bad_plugin_before_any_work() {
    let mlp = |c: Config| Config { backend: xla(), ..c };
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.so");
    std::fs::write(&junk, b"not a plugin").unwrap();
    refused_with(
        &Config {
            backend: BackendKind::Xla { plugin: Some(junk), partitioner: Partitioner::Meshwork },
            ..config(ModelKind::Mlp)
        },
        "--pjrt-plugin",
    );
    // A model larger than --max-memory is refused as on the interpreter.
    refused_with(
        &mlp(Config { max_memory: 1 << 10, ..config(ModelKind::Transformer) }),
        "--max-memory",
    );
}

/// `inspect --json` on XLA, the transformer on 1x4 with each partitioner, read from
/// the runtime (device buffers' sizes, the bytes uploaded and downloaded, XLA's
/// compilations): every Megatron-sharded weight and its Adam slots at a quarter per
/// device, a step's uploads exactly each device's batch and scalars, one compile.
#[test]
fn inspect_json_measures_xla_runs_with_each_partitioner() {
    for backend in [xla(), xla_partitioned()] {
        let config = Config {
            mesh: Some((1, 4)),
            optimizer: Some(OptimizerKind::Adam),
            check: meshwork_train::Check::Never,
            backend,
            ..config(ModelKind::Transformer)
        };
        common::check_inspect_json(&config, 4);
    }
}

/// `inspect --json` of a 2-stage pipeline: XLA holds what the interpreter holds on each
/// device, copies device to device what the interpreter's devices send each other,
/// uploads only the batch and the scalars, and compiles each segment once for the 3
/// steps.
#[test]
fn inspect_json_measures_an_xla_pipeline_as_the_interpreters() {
    let on = |backend: BackendKind| {
        let config = Config {
            mesh: Some((1, 1)),
            stages: Some(2),
            microbatches: Some(2),
            check: meshwork_train::Check::Never,
            backend,
            ..config(ModelKind::Transformer)
        };
        let text = meshwork_train::inspect_json(&config).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let (x, i) = (on(xla()), on(BackendKind::Interpreter));
    assert_eq!(x["devices"], i["devices"], "bytes held per device");
    for key in ["collective_bytes", "host_to_device_bytes", "device_to_host_bytes"] {
        assert_eq!(x["per_step"][key], i["per_step"][key], "{key}: {x} vs {i}");
    }
    let batch = x["per_step"]["batch_bytes"].as_u64().unwrap();
    // The batch to the first stage, the learning rate and step count (f32, i32) once.
    assert_eq!(x["per_step"]["host_to_device_bytes"].as_u64().unwrap(), batch + 8, "{x}");
    assert!(x["per_step"]["collective_bytes"].as_u64().unwrap() > 0, "{x}");
    // Every segment compiled before the first step, none while the steps ran.
    assert!(x["compiles"].as_u64().unwrap() > 2, "{x}");
    assert_eq!(x["compiles_in_steps"], 0, "{x}");
    assert_eq!(i["compiles"], 1);
    assert_eq!(i["compiles_in_steps"], 0);
}

/// GPT-2 through XLA: the AdamW command on meshes 1x1, 2x1 (meshwork's
/// partitioner) and 1x2 (XLA's) reproduces `transformers`' losses within 1e-9, and
/// greedy generation with the key-value cache resident on the XLA device gives its
/// ids.
#[test]
fn gpt2_trains_and_generates_on_xla_as_transformers_does() {
    use meshwork_train::generate::{GenerateConfig, generate};
    let text = std::fs::read_to_string(testdata("gpt2/expected.json")).unwrap();
    let oracle: serde_json::Value = serde_json::from_str(&text).unwrap();
    let numbers = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let want = numbers(&oracle["losses_adamw"]);
    for (mesh, backend) in [((1, 1), xla()), ((2, 1), xla()), ((1, 2), xla_partitioned())] {
        let config = Config { mesh: Some(mesh), backend, ..commands::gpt2::adamw_command() };
        assert_close(&losses(&config), &want, 1e-9, &format!("gpt2 on {mesh:?}"));
    }
    let ids = |v: &serde_json::Value| -> Vec<i64> {
        v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
    };
    let got = generate(&GenerateConfig {
        init: testdata("gpt2/model"),
        prompt_ids: ids(&oracle["generate"]["prompt_ids"]),
        tokenizer: None,
        max_new_tokens: 12,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        dtype: DType::F64,
        backend: xla(),
        max_memory: 1 << 30,
        lora: None,
        keep_logits: false,
    })
    .unwrap();
    assert_eq!(got.ids, ids(&oracle["generate"]["ids"]));
}

/// `--metrics-jsonl`'s gradient norm through XLA, with either partitioner: the first
/// step's is `transformers`' (testdata/gpt2/eval.json) within 1e-9.
#[test]
fn the_gradient_norm_on_xla_is_transformers() {
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("gpt2/eval.json")).unwrap()).unwrap();
    let want = oracle["grad_norm"]["norm"].as_f64().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (mesh, backend) in [((2, 1), xla()), ((1, 2), xla_partitioned())] {
        let path = dir.path().join(format!("{mesh:?}.jsonl"));
        run(&Config {
            init: Some(testdata("gpt2/model")),
            data: Data::Tokens(testdata("gpt2/tokens.npy")),
            seq: Some(16),
            batch: Some(4),
            steps: Some(2),
            dtype: Some(DType::F64),
            mesh: Some(mesh),
            backend,
            metrics_jsonl: Some(path.clone()),
            ..config(ModelKind::Auto)
        });
        let first: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&path).unwrap().lines().next().unwrap())
                .unwrap();
        let got = first["grad_norm"].as_f64().unwrap();
        assert!(((got - want) / want).abs() < 1e-9, "{mesh:?}: {got} {want}");
    }
}

/// The memory savers through XLA: `--fsdp` (its all-gathers and reduce-scatters
/// compiled by XLA), `--remat` and `--grad-accum 2` together on a 2x1 mesh reproduce
/// `transformers`' losses within 1e-9.
#[test]
fn gpt2_with_the_memory_savers_matches_transformers_on_xla() {
    let text = std::fs::read_to_string(testdata("gpt2/expected.json")).unwrap();
    let oracle: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want: Vec<f64> =
        oracle["losses_adamw"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let config = Config {
        mesh: Some((2, 1)),
        backend: xla(),
        fsdp: true,
        remat: true,
        grad_accum: Some(2),
        ..commands::gpt2::adamw_command()
    };
    assert_close(&losses(&config), &want, 1e-9, "gpt2 with the savers on XLA 2x1");
}

/// Mixed precision through XLA: the tiny GPT-2 with bf16 products (lowered as bf16
/// dots) and with f16 products and loss scaling, on one XLA device and on a 2x1 mesh,
/// follows the interpreter's run of the same precision within 1% at every step.
#[test]
fn mixed_precision_trains_on_xla_as_on_the_interpreter() {
    use meshwork_train::ModelKind;
    for precision in [DType::BF16, DType::F16] {
        let base = Config {
            preset: Some("tiny".into()),
            steps: Some(10),
            batch: Some(8),
            precision: Some(precision),
            ..config(ModelKind::Gpt2)
        };
        let want = losses(&base);
        for mesh in [(1, 1), (2, 1)] {
            let config = Config { mesh: Some(mesh), backend: xla(), ..base.clone() };
            assert_close(&losses(&config), &want, 1e-2, &format!("{precision} on XLA {mesh:?}"));
        }
    }
}

/// The Llama family through XLA: the AdamW run from each oracle's folder on 1x1 and
/// 2x1 (meshwork's partitioner), 1x2 (XLA's) and 2x2 with `--fsdp` (Qwen 2's biases
/// and pad row, and Llama's biases, on 1x1 and 1x2), its float32
/// RMSNorm and ordered row sums compiled by XLA (a step's loss is the interpreter's bit
/// for bit; XLA's own rewrites of the float32 backward leave 2e-9 after 10 steps),
/// gives the interpreter's losses within 1e-8 and `transformers`' within 3e-9, as
/// on the interpreter (`llama.rs`); greedy generation gives `transformers`' ids.
#[test]
fn the_llama_family_trains_and_generates_on_xla() {
    use meshwork_train::generate::{GenerateConfig, generate};
    for case in ["llama", "qwen3", "qwen2", "llama-bias"] {
        let base = commands::llama::adamw_command(case);
        let interpreter = losses(&base);
        let want = commands::llama::losses_adamw(case, "rope_cr.json");
        let mut runs = vec![((1, 1), xla(), false), ((1, 2), xla_partitioned(), false)];
        if matches!(case, "llama" | "qwen3") {
            runs.extend([((2, 1), xla(), false), ((2, 2), xla(), true)]);
        }
        for (mesh, backend, fsdp) in runs {
            let got = losses(&Config { mesh: Some(mesh), backend, fsdp, ..base.clone() });
            assert_close(&got, &interpreter, 1e-8, &format!("{case} on XLA {mesh:?}"));
            assert_close(
                &got,
                &want,
                3e-9,
                &format!("{case} on XLA {mesh:?} against transformers"),
            );
        }
        let text = std::fs::read_to_string(testdata(&format!("{case}/expected.json"))).unwrap();
        let oracle: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<i64> {
            v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
        };
        let got = generate(&GenerateConfig {
            init: testdata(&format!("{case}/model")),
            prompt_ids: ids(&oracle["generate"]["prompt_ids"]),
            tokenizer: None,
            max_new_tokens: 12,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            dtype: DType::F64,
            backend: xla(),
            max_memory: 1 << 30,
            lora: None,
            keep_logits: false,
        })
        .unwrap();
        assert_eq!(got.ids, ids(&oracle["generate"]["ids"]), "{case}");
    }
}

/// `peft`'s LoRA runs through XLA, the base frozen on the devices: on one device every
/// loss within 1e-9 of `peft`'s (correctly rounded tables); on 1x2 split by XLA's
/// partitioner within 3e-9, as the full runs on XLA (its split of Qwen 3's float32
/// per-head norms sums in another order: 1.1e-9 measured); both checked against the
/// interpreter step by step.
#[test]
fn lora_trains_on_xla_as_peft_does() {
    for case in ["llama", "qwen3"] {
        let want: Vec<f64> = commands::llama::expected(case, "rope_cr.json", "losses_lora")
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (mesh, backend, tolerance) in [((1, 1), xla(), 1e-9), ((1, 2), xla_partitioned(), 3e-9)]
        {
            let config = Config {
                mesh: Some(mesh),
                backend,
                lora: Some(meshwork_train::LoraSettings {
                    init: Some(testdata(&format!("{case}/lora_init"))),
                    ..Default::default()
                }),
                ..commands::llama::adamw_command(case)
            };
            let report = run(&config);
            assert_close(&report.losses, &want, tolerance, &format!("{case} LoRA on XLA {mesh:?}"));
            assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
        }
    }
}

/// LoRA's dropout on XLA (its masks drawn by `threefry_uniform` lowered to XLA's
/// integer ops): the interpreter's losses within 1e-9, on one device and split by
/// XLA's partitioner and by meshwork's, checked against the interpreter step by step.
#[test]
fn lora_dropout_trains_on_xla_as_on_the_interpreter() {
    let dir = tempfile::tempdir().unwrap();
    let lora = Config {
        lora: Some(meshwork_train::LoraSettings {
            init: Some(common::dropped_folder(dir.path(), 0.25)),
            ..Default::default()
        }),
        ..commands::llama::adamw_command("llama")
    };
    let want = losses(&lora);
    for (mesh, backend) in [((1, 1), xla()), ((1, 2), xla_partitioned()), ((2, 1), xla())] {
        let report = run(&Config { mesh: Some(mesh), backend, ..lora.clone() });
        assert_close(&report.losses, &want, 1e-9, &format!("dropout on XLA {mesh:?}"));
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    }
}

/// `--base-dtype bf16` on XLA: the frozen base held in bf16 on the device, converted
/// where each layer reads it, gives the interpreter's losses of the base rounded to
/// bf16 beforehand (by the test's own arithmetic) within 1e-9, on one device and split
/// by XLA's partitioner, checked against the interpreter step by step.
#[test]
fn a_bf16_base_trains_on_xla_as_the_rounded_base() {
    let dir = tempfile::tempdir().unwrap();
    let rounded =
        common::bf16_rounded_folder(&testdata("llama/model"), &dir.path().join("rounded"));
    let lora = Config {
        lora: Some(meshwork_train::LoraSettings {
            init: Some(testdata("llama/lora_init")),
            ..Default::default()
        }),
        ..commands::llama::adamw_command("llama")
    };
    let want = losses(&Config { init: Some(rounded), ..lora.clone() });
    for (mesh, backend) in [((1, 1), xla()), ((1, 2), xla_partitioned())] {
        let report = run(&Config {
            mesh: Some(mesh),
            backend,
            base_dtype: Some(DType::BF16),
            ..lora.clone()
        });
        assert_close(&report.losses, &want, 1e-9, &format!("bf16 base on XLA {mesh:?}"));
        assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    }
}
