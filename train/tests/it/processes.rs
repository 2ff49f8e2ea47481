//! One run spread over several processes, each a thread here joined by the executor's
//! loopback link (what `mpirun` gives the binary, without MPI): the losses of JAX's
//! reference run on every spread, checkpoints written by every process and resumed
//! across process counts, a failure in one process failing all alike, a stop
//! request seen by one process stopping all after the same step.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use meshwork_strategy::executor::LoopbackInterconnect;
use meshwork_train::{Config, Data, Error, OptimizerKind, Processes, Quiet, Report, Trainer};

use crate::transformer::reference_run;
use crate::{assert_close, expected, read_finite};

/// What each of `n` processes' runs of `config` ended with, in process order
/// (`stop[q]`: process `q`'s stop flag, set before it starts).
fn spread_with(config: &Config, n: usize, stop: &[bool]) -> Vec<Result<Report, Error>> {
    let links = LoopbackInterconnect::group(n);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(q, link)| {
            let mut config = config.clone();
            let stopped = stop.get(q).copied().unwrap_or(false);
            std::thread::spawn(move || {
                config.processes = Some(Processes::new(link)?);
                let flag = AtomicBool::new(stopped);
                Trainer::new(&config)?.run(&mut Quiet, &flag)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a process panicked")).collect()
}

/// Every process's report of `config` over `n` processes (each must succeed).
fn spread(config: &Config, n: usize) -> Vec<Report> {
    spread_with(config, n, &[])
        .into_iter()
        .enumerate()
        .map(|(q, r)| r.unwrap_or_else(|e| panic!("process {q} of {n}: {e}")))
        .collect()
}

/// The index of a checkpoint step as JSON.
fn index(step: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(step.join("index.json")).unwrap()).unwrap()
}

/// JAX's reference run (Adam, f64) over 2 and 4 processes on meshes of 2, 4 and 6
/// positions reproduces JAX's losses within 1e-9 in every process, and process 0
/// alone writes the losses file.
#[test]
fn a_run_spread_over_processes_matches_jax() {
    let want = expected("losses_adam");
    for (mesh, n) in [((2, 1), 2), ((2, 2), 2), ((2, 2), 4), ((1, 2), 2), ((4, 1), 2)] {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            mesh: Some(mesh),
            losses_json: Some(dir.path().join("losses.json")),
            ..reference_run(OptimizerKind::Adam, 0.01)
        };
        for (q, report) in spread(&config, n).iter().enumerate() {
            assert_close(&report.losses, &want, 1e-9, &format!("{mesh:?} over {n}, process {q}"));
        }
        assert_close(&read_finite(&dir.path().join("losses.json")), &want, 1e-9, "the file");
    }
}

/// Three processes on `3x1` and on `3x2` (batch 6, SGD, f32 built-in rows): every
/// process's losses are one process's on the same mesh, within 1e-9.
#[test]
fn three_processes_train_as_one() {
    for mesh in [(3, 1), (3, 2)] {
        let config = Config {
            mesh: Some(mesh),
            batch: Some(6),
            steps: Some(5),
            ..crate::config(meshwork_train::ModelKind::Transformer)
        };
        let want = crate::losses(&config);
        for (q, report) in spread(&config, 3).iter().enumerate() {
            assert_close(&report.losses, &want, 1e-9, &format!("{mesh:?}, process {q}"));
        }
    }
}

/// A checkpoint saved by 4 processes is written by each (its index names the process
/// of every file) and resumes in one process on another mesh to the losses of the
/// uninterrupted run; one saved in one process resumes over 2.
#[test]
fn checkpoints_are_written_by_every_process_and_resume_on_any_count() {
    let want = expected("losses_adam");
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let config = Config {
        mesh: Some((2, 2)),
        steps: Some(12),
        checkpoint_dir: Some(ckpt.clone()),
        checkpoint_every: Some(4),
        keep: Some(2),
        ..reference_run(OptimizerKind::Adam, 0.01)
    };
    for report in spread(&config, 4) {
        assert_close(&report.losses, &want[..12], 1e-9, "4 processes");
    }
    // --keep 2 of steps 4, 8, 12; nothing partial left.
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') || n.starts_with(".partial"))
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "meshwork-checkpoints.json", "step-00000008", "step-00000012"]);
    let step8 = ckpt.join("step-00000008");
    let files = index(&step8)["files"].as_array().unwrap().clone();
    let ranks: Vec<u64> = files.iter().map(|f| f["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, [0, 1, 2, 3], "position r's file written by process r: {files:?}");

    // Step 8 in one process on 1x1: steps 9..20 as the uninterrupted run's.
    let resumed = crate::run(&Config {
        mesh: Some((1, 1)),
        resume: Some(step8),
        init: None,
        checkpoint_dir: None,
        checkpoint_every: None,
        keep: None,
        steps: Some(20),
        ..reference_run(OptimizerKind::Adam, 0.01)
    });
    assert_close(&resumed.losses, &want[8..], 1e-9, "resumed in one process");

    // Saved in one process at step 6, resumed over 2 processes on 2x1.
    let one = dir.path().join("one");
    crate::run(&Config {
        mesh: Some((1, 2)),
        steps: Some(6),
        checkpoint_dir: Some(one.clone()),
        ..reference_run(OptimizerKind::Adam, 0.01)
    });
    let back = Config {
        mesh: Some((2, 1)),
        resume: Some(one),
        init: None,
        ..reference_run(OptimizerKind::Adam, 0.01)
    };
    for report in spread(&back, 2) {
        assert_close(&report.losses, &want[6..], 1e-9, "resumed over 2 processes");
    }
}

/// A file missing in one process only (its node's copy): every process refuses with
/// that process's line, before any step.
#[test]
fn bad_input_in_one_process_refuses_in_all() {
    let dir = tempfile::tempdir().unwrap();
    let links = LoopbackInterconnect::group(2);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(q, link)| {
            // Process 1's tokens file is missing.
            let tokens =
                if q == 0 { crate::reference("tokens.npy") } else { dir.path().join("absent.npy") };
            let config = Config {
                mesh: Some((2, 1)),
                data: Data::Tokens(tokens),
                ..reference_run(OptimizerKind::Adam, 0.01)
            };
            std::thread::spawn(move || {
                let mut config = config;
                config.processes = Some(Processes::new(link)?);
                Trainer::new(&config).map(|_| ())
            })
        })
        .collect();
    let got: Vec<Result<(), Error>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (q, r) in got.iter().enumerate() {
        match r {
            Err(Error::Usage(m)) => {
                assert!(m.starts_with("process 1: --data-tokens"), "process {q}: {m}");
                assert!(m.contains("absent.npy") && m.lines().count() == 1, "{m}");
            }
            other => panic!("process {q}: want the refusal, got {other:?}"),
        }
    }
}

/// A stop request seen by one process only stops every process after the same step,
/// each having saved its part of that step once.
#[test]
fn a_stop_seen_by_one_process_stops_all_after_the_same_step() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let config = Config {
        mesh: Some((2, 1)),
        checkpoint_dir: Some(ckpt.clone()),
        ..reference_run(OptimizerKind::Adam, 0.01)
    };
    let got = spread_with(&config, 2, &[false, true]);
    for (q, r) in got.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("process {q}: {e}"));
        assert!(r.stopped, "process {q} did not stop");
        assert_eq!(r.losses.len(), 1, "process {q}: stopped after the first step");
    }
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step-00000001");
}

/// The refusals a spread run alone has: a mesh that does not split over the
/// processes, a pipeline, `--check`.
#[test]
fn what_cannot_spread_is_refused_in_one_line() {
    let refusal = |config: &Config, n: usize| -> Vec<String> {
        let links = LoopbackInterconnect::group(n);
        let handles: Vec<_> = links
            .into_iter()
            .map(|link| {
                let mut config = config.clone();
                std::thread::spawn(move || {
                    config.processes = Some(Processes::new(link)?);
                    Trainer::new(&config).map(|_| ())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join().unwrap() {
                Err(Error::Usage(m)) => m,
                other => panic!("want a refusal, got {other:?}"),
            })
            .collect()
    };
    let base = reference_run(OptimizerKind::Adam, 0.01);
    for (config, n, says) in [
        (Config { mesh: Some((3, 1)), ..base.clone() }, 2, "do not split evenly"),
        (Config { stages: Some(2), ..base.clone() }, 2, "a pipeline's stages"),
        (
            Config { mesh: Some((2, 1)), check: meshwork_train::Check::Always, ..base.clone() },
            2,
            "--check",
        ),
    ] {
        for m in refusal(&config, n) {
            assert!(m.contains(says) && m.lines().count() == 1, "want {says:?}: {m}");
        }
    }
}

/// What a spread run sends between processes is the partitioner's minimum (the
/// collectives' groups combined in each process first, then the bandwidth-optimal
/// exchange between processes), measured on the link, whether the processes split
/// the data axis alone or the model axis too.
#[test]
fn processes_send_the_collectives_minimum() {
    for (mesh, n) in [((2, 1), 2), ((2, 2), 2), ((4, 1), 2), ((4, 1), 4), ((2, 2), 4)] {
        let config = Config { mesh: Some(mesh), ..reference_run(OptimizerKind::Adam, 0.01) };
        for (q, report) in spread(&config, n).iter().enumerate() {
            let (sent, least) = report.between_processes.expect("a spread run counts its bytes");
            // Beyond the collectives: each host call's agreement (3 words to each
            // other process) and the run's few others, spread over its 20 steps.
            let slack = 64.0 * (n - 1) as f64;
            assert!(
                least > 0 && sent >= least as f64 && sent <= least as f64 + slack,
                "{mesh:?} over {n}, process {q}: sent {sent} per step, the minimum is {least}"
            );
        }
    }
}

/// Every saver and `--precision` trains over 2 processes as in one: `--fsdp`,
/// `--remat`, `--grad-accum` and bf16 products (the reference run's f64 weights, on
/// 2x2), each within 1e-9 of one process's losses; with `--fsdp` a checkpoint's
/// sharded optimizer state comes from both processes' parts.
#[test]
fn every_saver_and_precision_spreads() {
    let base =
        Config { mesh: Some((2, 2)), steps: Some(6), ..reference_run(OptimizerKind::Adam, 0.01) };
    let cases = [
        Config { fsdp: true, ..base.clone() },
        Config { remat: true, ..base.clone() },
        Config { grad_accum: Some(2), ..base.clone() },
        Config { precision: Some(meshwork_types::DType::BF16), ..base.clone() },
    ];
    for config in cases {
        let want = crate::losses(&Config { check: meshwork_train::Check::Never, ..config.clone() });
        for (q, report) in spread(&config, 2).iter().enumerate() {
            assert_close(&report.losses, &want, 1e-9, &format!("{config:?}, process {q}"));
        }
    }
}

/// `--export-hf` of a run over 2 processes: process 0 alone writes the folder (the
/// weights sent to it, not to every process), the same bytes as one process's export
/// of the same run.
#[test]
fn an_export_is_written_once_by_process_0() {
    let dir = tempfile::tempdir().unwrap();
    let config = |out: &str| Config {
        mesh: Some((2, 1)),
        steps: Some(2),
        export_hf: Some(dir.path().join(out)),
        ..crate::gpt2::adamw_command()
    };
    crate::run(&config("one"));
    for r in spread_with(&config("two"), 2, &[]) {
        r.unwrap();
    }
    for file in ["model.safetensors", "config.json"] {
        let one = std::fs::read(dir.path().join("one").join(file)).unwrap();
        let two = std::fs::read(dir.path().join("two").join(file)).unwrap();
        assert!(one == two, "{file} differs");
    }
}

/// Each process reads only the rows it trains on: a token id out of range in a row
/// only process 1 trains on is refused by process 1 (named), one in a row no step of
/// the run takes is never read, and the run over 2 processes still matches JAX. The
/// GPT-2 case from its text over 2 processes: process 0 encodes the text into the
/// cache once, every process reads its rows from there.
#[test]
fn each_process_reads_only_the_rows_it_trains_on() {
    let dir = tempfile::tempdir().unwrap();
    let rows = meshwork_io::npy::read("--x", &crate::reference("tokens.npy"), 1 << 30).unwrap();
    let ids: Vec<i32> = rows.iter().map(|&v| v as i32).collect();
    let poke = |row: usize, name: &str| {
        let mut bad = ids.clone();
        bad[row * 17 + 3] = 999;
        let path = dir.path().join(name);
        std::fs::write(&path, meshwork_io::npy::encode(rows.shape(), &bad).unwrap()).unwrap();
        path
    };
    // 20 steps of 8 rows on 2x1: process 1 takes rows s·8+4..s·8+8, s < 20.
    let config = |tokens| Config {
        mesh: Some((2, 1)),
        data: Data::Tokens(tokens),
        ..reference_run(OptimizerKind::Adam, 0.01)
    };
    for r in spread_with(&config(poke(5, "row5.npy")), 2, &[]) {
        match r {
            Err(Error::Usage(m)) => {
                assert!(m.starts_with("process 1: --data-tokens") && m.contains("row 5"), "{m}")
            }
            other => panic!("want process 1's refusal, got {other:?}"),
        }
    }
    let want = expected("losses_adam");
    for report in spread(&config(poke(200, "row200.npy")), 2) {
        assert_close(&report.losses, &want, 1e-9, "a bad row no step takes");
    }

    let cache = dir.path().join("cache");
    let gpt = Config {
        mesh: Some((2, 1)),
        init: Some(crate::testdata("gpt2/model")),
        data: Data::Text(crate::testdata("gpt2/corpus.txt")),
        tokenizer: Some(crate::testdata("gpt2/tokenizer.json")),
        cache_dir: Some(cache.clone()),
        ..crate::gpt2::adamw_command()
    };
    let want = crate::gpt2::losses_adamw();
    for report in spread(&gpt, 2) {
        assert_close(&report.losses, &want, 1e-9, "GPT-2 from text over 2 processes");
    }
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1, "one cache file");
}

/// Processes that planned different runs (their flags or files differ between
/// machines: here the steps) refuse together, saying so, instead of pairing up
/// wrongly.
#[test]
fn processes_that_plan_different_runs_refuse_together() {
    let links = LoopbackInterconnect::group(2);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(q, link)| {
            let config = Config {
                mesh: Some((2, 1)),
                steps: Some(5 + q),
                ..reference_run(OptimizerKind::Adam, 0.01)
            };
            std::thread::spawn(move || {
                let mut config = config;
                config.processes = Some(Processes::new(link)?);
                Trainer::new(&config).map(|_| ())
            })
        })
        .collect();
    for h in handles {
        match h.join().unwrap() {
            Err(Error::Usage(m)) => {
                assert!(m.contains("do not run the same job") && m.lines().count() == 1, "{m}")
            }
            other => panic!("want the refusal, got {other:?}"),
        }
    }
}

/// The classifiers' `--data-x` rows are read by the processes that train on them:
/// JAX's MLP case (its `.npy` rows and initial weights) over 2 processes matches JAX,
/// and a row no step takes may hold anything; a CNN's images over 2 processes train
/// as in one.
#[test]
fn classifier_rows_are_read_by_their_processes() {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(crate::testdata("jax/losses.json")).unwrap())
            .unwrap();
    let want: Vec<f64> = serde_json::from_value(json["losses"].clone()).unwrap();
    let mlp = |x: std::path::PathBuf| Config {
        data: Data::Npy { x, y: crate::testdata("jax/y.npy") },
        init: Some(crate::testdata("jax/init.safetensors")),
        batch: Some(16),
        steps: Some(12),
        mesh: Some((2, 2)),
        optimizer: Some(OptimizerKind::Sgd),
        lr: Some(0.3),
        ..crate::config(meshwork_train::ModelKind::Mlp)
    };
    for (q, report) in spread(&mlp(crate::testdata("jax/x.npy")), 2).iter().enumerate() {
        assert_close(&report.losses, &want, 1e-12, &format!("JAX's MLP, process {q}"));
    }
    // A NaN in a row no step takes (2 steps of 16 take rows 0..32 of 48) is never
    // read; in a row process 1 trains on (slot 9 of step 0), process 1 refuses it.
    let x = meshwork_io::npy::read("--x", &crate::testdata("jax/x.npy"), 1 << 30).unwrap();
    let (n, f) = (x.shape()[0], x.shape()[1]);
    assert!(n > 40, "JAX's MLP rows: {n}");
    let dir = tempfile::tempdir().unwrap();
    let with_nan = |row: Option<usize>, name: &str| {
        let mut v: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        if let Some(row) = row {
            v[row * f] = f32::NAN;
        }
        crate::write_npy_f32(&dir.path().join(name), &[n, f], &v)
    };
    let short = |x| Config { steps: Some(2), ..mlp(x) };
    let whole = crate::losses(&Config {
        check: meshwork_train::Check::Never,
        ..short(with_nan(None, "clean.npy"))
    });
    for report in spread(&short(with_nan(Some(40), "late.npy")), 2) {
        assert_close(&report.losses, &whole, 1e-12, "a bad row no step takes");
    }
    for r in spread_with(&mlp(with_nan(Some(9), "early.npy")), 2, &[]) {
        match r {
            Err(Error::Usage(m)) => {
                assert!(m.starts_with("process 1: --data-x") && m.contains("row 9"), "{m}")
            }
            other => panic!("want process 1's refusal, got {other:?}"),
        }
    }
    // 32 images 4x4x1 of 2 classes.
    let (n, h, w) = (32, 4, 4);
    let xs: Vec<f32> =
        (0..n * h * w).map(|k| ((k * 7) % 11) as f32 * 0.1 + (k / (h * w) % 2) as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 2) as f32).collect();
    let cnn = Config {
        data: Data::Npy {
            x: crate::write_npy_f32(&dir.path().join("ix.npy"), &[n, h, w, 1], &xs),
            y: crate::write_npy_f32(&dir.path().join("iy.npy"), &[n], &ys),
        },
        batch: Some(8),
        steps: Some(5),
        mesh: Some((2, 1)),
        dtype: Some(meshwork_types::DType::F64),
        filters: Some([2, 2]),
        ..crate::config(meshwork_train::ModelKind::Cnn)
    };
    let one = crate::losses(&Config { check: meshwork_train::Check::Never, ..cnn.clone() });
    for report in spread(&cnn, 2) {
        assert_close(&report.losses, &one, 1e-12, "CNN over 2 processes");
    }
}

/// An `--init` file is read by boxes across processes: a value that is not finite in
/// the box of `layers.0.attn.wq` that process 1's model position holds (its last
/// column, whatever way Megatron splits it over `1x2`) is refused by process 1 alone,
/// naming it, before any step.
#[test]
fn an_init_file_is_read_by_boxes() {
    let dir = tempfile::tempdir().unwrap();
    let mut weights =
        meshwork_train::read_init(&crate::reference("init.safetensors"), 1 << 30).unwrap();
    let wq = weights.get_mut("layers.0.attn.wq").unwrap();
    let meshwork_types::Tensor::F64(a) = wq else { panic!("f64 weights") };
    let last = a.len() - 1;
    a.as_slice_mut().unwrap()[last] = f64::NAN;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        weights.iter().map(|(n, t)| (n.clone(), t.shape().to_vec(), t.to_le_bytes())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F64, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let path = dir.path().join("nan.safetensors");
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let config =
        Config { mesh: Some((1, 2)), init: Some(path), ..reference_run(OptimizerKind::Adam, 0.01) };
    for r in spread_with(&config, 2, &[]) {
        match r {
            Err(Error::Usage(m)) => {
                assert!(m.starts_with("process 1: --init") && m.contains("NaN"), "{m}")
            }
            other => panic!("want process 1's refusal, got {other:?}"),
        }
    }
}

/// A LoRA run whose base is held in bf16 over 2 processes (each reading its devices'
/// boxes of the base from the folder, narrowed to bf16) trains as in one; processes
/// given different `--base-dtype`s refuse together, before any step.
#[test]
fn a_bf16_base_spreads_over_processes() {
    let config = Config {
        mesh: Some((2, 1)),
        base_dtype: Some(meshwork_types::DType::BF16),
        ..crate::lora::lora_command("llama")
    };
    let want = crate::losses(&Config { check: meshwork_train::Check::Never, ..config.clone() });
    for (q, report) in spread(&config, 2).iter().enumerate() {
        assert_close(&report.losses, &want, 1e-12, &format!("process {q}"));
    }
    let links = LoopbackInterconnect::group(2);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(q, link)| {
            let mut config = Config {
                base_dtype: (q == 0).then_some(meshwork_types::DType::BF16),
                ..config.clone()
            };
            std::thread::spawn(move || {
                config.processes = Some(Processes::new(link)?);
                Trainer::new(&config).map(|_| ())
            })
        })
        .collect();
    for h in handles {
        match h.join().unwrap() {
            Err(Error::Usage(m)) => assert!(m.contains("do not run the same job"), "{m}"),
            other => panic!("want the refusal, got {other:?}"),
        }
    }
}

/// LoRA's dropout over 2 processes (each drawing the masks of the rows it trains
/// from the seed, the step and the row): one process's losses.
#[test]
fn lora_dropout_spreads_over_processes() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        mesh: Some((2, 1)),
        lora: Some(meshwork_train::LoraSettings {
            init: Some(crate::dropped_folder(dir.path(), 0.25)),
            ..Default::default()
        }),
        ..crate::commands::llama::adamw_command("llama")
    };
    let want = crate::losses(&Config { check: meshwork_train::Check::Never, ..config.clone() });
    let plain = crate::losses(&crate::lora::lora_command("llama"));
    assert!((want[1] - plain[1]).abs() > 1e-6, "dropped {want:?} vs {plain:?}");
    for (q, report) in spread(&config, 2).iter().enumerate() {
        assert_close(&report.losses, &want, 1e-12, &format!("process {q}"));
    }
}
