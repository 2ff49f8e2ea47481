//! What the trainer refuses before any work, in one line naming the flag — settings
//! alone and together, inputs (never waiting on a FIFO, never reading past the memory
//! limit), outputs (a user's files untouched, nothing made before every check passed),
//! and memory (the host call's batches included).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use meshwork_train::{Config, Data, ModelKind};
use meshwork_types::DType;

use crate::{config, reference, refused, refused_with, testdata, write_npy, write_safetensors_f64};

/// The MLP on the JAX case's files.
fn on_files(x: &Path, y: &Path) -> Config {
    Config {
        data: Data::Npy { x: x.to_path_buf(), y: y.to_path_buf() },
        batch: Some(16),
        steps: Some(2),
        ..config(ModelKind::Mlp)
    }
}

fn f64s(v: impl IntoIterator<Item = f64>) -> Vec<u8> {
    v.into_iter().flat_map(f64::to_le_bytes).collect()
}

/// Optimizer settings with one changed.
fn settings(
    f: impl FnOnce(&mut meshwork_train::OptimizerSettings),
) -> meshwork_train::OptimizerSettings {
    let mut s = meshwork_train::OptimizerSettings::default();
    f(&mut s);
    s
}

fn i64s(v: impl IntoIterator<Item = i64>) -> Vec<u8> {
    v.into_iter().flat_map(i64::to_le_bytes).collect()
}

#[test]
fn settings_alone_and_together_are_refused_naming_the_flag() {
    let mlp = |c: Config| Config { steps: Some(2), ..c };
    let m = config(ModelKind::Mlp);
    let t = config(ModelKind::Transformer);
    let cases: Vec<(Config, &str)> = vec![
        (
            mlp(Config { mesh: Some((3, 1)), ..m.clone() }),
            "--batch 64 does not split over the 3 data replicas of --mesh 3x1",
        ),
        (
            mlp(Config { mesh: Some((1, 3)), ..m.clone() }),
            "--hidden 32 does not split over the 3 model devices of --mesh 1x3",
        ),
        (mlp(Config { mesh: Some((0, 2)), ..m.clone() }), "--mesh 0x2"),
        (mlp(Config { dtype: Some(DType::F16), ..m.clone() }), "--dtype f16 is not f32 or f64"),
        (Config { steps: Some(0), ..m.clone() }, "--steps must be at least 1"),
        (
            Config { steps: Some(10_000_000_000_000), ..m.clone() },
            "--steps 10000000000000 is more than",
        ),
        (mlp(Config { lr: Some(-1.0), ..m.clone() }), "--lr -1 must be a positive number"),
        (mlp(Config { lr: Some(f64::INFINITY), ..m.clone() }), "--lr"),
        (
            mlp(Config { checkpoint_every: Some(5), ..m.clone() }),
            "--checkpoint-every needs --checkpoint-dir",
        ),
        (mlp(Config { keep: Some(2), ..m.clone() }), "--keep needs --checkpoint-dir"),
        (
            mlp(Config { optimizer_settings: settings(|s| s.beta1 = Some(0.8)), ..m.clone() }),
            "--beta1: applies to adam and adamw; the optimizer is sgd",
        ),
        (
            Config { optimizer_settings: settings(|s| s.weight_decay = Some(0.1)), ..t.clone() },
            "--weight-decay: applies to adamw; the optimizer is adam",
        ),
        (
            Config { optimizer_settings: settings(|s| s.no_decay_1d = true), ..t.clone() },
            "--no-decay-1d: applies to adamw; the optimizer is adam",
        ),
        (
            Config { optimizer_settings: settings(|s| s.beta2 = Some(1.0)), ..t.clone() },
            "--beta2: 1 is not in [0, 1)",
        ),
        (
            Config { optimizer_settings: settings(|s| s.eps = Some(0.0)), ..t.clone() },
            "--eps: 0 is not a positive number",
        ),
        (
            Config {
                optimizer: Some(meshwork_train::OptimizerKind::AdamW),
                optimizer_settings: settings(|s| s.weight_decay = Some(-0.5)),
                ..t.clone()
            },
            "--weight-decay: -0.5 is not a number ≥ 0",
        ),
        (mlp(Config { classes: Some(1), ..m.clone() }), "--classes 1: need at least 2"),
        (mlp(Config { classes: Some(4), ..m.clone() }), "the built-in data has 3 classes"),
        (
            mlp(Config { stages: Some(3), mesh: Some((2, 1)), ..m.clone() }),
            "--stages 3: the MLP has 2 layers",
        ),
        (
            mlp(Config { data: Data::Text(PathBuf::from("/nonexistent/t.txt")), ..m.clone() }),
            "--text is not the MLP's",
        ),
        (mlp(Config { batch: Some(1_000_000_000_000), ..m.clone() }), "--max-memory"),
        (mlp(Config { hidden: Some(1_000_000_000_000), ..m.clone() }), "--max-memory"),
        (
            mlp(Config {
                mesh: Some((100, 100)),
                batch: Some(100),
                hidden: Some(100),
                ..m.clone()
            }),
            "--mesh 100x100",
        ),
        (Config { stages: Some(4), ..t.clone() }, "--stages 4"),
        (Config { eval_every: Some(0), ..t.clone() }, "--eval-every must be at least 1"),
        (Config { hidden: Some(8), ..t.clone() }, "--hidden is not the transformer's"),
        (Config { mesh: Some((1, 2)), stages: Some(2), ..t.clone() }, "--stages 2 with --mesh 1x2"),
        (Config { microbatches: Some(2), ..t.clone() }, "--microbatches needs --stages"),
        (Config { batch: Some(6), mesh: Some((4, 1)), ..t.clone() }, "--batch 6 does not split"),
        (Config { heads: Some(5), ..t.clone() }, "--heads: 5 heads do not divide --dim 64"),
        (Config { seq: Some(1 << 40), ..t.clone() }, "--max-memory"),
        (Config { vocab: Some(4_000_000_000), ..t.clone() }, "--max-memory"),
        (Config { mesh: Some((1 << 32, 1 << 32)), ..t.clone() }, "--mesh 4294967296x4294967296"),
        (Config { stages: Some(2), microbatches: Some(usize::MAX), ..t.clone() }, "--batch"),
        (
            Config { init: Some(reference("init.safetensors")), ..t.clone() },
            "--heads: an --init file does not say",
        ),
        (
            Config {
                init: Some(reference("init.safetensors")),
                heads: Some(4),
                dim: Some(48),
                ..t.clone()
            },
            "--dim: 48 disagrees with --init",
        ),
    ];
    for (c, says) in cases {
        refused_with(&c, says);
    }
}

/// Input files: missing, not NumPy, of shapes that disagree, with NaN, claiming sizes
/// past the limit, devices and directories — each refused naming its flag.
#[test]
fn input_files_are_refused_naming_their_flag() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let (x, y, init) =
        (testdata("jax/x.npy"), testdata("jax/y.npy"), testdata("jax/init.safetensors"));
    std::fs::write(d("garbage.npy"), b"this is not numpy").unwrap();
    std::fs::write(d("garbage.safetensors"), b"nor this").unwrap();
    write_npy(&d("x1d.npy"), "<f8", &[20], f64s((0..20).map(f64::from)));
    write_npy(
        &d("x_nan.npy"),
        "<f8",
        &[48, 5],
        f64s((0..240).map(|i| if i == 5 { f64::NAN } else { 1.0 })),
    );
    write_npy(&d("x_huge.npy"), "<f8", &[4_000_000_000, 4_000_000_000], f64s([1.0]));
    write_npy(
        &d("y_huge_class.npy"),
        "<i8",
        &[48],
        i64s((0..48).map(|i| if i == 0 { 100_000_000 } else { 0 })),
    );
    write_npy(
        &d("y_million.npy"),
        "<i8",
        &[48],
        i64s((0..48).map(|i| if i == 0 { 1_000_000 } else { i % 3 })),
    );
    let init_of = |w1: f64| {
        let mut w1s = vec![0.1; 40];
        w1s[0] = w1;
        vec![
            ("w1", (vec![5, 8], w1s)),
            ("b1", (vec![8], vec![0.0; 8])),
            ("w2", (vec![8, 3], vec![0.1; 24])),
            ("b2", (vec![3], vec![0.0; 3])),
        ]
    };
    let nan_init = write_safetensors_f64(&d("nan.safetensors"), &init_of(f64::NAN));
    let inf_init = write_safetensors_f64(&d("inf.safetensors"), &init_of(f64::INFINITY));
    let with_init = |p: &Path| Config { init: Some(p.to_path_buf()), ..on_files(&x, &y) };
    let cases: Vec<(Config, &str)> = vec![
        (on_files(&d("missing.npy"), &y), "--data-x: cannot read"),
        (on_files(&d("garbage.npy"), &y), "--data-x: "),
        (on_files(&x, &x), "--data-y: "),
        (on_files(&d("x1d.npy"), &y), "want [rows, features]"),
        (on_files(&d("x_nan.npy"), &y), "NaN"),
        (on_files(&d("x_huge.npy"), &y), "--data-x"),
        (on_files(Path::new("/dev/zero"), &y), "--data-x: cannot read /dev/zero: it is a device"),
        (on_files(dir.path(), &y), "it is a directory"),
        (on_files(&x, &d("y_huge_class.npy")), "--classes"),
        (on_files(&x, &d("y_million.npy")), "--classes"),
        (
            Config {
                classes: Some(1_000_001),
                max_memory: 1 << 30,
                ..on_files(&x, &d("y_million.npy"))
            },
            "--max-memory",
        ),
        (Config { classes: Some(2), ..on_files(&x, &y) }, "--classes"),
        (with_init(&d("garbage.safetensors")), "--init: "),
        (with_init(&nan_init), "NaN"),
        (with_init(&inf_init), "inf"),
        (Config { hidden: Some(4), ..with_init(&init) }, "--hidden 4 disagrees with --init"),
        (Config { resume: Some(d("nowhere")), ..on_files(&x, &y) }, "--resume: "),
        (Config { resume: Some(PathBuf::from("/dev/null")), ..on_files(&x, &y) }, "--resume"),
        (
            Config {
                resume: Some(dir.path().to_path_buf()),
                init: Some(init.clone()),
                ..on_files(&x, &y)
            },
            "--init and --resume",
        ),
        (
            Config {
                data: Data::Text(PathBuf::from("/dev/zero")),
                ..config(ModelKind::Transformer)
            },
            "--text",
        ),
        (
            Config {
                init: Some("/dev/zero".into()),
                heads: Some(4),
                ..config(ModelKind::Transformer)
            },
            "--init",
        ),
    ];
    for (c, says) in cases {
        refused_with(&c, says);
    }
    // The right files with the wrong shapes: 48 x 5 read as 24 x 10.
    let bytes = std::fs::read(&x).unwrap();
    let at = bytes.windows(7).position(|w| w == b"(48, 5)").unwrap();
    let mut wider = bytes.clone();
    wider.splice(at..at + 7, b"(24,10)".iter().copied());
    std::fs::write(d("wide.npy"), wider).unwrap();
    refused_with(&on_files(&d("wide.npy"), &y), "--data-y: 48 labels for 24 rows of --data-x");
    // A safetensors file whose w1 is renamed.
    let bytes = std::fs::read(&init).unwrap();
    let at = bytes.windows(4).position(|w| w == b"\"w1\"").unwrap();
    let mut other = bytes.clone();
    other.splice(at..at + 4, b"\"W1\"".iter().copied());
    std::fs::write(d("renamed.safetensors"), other).unwrap();
    refused_with(
        &with_init(&d("renamed.safetensors")),
        "has no tensor \"w1\" (want w1, b1, w2, b2)",
    );
}

/// Runs `f` on another thread; fails instead of hanging when it takes over 10 s.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("refused instead of waiting for a writer")
}

/// A FIFO given as any input — `--text`, `--data-tokens`, `--data-x`, `--data-y`,
/// `--init`, `--resume`'s index — is refused at once, naming the flag: opening one for
/// reading used to wait for a writer for ever.
#[test]
fn a_fifo_as_any_input_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let (x, y) = (testdata("jax/x.npy"), testdata("jax/y.npy"));
    let t = config(ModelKind::Transformer);
    let cases: Vec<(Config, &str)> = vec![
        (Config { data: Data::Text(fifo.clone()), ..t.clone() }, "--text"),
        (Config { data: Data::Tokens(fifo.clone()), ..t.clone() }, "--data-tokens"),
        (Config { init: Some(fifo.clone()), heads: Some(4), ..t.clone() }, "--init"),
        (on_files(&fifo, &y), "--data-x"),
        (on_files(&x, &fifo), "--data-y"),
        (Config { init: Some(fifo.clone()), ..on_files(&x, &y) }, "--init"),
    ];
    for (c, flag) in cases {
        let started = Instant::now();
        let m = within_10s(move || refused(&c));
        assert!(
            m.starts_with(&format!("{flag}: cannot read")) && m.contains("a named pipe"),
            "{m}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    // A checkpoint whose index is a FIFO.
    let step = dir.path().join("ck");
    std::fs::create_dir(&step).unwrap();
    assert!(Command::new("mkfifo").arg(step.join("index.json")).status().unwrap().success());
    let c = Config { resume: Some(step), ..config(ModelKind::Mlp) };
    let m = within_10s(move || refused(&c));
    assert!(m.starts_with("--resume: "), "{m}");
}

/// Outputs are checked before any work and never replace a user's file; a check that
/// fails late leaves nothing behind; each output needs its own path.
#[test]
fn outputs_are_checked_first_and_a_users_files_are_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let mine = d("mine.txt");
    std::fs::write(&mine, "my notes").unwrap();
    std::fs::create_dir(d("proj")).unwrap();
    std::fs::write(d("proj/notes.txt"), "mine").unwrap();
    std::os::unix::fs::symlink(d("proj"), d("link")).unwrap();
    let t = Config { steps: Some(3), ..config(ModelKind::Transformer) };
    let (m, c, p) = (d("m.jsonl"), d("ck"), d("p.svg"));
    // A check that fails late (the held-out fraction) leaves no file behind.
    refused_with(
        &Config {
            metrics_jsonl: Some(m.clone()),
            checkpoint_dir: Some(c.clone()),
            eval_every: Some(2),
            eval_fraction: Some(0.9999),
            ..t.clone()
        },
        "--eval-fraction",
    );
    assert!(!m.exists() && !c.exists(), "nothing made");
    refused_with(
        &Config { metrics_jsonl: Some(p.clone()), plot: Some(p.clone()), ..t.clone() },
        "--plot: ",
    );
    refused_with(
        &Config { losses_json: Some(m.clone()), metrics_jsonl: Some(m.clone()), ..t.clone() },
        "is also --losses-json's",
    );
    // The same file by another name.
    refused_with(
        &Config {
            losses_json: Some(m.clone()),
            plot: Some(dir.path().join(".").join("m.jsonl")),
            ..t.clone()
        },
        "is also --losses-json's",
    );
    let long = Config { steps: Some(100_000_000), ..config(ModelKind::Mlp) };
    for (c, says) in [
        (
            Config { metrics_jsonl: Some(mine.clone()), ..long.clone() },
            "exists; meshwork writes only new files here",
        ),
        (
            Config { losses_json: Some(mine.clone()), ..long.clone() },
            "is not a losses list meshwork wrote",
        ),
        (Config { plot: Some(mine.clone()), ..long.clone() }, "--plot: "),
        (Config { losses_json: Some("/proc/losses.json".into()), ..long.clone() }, "--losses-json"),
        (Config { losses_json: Some("/dev/null".into()), ..long.clone() }, "not a regular file"),
        (Config { losses_json: Some(d("proj")), ..long.clone() }, "--losses-json"),
        (Config { losses_json: Some(d("nowhere/l.json")), ..long.clone() }, "does not exist"),
        (Config { losses_json: Some("".into()), ..long.clone() }, "names no file"),
        (Config { checkpoint_dir: Some(mine.clone()), ..long.clone() }, "--checkpoint-dir"),
        (Config { checkpoint_dir: Some("/dev/null".into()), ..long.clone() }, "--checkpoint-dir"),
    ] {
        refused_with(&c, says);
    }
    // A directory meshwork did not make: refused when the run opens it, untouched; a
    // link to one before.
    let trainer = meshwork_train::Trainer::new(&Config {
        checkpoint_dir: Some(d("proj")),
        steps: Some(2),
        ..config(ModelKind::Mlp)
    })
    .unwrap();
    let e = trainer
        .run(&mut meshwork_train::Quiet, &std::sync::atomic::AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("--checkpoint-dir ") && e.contains("is not empty"), "{e}");
    refused_with(
        &Config { checkpoint_dir: Some(d("link")), ..long.clone() },
        "it is a symbolic link, not a directory meshwork made",
    );
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my notes");
    assert_eq!(std::fs::read_to_string(d("proj/notes.txt")).unwrap(), "mine");
    assert_eq!(std::fs::read_dir(d("proj")).unwrap().count(), 1);
}

/// The memory a run would hold counts a host call's batches: `--steps-per-run` steps
/// of rows are built at once (and split per device). A call of ten million steps is
/// refused naming `--max-memory`, where one step a call is not; before, the estimate
/// left them out and the run aborted building them.
#[test]
fn the_memory_estimate_counts_a_host_calls_batches() {
    let t = |spr: usize| Config {
        steps: Some(10_000_000),
        steps_per_run: spr,
        ..config(ModelKind::Transformer)
    };
    assert!(meshwork_train::Trainer::new(&t(1)).is_ok());
    refused_with(&t(10_000_000), "--max-memory");
    // Per step, the losses kept (and, with --losses-json, their list and text).
    let long = |losses_json: Option<PathBuf>| Config {
        steps: Some(100_000_000),
        max_memory: 1 << 30,
        losses_json,
        ..config(ModelKind::Mlp)
    };
    assert!(meshwork_train::Trainer::new(&long(None)).is_ok());
    let dir = tempfile::tempdir().unwrap();
    refused_with(&long(Some(dir.path().join("l.json"))), "--max-memory");
    // Within a limit the batches of a smaller call fit.
    let limit = |spr: usize| Config { max_memory: 200 << 20, ..t(spr) };
    assert!(meshwork_train::Trainer::new(&limit(100)).is_ok());
    refused_with(&limit(1_000_000), "--steps-per-run");
}

/// `inspect` takes `--max-memory` too: a vocabulary of 1e11 (25.6 TB of Adam state,
/// which aborted the process) is refused naming the flag, before anything is built.
#[test]
fn inspect_refuses_a_step_over_the_memory_limit() {
    let e = meshwork_train::inspect(&Config {
        vocab: Some(100_000_000_000),
        mesh: Some((1, 2)),
        ..config(ModelKind::Transformer)
    })
    .unwrap_err();
    assert!(matches!(e, meshwork_train::Error::Usage(_)));
    assert!(e.to_string().starts_with("--max-memory: "), "{e}");
    let small = Config {
        vocab: Some(64),
        dim: Some(16),
        ffn: Some(32),
        seq: Some(8),
        ..config(ModelKind::Transformer)
    };
    assert!(meshwork_train::inspect(&small).is_ok());
    let e = meshwork_train::inspect(&Config { max_memory: 1 << 10, ..small }).unwrap_err();
    assert!(e.to_string().starts_with("--max-memory: "), "{e}");
}

/// A loss that is not finite ends the run as a failure naming the step; the losses so
/// far (`null` for the one that is not finite) are written.
#[test]
fn a_diverging_run_fails_naming_the_step_and_keeps_its_losses() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("l.json");
    let c = Config {
        lr: Some(1e308),
        steps: Some(50),
        losses_json: Some(file.clone()),
        ..config(ModelKind::Mlp)
    };
    let e = meshwork_train::Trainer::new(&c)
        .unwrap()
        .run(&mut meshwork_train::Quiet, &std::sync::atomic::AtomicBool::new(false))
        .unwrap_err();
    assert!(matches!(e, meshwork_train::Error::Failed(_)));
    assert!(e.to_string().contains("step 2: the loss is NaN"), "{e}");
    let written = crate::read_losses(&file);
    assert_eq!(written.len(), 2);
    assert!(written[0].is_some() && written[1].is_none(), "{written:?}");
}

/// Over `--max-memory`, the refusal names the flags that would fit, each with its
/// size; each of them, given, is accepted under the same limit (and without the
/// refusal's flags the run is refused).
#[test]
fn the_memory_refusal_names_the_savers_that_fit() {
    let run = |limit: u64, extra: &dyn Fn(&mut Config)| {
        let mut c = Config {
            mesh: Some((2, 1)),
            batch: Some(32),
            seq: Some(64),
            max_memory: limit,
            ..config(ModelKind::Transformer)
        };
        extra(&mut c);
        meshwork_train::Trainer::new(&c).map(|_| ())
    };
    // The smallest limit the run fits in, to a percent.
    let (mut lo, mut hi) = (1u64 << 10, 1u64 << 34);
    while hi - lo > hi / 100 {
        let mid = lo + (hi - lo) / 2;
        if run(mid, &|_| {}).is_ok() { hi = mid } else { lo = mid }
    }
    let limit = lo * 9 / 10;
    let m = match run(limit, &|_| {}) {
        Err(meshwork_train::Error::Usage(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.starts_with("--max-memory: the run would hold about "), "{m}");
    assert!(m.contains(" would fit; or give a larger mesh"), "{m}");
    let listed = m.split("; ").nth(1).unwrap().trim_end_matches(" would fit");
    let mut tried = 0;
    for option in listed.split(", ") {
        let flags = option.split(" (").next().unwrap();
        let apply = |c: &mut Config| {
            let mut words = flags.split(' ').peekable();
            while let Some(w) = words.next() {
                match w {
                    "--no-check" => c.check = meshwork_train::Check::Never,
                    "--remat" => c.remat = true,
                    "--fsdp" => c.fsdp = true,
                    "--grad-accum" => c.grad_accum = words.next().map(|k| k.parse().unwrap()),
                    other => panic!("{other} in {m}"),
                }
            }
        };
        assert!(run(limit, &apply).is_ok(), "{flags} was said to fit: {m}");
        tried += 1;
    }
    assert!(tried >= 2, "{m}");
}
