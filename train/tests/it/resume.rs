//! Checkpoints and resuming: on another mesh or pipeline the resumed run continues the
//! uninterrupted one; the main job's checkpoints from before the one trainer resume;
//! what a checkpoint says is checked as strictly as the flags; a resumed losses file
//! holds every step; a stopped run saves and resumes.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use meshwork_train::{Check, Config, Data, ModelKind, OptimizerKind, Trainer};
use meshwork_types::DType;

use crate::{
    StopAfter, assert_close, config, expected, losses, read_finite, reference, refused,
    refused_with, run, step_dirs, testdata,
};

/// The MLP of the resume tests: hidden 16, shuffled by seed 3, unchecked.
fn mlp(mesh: (usize, usize), steps: usize) -> Config {
    Config {
        hidden: Some(16),
        shuffle: true,
        seed: 3,
        mesh: Some(mesh),
        steps: Some(steps),
        check: Check::Never,
        ..config(ModelKind::Mlp)
    }
}

/// Saved every 10 steps on 2x2 and resumed from step 10 on 4x1 and 1x2, the run
/// continues the uninterrupted one; the resumed losses file holds every step's loss
/// (the first ten from the file the saving run wrote).
#[test]
fn a_run_resumed_on_another_mesh_continues_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let whole = losses(&mlp((1, 1), 24));
    let first_losses = dir.path().join("first.json");
    let first = run(&Config {
        checkpoint_dir: Some(ck.clone()),
        checkpoint_every: Some(10),
        losses_json: Some(first_losses.clone()),
        ..mlp((2, 2), 24)
    });
    assert_close(&first.losses, &whole, 1e-12, "first part");
    assert_eq!(step_dirs(&ck), ["step-00000010", "step-00000020", "step-00000024"]);
    for mesh in [(4, 1), (1, 2)] {
        let file = dir.path().join(format!("{mesh:?}.json"));
        std::fs::copy(&first_losses, &file).unwrap();
        let rest = run(&Config {
            resume: Some(ck.join("step-00000010")),
            losses_json: Some(file.clone()),
            ..mlp(mesh, 24)
        });
        assert_eq!(rest.first_step, 10);
        assert_close(&rest.losses, &whole[10..], 1e-12, &format!("{mesh:?}"));
        assert_close(&read_finite(&file), &whole, 1e-12, "the losses file holds every step");
    }
    // The directory itself resumes from its latest step (24): nothing left to run, and
    // nothing written (a finished job run again is a no-op).
    let done = dir.path().join("done.json");
    let again =
        run(&Config { resume: Some(ck), losses_json: Some(done.clone()), ..mlp((2, 2), 24) });
    assert!(again.losses.is_empty() && again.first_step == 24);
    assert!(again.summary()[1].contains("nothing to run: the checkpoint is at step 24"));
    assert!(!done.exists());
}

/// A resumed run's `--losses-json` must hold the steps before it: a file that does not
/// exist, or holds fewer losses than the checkpoint's step, is refused, saying why
/// (before, the file was replaced by the resumed steps alone).
#[test]
fn a_resumed_losses_file_holds_every_step_or_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    run(&Config { checkpoint_dir: Some(ck.clone()), ..mlp((2, 2), 6) });
    let resumed = |file: &Path| Config {
        resume: Some(ck.clone()),
        losses_json: Some(file.to_path_buf()),
        ..mlp((2, 2), 9)
    };
    let missing = dir.path().join("missing.json");
    let m = refused(&resumed(&missing));
    assert!(m.starts_with("--losses-json: ") && m.contains("does not exist"), "{m}");
    assert!(m.contains("holds the first 6 steps"), "{m}");
    let short = dir.path().join("short.json");
    std::fs::write(&short, "[1.0,0.9,0.8]").unwrap();
    let m = refused(&resumed(&short));
    assert!(m.contains("holds 3 losses") && m.contains("at step 6"), "{m}");
    assert_eq!(std::fs::read_to_string(&short).unwrap(), "[1.0,0.9,0.8]", "untouched");
    // The saving run's file: the resumed run adds its steps to the first six.
    let whole = losses(&mlp((2, 2), 9));
    let file = dir.path().join("l.json");
    std::fs::write(&file, serde_json::to_string(&whole[..6]).unwrap()).unwrap();
    run(&resumed(&file));
    assert_close(&read_finite(&file), &whole, 1e-12, "every step");
}

/// The main job's checkpoint from before the one trainer (`testdata/main-job`: the
/// old run description, the step a variable `step`) resumes, on its mesh and another,
/// and continues the old binary's uninterrupted run within 1e-12.
#[test]
fn the_main_jobs_older_checkpoints_resume() {
    let old = testdata("main-job");
    let want = read_finite(&old.join("losses-20.json"));
    let dir = tempfile::tempdir().unwrap();
    for mesh in [(2, 2), (1, 1), (4, 1)] {
        let file = dir.path().join(format!("{mesh:?}.json"));
        std::fs::write(&file, serde_json::to_string(&want[..10]).unwrap()).unwrap();
        let report = run(&Config {
            resume: Some(old.clone()),
            steps: Some(20),
            mesh: Some(mesh),
            losses_json: Some(file.clone()),
            ..config(ModelKind::Mlp)
        });
        assert_eq!(report.first_step, 10);
        assert_close(&report.losses, &want[10..], 1e-12, &format!("{mesh:?}"));
        assert_close(&read_finite(&file), &want, 1e-12, "the whole run");
    }
    // It says its sizes and optimizer (SGD): another is refused, naming both.
    refused_with(
        &Config {
            resume: Some(old.clone()),
            steps: Some(20),
            hidden: Some(16),
            ..config(ModelKind::Mlp)
        },
        "holds a model with hidden 32; --hidden is 16",
    );
    refused_with(
        &Config {
            resume: Some(old.clone()),
            steps: Some(20),
            optimizer: Some(OptimizerKind::Adam),
            ..config(ModelKind::Mlp)
        },
        "optimizer",
    );
    refused_with(
        &Config { resume: Some(old), ..config(ModelKind::Transformer) },
        "is not a checkpoint of a transformer run",
    );
}

/// A checkpoint without run metadata (saved by the library): the MLP's sizes and dtype
/// from its variables' shapes; it resumes, and a size that disagrees is one line
/// naming both.
#[test]
fn a_checkpoint_without_metadata_takes_the_sizes_from_its_variables() {
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("bare");
    copy_dir(&testdata("main-job/step-00000010"), &bare);
    let index = bare.join("index.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("metadata");
    std::fs::write(&index, serde_json::to_vec(&json).unwrap()).unwrap();
    let want = read_finite(&testdata("main-job/losses-20.json"));
    let report =
        run(&Config { resume: Some(bare.clone()), steps: Some(20), ..config(ModelKind::Mlp) });
    assert_close(&report.losses, &want[10..], 1e-12, "resumed from the variables alone");
    refused_with(
        &Config { resume: Some(bare), steps: Some(20), hidden: Some(16), ..config(ModelKind::Mlp) },
        "hidden 32; --hidden is 16",
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A change to a checkpoint's metadata.
type Edit = dyn Fn(&mut serde_json::Value);

/// Edits the metadata of the checkpoint `dir` (one step's directory).
fn edit_metadata(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let index = dir.join("index.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    f(&mut json["metadata"]);
    std::fs::write(&index, serde_json::to_vec(&json).unwrap()).unwrap();
}

/// Every value a checkpoint's metadata gives is checked as its flag would be, before
/// anything is sized by it: a vocabulary of 0 (which divided by zero), 2^64-1 layers
/// (which overflowed), sizes that are not counts, a dtype that is not f32 or f64 — each
/// one line naming `--resume`.
#[test]
fn a_checkpoints_metadata_is_checked_as_strictly_as_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    run(&Config {
        steps: Some(2),
        layers: Some(1),
        dim: Some(16),
        ffn: Some(32),
        seq: Some(8),
        checkpoint_dir: Some(ck.clone()),
        ..config(ModelKind::Transformer)
    });
    let step = ck.join("step-00000002");
    let resume = |edit: &Edit| {
        let copy = dir.path().join("copy");
        let _ = std::fs::remove_dir_all(&copy);
        copy_dir(&step, &copy);
        edit_metadata(&copy, edit);
        refused(&Config { resume: Some(copy), steps: Some(4), ..config(ModelKind::Transformer) })
    };
    // Each value as its flag would be refused: named, or (a size no memory holds)
    // by the memory limit, as `--layers 18446744073709551615` is.
    let cases: [(&Edit, &str); 6] = [
        (&|m| m["vocab"] = 0.into(), "--resume: "),
        (&|m| m["layers"] = u64::MAX.into(), "--max-memory: "),
        (&|m| m["dim"] = (-3).into(), "--resume: "),
        (&|m| m["seq"] = "32".into(), "--resume: "),
        (&|m| m["heads"] = serde_json::Value::Null, "--resume: "),
        (&|m| m["dtype"] = "u8".into(), "--resume: "),
    ];
    let says = ["vocab 0", "", "dim -3", "seq \"32\"", "heads null", "dtype \"u8\""];
    for ((edit, prefix), says) in cases.into_iter().zip(says) {
        let m = resume(edit);
        assert!(m.starts_with(prefix) && m.contains(says), "want {prefix}…{says} in {m}");
    }
}

/// A transformer saved at step 10 on a mesh (or in a pipeline) resumes in a pipeline
/// (or on a mesh) and its steps 11–20 are JAX's; what a resume refuses: another
/// optimizer, weights from two places, no steps left, another size, and other data is
/// a warning.
#[test]
fn a_transformer_resumes_on_another_mesh_or_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let want = expected("losses_adam");
    let reference_run = |steps: usize| Config {
        data: Data::Tokens(reference("tokens.npy")),
        heads: Some(4),
        batch: Some(8),
        dtype: Some(DType::F64),
        optimizer: Some(OptimizerKind::Adam),
        lr: Some(0.01),
        steps: Some(steps),
        ..config(ModelKind::Transformer)
    };
    let layouts: [(Config, Config); 2] = [
        (
            Config { mesh: Some((2, 2)), ..reference_run(10) },
            Config { stages: Some(2), microbatches: Some(2), ..reference_run(20) },
        ),
        (
            Config { stages: Some(3), ..reference_run(10) },
            Config { mesh: Some((1, 2)), ..reference_run(20) },
        ),
    ];
    for (i, (before, after)) in layouts.into_iter().enumerate() {
        let ck = dir.path().join(format!("ck{i}"));
        let head = run(&Config {
            init: Some(reference("init.safetensors")),
            checkpoint_dir: Some(ck.clone()),
            checkpoint_every: Some(5),
            ..before
        });
        assert_close(&head.losses, &want[..10], 1e-9, "before");
        assert_eq!(step_dirs(&ck).len(), 2, "steps 5 and 10");
        let tail = run(&Config { resume: Some(ck), ..after });
        assert_close(&tail.losses, &want[10..], 1e-9, "after");
    }
    let ck = dir.path().join("ck0");
    let resumed = |c: Config| Config { resume: Some(ck.clone()), ..c };
    refused_with(
        &resumed(Config { optimizer: Some(OptimizerKind::Sgd), ..reference_run(30) }),
        "optimizer",
    );
    refused_with(
        &resumed(Config { init: Some(reference("init.safetensors")), ..reference_run(30) }),
        "--init and --resume",
    );
    assert!(run(&resumed(reference_run(10))).losses.is_empty(), "nothing to run");
    refused_with(&resumed(Config { dim: Some(48), ..reference_run(30) }), "--dim is 48");
    // Resumed by its directory, the run went on saving there (steps 15 and 20); a
    // resume that gives no data takes the run's, another learning rate is a warning.
    assert_eq!(step_dirs(&ck), ["step-00000010", "step-00000015", "step-00000020"]);
    let warned = run(&resumed(Config { data: Data::BuiltIn, lr: Some(0.02), ..reference_run(22) }));
    assert_eq!(warned.first_step, 20);
    assert_eq!(warned.losses.len(), 2);
}

/// A stop request ends the run after its host call: a checkpoint of that step, the
/// losses so far, a report that says so; resuming continues from there and gives the
/// uninterrupted run's losses.
#[test]
fn a_stopped_run_saves_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let file = dir.path().join("l.json");
    let flag = Arc::new(AtomicBool::new(false));
    let mut observer = StopAfter { after: 7, flag: flag.clone(), seen: Vec::new() };
    let stopped = Config {
        steps_per_run: 3,
        checkpoint_dir: Some(ck.clone()),
        losses_json: Some(file.clone()),
        ..mlp((2, 2), 30)
    };
    let report = Trainer::new(&stopped).unwrap().run(&mut observer, &flag).unwrap();
    // Step 7 is in the host call of steps 7–9: the run stops after step 9.
    assert!(report.stopped);
    assert_eq!(report.losses.len(), 9);
    assert_eq!(observer.seen, (1..=9).collect::<Vec<_>>());
    assert_eq!(step_dirs(&ck), ["step-00000009"]);
    assert_eq!(read_finite(&file), report.losses);
    assert!(
        report.summary().last().unwrap().contains("by a signal after step 9; resume with --resume")
    );
    let rest = run(&Config { resume: Some(ck.clone()), checkpoint_dir: Some(ck), ..stopped });
    let whole = losses(&mlp((1, 1), 30));
    assert_close(&read_finite(&file), &whole, 1e-12, "stopped and resumed");
    assert_eq!(rest.first_step, 9);
}

/// Resume warns (one line each) when the learning rate or batch differ, refuses another
/// dtype, and a fresh run into a directory holding a later run's checkpoints is
/// refused rather than mixing them.
#[test]
fn resume_warns_of_what_may_change_and_refuses_what_may_not() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    run(&Config { checkpoint_dir: Some(ck.clone()), ..mlp((2, 2), 6) });
    refused_with(
        &Config { resume: Some(ck.clone()), dtype: Some(DType::F32), ..mlp((2, 2), 8) },
        "was trained in f64; --dtype is f32",
    );
    // (Saving elsewhere: resumed by its directory alone, a run goes on saving there.)
    let elsewhere = Some(dir.path().join("elsewhere"));
    let report = run(&Config {
        resume: Some(ck.clone()),
        lr: Some(0.1),
        batch: Some(32),
        checkpoint_dir: elsewhere,
        ..mlp((2, 2), 8)
    });
    assert_eq!(report.first_step, 6);
    let trainer = Trainer::new(&Config {
        resume: Some(ck.clone()),
        lr: Some(0.1),
        checkpoint_dir: Some(dir.path().join("elsewhere2")),
        ..mlp((2, 2), 8)
    })
    .unwrap();
    let mut seen = Vec::new();
    struct Warnings<'a>(&'a mut Vec<String>);
    impl meshwork_train::Observer for Warnings<'_> {
        fn start(&mut self, s: &meshwork_train::Start) {
            self.0.extend(s.warnings.iter().cloned());
        }
    }
    trainer.run(&mut Warnings(&mut seen), &AtomicBool::new(false)).unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], "--steps 8 given: the resumed run had 6", "{seen:?}");
    assert!(seen[1].starts_with("--lr 0.1 differs from the checkpoint's 0.5"), "{seen:?}");
    refused_with(
        &Config { checkpoint_dir: Some(ck), ..mlp((2, 2), 3) },
        "already holds checkpoints up to step 6, which this run (from step 0) would not continue",
    );
}

/// The GPT-2 oracle's model fine-tuned on its corpus (the folder's tokenizer; the
/// fine-tuning defaults), saving into `ck`.
fn gpt2_text(ck: &Path, text: &Path, steps: usize) -> Config {
    Config {
        init: Some(testdata("gpt2/model")),
        data: Data::Text(text.to_path_buf()),
        tokenizer: Some(testdata("gpt2/tokenizer.json")),
        seq: Some(16),
        batch: Some(4),
        steps: Some(steps),
        dtype: Some(DType::F64),
        checkpoint_dir: Some(ck.to_path_buf()),
        ..config(ModelKind::Gpt2)
    }
}

/// `--resume DIR` alone continues the run it names: stopped after step 3 and resumed
/// with nothing else given, the run takes its data, tokenizer, sizes, optimizer,
/// schedule and checkpoint directory from the checkpoint and gives the uninterrupted
/// run's losses (1e-12); a flag given anyway is a one-line note; a data file changed
/// since is refused unless `data_changed_ok`.
#[test]
fn resume_alone_continues_the_run_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("corpus.txt");
    std::fs::copy(testdata("gpt2/corpus.txt"), &text).unwrap();
    let whole = losses(&gpt2_text(&dir.path().join("whole"), &text, 8));
    let ck = dir.path().join("ck");
    let flag = Arc::new(AtomicBool::new(false));
    let mut observer = StopAfter { after: 3, flag: flag.clone(), seen: Vec::new() };
    let head = Trainer::new(&gpt2_text(&ck, &text, 8)).unwrap().run(&mut observer, &flag).unwrap();
    assert!(head.stopped);
    assert_eq!(step_dirs(&ck), ["step-00000003"]);
    let alone = Config { resume: Some(ck.clone()), ..config(ModelKind::Auto) };
    let mut seen = Vec::new();
    struct Warnings<'a>(&'a mut Vec<String>);
    impl meshwork_train::Observer for Warnings<'_> {
        fn start(&mut self, s: &meshwork_train::Start) {
            self.0.extend(s.warnings.iter().cloned());
            self.0.push(s.headline.clone());
        }
    }
    let tail = Trainer::new(&alone)
        .unwrap()
        .run(&mut Warnings(&mut seen), &AtomicBool::new(false))
        .unwrap();
    assert_eq!(tail.first_step, 3);
    let saving = format!(
        "saving into {} as the resumed run did (--checkpoint-dir to save elsewhere)",
        std::path::absolute(&ck).unwrap().display()
    );
    assert_eq!(seen.len(), 2, "one note: {seen:?}");
    assert_eq!(seen[0], saving);
    assert!(seen[1].contains("(f64, adamw (decay 0), lr 5e-5, linear to 0)"), "{seen:?}");
    let both: Vec<f64> = head.losses.iter().chain(&tail.losses).copied().collect();
    assert_close(&both, &whole, 1e-12, "stopped and resumed alone");
    // It went on saving where it saved.
    assert_eq!(step_dirs(&ck), ["step-00000003", "step-00000008"]);
    // A flag given anyway: a note naming it and the run's.
    let longer = Config { steps: Some(10), ..alone.clone() };
    let mut seen = Vec::new();
    let more = Trainer::new(&longer)
        .unwrap()
        .run(&mut Warnings(&mut seen), &AtomicBool::new(false))
        .unwrap();
    assert_eq!(more.first_step, 8);
    assert!(seen.iter().any(|w| w == "--steps 10 given: the resumed run had 8"), "{seen:?}");
    // The text changed since: refused, naming the flag that allows it.
    let mut changed = std::fs::read(&text).unwrap();
    changed[0] ^= 1;
    std::fs::write(&text, changed).unwrap();
    let longer = Config { steps: Some(12), ..alone };
    let m = refused(&longer);
    assert!(m.contains("has changed since the resumed run read it"), "{m}");
    assert!(m.contains("--data-changed-ok"), "{m}");
    let ok = run(&Config { data_changed_ok: true, ..longer });
    assert_eq!(ok.first_step, 10);
}
