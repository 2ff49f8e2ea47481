//! The `meshwork` binary end to end: the main job as the README runs it, each
//! command's flags parsed into one-line errors naming the flag (exit 2), the help pages,
//! and the inspection tools. What the trainer does is tested in-process in
//! `meshwork-train`; here only that the binary hands it the flags and reports its end.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary run with `args` in a working directory of its own (a fine-tune saves
/// its checkpoint there by default), removed after.
fn meshwork(args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .current_dir(cwd.path())
        .args(args)
        .output()
        .expect("the binary runs")
}

fn testdata(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(rel).to_str().unwrap().to_string()
}

/// The losses the main job printed before the one trainer (kept with the trainer).
fn main_job_before() -> Vec<f64> {
    let path: PathBuf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/main-job/losses-200.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// `meshwork train` with every default, as the README runs it: the headline and the
/// summary on stdout, a progress line a tenth of the run apart on stderr, and the
/// losses the binary wrote before the one trainer (within 1e-12).
#[test]
fn the_main_job_runs_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let losses = dir.path().join("l.json");
    let out = meshwork(&["train", "--losses-json", losses.to_str().unwrap()]);
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("training MLP 8 -> 32 -> 3 on 512 rows (f64, sgd, lr 0.5) on mesh 2x2, batch 64, 200 steps\n"), "{stdout}");
    for label in [
        "final loss",
        "loss curve",
        "accuracy",
        "throughput",
        "check        every step equal to one device's",
    ] {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(label)), "no {label}: {stdout}");
    }
    let steps: Vec<&str> = stderr.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 11, "step 1 and every 20th: {stderr}");
    assert!(steps[0].starts_with("step     1/200 loss 1.067104"), "{stderr}");
    let got: Vec<f64> = serde_json::from_slice(&std::fs::read(&losses).unwrap()).unwrap();
    let want = main_job_before();
    assert_eq!(got.len(), want.len());
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs(), "step {k}: {g} vs {w}");
    }
    // Quiet: nothing on either stream.
    let out = meshwork(&["train", "--steps", "5", "--quiet"]);
    assert!(out.status.success() && out.stdout.is_empty() && out.stderr.is_empty());
    // --log-every 3: step 1, every third, and the last, each with its learning rate.
    let out = meshwork(&["train", "--steps", "10", "--log-every", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let steps: Vec<&str> = stderr.lines().filter(|l| l.starts_with("step ")).collect();
    let named: Vec<&str> =
        steps.iter().map(|l| l[5..].trim_start().split('/').next().unwrap()).collect();
    assert_eq!(named, ["1", "3", "6", "9", "10"], "{stderr}");
    assert!(steps.iter().all(|l| l.contains("  lr 0.5  ")), "{stderr}");
}

/// Runs `args`; expects exit 2 and one line on stderr, `meshwork: error: …` containing
/// each of `says`.
fn refused(args: &[&str], says: &[&str]) {
    let out = meshwork(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    assert!(err.starts_with("meshwork: error: "), "{args:?}: {err}");
    for s in says {
        assert!(err.contains(s), "{args:?}: want {s:?} in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

/// Flags the parser refuses and settings the trainer refuses both end as one line
/// naming the flag, exit 2; the parser's say which help page to read.
#[test]
fn bad_input_exits_2_with_one_line_naming_the_flag() {
    refused(&["train", "--warp"], &["'--warp'", "meshwork help train"]);
    refused(&["train", "--steps", "-1"], &["--steps <N>", "invalid digit"]);
    refused(&["train", "--steps", "ten"], &["--steps <N>"]);
    refused(&["train", "--mesh", "two"], &["--mesh <DxM>", "\"two\" is not a mesh like 2x2"]);
    refused(&["train", "--mesh", "0x2"], &["--mesh <DxM>", "at least one device"]);
    refused(&["train", "--dtype", "f16"], &["--dtype <DTYPE>", "f16"]);
    refused(&["train", "--base-dtype", "f16"], &["--base-dtype <DTYPE>", "f16"]);
    refused(
        &["train", "--preset", "tiny-llama", "--base-dtype", "bf16"],
        &["--base-dtype holds a LoRA run's frozen base"],
    );
    refused(&["train", "--model", "convnet"], &["--model <MODEL>", "convnet"]);
    refused(&["train", "--optimizer", "lamb"], &["--optimizer <OPTIMIZER>", "lamb"]);
    refused(&["train", "--filters", "4"], &["--filters <F1,F2>", "give two counts"]);
    refused(&["train", "--max-memory", "lots"], &["--max-memory <SIZE>", "not a size"]);
    refused(&["train", "--data-x", "x.npy"], &["--data-y <Y.npy>"]);
    refused(&["train", "--text", "a", "--data-tokens", "b"], &["--text", "--data-tokens"]);
    refused(&["train", "--check", "--no-check"], &["--check", "--no-check"]);
    refused(&["train", "--steps", "2", "--steps", "3"], &["--steps <N>"]);
    refused(&["train", "--checkpoint-dir"], &["--checkpoint-dir <DIR>"]);
    refused(&["train", "stray"], &["'stray'"]);
    refused(&["train", "-s", "5"], &["'-s'"]);
    refused(&["frobnicate"], &["'frobnicate'", "meshwork help"]);
    refused(&["help", "bogus"], &["no help on \"bogus\""]);
    refused(&["help", "train", "shard"], &["help takes one command"]);
    refused(&["version", "extra"], &["'extra'"]);
    refused(&["inspect", "--model", "cnn"], &["--mesh 1x2: the CNN's weights are not split"]);
    // The trainer's refusals, through the binary.
    refused(
        &["train", "--steps", "2", "--mesh", "3x1"],
        &["--batch 64 does not split over the 3 data replicas of --mesh 3x1"],
    );
    refused(&["train", "--lr", "-1"], &["--lr -1 must be a positive number"]);
    refused(
        &["train", "--model", "transformer", "--beta2", "1.5"],
        &["--beta2: 1.5 is not in [0, 1)"],
    );
    refused(
        &["train", "--model", "transformer", "--optimizer", "adam", "--no-decay-1d"],
        &["--no-decay-1d: applies to adamw; the optimizer is adam"],
    );
    refused(
        &["train", "--model", "mlp", "--stages", "3", "--mesh", "2x1"],
        &["--stages 3: the MLP has 2 layers"],
    );
    refused(&["train", "--checkpoint-every", "5"], &["--checkpoint-every needs --checkpoint-dir"]);
    refused(&["inspect", "--model", "transformer", "--vocab", "100000000000"], &["--max-memory: "]);
    refused(&["inspect", "--model", "transformer", "--mesh", "1x3"], &["--mesh 1x3"]);
}

/// The help pages: the commands, each command's flags (`train --help` and `help train`
/// alike), the model's defaults for `help train --model M`, the version.
#[test]
fn help_and_version() {
    let ok = |args: &[&str]| {
        let out = meshwork(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = ok(&["help"]);
    for command in ["train", "inspect", "shard", "reshard", "place"] {
        assert!(top.contains(command), "{top}");
    }
    assert_eq!(ok(&[]), top);
    let train = ok(&["train", "--help"]);
    assert_eq!(ok(&["help", "train"]), train);
    assert!(
        train.contains("--checkpoint-every <N>") && train.contains("--model mlp (the main job)"),
        "{train}"
    );
    let transformer = ok(&["help", "train", "--model", "transformer"]);
    assert_eq!(ok(&["train", "--model", "transformer", "--help"]), transformer);
    assert!(
        transformer.contains("--model transformer: the reference decoder-only transformer"),
        "{transformer}"
    );
    assert!(ok(&["help", "train", "--model=cnn"]).contains("--model cnn: conv3x3(F1)"));
    for topic in ["inspect", "shard", "reshard", "place"] {
        assert_eq!(ok(&["help", topic]), ok(&[topic, "--help"]), "{topic}");
    }
    let version = format!("meshwork {}\n", env!("CARGO_PKG_VERSION"));
    assert!(ok(&["--version"]).starts_with("meshwork "));
    assert_eq!(ok(&["version"]), version);
}

/// `inspect` prints the partitioned transformer step the trainer builds.
#[test]
fn inspect_prints_the_partitioned_step() {
    let out = meshwork(&["inspect", "--model", "transformer", "--mesh", "1x2", "--layers", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("12 collectives in 12 launches (12 all_reduce over model)"), "{text}");
}

/// `inspect --base-dtype bf16` of a LoRA step holds the frozen base in bf16: a
/// quarter of the bytes of the same step's f64 base.
#[test]
fn inspect_holds_a_lora_base_in_bf16() {
    let param_bytes = |extra: &[&str]| -> u64 {
        let mut args = vec![
            "inspect",
            "--mesh",
            "1x1",
            "--preset",
            "tiny-llama",
            "--seq",
            "8",
            "--dtype",
            "f64",
            "--lora-r",
            "2",
            "--json",
        ];
        args.extend(extra);
        let out = meshwork(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let frozen = j["weights"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| {
                w["trains"] == false && !w["name"].as_str().unwrap().starts_with("optimizer.")
            })
            .map(|w| w["whole_bytes"].as_u64().unwrap())
            .sum::<u64>();
        assert!(frozen > 0);
        let held = j["devices"][0]["param_bytes"].as_u64().unwrap();
        if extra.is_empty() { held } else { held + frozen * 3 }
    };
    assert_eq!(param_bytes(&["--base-dtype", "bf16"]), param_bytes(&[]));
    // The text view: the step with the base frozen in bf16 (no optimizer state for it).
    let out = meshwork(&[
        "inspect",
        "--mesh",
        "1x1",
        "--preset",
        "tiny-llama",
        "--seq",
        "8",
        "--lora-r",
        "2",
        "--base-dtype",
        "bf16",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("the frozen base held in bf16"), "{text}");
    assert!(text.contains("convert"), "{text}");
    // Optimizer state for the adapter alone.
    assert!(text.contains("optimizer.") && text.contains("lora_A"), "{text}");
    let base_state = text.lines().find(|l| l.contains("optimizer.") && l.contains("embed_tokens"));
    assert_eq!(base_state, None, "no optimizer state for the frozen base");
}

/// `--lora-dropout` on a new adapter: it trains (the header names the dropout), its
/// step's estimate counts the dropped inputs and masks it keeps, and a dropout
/// outside [0, 1) is exit 2 naming the flag.
#[test]
fn lora_dropout_trains_a_new_adapter_and_is_counted() {
    let tiny = ["--preset", "tiny-llama", "--seq", "8", "--lora-r", "2"];
    let with = |first: &[&str], more: &[&str]| {
        let args: Vec<&str> = first.iter().chain(&tiny).chain(more).copied().collect();
        meshwork(&args)
    };
    let out = with(&["train", "--steps", "2"], &["--lora-dropout", "0.1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("dropout 0.1"));
    let estimate = |more: &[&str]| -> f64 {
        let out = with(&["inspect", "--mesh", "1x1", "--json"], more);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        j["memory"]["estimate"]["total_bytes"].as_f64().unwrap()
    };
    let (plain, dropped) = (estimate(&[]), estimate(&["--lora-dropout", "0.1"]));
    assert!(dropped > plain, "{dropped} vs {plain}");
    for bad in ["1", "-0.5"] {
        let out = with(&["train", "--steps", "2"], &["--lora-dropout", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains("--lora-dropout") && e.contains("below 1"), "{e}");
    }
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

/// The oracle's AdamW command's flags after the data: `--seq 16 --batch 4 --steps 10
/// --optimizer adamw --lr 0.003 --weight-decay 0.1 --dtype f64`.
const ADAMW: [&str; 14] = [
    "--seq",
    "16",
    "--batch",
    "4",
    "--steps",
    "10",
    "--optimizer",
    "adamw",
    "--lr",
    "0.003",
    "--weight-decay",
    "0.1",
    "--dtype",
    "f64",
];

/// The oracle's `losses_adamw` (`expected.json` in `data`).
fn losses_adamw(data: &Path) -> Vec<f64> {
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("expected.json")).unwrap()).unwrap();
    expected["losses_adamw"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The issue's GPT-2 command through the binary: Hugging Face's checkpoint folder,
/// the oracle's token rows, AdamW with weight decay 0.1 in f64 on a 2x1 mesh; the
/// losses it writes are `transformers`' within 1e-9.
#[test]
fn gpt2_from_a_hugging_face_checkpoint_trains_as_transformers_does() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    let dir = tempfile::tempdir().unwrap();
    let losses = dir.path().join("l.json");
    let arg = |p: PathBuf| p.to_str().unwrap().to_string();
    let (init, tokens, out) =
        (arg(data.join("model")), arg(data.join("tokens.npy")), arg(losses.clone()));
    let run = meshwork(
        &[
            &["train", "--model", "gpt2", "--init", &init, "--data-tokens", &tokens][..],
            &ADAMW,
            &["--mesh", "2x1", "--losses-json", &out],
        ]
        .concat(),
    );
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let got: Vec<f64> = serde_json::from_slice(&std::fs::read(&losses).unwrap()).unwrap();
    let want = losses_adamw(&data);
    assert_eq!(got.len(), want.len());
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "step {k}: {g} vs {w}");
    }
    // A size flag where the checkpoint fixes the sizes is refused, naming it.
    refused(
        &["train", "--model", "gpt2", "--init", &init, "--layers", "3"],
        &["--layers: GPT-2's sizes come from --init's config.json"],
    );
}

/// `meshwork generate --init … --prompt-ids <the prompt> --max-new-tokens 12
/// --temperature 0 --json` prints `transformers`' greedy ids; a token outside the
/// vocabulary is exit 2 naming the flag.
#[test]
fn generate_prints_transformers_greedy_ids() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    let init = data.join("model").to_str().unwrap().to_string();
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("expected.json")).unwrap()).unwrap();
    let prompt: Vec<String> = expected["generate"]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let out = meshwork(&[
        "generate",
        "--init",
        &init,
        "--prompt-ids",
        &prompt.join(","),
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--dtype",
        "f64",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["ids"], expected["generate"]["ids"]);
    assert_eq!(got["prompt_ids"], expected["generate"]["prompt_ids"]);
    refused(
        &["generate", "--init", &init, "--prompt-ids", "320", "--max-new-tokens", "1"],
        &["--prompt-ids: 320 is not a token of the vocabulary of 320"],
    );
    // --logits writes [new tokens, vocabulary] float64, a new file only (checked
    // before decoding), in a folder that is there.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("logits.npy");
    let logits = file.to_str().unwrap();
    let args = ["generate", "--init", &init, "--prompt-ids", "1,2", "--max-new-tokens", "3"];
    let out = meshwork(&[&args[..], &["--logits", logits]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let npy = std::fs::read(&file).unwrap();
    let header = String::from_utf8_lossy(&npy[..128]).to_string();
    assert!(header.contains("'<f8'") && header.contains("(3, 320)"), "{header}");
    refused(&[&args[..], &["--logits", logits]].concat(), &["--logits: ", "exists"]);
    let nowhere = dir.path().join("no/such/l.npy");
    refused(
        &[&args[..], &["--logits", nowhere.to_str().unwrap()]].concat(),
        &["is not in a folder that exists"],
    );
}

/// `meshwork tokenize --text corpus.txt --tokenizer tokenizer.json --seq 16 --out F`
/// writes the oracle's `tokens.npy` rows (int32), never over an existing file; and
/// `train --text --tokenizer` with the memory savers, its rows cached under
/// `$XDG_CACHE_HOME/meshwork`, reproduces `transformers`' losses from the text (the
/// second run from the cache).
#[test]
fn tokenize_writes_the_oracles_rows_and_training_caches_them() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    let dir = tempfile::tempdir().unwrap();
    let arg = |p: PathBuf| p.to_str().unwrap().to_string();
    let (text, tok) = (arg(data.join("corpus.txt")), arg(data.join("tokenizer.json")));
    let out = dir.path().join("rows.npy");
    let args = ["tokenize", "--text", &text, "--tokenizer", &tok, "--seq", "16", "--out"];
    let run = meshwork(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("rows of 17 tokens"));
    // NumPy's int32 rows, header and all.
    let ours = std::fs::read(&out).unwrap();
    assert_eq!(ours, std::fs::read(data.join("tokens.npy")).unwrap());
    // Never over a file.
    let again = meshwork(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert_eq!(again.status.code(), Some(2));
    assert_eq!(std::fs::read(&out).unwrap(), ours);

    let cache_home = dir.path().join("cache-home");
    let train = |losses: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_meshwork"))
            .current_dir(dir.path())
            .env("XDG_CACHE_HOME", &cache_home)
            .args(["train", "--model", "gpt2", "--init", &arg(data.join("model"))])
            .args(["--text", &text, "--tokenizer", &tok])
            .args(ADAMW)
            .args(["--mesh", "2x1", "--fsdp", "--grad-accum", "2", "--remat"])
            .args(["--losses-json", losses.to_str().unwrap(), "--quiet"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Vec<f64>>(&std::fs::read(losses).unwrap()).unwrap()
    };
    let want = losses_adamw(&data);
    for run in ["first", "second"] {
        let got = train(&dir.path().join(format!("{run}.json")));
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{run} run, step {k}: {g} vs {w}");
        }
        let cached: Vec<_> = std::fs::read_dir(cache_home.join("meshwork")).unwrap().collect();
        assert_eq!(cached.len(), 1, "one cached rows file");
    }
}

/// The issue's Llama-family command through the binary, as a new user types it:
/// `meshwork train --init DIR --text notes.txt` — the model and its tokenizer from the
/// folder, no `--model` — trains (here Qwen 3 with AdamW in f64 on 1x2, its one
/// key/value head on both model positions) to `transformers`' losses; `generate
/// --chat` prints the chat template's ids and the new tokens; a text prompt comes back
/// decoded.
#[test]
fn a_llama_family_folder_trains_and_chats_without_naming_the_model() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/qwen3");
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("Qwen3-tiny");
    std::fs::create_dir(&folder).unwrap();
    for entry in std::fs::read_dir(data.join("model")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), folder.join(entry.file_name())).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(data.join(f), folder.join(f)).unwrap();
    }
    let arg = |p: &Path| p.to_str().unwrap().to_string();
    let losses = dir.path().join("l.json");
    let out = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .current_dir(dir.path())
        .env("XDG_CACHE_HOME", dir.path().join("cache"))
        .args(["train", "--init", &arg(&folder), "--text", &arg(&data.join("corpus.txt"))])
        .args(["--seq", "16", "--batch", "4", "--steps", "10", "--optimizer", "adamw"])
        .args(["--lr", "0.003", "--weight-decay", "0.1", "--dtype", "f64", "--mesh", "1x2"])
        .args(["--losses-json", &arg(&losses), "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: Vec<f64> = serde_json::from_slice(&std::fs::read(&losses).unwrap()).unwrap();
    let want = losses_adamw(&data);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 3e-9 * w.abs(), "step {k}: {g} vs {w}");
    }
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("expected.json")).unwrap()).unwrap();
    let messages = dir.path().join("messages.json");
    std::fs::write(&messages, expected["chat"]["messages"].to_string()).unwrap();
    // The conversation is longer than the oracle's 64 positions; rotary positions take
    // any context the config says.
    let config = folder.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"max_position_embeddings\": 64", "\"max_position_embeddings\": 128"),
    )
    .unwrap();
    let out = meshwork(&[
        "generate",
        "--init",
        &arg(&folder),
        "--chat",
        &arg(&messages),
        "--max-new-tokens",
        "3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["prompt_ids"], expected["chat"]["ids"]);
    assert!(got["text"].is_string(), "{got}");
    let out = meshwork(&[
        "generate",
        "--init",
        &arg(&folder),
        "--prompt",
        "a mesh  splits",
        "--max-new-tokens",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u64> =
        got["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(ids.len(), got["prompt_ids"].as_array().unwrap().len() + 2);
    // --model must agree with the folder's model_type.
    refused(
        &["train", "--model", "llama", "--init", &arg(&folder)],
        &["--model: llama disagrees with --init's", "whose model_type is qwen3"],
    );
}

/// `train --help` groups its flags under headings, in the order a run is described:
/// the model, its data, the optimizer, LoRA, the mesh and back end, checkpoints and
/// outputs; each flag under its own.
#[test]
fn train_help_is_grouped_under_headings() {
    let out = meshwork(&["train", "--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let headings: Vec<&str> =
        text.lines().filter(|l| !l.starts_with(' ') && l.ends_with(':')).collect();
    assert_eq!(
        headings,
        [
            "Options:",
            "Model:",
            "Data:",
            "Optimizer:",
            "LoRA:",
            "Mesh and back end:",
            "Checkpoints:",
            "Output:"
        ],
        "{text}"
    );
    let under = |flag: &str| {
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| {
                let l = l.trim_start();
                l == flag || l.starts_with(&format!("{flag} "))
            })
            .unwrap_or_else(|| panic!("{flag}"));
        *lines[..at].iter().rev().find(|l| !l.starts_with(' ') && l.ends_with(':')).unwrap()
    };
    for (flag, heading) in [
        ("--init", "Model:"),
        ("--seq", "Model:"),
        ("--text", "Data:"),
        ("--lr", "Optimizer:"),
        ("--weight-decay", "Optimizer:"),
        ("--lora-r", "LoRA:"),
        ("--mesh", "Mesh and back end:"),
        ("--remat", "Mesh and back end:"),
        ("--resume", "Checkpoints:"),
        ("--plot", "Output:"),
        ("--log-every", "Output:"),
    ] {
        assert_eq!(under(flag), heading, "{flag}");
    }
}

/// `meshwork eval --json` on the GPT-2 case prints transformers' mean cross-entropy
/// over the corpus's rows (`eval.json`, within 1e-9), its perplexity and the tokens;
/// the plain form is one line.
#[test]
fn eval_prints_the_mean_cross_entropy() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    let path = |f: &str| data.join(f).to_str().unwrap().to_string();
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("eval.json")).unwrap()).unwrap();
    let want = oracle["cases"][0]["loss"].as_f64().unwrap();
    let (init, text, tok) = (path("model"), path("corpus.txt"), path("tokenizer.json"));
    let args = ["eval", "--init", &init, "--text", &text, "--tokenizer", &tok];
    let tail = ["--seq", "16", "--batch", "8", "--dtype", "f64"];
    let all = |more: &[&'static str]| -> Vec<String> {
        args.iter().chain(&tail).chain(more).map(|s| s.to_string()).collect()
    };
    let run = |v: Vec<String>| meshwork(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let out = run(all(&["--json"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let loss = got["loss"].as_f64().unwrap();
    assert!(((loss - want) / want).abs() < 1e-9, "{loss} {want}");
    assert_eq!(got["tokens"], oracle["cases"][0]["tokens"]);
    assert!((got["perplexity"].as_f64().unwrap() - want.exp()).abs() < 1e-6);
    let out = run(all(&[]));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.starts_with("loss 5.7633657") && line.ends_with(" tokens 6016\n"), "{line}");
}

/// The issue's first command, verbatim on the GPT-2 case (the oracle folder's files
/// under the names the issue gives them): it exits 0 and keeps its checkpoint in a
/// new `meshwork-runs/model-1` of the working directory, said in the summary; a
/// second run takes `model-2`; `--no-checkpoints` saves none, and `eval` never does.
#[test]
fn a_fine_tune_keeps_its_checkpoint() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("model")).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(data.join("model").join(f), dir.path().join("model").join(f)).unwrap();
    }
    for f in ["corpus.txt", "tokenizer.json"] {
        std::fs::copy(data.join(f), dir.path().join(f)).unwrap();
    }
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_meshwork"))
            .current_dir(dir.path())
            .env("XDG_CACHE_HOME", dir.path().join("cache"))
            .args(["train", "--model", "gpt2", "--init", "model", "--mesh", "2x1"])
            .args(["--text", "corpus.txt", "--tokenizer", "tokenizer.json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let first = run(&["--steps", "100"]);
    assert!(first.contains("checkpoint   step 100 in meshwork-runs/model-1"), "{first}");
    assert!(dir.path().join("meshwork-runs/model-1/step-00000100").is_dir());
    let second = run(&["--steps", "2"]);
    assert!(second.contains("in meshwork-runs/model-2"), "{second}");
    run(&["--steps", "2", "--no-checkpoints"]);
    // A run refused before it starts leaves no directory.
    let refused = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .current_dir(dir.path())
        .args(["train", "--init", "model", "--text", "corpus.txt", "--steps", "0"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let eval = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .current_dir(dir.path())
        .args(["eval", "--init", "model", "--text", "corpus.txt", "--seq", "16"])
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    let runs: Vec<_> = std::fs::read_dir(dir.path().join("meshwork-runs")).unwrap().collect();
    assert_eq!(runs.len(), 2);
}
