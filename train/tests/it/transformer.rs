//! The reference transformer: JAX's run (its tokens, initial weights and losses) on
//! every mesh, in pipelines and with several steps per host call; the built-in run
//! learning; schedules, shuffling, metrics and plots; evaluation on held-out rows; text
//! as tokens and gradient clipping; the partitioned step `inspect` prints.

use meshwork_train::{CheckOutcome, Config, Data, ModelKind, OptimizerKind, Schedule};
use meshwork_types::DType;

use crate::{
    assert_close, config, expected, losses, read_finite, reference, refused_with, run, write_npy,
    write_npy_i32,
};

pub(crate) use crate::commands::reference_run;

/// Both optimizers of the reference run with `layout` applied, against JAX within 1e-9.
fn matches_jax(layout: impl Fn(Config) -> Config, what: &str) {
    for (optimizer, lr, key) in
        [(OptimizerKind::Adam, 0.01, "losses_adam"), (OptimizerKind::Sgd, 0.1, "losses_sgd")]
    {
        let got = losses(&layout(reference_run(optimizer, lr)));
        assert_close(&got, &expected(key), 1e-9, &format!("{what} {key}"));
    }
}

#[test]
fn the_reference_run_matches_jax_on_every_mesh() {
    for mesh in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)] {
        matches_jax(|c| Config { mesh: Some(mesh), ..c }, &format!("{mesh:?}"));
    }
    // The same rows as int64.
    let dir = tempfile::tempdir().unwrap();
    let npy = std::fs::read(reference("tokens.npy")).unwrap();
    let start = 10 + u16::from_le_bytes([npy[8], npy[9]]) as usize;
    let wide: Vec<u8> = npy[start..]
        .chunks_exact(4)
        .flat_map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
        .collect();
    assert_eq!(wide.len(), 256 * 17 * 8, "the reference rows are [256, 17]");
    let tokens = write_npy(&dir.path().join("tokens64.npy"), "<i8", &[256, 17], wide);
    let got = losses(&Config {
        mesh: Some((2, 1)),
        data: Data::Tokens(tokens),
        ..reference_run(OptimizerKind::Sgd, 0.1)
    });
    assert_close(&got, &expected("losses_sgd"), 1e-9, "int64 tokens");
}

#[test]
fn the_reference_run_matches_jax_in_pipelines_and_several_steps_per_call() {
    matches_jax(|c| Config { mesh: Some((2, 2)), steps_per_run: 4, ..c }, "2x2, 4 per call");
    matches_jax(
        |c| Config { mesh: Some((1, 2)), steps_per_run: 3, eval_every: Some(5), ..c },
        "1x2, 3 per call, evaluated",
    );
    matches_jax(|c| Config { stages: Some(2), ..c }, "2 stages");
    matches_jax(|c| Config { stages: Some(3), ..c }, "3 stages");
    matches_jax(|c| Config { stages: Some(2), microbatches: Some(4), ..c }, "2 stages x 4");
    matches_jax(
        |c| Config { mesh: Some((2, 1)), stages: Some(2), microbatches: Some(2), ..c },
        "2 replicas of 2 stages",
    );
}

/// The built-in rows learn (the loss halves in 60 steps on 2x1, checked against one
/// device every step), and the summary says so.
#[test]
fn the_built_in_run_learns_and_summarises() {
    let report =
        run(&Config { steps: Some(60), mesh: Some((2, 1)), ..config(ModelKind::Transformer) });
    assert!(report.losses[59] < 0.5 * report.losses[0], "{:?}", report.losses);
    assert!(matches!(report.check, CheckOutcome::Checked { most, .. } if most < 1e-3));
    let summary = report.summary();
    let line = |label: &str| {
        summary
            .iter()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("{summary:?}"))
            .clone()
    };
    assert!(line("check").contains("every step equal to one device's"));
    let curve = line("loss curve");
    assert!(
        curve.trim_start()["loss curve".len()..].trim().chars().all(|c| ('▁'..='█').contains(&c))
    );
    assert!(line("throughput").contains("tokens/s (60 steps in "), "{summary:?}");
}

/// Warm-up then cosine, as the metrics say step by step; the plot draws every step; new
/// files only; shuffling is deterministic for a seed and not the plain order.
#[test]
fn schedules_shuffling_metrics_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let (metrics, plot) = (dir.path().join("m.jsonl"), dir.path().join("loss.svg"));
    let base = Config { steps: Some(12), ..config(ModelKind::Transformer) };
    let with_sinks = Config {
        warmup: 4,
        schedule: Some(Schedule::Cosine),
        metrics_jsonl: Some(metrics.clone()),
        plot: Some(plot.clone()),
        ..base.clone()
    };
    run(&with_sinks);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    let lr: Vec<f64> = lines.iter().map(|l| l["lr"].as_f64().unwrap()).collect();
    for (s, want) in [(0, 0.0025), (1, 0.005), (3, 0.01), (4, 0.01), (8, 0.005)] {
        assert!((lr[s] - want).abs() < 1e-12, "step {s}: lr {}", lr[s]);
    }
    // transformers' cosine: 0 one step past the last, so the last step still learns.
    let last = 0.01 * 0.5 * (1.0 + (std::f64::consts::PI * 7.0 / 8.0).cos());
    assert!(lr[11] > 0.0 && (lr[11] - last).abs() < 1e-12, "{}", lr[11]);
    assert!(lines.iter().all(|l| l["tokens_per_s"].as_f64().is_some_and(|r| r > 0.0)));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let points = svg.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
    assert_eq!(points.split_whitespace().count(), 12);
    // New files only: a second run refuses before training, the files untouched.
    refused_with(&with_sinks, "exists; meshwork writes only new files here");
    assert_eq!(std::fs::read_to_string(&metrics).unwrap().lines().count(), 12);
    let shuffled = |seed| losses(&Config { shuffle: true, seed, ..base.clone() });
    assert_eq!(shuffled(0), shuffled(0));
    assert_ne!(shuffled(0), losses(&base));
    assert_ne!(shuffled(0), shuffled(1));
}

/// Held-out rows are never trained on: with a quarter of the reference rows held out,
/// 30 steps of 8 rows (240 > 192) wrap around the other three quarters exactly as a run
/// on those rows alone does; each evaluation reports a loss and an accuracy, the same
/// in a pipeline, drawn as the plot's second line.
#[test]
fn evaluation_holds_rows_out_of_training() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(reference("tokens.npy")).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let values: Vec<i32> = bytes[10 + header..]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let first = write_npy_i32(&dir.path().join("first.npy"), 192, 17, &values[..192 * 17]);
    let evaluated = Config {
        eval_every: Some(5),
        eval_fraction: Some(0.25),
        steps: Some(30),
        ..reference_run(OptimizerKind::Adam, 0.01)
    };
    let with_eval = run(&evaluated);
    let alone = losses(&Config {
        data: Data::Tokens(first),
        steps: Some(30),
        ..reference_run(OptimizerKind::Adam, 0.01)
    });
    assert_eq!(with_eval.losses, alone, "training read only the first 192 rows");
    let evals = &with_eval.evals;
    assert_eq!(evals.len(), 6, "every 5 steps of 30");
    assert!(evals.iter().all(|&(_, l, a)| l.is_finite() && l > 0.0 && (0.0..=1.0).contains(&a)));
    assert!(evals[5].1 < evals[0].1, "the held-out loss falls: {evals:?}");
    assert_eq!(with_eval.eval_rows, 64);
    let plot = dir.path().join("eval.svg");
    let piped = run(&Config {
        stages: Some(2),
        microbatches: Some(2),
        plot: Some(plot.clone()),
        ..evaluated
    });
    for (g, w) in piped.evals.iter().zip(evals) {
        assert!((g.1 - w.1).abs() <= 1e-9 * w.1.abs(), "pipeline eval {g:?} vs mesh {w:?}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    let lines: Vec<&str> =
        svg.split("points=\"").skip(1).map(|p| p.split('"').next().unwrap()).collect();
    assert_eq!(lines.len(), 3, "train, eval and learning-rate lines");
    assert_eq!(lines[0].split_whitespace().count(), 30);
    assert_eq!(lines[1].split_whitespace().count(), 6);
    assert_eq!(lines[2].split_whitespace().count(), 30);
    refused_with(
        &Config { eval_fraction: Some(0.2), ..config(ModelKind::Transformer) },
        "--eval-fraction needs --eval-every",
    );
}

/// A text file's bytes are tokens, row i being bytes 32i … 32i+32; a clipping norm no
/// gradient reaches changes nothing, a small one changes the run — the same on a mesh,
/// one device and in a pipeline (the global norm over every stage's gradients).
#[test]
fn text_rows_and_gradient_clipping() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let on_text = |c: Config| Config {
        data: Data::Text(text.clone()),
        // 8 steps of 8 rows: every one of the text's 56 rows, then round again.
        steps: Some(8),
        dtype: Some(DType::F64),
        ..c
    };
    let plain = losses(&on_text(config(ModelKind::Transformer)));
    assert!(plain[7] < plain[0], "bytes of text are learned: {plain:?}");
    let bytes = std::fs::read(&text).unwrap();
    let n = (bytes.len() - 1) / 32;
    let rows: Vec<i32> =
        (0..n).flat_map(|i| bytes[32 * i..32 * i + 33].iter().map(|&b| i32::from(b))).collect();
    let tokens = write_npy_i32(&dir.path().join("rows.npy"), n, 33, &rows);
    let from_rows =
        losses(&Config { data: Data::Tokens(tokens), ..on_text(config(ModelKind::Transformer)) });
    assert_eq!(from_rows, plain, "--text cuts the rows as documented");
    let clip = |norm: f64, c: Config| losses(&on_text(Config { clip_norm: Some(norm), ..c }));
    assert_eq!(clip(1e9, config(ModelKind::Transformer)), plain);
    let clipped = clip(0.05, Config { mesh: Some((2, 2)), ..config(ModelKind::Transformer) });
    // The first step is before any update: clipping cannot change its loss.
    assert!((clipped[0] - plain[0]).abs() <= 1e-12 * plain[0], "{} vs {}", clipped[0], plain[0]);
    assert_ne!(clipped[1], plain[1]);
    assert_close(&clip(0.05, config(ModelKind::Transformer)), &clipped, 1e-9, "one device");
    let piped = clip(
        0.05,
        Config { stages: Some(2), microbatches: Some(2), ..config(ModelKind::Transformer) },
    );
    assert_close(&piped, &clipped, 1e-9, "pipeline");
    refused_with(&on_text(Config { vocab: Some(128), ..config(ModelKind::Transformer) }), "--text");
    refused_with(
        &on_text(Config { clip_norm: Some(-1.0), ..config(ModelKind::Transformer) }),
        "--clip-norm",
    );
    let _ = read_finite;
}

/// `inspect`: each device's step with Megatron's collectives — two all-reduces over
/// `model` forward and two backward per block, and on a 2x2 mesh the data axis's
/// gradient all-reduces combined into one launch; a model axis that does not divide the
/// heads is refused.
#[test]
fn inspect_prints_each_devices_step_with_megatrons_collectives() {
    let text = meshwork_train::inspect(&Config {
        mesh: Some((1, 2)),
        layers: Some(3),
        ..config(ModelKind::Transformer)
    })
    .unwrap();
    assert!(text.contains("all_reduce") && text.contains("groups={{0,1}}"), "{text}");
    assert!(text.contains("12 collectives in 12 launches (12 all_reduce over model)"), "{text}");
    let text =
        meshwork_train::inspect(&Config { mesh: Some((2, 2)), ..config(ModelKind::Transformer) })
            .unwrap();
    let last = text.lines().last().unwrap();
    assert!(last.contains("in 9 launches") && last.contains("8 all_reduce over model"), "{last}");
    let e =
        meshwork_train::inspect(&Config { mesh: Some((1, 3)), ..config(ModelKind::Transformer) })
            .unwrap_err();
    assert!(e.to_string().contains("--mesh 1x3"), "{e}");
}

/// `inspect --json` on the interpreter, the transformer on a 1x4 mesh: read from the
/// tensors each position holds, every Megatron-sharded weight and both its Adam slots
/// are held at a quarter per device, the rest whole; a step feeds each device the
/// whole batch (rows are split over `data`, here 1) and its two scalars, and nothing
/// else; it compiles once.
#[test]
fn inspect_json_measures_the_interpreters_run() {
    let config = Config {
        mesh: Some((1, 4)),
        optimizer: Some(OptimizerKind::Adam),
        check: meshwork_train::Check::Never,
        ..config(ModelKind::Transformer)
    };
    crate::check_inspect_json(&config, 4);
}

/// The optimizer's settings reach the step: AdamW with no decay is Adam, bit for bit,
/// with Adam's β and ε given or not; other β, ε or decay change the run; and exempting
/// 1-D parameters from a decay changes it again (the reference transformer has
/// biases and LayerNorm parameters).
#[test]
fn optimizer_settings_reach_the_step() {
    use meshwork_train::OptimizerSettings;
    let run = |optimizer, settings: OptimizerSettings| {
        let c = Config {
            steps: Some(4),
            optimizer_settings: settings,
            ..reference_run(optimizer, 0.01)
        };
        losses(&c)
    };
    let adam = run(OptimizerKind::Adam, OptimizerSettings::default());
    let plain = OptimizerSettings { weight_decay: Some(0.0), ..OptimizerSettings::default() };
    assert_eq!(run(OptimizerKind::AdamW, plain), adam);
    let explicit =
        OptimizerSettings { beta1: Some(0.9), beta2: Some(0.999), eps: Some(1e-8), ..plain };
    assert_eq!(run(OptimizerKind::AdamW, explicit), adam);
    let betas = OptimizerSettings { beta1: Some(0.5), beta2: Some(0.9), ..plain };
    let other = run(OptimizerKind::AdamW, betas);
    assert_eq!(other[0], adam[0], "the first loss comes before any update");
    assert_ne!(other[1..], adam[1..]);
    let decay = OptimizerSettings { weight_decay: Some(0.5), ..OptimizerSettings::default() };
    let decayed = run(OptimizerKind::AdamW, decay);
    let matrices_only = run(OptimizerKind::AdamW, OptimizerSettings { no_decay_1d: true, ..decay });
    assert_ne!(decayed[1..], adam[1..]);
    assert_ne!(matrices_only[1..], decayed[1..]);
    assert_ne!(matrices_only[1..], adam[1..]);
}
