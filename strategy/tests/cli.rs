//! The `meshwork` binary end to end: training agrees across meshes and with JAX,
//! resuming on another mesh continues the same run, bad input exits 2 with one line,
//! and the inspection tools print what they should.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn meshwork(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshwork")).args(args).output().expect("the binary runs")
}

fn temp(tag: &str) -> PathBuf {
    let stamp =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir =
        std::env::temp_dir().join(format!("meshwork-cli-{tag}-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn testdata(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(rel).to_str().unwrap().to_string()
}

/// Trains with `args` plus `--losses-json`, and returns the losses.
fn losses(dir: &Path, name: &str, args: &[&str]) -> Vec<f64> {
    let path = dir.join(format!("{name}.json"));
    let mut all = args.to_vec();
    all.extend(["--losses-json", path.to_str().unwrap()]);
    let out = meshwork(&all);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn bytes_of(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn assert_close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= rel * y.abs(), "{what}: step {k}: {x} vs {y}");
    }
}

#[test]
fn every_mesh_of_four_devices_trains_like_one_device() {
    let dir = temp("meshes");
    let common = ["train", "--steps", "30", "--no-check", "--hidden", "16"];
    let one = losses(&dir, "1x1", &[&common[..], &["--mesh", "1x1"]].concat());
    assert!(one.last().unwrap() < &(0.6 * one[0]), "the loss falls: {one:?}");
    for mesh in ["4x1", "2x2", "1x4"] {
        let got = losses(&dir, mesh, &[&common[..], &["--mesh", mesh]].concat());
        assert_close(&got, &one, 1e-12, mesh);
    }
    // Several steps per host call, and shuffling, change nothing across meshes either.
    let spr =
        losses(&dir, "spr", &[&common[..], &["--mesh", "2x2", "--steps-per-run", "7"]].concat());
    assert_close(&spr, &one, 1e-12, "steps-per-run");
    let a = losses(&dir, "sh1", &[&common[..], &["--mesh", "1x1", "--shuffle"]].concat());
    let b = losses(&dir, "sh4", &[&common[..], &["--mesh", "2x2", "--shuffle"]].concat());
    assert_close(&b, &a, 1e-12, "shuffled");
    assert_ne!(a, one, "shuffling changes the order");
    // f32 agrees to f32 precision.
    let f32_one = losses(&dir, "f1", &[&common[..], &["--mesh", "1x1", "--dtype", "f32"]].concat());
    let f32_four =
        losses(&dir, "f4", &[&common[..], &["--mesh", "2x2", "--dtype", "f32"]].concat());
    assert_close(&f32_four, &f32_one, 1e-5, "f32");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn training_from_npy_and_safetensors_matches_jax() {
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("jax/losses.json")).unwrap()).unwrap();
    let want: Vec<f64> = serde_json::from_value(reference["losses"].clone()).unwrap();
    let dir = temp("jax");
    let (x, y, init) =
        (testdata("jax/x.npy"), testdata("jax/y.npy"), testdata("jax/init.safetensors"));
    for mesh in ["1x1", "2x2", "4x1", "2x4"] {
        let got = losses(
            &dir,
            mesh,
            &[
                "train",
                "--data-x",
                &x,
                "--data-y",
                &y,
                "--init",
                &init,
                "--batch",
                "16",
                "--steps",
                "12",
                "--lr",
                "0.3",
                "--mesh",
                mesh,
                "--no-check",
            ],
        );
        assert_close(&got, &want, 1e-12, mesh);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resuming_on_another_mesh_continues_the_uninterrupted_run() {
    let dir = temp("resume");
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let common = ["train", "--no-check", "--hidden", "16", "--shuffle", "--seed", "3"];
    let whole = losses(&dir, "whole", &[&common[..], &["--mesh", "1x1", "--steps", "24"]].concat());
    let first = losses(
        &dir,
        "first",
        &[
            &common[..],
            &[
                "--mesh",
                "2x2",
                "--steps",
                "24",
                "--checkpoint-dir",
                ckpt,
                "--checkpoint-every",
                "10",
            ],
        ]
        .concat(),
    );
    assert_close(&first, &whole, 1e-12, "first part");
    // The directory keeps the newest three steps: 10, 20 and 24; resume from 10.
    let names: Vec<String> = std::fs::read_dir(ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["step-00000010", "step-00000020", "step-00000024"]);
    let ten = format!("{ckpt}/step-00000010");
    for mesh in ["4x1", "1x2"] {
        let rest = losses(
            &dir,
            mesh,
            &[&common[..], &["--mesh", mesh, "--steps", "24", "--resume", &ten]].concat(),
        );
        assert_close(&rest, &whole[10..], 1e-12, mesh);
    }
    // Resuming the directory itself takes its latest step (24): already there.
    let out = meshwork(&[&common[..], &["--steps", "24", "--resume", ckpt]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("already at or past --steps 24"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs `args`, expects exit status 2 and one stderr line containing `says`, and that
/// the losses file the run was given does not exist.
fn refused(args: &[&str], says: &str) {
    let dir = temp("bad");
    let losses = dir.join("losses.json");
    let mut all = args.to_vec();
    all.extend(["--losses-json", losses.to_str().unwrap()]);
    let out = meshwork(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        last.starts_with("meshwork: error: ") && last.contains(says),
        "{args:?}: want {says:?} in {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!losses.exists(), "{args:?} left a losses file");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_exits_2_with_one_line_naming_the_flag() {
    let dir = temp("inputs");
    let d = |name: &str| dir.join(name).to_str().unwrap().to_string();
    std::fs::write(d("garbage.npy"), b"this is not numpy").unwrap();
    std::fs::write(d("garbage.safetensors"), b"nor this").unwrap();
    let (x, y, init) =
        (testdata("jax/x.npy"), testdata("jax/y.npy"), testdata("jax/init.safetensors"));
    fn train<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        [&["train", "--steps", "2"][..], extra].concat()
    }
    refused(
        &train(&["--mesh", "3x1"]),
        "--batch 64 does not split over the 3 data replicas of --mesh 3x1",
    );
    refused(
        &train(&["--mesh", "1x3"]),
        "--hidden 32 does not split over the 3 model devices of --mesh 1x3",
    );
    refused(&train(&["--mesh", "two"]), "--mesh \"two\" is not a mesh");
    refused(&["train", "--steps", "-1"], "--steps \"-1\" is not a step count");
    refused(&train(&["--dtype", "f16"]), "--dtype \"f16\" is not f32 or f64");
    refused(&train(&["--warp"]), "unknown flag --warp");
    refused(&train(&["--data-x", &d("missing.npy"), "--data-y", &y]), "--data-x: cannot read");
    refused(&train(&["--data-x", &d("garbage.npy"), "--data-y", &y]), "--data-x: ");
    refused(&train(&["--data-x", &x]), "--data-x needs --data-y");
    refused(&train(&["--data-x", &x, "--data-y", &x]), "--data-y: ");
    refused(
        &train(&[
            "--data-x",
            &x,
            "--data-y",
            &y,
            "--init",
            &d("garbage.safetensors"),
            "--batch",
            "16",
        ]),
        "--init: ",
    );
    // The right file with the wrong data: shapes disagree.
    let wide = d("wide.npy");
    // 48 x 5 → 24 x 10: the same bytes under another shape (same header length).
    let bytes = std::fs::read(&x).unwrap();
    let at = bytes.windows(7).position(|w| w == b"(48, 5)").unwrap();
    let mut wider = bytes.clone();
    wider.splice(at..at + 7, b"(24,10)".iter().copied());
    std::fs::write(&wide, wider).unwrap();
    refused(
        &train(&["--data-x", &wide, "--data-y", &y, "--batch", "16"]),
        "--data-y: 48 labels for 24 rows of --data-x",
    );
    refused(
        &train(&[
            "--data-x", &x, "--data-y", &y, "--init", &init, "--batch", "16", "--hidden", "4",
        ]),
        "--hidden 4 disagrees with --init",
    );
    // Safetensors files with the wrong names, and with shapes the data cannot use.
    let renamed = d("renamed.safetensors");
    let bytes = std::fs::read(&init).unwrap();
    let at = bytes.windows(4).position(|w| w == b"\"w1\"").unwrap();
    let mut other = bytes.clone();
    other.splice(at..at + 4, b"\"W1\"".iter().copied());
    std::fs::write(&renamed, other).unwrap();
    refused(
        &train(&["--data-x", &x, "--data-y", &y, "--init", &renamed, "--batch", "16"]),
        "has no tensor \"w1\" (want w1, b1, w2, b2)",
    );
    refused(
        &train(&["--data-x", &wide, "--data-y", &d("y24.npy"), "--init", &init, "--batch", "16"]),
        "--data-y: cannot read",
    );
    let x3 = d("x3.npy");
    let at = bytes_of(&x).windows(7).position(|w| w == b"(48, 5)").unwrap();
    let mut narrow = bytes_of(&x);
    // 48 x 5 → 80 x 3: the init's w1 has 5 rows, the data 3 features.
    narrow.splice(at..at + 7, b"(80, 3)".iter().copied());
    std::fs::write(&x3, narrow).unwrap();
    let y80 = d("y80.npy");
    let mut ys = bytes_of(&y);
    let at = ys.windows(5).position(|w| w == b"(48,)").unwrap();
    ys.splice(at..at + 5, b"(80,)".iter().copied());
    ys.extend(std::iter::repeat_n(0u8, 32 * 8));
    std::fs::write(&y80, ys).unwrap();
    refused(
        &train(&["--data-x", &x3, "--data-y", &y80, "--init", &init, "--batch", "16"]),
        "--init: w1 has shape [5, 8]; the data (3 features, 3 classes) needs [3, 8]",
    );
    refused(&train(&["--resume", &d("nowhere")]), "--resume: ");
    refused(&train(&["--checkpoint-every", "5"]), "--checkpoint-every needs --checkpoint-dir");
    refused(&["frobnicate"], "unknown command");
    let help = meshwork(&["train", "--help"]);
    assert!(
        help.status.success()
            && String::from_utf8_lossy(&help.stdout).contains("--checkpoint-every N")
    );
    // A checkpoint of another model size is refused on resume, naming both sizes.
    let ckpt = d("ckpt");
    let out = meshwork(&["train", "--steps", "2", "--no-check", "--checkpoint-dir", &ckpt]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    refused(
        &["train", "--steps", "4", "--resume", &ckpt, "--hidden", "16"],
        "holds a model with hidden 32; --hidden is 16",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_inspection_tools_draw_shardings_plans_and_placements() {
    let out = meshwork(&[
        "shard",
        "--shape",
        "8,8",
        "--mesh",
        "2x4",
        "--axes",
        "a,b",
        "--spec",
        "P('a','b')",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("[4:8, 6:8]") && text.contains("shard shape: [4, 2] of [8, 8]"),
        "{text}"
    );
    assert!(text.contains("XLA sharding: {devices=[2,4]<=[8]}"), "{text}");
    let out = meshwork(&[
        "shard",
        "--shape",
        "8,8",
        "--mesh",
        "2x4",
        "--axes",
        "a,b",
        "--spec",
        "{devices=[1,8]<=[8]}",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("shard shape: [8, 1]"));

    let out = meshwork(&[
        "reshard",
        "--shape",
        "8,8",
        "--mesh",
        "2x4",
        "--axes",
        "a,b",
        "--from",
        "P('a','b')",
        "--to",
        "P('b','a')",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("moved          48 of 64 elements (75.0%), 192 of 256 bytes"), "{text}");

    let graph = testdata("graph.json");
    let out = meshwork(&["place", &graph, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = |node: &str| {
        text.lines().find(|l| l.starts_with(&format!("{node} "))).unwrap_or_default().to_string()
    };
    // The resource edge keeps the read and the update with the variable.
    assert!(
        line("read_w").ends_with("device:CPU:1") && line("update").ends_with("device:CPU:1"),
        "{text}"
    );
    assert!(line("grad").ends_with("device:XLA_CPU:0"), "{text}");
    let out = meshwork(&["place", &graph, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft", "--dot"]);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("digraph"));
    let out = meshwork(&[
        "place",
        &graph,
        "--devices",
        "CPU:0,CPU:1,XLA_CPU:0",
        "--soft",
        "--explain",
        "log",
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("constraint: log requests '/device:XLA_CPU:0'")
    );
    // Without soft placement TF refuses the impossible request, and so do we.
    let out = meshwork(&["place", &graph, "--devices", "CPU:0,CPU:1,XLA_CPU:0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("Could not satisfy explicit device specification")
    );
}
