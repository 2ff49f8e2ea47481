//! The main job: the MLP through the trainer, against the hand-written MLP (its own
//! forward and backward), the losses the binary printed before the one trainer, and
//! JAX's MLP case, on every mesh and in pipelines.

use meshwork_train::{CheckOutcome, Config, Data, ModelKind, OptimizerKind};
use meshwork_types::DType;

use crate::{assert_close, config, losses, read_finite, refused_with, run, testdata};

// The hand-written MLP on `Strategy::run_steps`: the oracle, kept with the strategy's
// examples.
#[path = "../../../strategy/examples/common/mlp.rs"]
mod oracle;

/// The README's main job, `meshwork train` with every default: 200 steps of the MLP on
/// a 2x2 mesh, each loss equal to the hand-written MLP's (on one device, its own
/// gradients) and to what the binary printed before the one trainer, within 1e-12;
/// checked against one device, and a final accuracy over the rows.
#[test]
fn the_main_job_gives_the_hand_written_mlps_losses() {
    let report = run(&config(ModelKind::Mlp));
    assert_eq!(report.layout, "mesh 2x2");
    assert_eq!(report.model, "MLP 8 -> 32 -> 3");
    assert!(matches!(report.check, CheckOutcome::Checked { .. }), "{:?}", report.check);
    let before = read_finite(&testdata("main-job/losses-200.json"));
    assert_close(&report.losses, &before, 1e-12, "the binary before the one trainer");
    let (rows, features, classes) = meshwork_train::data::BUILT_IN_CLASSIFICATION;
    let data = oracle::Dataset::synthetic(0, rows, features, classes);
    let init = oracle::Params::init(0, features, 32, classes);
    let by_hand = oracle::TrainConfig { data: 1, model: 1, ..Default::default() };
    let want = oracle::train(&by_hand, &data, &init, &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_close(&report.losses, &want.losses, 1e-12, "the hand-written MLP");
    let (accuracy, n) = report.accuracy.expect("the main job reports its accuracy");
    assert_eq!(n, rows);
    assert!((accuracy - want.params.accuracy(&data)).abs() < 1e-12, "{accuracy}");
    assert!(report.summary().iter().any(|l| l.starts_with("  accuracy     ")));
}

/// Every mesh of four devices trains as one device: several steps per host call,
/// shuffling, and f32 (to f32 precision) too.
#[test]
fn every_mesh_of_four_devices_trains_like_one_device() {
    let base = |mesh: (usize, usize)| Config {
        steps: Some(30),
        hidden: Some(16),
        mesh: Some(mesh),
        check: meshwork_train::Check::Never,
        ..config(ModelKind::Mlp)
    };
    let one = losses(&base((1, 1)));
    assert!(one[29] < 0.6 * one[0], "the loss falls: {one:?}");
    for mesh in [(4, 1), (2, 2), (1, 4)] {
        assert_close(&losses(&base(mesh)), &one, 1e-12, &format!("{mesh:?}"));
    }
    let spr = losses(&Config { steps_per_run: 7, ..base((2, 2)) });
    assert_close(&spr, &one, 1e-12, "steps-per-run");
    let a = losses(&Config { shuffle: true, ..base((1, 1)) });
    let b = losses(&Config { shuffle: true, ..base((2, 2)) });
    assert_close(&b, &a, 1e-12, "shuffled");
    assert_ne!(a, one, "shuffling changes the order");
    let f1 = losses(&Config { dtype: Some(DType::F32), ..base((1, 1)) });
    let f4 = losses(&Config { dtype: Some(DType::F32), ..base((2, 2)) });
    assert_close(&f4, &f1, 1e-5, "f32");
}

/// JAX's MLP case (`testdata/jax`: rows, labels and initial weights from files, SGD,
/// momentum and AdamW by PyTorch's formulas) on every mesh and in pipelines, within
/// 1e-12; shuffled, the rows the main job's stream draws.
#[test]
fn jaxs_mlp_case_on_every_mesh_and_in_pipelines() {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("jax/losses.json")).unwrap()).unwrap();
    let jax = |key: &[&str]| -> Vec<f64> {
        serde_json::from_value(key.iter().fold(&json, |v, k| &v[*k]).clone()).unwrap()
    };
    let case = |mesh: (usize, usize), optimizer: OptimizerKind, lr: f64| Config {
        data: Data::Npy { x: testdata("jax/x.npy"), y: testdata("jax/y.npy") },
        init: Some(testdata("jax/init.safetensors")),
        batch: Some(16),
        steps: Some(12),
        mesh: Some(mesh),
        optimizer: Some(optimizer),
        lr: Some(lr),
        ..config(ModelKind::Mlp)
    };
    let sgd = |mesh| case(mesh, OptimizerKind::Sgd, 0.3);
    for mesh in [(1, 1), (2, 2), (4, 1), (2, 4)] {
        assert_close(&losses(&sgd(mesh)), &jax(&["losses"]), 1e-12, &format!("{mesh:?}"));
    }
    let piped = Config { stages: Some(2), microbatches: Some(2), ..sgd((2, 1)) };
    assert_close(&losses(&piped), &jax(&["losses"]), 1e-12, "pipeline");
    let momentum = case((2, 2), OptimizerKind::Momentum, 0.1);
    assert_close(&losses(&momentum), &jax(&["momentum", "losses"]), 1e-12, "momentum");
    let adamw = case((2, 2), OptimizerKind::AdamW, 0.01);
    assert_close(&losses(&adamw), &jax(&["adamw", "losses"]), 1e-12, "adamw");
    let piped = Config {
        stages: Some(2),
        microbatches: Some(4),
        ..case((1, 1), OptimizerKind::AdamW, 0.01)
    };
    assert_close(&losses(&piped), &jax(&["adamw", "losses"]), 1e-12, "adamw pipeline");
    // Shuffled, the trainer reads the rows the hand-written MLP reads.
    let shuffled = losses(&Config { shuffle: true, seed: 7, ..sgd((2, 2)) });
    assert_ne!(shuffled, jax(&["losses"]), "--shuffle changes the order");
    let data = meshwork_train::data::Classification::from_npy(
        &testdata("jax/x.npy"),
        &testdata("jax/y.npy"),
        1 << 20,
        None,
    )
    .unwrap();
    let init = meshwork_train::read_init(&testdata("jax/init.safetensors"), 1 << 20).unwrap();
    let matrix = |name: &str| {
        let t = &init[name];
        ndarray::Array2::from_shape_vec((t.shape()[0], t.shape()[1]), t.to_f64()).unwrap()
    };
    let vector = |name: &str| ndarray::Array1::from_vec(init[name].to_f64());
    let params =
        oracle::Params { w1: matrix("w1"), b1: vector("b1"), w2: matrix("w2"), b2: vector("b2") };
    let by_hand =
        oracle::Dataset { x: data.x.clone(), labels: data.labels.clone(), classes: data.classes };
    let hand = oracle::TrainConfig {
        data: 1,
        model: 1,
        steps: 12,
        batch: 16,
        lr: 0.3,
        shuffle: Some(7),
        ..Default::default()
    };
    let want =
        oracle::train(&hand, &by_hand, &params, &mut |_| std::ops::ControlFlow::Continue(()))
            .unwrap();
    assert_close(&shuffled, &want.losses, 1e-12, "shuffled, against the hand-written MLP");
}

/// Every training flag works for the MLP: an optimizer, a schedule, clipping and
/// held-out evaluation; `--hidden` that disagrees with `--init` is refused.
#[test]
fn the_mlp_takes_every_training_flag() {
    let report = run(&Config {
        optimizer: Some(OptimizerKind::Adam),
        lr: Some(0.01),
        warmup: 5,
        schedule: Some(meshwork_train::Schedule::Cosine),
        clip_norm: Some(1.0),
        eval_every: Some(50),
        eval_fraction: Some(0.2),
        steps: Some(100),
        ..config(ModelKind::Mlp)
    });
    assert_eq!(report.evals.len(), 2);
    assert!(report.classifies && report.accuracy.is_none());
    let summary = report.summary().join("\n");
    assert!(summary.contains("MLP 8 -> 32 -> 3") && summary.contains(", accuracy "), "{summary}");
    refused_with(
        &Config {
            init: Some(testdata("jax/init.safetensors")),
            hidden: Some(16),
            data: Data::Npy { x: testdata("jax/x.npy"), y: testdata("jax/y.npy") },
            ..config(ModelKind::Mlp)
        },
        "--hidden 16 disagrees with --init",
    );
}
