//! `meshwork train --model transformer` end to end: JAX's reference run (its tokens,
//! initial weights and losses) reproduced on every mesh and pipeline, the built-in
//! default learning, and bad input refused with one line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn meshwork(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshwork")).args(args).output().expect("the binary runs")
}

fn temp(tag: &str) -> PathBuf {
    let stamp =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir =
        std::env::temp_dir().join(format!("meshwork-lm-{tag}-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn reference(name: &str) -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/testdata");
    dir.join(name).to_str().unwrap().to_string()
}

fn expected(key: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(reference("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The reference command with `extra` flags; returns the losses it wrote.
fn train(dir: &Path, name: &str, optimizer: &str, lr: &str, extra: &[&str]) -> Vec<f64> {
    let path = dir.join(format!("{name}.json"));
    let (tokens, init) = (reference("tokens.npy"), reference("init.safetensors"));
    let mut args = vec!["train", "--model", "transformer"];
    if !extra.contains(&"--data-tokens") {
        args.extend(["--data-tokens", &tokens]);
    }
    args.extend([
        "--init",
        &init,
        "--heads",
        "4",
        "--batch",
        "8",
        "--dtype",
        "f64",
        "--optimizer",
        optimizer,
        "--lr",
        lr,
        "--quiet",
        "--losses-json",
        path.to_str().unwrap(),
    ]);
    if !extra.contains(&"--steps") {
        args.extend(["--steps", "20"]);
    }
    args.extend(extra);
    let out = meshwork(&args);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Writes `data` (little-endian values of NumPy type `descr`, `<i4`, `<i8` or `<f4`) of
/// `shape` as a `.npy` file; returns its path.
fn write_npy(path: &Path, descr: &str, shape: &[usize], data: Vec<u8>) -> String {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let tuple =
        if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    npy.extend((header.len() as u16).to_le_bytes());
    npy.extend(header.as_bytes());
    npy.extend(data);
    std::fs::write(path, npy).unwrap();
    path.to_str().unwrap().to_string()
}

/// A tensor's shape and f64 values.
type Values = (Vec<usize>, Vec<f64>);

/// A safetensors file of f64 tensors (header length, JSON header, little-endian data).
fn write_safetensors_f64(path: &Path, tensors: &[(&str, Values)]) -> String {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, (shape, values)) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F64", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

/// Int32 rows `[rows, cols]` as a `.npy` file.
fn write_npy_i32(path: &Path, rows: usize, cols: usize, values: &[i32]) -> String {
    write_npy(path, "<i4", &[rows, cols], values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// F32 values of `shape` as a `.npy` file.
fn write_npy_f32(path: &Path, shape: &[usize], values: &[f32]) -> String {
    write_npy(path, "<f4", shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn assert_jax(got: &[f64], key: &str, what: &str) {
    let want = expected(key);
    assert_eq!(got.len(), want.len(), "{what}");
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "{what} {key} step {s}: {g} vs JAX {w}");
    }
}

#[test]
fn the_reference_run_matches_jax_on_every_mesh() {
    let dir = temp("mesh");
    for mesh in ["1x1", "2x1", "1x2", "2x2", "4x1", "1x4"] {
        for (optimizer, lr, key) in [("adam", "0.01", "losses_adam"), ("sgd", "0.1", "losses_sgd")]
        {
            let got = train(&dir, &format!("{mesh}-{optimizer}"), optimizer, lr, &["--mesh", mesh]);
            assert_jax(&got, key, &format!("--mesh {mesh}"));
        }
    }
    // The same rows as int64.
    let npy = std::fs::read(reference("tokens.npy")).unwrap();
    let start = 10 + u16::from_le_bytes([npy[8], npy[9]]) as usize;
    let wide: Vec<u8> = npy[start..]
        .chunks_exact(4)
        .flat_map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
        .collect();
    assert_eq!(wide.len(), 256 * 17 * 8, "the reference rows are [256, 17]");
    let tokens = write_npy(&dir.join("tokens64.npy"), "<i8", &[256, 17], wide);
    let got = train(&dir, "int64", "sgd", "0.1", &["--mesh", "2x1", "--data-tokens", &tokens]);
    assert_jax(&got, "losses_sgd", "int64 tokens");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_reference_run_matches_jax_in_pipelines_and_several_steps_per_call() {
    let dir = temp("pipe");
    for extra in [
        &["--mesh", "2x2", "--steps-per-run", "4"][..],
        &["--mesh", "1x2", "--steps-per-run", "3", "--eval-every", "5"],
        &["--stages", "2"],
        &["--stages", "3"],
        &["--stages", "2", "--microbatches", "4"],
        &["--mesh", "2x1", "--stages", "2", "--microbatches", "2"],
    ] {
        for (optimizer, lr, key) in [("adam", "0.01", "losses_adam"), ("sgd", "0.1", "losses_sgd")]
        {
            let got = train(&dir, &format!("{}-{optimizer}", extra.join("")), optimizer, lr, extra);
            assert_jax(&got, key, &format!("{extra:?}"));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_built_in_run_learns_and_summarises() {
    let out = meshwork(&["train", "--model", "transformer", "--steps", "60", "--mesh", "2x1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = |label: &str| {
        let l = stdout.lines().find(|l| l.trim_start().starts_with(label));
        l.unwrap_or_else(|| panic!("no {label} line: {stdout}")).trim_start()[label.len()..].trim()
    };
    let nums: Vec<f64> = line("final loss")
        .split(|c: char| c.is_whitespace() || c == ')')
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(nums[0] < 0.5 * nums[1], "the loss halves: {stdout}");
    assert!(line("check").starts_with("every step equal to one device's"), "{stdout}");
    let curve = line("loss curve");
    assert!(curve.chars().count() > 10, "{stdout}");
    assert!(curve.chars().all(|c| ('▁'..='█').contains(&c)), "{stdout}");
    assert!(line("throughput").contains("tokens/s (60 steps in "), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tokens/s"), "progress lines: {stderr}");
}

#[test]
fn bad_input_exits_2_naming_the_flag() {
    let init = reference("init.safetensors");
    let dir = temp("bad");
    // A token row of the wrong width: [1, 3].
    let wrong = write_npy_i32(&dir.join("wrong.npy"), 1, 3, &[1, 2, 3]);
    // A user's file that is not a losses list: never replaced.
    let mine = dir.join("mine.txt");
    std::fs::write(&mine, "my notes").unwrap();
    let mine_path = mine.to_str().unwrap();
    // A NaN weight in an --init file.
    let nan_init = write_safetensors_f64(
        &dir.join("nan.safetensors"),
        &[("embed", (vec![1], vec![f64::NAN]))],
    );
    for (args, flag) in [
        (vec!["--init", &init, "--heads", "4", "--dim", "48"], "--dim"),
        // Not regular files: never read to the end of memory.
        (vec!["--text", "/dev/zero"], "--text"),
        (vec!["--init", "/dev/zero", "--heads", "4"], "--init"),
        (vec!["--init", &nan_init, "--heads", "4"], "--init"),
        (vec!["--losses-json", mine_path], "--losses-json"),
        (vec!["--stages", "4"], "--stages"),
        (vec!["--check", "--no-check"], "--check"),
        (vec!["--eval-every", "0"], "--eval-every"),
        (vec!["--init", &init], "--heads"),
        (vec!["--hidden", "8"], "--hidden"),
        (vec!["--mesh", "1x2", "--stages", "2"], "--stages"),
        (vec!["--microbatches", "2"], "--microbatches"),
        (vec!["--optimizer", "lamb"], "--optimizer"),
        (vec!["--data-tokens", &wrong], "--data-tokens"),
        (vec!["--batch", "6", "--mesh", "4x1"], "--batch"),
        (vec!["--heads", "5"], "--heads"),
    ] {
        let mut all = vec!["train", "--model", "transformer"];
        all.extend(args.iter().map(|s| &**s));
        let out = meshwork(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag) && stderr.lines().count() == 1, "{args:?}: {stderr}");
    }
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my notes", "untouched");
    let out = meshwork(&["train", "--model", "convnet"]);
    assert_eq!(out.status.code(), Some(2));
    let out = meshwork(&["train", "--model", "mlp", "--stages", "3"]);
    assert_eq!(out.status.code(), Some(2), "the MLP has two layers");
    let out = meshwork(&["inspect", "--model", "transformer", "--init", &init]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--heads"), "{stderr}");
    // A diverging run stops with status 1 and says why.
    let out = meshwork(&[
        "train",
        "--model",
        "transformer",
        "--optimizer",
        "sgd",
        "--lr",
        "1e30",
        "--steps",
        "5",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("loss is"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn inspect_prints_each_devices_step_with_megatrons_collectives() {
    let out = meshwork(&["inspect", "--model", "transformer", "--mesh", "1x2", "--layers", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("all_reduce") && text.contains("groups={{0,1}}"), "{text}");
    // Megatron: two all-reduces over `model` forward and two backward per block.
    assert!(text.contains("12 collectives in 12 launches (12 all_reduce over model)"), "{text}");
    let out = meshwork(&["inspect", "--model", "transformer", "--mesh", "2x2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    // And the data axis's gradient all-reduces combined into one launch.
    let last = text.lines().last().unwrap();
    assert!(last.contains("in 9 launches") && last.contains("8 all_reduce over model"), "{last}");
    let out = meshwork(&["inspect", "--model", "transformer", "--mesh", "1x3"]);
    assert_eq!(out.status.code(), Some(2), "3 does not divide 4 heads");
}

#[test]
fn schedules_shuffling_metrics_and_plots() {
    let dir = temp("extras");
    let metrics = dir.join("m.jsonl");
    let plot = dir.join("loss.svg");
    let (m, p) = (metrics.to_str().unwrap(), plot.to_str().unwrap());
    let base = ["train", "--model", "transformer", "--steps", "12", "--quiet"];
    let mut args = base.to_vec();
    args.extend(["--warmup", "4", "--schedule", "cosine", "--metrics-jsonl", m, "--plot", p]);
    let out = meshwork(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    let lr: Vec<f64> = lines.iter().map(|l| l["lr"].as_f64().unwrap()).collect();
    // Warm-up 0.0025, 0.005, 0.0075, 0.01, then cosine from 0.01 down to 0.
    for (s, want) in [(0, 0.0025), (1, 0.005), (3, 0.01), (4, 0.01), (11, 0.0)] {
        assert!((lr[s] - want).abs() < 1e-12, "step {s}: lr {}", lr[s]);
    }
    let mid = 0.01 * 0.5 * (1.0 + (std::f64::consts::PI * 4.0 / 7.0).cos());
    assert!((lr[8] - mid).abs() < 1e-12, "{}", lr[8]);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let points = svg.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
    assert_eq!(points.split_whitespace().count(), 12);
    // New files only: a second run refuses both before training.
    let out = meshwork(&args);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(&metrics).unwrap().lines().count(), 12, "untouched");
    // Shuffled rows: deterministic for a seed, not the plain order.
    let run = |extra: &[&str]| {
        let mut all = base.to_vec();
        all.extend(extra);
        let path = dir.join(format!("{}.json", extra.join("")));
        all.extend(["--losses-json", path.to_str().unwrap()]);
        assert!(meshwork(&all).status.success());
        std::fs::read_to_string(path).unwrap()
    };
    assert_eq!(run(&["--shuffle"]), run(&["--shuffle", "--seed", "0"]));
    assert_ne!(run(&["--shuffle"]), run(&[]));
    let _ = std::fs::remove_dir_all(dir);
}

/// Held-out rows are never trained on: with a quarter of the reference rows held out,
/// 30 steps of 8 rows (240 > 192) wrap around the other three quarters exactly as a run
/// on those rows alone does; the
/// evaluation reports a loss and an accuracy each time.
#[test]
fn evaluation_holds_rows_out_of_training() {
    let dir = temp("eval");
    let tokens = reference("tokens.npy");
    let bytes = std::fs::read(&tokens).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let values: Vec<i32> = bytes[10 + header..]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(String::from_utf8_lossy(&bytes[10..10 + header]).contains("(256, 17)"));
    let first = write_npy_i32(&dir.join("first.npy"), 192, 17, &values[..192 * 17]);
    let metrics = dir.join("m.jsonl");
    let with_eval = train(
        &dir,
        "eval",
        "adam",
        "0.01",
        &[
            "--eval-every",
            "5",
            "--eval-fraction",
            "0.25",
            "--metrics-jsonl",
            metrics.to_str().unwrap(),
            "--steps",
            "30",
        ],
    );
    let path = dir.join("first.json");
    let out = meshwork(&[
        "train",
        "--model",
        "transformer",
        "--data-tokens",
        &first,
        "--init",
        &reference("init.safetensors"),
        "--heads",
        "4",
        "--batch",
        "8",
        "--steps",
        "30",
        "--dtype",
        "f64",
        "--lr",
        "0.01",
        "--quiet",
        "--losses-json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let alone: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(with_eval, alone, "training read only the first 192 rows");
    let evals: Vec<(f64, f64)> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l.get("eval_loss").is_some())
        .map(|l| (l["eval_loss"].as_f64().unwrap(), l["eval_accuracy"].as_f64().unwrap()))
        .collect();
    assert_eq!(evals.len(), 6, "every 5 steps of 30");
    assert!(evals.iter().all(|&(l, a)| l.is_finite() && l > 0.0 && (0.0..=1.0).contains(&a)));
    assert!(evals[5].0 < evals[0].0, "the held-out loss falls: {evals:?}");
    // In a pipeline the same evaluations (each within 1e-9 of the mesh's), drawn as a
    // second line of the plot, one point per evaluation.
    let (piped, plot) = (dir.join("piped.jsonl"), dir.join("eval.svg"));
    train(
        &dir,
        "eval-piped",
        "adam",
        "0.01",
        &[
            "--eval-every",
            "5",
            "--eval-fraction",
            "0.25",
            "--metrics-jsonl",
            piped.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
            "--steps",
            "30",
            "--stages",
            "2",
            "--microbatches",
            "2",
        ],
    );
    let piped: Vec<f64> = std::fs::read_to_string(&piped)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["eval_loss"].as_f64())
        .collect();
    assert_eq!(piped.len(), evals.len());
    for (g, (w, _)) in piped.iter().zip(&evals) {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "pipeline eval {g} vs mesh {w}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    let lines: Vec<&str> =
        svg.split("points=\"").skip(1).map(|p| p.split('"').next().unwrap()).collect();
    assert_eq!(lines.len(), 2, "train and eval lines");
    assert_eq!(lines[0].split_whitespace().count(), 30);
    assert_eq!(lines[1].split_whitespace().count(), 6);
    let out = meshwork(&["train", "--model", "transformer", "--eval-fraction", "0.2"]);
    assert_eq!(out.status.code(), Some(2), "--eval-fraction needs --eval-every");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn text_rows_and_gradient_clipping() {
    let dir = temp("text");
    let text = dir.join("t.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let t = text.to_str().unwrap();
    let run = |extra: &[&str]| -> Vec<f64> {
        let path = dir.join(format!("{}.json", extra.join("").replace('/', "_")));
        let mut all = vec!["train", "--model", "transformer", "--text", t, "--steps", "15"];
        all.extend(["--dtype", "f64", "--quiet", "--losses-json", path.to_str().unwrap()]);
        all.extend(extra);
        let out = meshwork(&all);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let plain = run(&[]);
    assert!(plain[14] < plain[0], "bytes of text are learned: {plain:?}");
    // Row i is bytes 32i … 32i+32 (--seq 32): the same rows cut here and given as
    // --data-tokens train the same run.
    let bytes = std::fs::read(&text).unwrap();
    let n = (bytes.len() - 1) / 32;
    let rows: Vec<i32> =
        (0..n).flat_map(|i| bytes[32 * i..32 * i + 33].iter().map(|&b| i32::from(b))).collect();
    let tokens = write_npy_i32(&dir.join("rows.npy"), n, 33, &rows);
    let path = dir.join("rows.json");
    let out = meshwork(&[
        "train",
        "--model",
        "transformer",
        "--data-tokens",
        &tokens,
        "--steps",
        "15",
        "--dtype",
        "f64",
        "--quiet",
        "--losses-json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let from_rows: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(from_rows, plain, "--text cuts the rows as documented");
    // A norm no gradient reaches changes nothing; a small one changes the run, the same
    // on a 2x2 mesh as on one device (the run's own check).
    assert_eq!(run(&["--clip-norm", "1e9"]), plain);
    let clipped = run(&["--clip-norm", "0.05", "--mesh", "2x2"]);
    assert_eq!(clipped[0], plain[0]);
    assert_ne!(clipped[1], plain[1]);
    assert_eq!(run(&["--clip-norm", "0.05"]).len(), 15);
    // Clipped in a pipeline: the global norm over every stage's gradients, so the same
    // run as on the mesh.
    let piped = run(&["--clip-norm", "0.05", "--stages", "2", "--microbatches", "2"]);
    for (g, w) in piped.iter().zip(&clipped) {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "pipeline {g} vs mesh {w}");
    }
    for (extra, flag) in [
        (&["--vocab", "128"][..], "--text"),
        (&["--clip-norm", "-1"], "--clip-norm"),
        (&["--data-tokens", t], "--text"),
    ] {
        let mut all = vec!["train", "--model", "transformer", "--text", t];
        all.extend(extra);
        let out = meshwork(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(flag), "{extra:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A run stopped at step 10 and resumed on another mesh or pipeline continues the
/// uninterrupted run: its losses for steps 11–20 are JAX's.
#[test]
fn a_checkpoint_resumes_on_another_mesh_or_pipeline() {
    let dir = temp("resume");
    let want = expected("losses_adam");
    for (i, (before, after)) in [
        (&["--mesh", "2x2"][..], &["--stages", "2", "--microbatches", "2"][..]),
        (&["--stages", "3"], &["--mesh", "1x2"]),
    ]
    .into_iter()
    .enumerate()
    {
        let ck = dir.join(format!("ck{i}"));
        let ck = ck.to_str().unwrap();
        let mut first = vec!["--steps", "10", "--checkpoint-dir", ck, "--checkpoint-every", "5"];
        first.extend(before);
        let head = train(&dir, &format!("head{i}"), "adam", "0.01", &first);
        for (s, (g, w)) in head.iter().zip(&want[..10]).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{before:?} step {s}: {g} vs {w}");
        }
        let names: Vec<String> = std::fs::read_dir(ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        assert_eq!(names.len(), 2, "steps 5 and 10: {names:?}");
        // Resume: everything but --init and the weights' source.
        let path = dir.join(format!("tail{i}.json"));
        let tokens = reference("tokens.npy");
        let mut args = vec![
            "train",
            "--model",
            "transformer",
            "--data-tokens",
            &tokens,
            "--heads",
            "4",
            "--batch",
            "8",
            "--dtype",
            "f64",
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
            "--steps",
            "20",
            "--quiet",
            "--resume",
            ck,
            "--losses-json",
            path.to_str().unwrap(),
        ];
        args.extend(after);
        let out = meshwork(&args);
        assert!(out.status.success(), "{after:?}: {}", String::from_utf8_lossy(&out.stderr));
        let tail: Vec<f64> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(tail.len(), 10);
        for (s, (g, w)) in tail.iter().zip(&want[10..]).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{after:?} step {}: {g} vs {w}", s + 10);
        }
    }
    // What a resume refuses: another optimizer, weights from two places, no steps left.
    let ck = dir.join("ck0");
    let ck = ck.to_str().unwrap();
    let (init, tokens) = (reference("init.safetensors"), reference("tokens.npy"));
    for (extra, flag) in [
        (
            vec!["--data-tokens", &tokens, "--optimizer", "sgd", "--dtype", "f64", "--steps", "30"],
            "optimizer",
        ),
        (vec!["--data-tokens", &tokens, "--init", &init], "--init"),
        (vec!["--data-tokens", &tokens, "--dtype", "f64", "--steps", "10"], "nothing to run"),
        (vec!["--data-tokens", &tokens, "--dim", "48", "--dtype", "f64"], "--dim"),
        // The built-in rows, not the reference rows the checkpoint's run read.
        (vec!["--dtype", "f64", "--steps", "30"], "other data (--data-tokens "),
    ] {
        let mut all = vec!["train", "--model", "transformer", "--heads", "4", "--resume", ck];
        all.extend(extra.iter().map(|s| &**s));
        let out = meshwork(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(flag), "{extra:?}: {stderr}");
    }
    let out = meshwork(&["train", "--model", "transformer", "--checkpoint-every", "5"]);
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_cnn_trains_on_images_from_npy_files_data_parallel() {
    let dir = temp("cnn");
    // 64 images 6x6x2: class 1 when the first channel's left half is brighter.
    let (n, h, w, c) = (64, 6, 6, 2);
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in 0..n {
        let class = i % 2;
        for _r in 0..h {
            for col in 0..w {
                for ch in 0..c {
                    let bright = ch == 0 && (col < w / 2) == (class == 1);
                    let jitter = ((i * 7 + col * 3 + ch) % 5) as f32 * 0.1;
                    x.push(if bright { 1.0 } else { 0.0 } + jitter);
                }
            }
        }
        y.push(class as f32);
    }
    let xp = write_npy_f32(&dir.join("x.npy"), &[n, h, w, c], &x);
    let yp = write_npy_f32(&dir.join("y.npy"), &[n], &y);
    // One stray label that would make a head of 60001 classes; a NaN pixel.
    let mut bad_y = y.clone();
    bad_y[5] = 60000.0;
    let stray = write_npy_f32(&dir.join("stray.npy"), &[n], &bad_y);
    let mut bad_x = x.clone();
    bad_x[17] = f32::NAN;
    let nan_x = write_npy_f32(&dir.join("nan.npy"), &[n, h, w, c], &bad_x);
    let losses = dir.join("l.json");
    let out = meshwork(&[
        "train",
        "--model",
        "cnn",
        "--data-x",
        &xp,
        "--data-y",
        &yp,
        "--mesh",
        "4x1",
        "--batch",
        "16",
        "--steps",
        "30",
        "--dtype",
        "f64",
        "--filters",
        "4,6",
        "--losses-json",
        losses.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("on 6x6x2 images on 64 rows")
            && stdout.contains("every step equal to one device's"),
        "{stdout}"
    );
    let l: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(&losses).unwrap()).unwrap();
    assert_eq!(l.len(), 30);
    assert!(l[29] < 0.5 * l[0], "learns: {l:?}");
    let out = meshwork(&["train", "--model", "cnn", "--steps", "40", "--quiet"]);
    assert!(out.status.success(), "the built-in images: {}", String::from_utf8_lossy(&out.stderr));
    // The trainer's other flags work for the CNN too: a checkpoint saved on one device
    // resumes on four and continues the uninterrupted run; evaluation reports accuracy.
    let ck = dir.join("ck");
    let (ck, whole, tail) = (ck.to_str().unwrap(), dir.join("whole.json"), dir.join("tail.json"));
    let common = ["train", "--model", "cnn", "--data-x", &xp, "--data-y", &yp, "--batch", "16"];
    let with = |extra: &[&str]| {
        let mut all = common.to_vec();
        all.extend(["--dtype", "f64", "--quiet"]);
        all.extend(extra);
        let out = meshwork(&all);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    with(&["--steps", "12", "--losses-json", whole.to_str().unwrap()]);
    with(&["--steps", "6", "--checkpoint-dir", ck]);
    with(&[
        "--steps",
        "12",
        "--resume",
        ck,
        "--mesh",
        "4x1",
        "--losses-json",
        tail.to_str().unwrap(),
    ]);
    let read = |p: &Path| -> Vec<f64> {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (whole, tail) = (read(&whole), read(&tail));
    for (g, w) in tail.iter().zip(&whole[6..]) {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "{tail:?} vs {whole:?}");
    }
    // In a pipeline (2 replicas of 2 stages, 2 micro-batches; and 3 stages): every
    // step equal to one device's (the run's check) and to the mesh run's losses.
    let piped = dir.join("piped.json");
    with(&[
        "--steps",
        "12",
        "--mesh",
        "2x1",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--losses-json",
        piped.to_str().unwrap(),
    ]);
    for (g, w) in read(&piped).iter().zip(&whole) {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "pipeline {g} vs {w}");
    }
    with(&["--steps", "4", "--stages", "3"]);
    let out = meshwork(&["train", "--model", "cnn", "--stages", "4"]);
    assert_eq!(out.status.code(), Some(2), "three layers, three stages at most");
    let mut all = common.to_vec();
    all.extend(["--steps", "20", "--eval-every", "10", "--eval-fraction", "0.25"]);
    let out = meshwork(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("eval         after step 20: loss ") && stdout.contains(", accuracy "),
        "{stdout}"
    );
    // --init sets the weights and says the filters: zero weights and a head bias of
    // [1, 0] make every image's logits [1, 0], so the first loss (a batch of both
    // classes evenly) is (ln(1 + e⁻¹) + ln(1 + e)) / 2; a --filters that disagrees is
    // refused.
    let zeros = |shape: &[usize]| (shape.to_vec(), vec![0.0; shape.iter().product()]);
    let init = write_safetensors_f64(
        &dir.join("init.safetensors"),
        &[
            ("conv1.weight", zeros(&[3, 3, 2, 4])),
            ("conv1.bias", zeros(&[4])),
            ("conv2.weight", zeros(&[3, 3, 4, 6])),
            ("conv2.bias", zeros(&[6])),
            ("head.weight", zeros(&[3 * 3 * 6, 2])),
            ("head.bias", (vec![2], vec![1.0, 0.0])),
        ],
    );
    let from_init = dir.join("init.json");
    with(&[
        "--steps",
        "3",
        "--mesh",
        "2x1",
        "--init",
        &init,
        "--losses-json",
        from_init.to_str().unwrap(),
    ]);
    let l = read(&from_init);
    let want = ((1.0 + (-1f64).exp()).ln() + (1.0 + 1f64.exp()).ln()) / 2.0;
    assert!((l[0] - want).abs() < 1e-12 && l[2] < l[0], "{l:?} vs {want}");
    // Evaluation against the same closed form: with a learning rate too small to move
    // the weights, every held-out image (rows 48..64, both classes evenly) has logits
    // [1, 0]: the held-out loss is the first loss above, the accuracy one half.
    let metrics = dir.join("init-eval.jsonl");
    with(&[
        "--steps",
        "2",
        "--lr",
        "1e-300",
        "--init",
        &init,
        "--eval-every",
        "2",
        "--eval-fraction",
        "0.25",
        "--metrics-jsonl",
        metrics.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let (eval_loss, accuracy) =
        (last["eval_loss"].as_f64().unwrap(), last["eval_accuracy"].as_f64().unwrap());
    assert!((eval_loss - want).abs() < 1e-12 && accuracy == 0.5, "{text}");
    let mut all = common.to_vec();
    all.extend(["--init", &init, "--filters", "8,16"]);
    let out = meshwork(&all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--filters: 8,16 disagrees") && stderr.contains("4,6"), "{stderr}");
    for (args, flag) in [
        (vec!["--mesh", "1x2"], "--mesh"),
        (vec!["--seq", "8"], "--seq"),
        (vec!["--data-x", &xp], "--data-x"),
        (vec!["--data-x", &yp, "--data-y", &yp], "--data-x"),
        (vec!["--data-x", &xp, "--data-y", &xp], "--data-y"),
        (vec!["--filters", "4"], "--filters"),
        (vec!["--data-x", &xp, "--data-y", &stray], "--data-y"),
        (vec!["--data-x", &nan_x, "--data-y", &yp], "--data-x"),
    ] {
        let mut all = vec!["train", "--model", "cnn"];
        all.extend(args.iter().map(|s| &**s));
        let out = meshwork(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Nothing is created before every check has passed; outputs need their own paths;
/// sizes that could not fit are refused before anything is allocated.
#[test]
fn checks_come_before_outputs_and_sizes_are_bounded() {
    let dir = temp("checks");
    let (m, c, p) = (dir.join("m.jsonl"), dir.join("ck"), dir.join("p.svg"));
    let (m, c, p) = (m.to_str().unwrap(), c.to_str().unwrap(), p.to_str().unwrap());
    let base = ["train", "--model", "transformer", "--steps", "3", "--quiet"];
    let refused = |extra: &[&str], flag: &str| {
        let mut all = base.to_vec();
        all.extend(extra);
        let out = meshwork(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(flag) && stderr.lines().count() == 1, "{extra:?}: {stderr}");
    };
    // A check that fails late (the held-out fraction) leaves no file behind.
    refused(
        &[
            "--metrics-jsonl",
            m,
            "--checkpoint-dir",
            c,
            "--eval-every",
            "2",
            "--eval-fraction",
            "0.001",
        ],
        "--eval-fraction",
    );
    assert!(!Path::new(m).exists() && !Path::new(c).exists(), "nothing made");
    refused(&["--metrics-jsonl", p, "--plot", p], "--plot");
    refused(&["--losses-json", m, "--metrics-jsonl", m], "--metrics-jsonl");
    std::fs::write(m, "the user's\n").unwrap();
    refused(&["--metrics-jsonl", m], "--metrics-jsonl");
    assert_eq!(std::fs::read_to_string(m).unwrap(), "the user's\n", "untouched");
    refused(&["--steps", "10000000000000"], "--steps");
    refused(&["--seq", "1099511627776"], "--max-memory");
    refused(&["--vocab", "4000000000", "--dim", "64"], "--max-memory");
    refused(&["--mesh", "4294967296x4294967296"], "--mesh");
    refused(&["--stages", "2", "--microbatches", "18446744073709551615"], "--batch");
    let out = meshwork(&["train", "--model", "cnn", "--text", m]);
    assert_eq!(out.status.code(), Some(2), "the CNN takes no text");
    assert!(meshwork(&["help", "inspect"]).status.success());
    // Seeds shuffle differently.
    let run = |seed: &str| {
        let path = dir.join(format!("s{seed}.json"));
        let mut all = base.to_vec();
        all.extend(["--shuffle", "--seed", seed, "--losses-json", path.to_str().unwrap()]);
        assert!(meshwork(&all).status.success());
        std::fs::read_to_string(path).unwrap()
    };
    assert_ne!(run("0"), run("1"));
    let _ = std::fs::remove_dir_all(dir);
}

/// SIGTERM stops a run after its current step: a checkpoint and the losses so far are
/// saved, status 130, and the run resumes from there.
#[test]
fn a_terminated_run_saves_and_resumes() {
    let dir = temp("term");
    let ck = dir.join("ck");
    let losses = dir.join("l.json");
    let child = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .args([
            "train",
            "--model",
            "transformer",
            "--steps",
            "100000",
            "--quiet",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--losses-json",
            losses.to_str().unwrap(),
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until the run is training (its first checkpoint directory exists).
    let start = std::time::Instant::now();
    while !ck.exists() && start.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped after step"), "{stderr}");
    let done: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(&losses).unwrap()).unwrap();
    assert!(!done.is_empty());
    let step = std::fs::read_dir(&ck)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse::<usize>().ok())
        .max()
        .unwrap();
    assert_eq!(step, done.len(), "the checkpoint is the last step taken");
    let more = (step + 2).to_string();
    let out = meshwork(&[
        "train",
        "--model",
        "transformer",
        "--steps",
        &more,
        "--quiet",
        "--resume",
        ck.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(dir);
}

/// `--model mlp` runs the main job's MLP through the same trainer: JAX's MLP case on
/// every mesh and in a pipeline, and every training flag with it.
#[test]
fn the_mlp_through_the_trainer_matches_jax_and_takes_every_flag() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/jax");
    let file = |n: &str| data.join(n).to_str().unwrap().to_string();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("losses.json")).unwrap()).unwrap();
    let losses = |key: &[&str]| -> Vec<f64> {
        let v = key.iter().fold(&json, |v, k| &v[*k]);
        serde_json::from_value(v.clone()).unwrap()
    };
    let dir = temp("mlp");
    let (x, y, init) = (file("x.npy"), file("y.npy"), file("init.safetensors"));
    let sgd = &["--lr", "0.3"][..];
    let momentum = &["--optimizer", "momentum", "--lr", "0.1"][..];
    let adamw = &["--optimizer", "adamw", "--lr", "0.01"][..];
    let run = |extra: &[&str], optimizer: &[&str], name: &str| -> Vec<f64> {
        let path = dir.join(format!("{name}.json"));
        let mut args = vec![
            "train",
            "--model",
            "mlp",
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
            "--quiet",
            "--losses-json",
            path.to_str().unwrap(),
        ];
        args.extend(optimizer);
        args.extend(extra);
        let out = meshwork(&args);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    for (extra, optimizer, key) in [
        (&["--mesh", "1x1"][..], sgd, &["losses"][..]),
        (&["--mesh", "2x2"], sgd, &["losses"]),
        (&["--mesh", "2x4"], sgd, &["losses"]),
        (&["--mesh", "2x1", "--stages", "2", "--microbatches", "2"], sgd, &["losses"]),
        // The optimizers' formulas (PyTorch's) against JAX's run of them.
        (&["--mesh", "2x2"], momentum, &["momentum", "losses"]),
        (&["--mesh", "2x2"], adamw, &["adamw", "losses"]),
        (&["--mesh", "1x1", "--stages", "2", "--microbatches", "4"], adamw, &["adamw", "losses"]),
    ] {
        let name = format!("{}{}", extra.join(""), optimizer.join(""));
        let got = run(extra, optimizer, &name);
        let want = losses(key);
        assert_eq!(got.len(), want.len());
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs(), "{name} step {s}: {g} vs JAX {w}");
        }
    }
    // Shuffled, the trainer reads the rows the main job reads (its own MLP, checked
    // against JAX in cli.rs).
    let shuffled = run(&["--mesh", "2x2", "--shuffle", "--seed", "7"], sgd, "shuffled");
    let path = dir.join("main-shuffled.json");
    let out = meshwork(&[
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
        "--shuffle",
        "--seed",
        "7",
        "--quiet",
        "--losses-json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let main: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_ne!(shuffled, losses(&["losses"]), "--shuffle changes the order");
    for (s, (g, w)) in shuffled.iter().zip(&main).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs(), "shuffled step {s}: {g} vs the main job's {w}");
    }
    let out = meshwork(&[
        "train",
        "--model",
        "mlp",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--warmup",
        "5",
        "--schedule",
        "cosine",
        "--clip-norm",
        "1",
        "--eval-every",
        "50",
        "--eval-fraction",
        "0.2",
        "--steps",
        "100",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("MLP 8 -> 32 -> 3") && stdout.contains(", accuracy "), "{stdout}");
    let out = meshwork(&[
        "train", "--model", "mlp", "--init", &init, "--hidden", "16", "--data-x", &x, "--data-y",
        &y,
    ]);
    assert_eq!(out.status.code(), Some(2), "--hidden disagrees with the file");
    let _ = std::fs::remove_dir_all(dir);
}

/// The main job (`meshwork train`, no `--model`): quiet, a plot, a loss curve.
#[test]
fn the_main_job_is_quiet_on_request_and_plots() {
    let dir = temp("main");
    let plot = dir.join("loss.svg");
    let p = plot.to_str().unwrap();
    let out = meshwork(&["train", "--steps", "20", "--quiet", "--plot", p]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.is_empty() && out.stderr.is_empty(), "quiet");
    let svg = std::fs::read_to_string(&plot).unwrap();
    let points = svg.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
    assert_eq!(points.split_whitespace().count(), 20);
    let out = meshwork(&["train", "--steps", "20", "--plot", p]);
    assert_eq!(out.status.code(), Some(2), "a new file only");
    let out = meshwork(&["train", "--steps", "20"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("  loss curve   "), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}
