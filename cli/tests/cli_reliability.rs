//! The `meshwork` binary as a careful user of a training tool expects it: bad input of
//! every kind is one line and exit 2 and changes no file; the checkpoint directory is
//! meshwork's or refused untouched; closed or full output never panics; a run that
//! diverges exits 1; SIGINT saves, writes the losses and exits 130; a second run on a
//! directory in use is refused. (What each refusal says is the trainer's and the tools'
//! to test; here, that the binary ends each as one line and touches nothing.)

use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_meshwork");

/// A temporary directory, removed when the test ends (failing too).
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Runs the binary in `cwd` with `args` (bytes, so non-UTF-8 ones can be passed).
fn run_in(cwd: &Path, args: &[&[u8]]) -> Output {
    Command::new(BIN)
        .current_dir(cwd)
        .args(args.iter().map(|a| std::ffi::OsStr::from_bytes(a)))
        .stdin(Stdio::null())
        .output()
        .expect("the binary runs")
}

/// `.npy` bytes of `shape` with `descr` and raw little-endian `data`.
fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    [meshwork_io::npy::header(descr, shape), data.to_vec()].concat()
}

fn f64s(v: impl IntoIterator<Item = f64>) -> Vec<u8> {
    v.into_iter().flat_map(f64::to_le_bytes).collect()
}

fn i64s(v: impl IntoIterator<Item = i64>) -> Vec<u8> {
    v.into_iter().flat_map(i64::to_le_bytes).collect()
}

/// A safetensors file of f64 tensors.
fn safetensors(tensors: &[(&str, Vec<usize>, Vec<f64>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(f64s(values.iter().copied()));
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": "F64", "shape": shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    out
}

/// Every file and directory under `dir` with its bytes, for "nothing changed".
fn snapshot(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                out.push((p.clone(), None));
                stack.push(p);
            } else if meta.is_file() {
                out.push((p.clone(), Some(std::fs::read(&p).unwrap())));
            } else {
                out.push((
                    p.clone(),
                    Some(
                        std::fs::read_link(&p)
                            .map(|l| l.as_os_str().as_bytes().to_vec())
                            .unwrap_or_default(),
                    ),
                ));
            }
        }
    }
    out.sort();
    out
}

/// A working directory with inputs good and bad.
fn inputs(dir: &Path) {
    let w = |name: &str, bytes: Vec<u8>| std::fs::write(dir.join(name), bytes).unwrap();
    w("x.npy", npy("<f8", &[20, 4], &f64s((0..80).map(|i| (i % 7) as f64 - 3.0))));
    w("y.npy", npy("<i8", &[20], &i64s((0..20).map(|i| i % 3))));
    w("x1d.npy", npy("<f8", &[20], &f64s((0..20).map(f64::from))));
    w(
        "y_huge_class.npy",
        npy("<i8", &[20], &i64s((0..20).map(|i| if i == 0 { 100_000_000 } else { 0 }))),
    );
    w(
        "y_million.npy",
        npy("<i8", &[20], &i64s((0..20).map(|i| if i == 0 { 1_000_000 } else { i % 3 }))),
    );
    w("x_short.npy", npy("<f8", &[20, 4], &f64s((0..79).map(f64::from))));
    w(
        "x_nan.npy",
        npy("<f8", &[20, 4], &f64s((0..80).map(|i| if i == 5 { f64::NAN } else { 1.0 }))),
    );
    w("x_claims_huge.npy", npy("<f8", &[4_000_000_000, 4_000_000_000], &f64s([1.0])));
    w("garbage.npy", b"not numpy at all".to_vec());
    let init = |w1: f64| {
        safetensors(&[
            ("w1", vec![4, 2], vec![w1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]),
            ("b1", vec![2], vec![0.0, 0.0]),
            ("w2", vec![2, 3], vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
            ("b2", vec![3], vec![0.0, 0.0, 0.0]),
        ])
    };
    w("init_nan.safetensors", init(f64::NAN));
    w("init_inf.safetensors", init(f64::INFINITY));
    w("notes.txt", b"mine".to_vec());
    std::fs::create_dir(dir.join("proj")).unwrap();
    std::fs::write(dir.join("proj/notes.txt"), "mine").unwrap();
    std::os::unix::fs::symlink(dir.join("proj"), dir.join("link")).unwrap();
    w("graph.json", br#"{"nodes": []}"#.to_vec());
    // Hostile files: a safetensors header naming a tensor twice, and one whose tensors
    // share bytes (serde would keep the last entry; the bytes would alias).
    let header = |json: &str, data: usize| {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend(json.as_bytes());
        b.extend(vec![0u8; data]);
        b
    };
    w(
        "dup.safetensors",
        header(
            r#"{"w1":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"w1":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}}"#,
            16,
        ),
    );
    w(
        "aliased.safetensors",
        header(
            r#"{"w1":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"b1":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#,
            8,
        ),
    );
    // A PJRT plugin cut short (an ELF whose segments run past its end: dlopen would
    // crash with SIGBUS), and a named pipe in a plugin's place.
    let elf = std::fs::read(BIN).unwrap();
    w("cut.so", elf[..100_000].to_vec());
    let made = Command::new("mkfifo").arg(dir.join("pipe.so")).status().unwrap();
    assert!(made.success());
    // GPT-2 folders: the test one; one whose generation config names a non-id end;
    // one whose generation config is a named pipe; a tokenizer whose post-processor
    // names a special token it does not define (the tokenizers crate panics on it).
    let gpt2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/testdata/gpt2");
    for name in ["gpt2", "gpt2_badgen", "gpt2_pipegen"] {
        std::fs::create_dir(dir.join(name)).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(gpt2.join("model").join(f), dir.join(name).join(f)).unwrap();
        }
        std::fs::copy(gpt2.join("tokenizer.json"), dir.join(name).join("tokenizer.json")).unwrap();
    }
    w("gpt2_badgen/generation_config.json", br#"{"eos_token_id": 2.5}"#.to_vec());
    let made = Command::new("mkfifo")
        .arg(dir.join("gpt2_pipegen/generation_config.json"))
        .status()
        .unwrap();
    assert!(made.success());
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(gpt2.join("tokenizer.json")).unwrap()).unwrap();
    tok["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}
    });
    w("bad_template.json", tok.to_string().into_bytes());
}

/// The table: every command with bad arguments, each with a word its one line must
/// contain. Each must exit 2 with exactly one line on stderr, no panic, and leave every
/// file in the working directory as it was (and /dev/null a device).
#[test]
fn every_command_refuses_bad_arguments_with_one_line_and_changes_no_file() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    inputs(&dir);
    let cases: Vec<(Vec<&[u8]>, &str)> = vec![
        // The checkpoint directory: never anything meshwork did not make.
        (
            vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"proj"],
            "--checkpoint-dir proj: is not empty",
        ),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"notes.txt"], "a regular file"),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"link"], "a symbolic link"),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"/dev/null"], "a device"),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"."], "is not empty"),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"../"], "is not empty"),
        (vec![b"train", b"--steps", b"5", b"--checkpoint-dir", b"no/such/dir"], "--checkpoint-dir"),
        (
            vec![b"train", b"--checkpoint-dir", b"--no-check"],
            "a value is required for '--checkpoint-dir <DIR>'",
        ),
        (vec![b"train", b"--checkpoint-every", b"0"], "--checkpoint-every needs --checkpoint-dir"),
        (vec![b"train", b"--keep", b"2"], "--keep needs --checkpoint-dir"),
        (vec![b"train", b"--checkpoint-dir", b"new", b"--keep", b"0"], "--keep must be at least 1"),
        // Sizes checked against memory before anything is allocated.
        (vec![b"train", b"--batch", b"1000000000000"], "--max-memory"),
        (vec![b"train", b"--hidden", b"1000000000000"], "--max-memory"),
        (
            vec![b"train", b"--mesh", b"100x100", b"--batch", b"100", b"--hidden", b"100"],
            "--mesh 100x100",
        ),
        (
            vec![
                b"train",
                b"--steps-per-run",
                b"100000000",
                b"--steps",
                b"100000000",
                b"--batch",
                b"1000000",
            ],
            "--max-memory",
        ),
        (vec![b"train", b"--max-memory", b"lots"], "--max-memory"),
        (vec![b"train", b"--data-x", b"x.npy", b"--data-y", b"y_huge_class.npy"], "--classes"),
        (vec![b"train", b"--data-x", b"x.npy", b"--data-y", b"y_million.npy"], "--classes"),
        (
            vec![
                b"train",
                b"--data-x",
                b"x.npy",
                b"--data-y",
                b"y_million.npy",
                b"--classes",
                b"1000001",
                b"--batch",
                b"4",
                b"--max-memory",
                b"1G",
            ],
            "--max-memory",
        ),
        (
            vec![b"train", b"--data-x", b"x.npy", b"--data-y", b"y.npy", b"--classes", b"2"],
            "--classes",
        ),
        (vec![b"train", b"--classes", b"1"], "--classes"),
        // Inputs.
        (vec![b"place", b"\xff.json", b"--devices", b"CPU:0"], "not valid UTF-8"),
        (vec![b"train", b"--data-x", b"\xfe.npy", b"--data-y", b"y.npy"], "not valid UTF-8"),
        (vec![b"train", b"--data-x", b"/dev/zero", b"--data-y", b"y.npy"], "--data-x"),
        (vec![b"train", b"--data-x", b"x_claims_huge.npy", b"--data-y", b"y.npy"], "--data-x"),
        (vec![b"train", b"--data-x", b"x_short.npy", b"--data-y", b"y.npy"], "--data-x"),
        (vec![b"train", b"--data-x", b"x_nan.npy", b"--data-y", b"y.npy"], "NaN"),
        (vec![b"train", b"--data-x", b"x1d.npy", b"--data-y", b"y.npy"], "want [rows, features]"),
        (vec![b"train", b"--data-x", b"garbage.npy", b"--data-y", b"y.npy"], "--data-x"),
        (
            vec![
                b"train",
                b"--data-x",
                b"x.npy",
                b"--data-y",
                b"y.npy",
                b"--init",
                b"init_nan.safetensors",
                b"--batch",
                b"4",
            ],
            "NaN",
        ),
        (
            vec![
                b"train",
                b"--data-x",
                b"x.npy",
                b"--data-y",
                b"y.npy",
                b"--init",
                b"init_inf.safetensors",
                b"--batch",
                b"4",
            ],
            "inf",
        ),
        (
            vec![b"train", b"--init", b"init_nan.safetensors", b"--resume", b"proj"],
            "--init and --resume",
        ),
        (vec![b"train", b"--resume", b"proj"], "--resume"),
        (vec![b"train", b"--resume", b"/dev/null"], "--resume"),
        // Outputs checked before the first step (a billion steps would never end).
        (
            vec![b"train", b"--steps", b"100000000", b"--losses-json", b"/proc/losses.json"],
            "--losses-json",
        ),
        (vec![b"train", b"--steps", b"100000000", b"--losses-json", b"/dev/null"], "--losses-json"),
        (vec![b"train", b"--steps", b"100000000", b"--losses-json", b"proj"], "--losses-json"),
        (
            vec![b"train", b"--steps", b"100000000", b"--losses-json", b"nowhere/l.json"],
            "--losses-json",
        ),
        (vec![b"train", b"--steps", b"100000000", b"--losses-json", b""], "--losses-json"),
        (vec![b"train", b"--steps", b"100000000", b"--losses-json=proj/"], "--losses-json"),
        (vec![b"train", b"--steps", b"0"], "--steps must be at least 1"),
        // Flags and commands.
        (vec![b"train", b"-s", b"5"], "'-s'"),
        (vec![b"train", b"stray"], "'stray'"),
        (vec![b"train", b"--lr", b"-1"], "--lr"),
        (vec![b"train", b"--lr", b"inf"], "--lr"),
        (vec![b"help", b"bogus"], "no help on"),
        (vec![b"frobnicate"], "'frobnicate'"),
        (vec![b"version", b"extra"], "'extra'"),
        (
            vec![
                b"shard",
                b"--shape",
                b"8,8",
                b"--mesh",
                b"2x4",
                b"--axes",
                b"a,b",
                b"--spec",
                b"P('a','b',None)",
            ],
            "--spec",
        ),
        (
            vec![
                b"shard", b"--shape", b"8,8", b"--mesh", b"2x4", b"--axes", b"a,b", b"--spec",
                b"P('a')", b"extra",
            ],
            "extra",
        ),
        (
            vec![
                b"reshard",
                b"--shape",
                b"100000000000,100000000000",
                b"--mesh",
                b"2",
                b"--axes",
                b"a",
                b"--from",
                b"P('a')",
                b"--to",
                b"P()",
            ],
            "--shape",
        ),
        (vec![b"place", b"graph.json", b"--devices", b"CPU:0", b"--explain", b"nope"], "--explain"),
        (vec![b"place", b"/dev/zero", b"--devices", b"CPU:0"], "/dev/zero"),
        // Issue 43's hostile inputs.
        (
            vec![
                b"tokenize",
                b"--text",
                b"notes.txt",
                b"--tokenizer",
                b"bad_template.json",
                b"--seq",
                b"2",
                b"--out",
                b"o.npy",
            ],
            "--tokenizer",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2",
                b"--tokenizer",
                b"bad_template.json",
                b"--prompt",
                b"hi",
            ],
            "special token",
        ),
        (
            vec![b"train", b"--backend", b"xla", b"--pjrt-plugin", b"cut.so", b"--steps", b"1"],
            "cut short",
        ),
        (
            vec![b"train", b"--backend", b"xla", b"--pjrt-plugin", b"pipe.so", b"--steps", b"1"],
            "named pipe",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2",
                b"--prompt-ids",
                b"1",
                b"--backend",
                b"xla",
                b"--pjrt-plugin",
                b"pipe.so",
            ],
            "named pipe",
        ),
        (
            vec![b"train", b"--backend", b"xla", b"--pjrt-plugin", b"libm.so.6", b"--steps", b"1"],
            "./libm.so.6",
        ),
        (
            vec![b"train", b"--pjrt-plugin", b"cut.so", b"--steps", b"1"],
            "nothing here loads a plugin",
        ),
        (vec![b"train", b"--init", b"dup.safetensors", b"--steps", b"1"], "w1 is listed twice"),
        (vec![b"train", b"--init", b"aliased.safetensors", b"--steps", b"1"], "overlaps"),
        (
            vec![b"train", b"--checkpoint-dir", b"new", b"--checkpoint-every", b"0"],
            "--checkpoint-every must be at least 1",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2",
                b"--prompt-ids",
                b"1",
                b"--seed",
                b"-1",
            ],
            "'--seed <S>'",
        ),
        (
            vec![
                b"train",
                b"--model",
                b"gpt2",
                b"--init",
                b"gpt2",
                b"--text",
                b"notes.txt",
                b"--tokenizer",
                b"bad_template.json",
                b"--steps",
                b"1",
            ],
            "--tokenizer",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2",
                b"--tokenizer",
                b"gpt2/tokenizer.json",
                b"--prompt",
                b"",
            ],
            "--prompt: it encodes to no tokens",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2_badgen",
                b"--prompt-ids",
                b"1",
            ],
            "eos_token_id is 2.5",
        ),
        (
            vec![
                b"generate",
                b"--max-new-tokens",
                b"2",
                b"--init",
                b"gpt2_pipegen",
                b"--prompt-ids",
                b"1",
            ],
            "named pipe",
        ),
        (vec![b"train", b"--clip-norm", b"-1e300"], "-1e300"),
    ];
    let before = snapshot(&dir);
    for (args, says) in &cases {
        let shown: Vec<String> =
            args.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let out = run_in(&dir, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{shown:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{shown:?}: want one line, got {err}");
        assert!(err.len() < 400, "{shown:?}: a line of {} characters: {err}", err.len());
        assert!(err.starts_with("meshwork: error: "), "{shown:?}: {err}");
        assert!(err.contains(says), "{shown:?}: want {says:?} in {err}");
        assert!(!err.contains("panicked"), "{shown:?}: {err}");
        assert_eq!(snapshot(&dir), before, "{shown:?} changed a file");
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    // A sharding spec of 50 KB is not echoed whole.
    let spec = format!("P({})", vec!["'a'"; 12_000].join(","));
    let out = run_in(
        &dir,
        &[
            b"shard",
            b"--shape",
            b"8,8",
            b"--mesh",
            b"2x4",
            b"--axes",
            b"a,b",
            b"--spec",
            spec.as_bytes(),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.lines().count() == 1 && err.len() < 400, "{} characters: {err}", err.len());
    // Every command has help, tokenize too.
    for command in ["train", "inspect", "generate", "tokenize", "shard", "reshard", "place"] {
        let out = run_in(&dir, &[b"help", command.as_bytes()]);
        assert!(out.status.success(), "help {command}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("--"), "help {command}");
    }
}

/// A reader that closes the pipe ends the command quietly (exit 0, as `ls | head`);
/// a full device is one line and exit 2. Never a panic.
#[test]
fn closed_or_full_output_never_panics() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    for args in [
        &["train", "--steps", "5", "--no-check"][..],
        &["help"],
        &["--version"],
        &["train", "--help"],
    ] {
        // Closed before anything is read.
        let mut child = Command::new(BIN)
            .current_dir(&dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?} | (closed): {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // A full device.
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = Command::new(BIN).current_dir(&dir).args(args).stdout(full).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} > /dev/full: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.contains("cannot write to standard output"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let out = run_in(&dir, &[b"--version"]);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("meshwork "));
}

/// A loss that is not finite stops the run at once with exit 1 and a line naming the
/// step; the losses file holds the steps made (`null` for the one that is not finite).
#[test]
fn a_diverging_run_exits_1_naming_the_step() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    let out = run_in(
        &dir,
        &[b"train", b"--lr", b"1e308", b"--steps", b"50", b"--losses-json", b"l.json"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap();
    assert!(last.starts_with("meshwork: error: step 2: the loss is NaN"), "{err}");
    let written: Vec<Option<f64>> =
        serde_json::from_slice(&std::fs::read(dir.join("l.json")).unwrap()).unwrap();
    assert!(written.len() == 2 && written[1].is_none(), "{written:?}");
}

/// Starts a long training run; returns it once it is training (its first progress
/// line is out) and has had a moment to make steps.
fn start_long_run(dir: &Path, extra: &[&str]) -> std::process::Child {
    let mut child = Command::new(BIN)
        .current_dir(dir)
        .args(
            [&["train", "--steps", "1000000", "--no-check"][..], extra].concat().into_iter().chain(
                // Ten steps a host call unless the caller says.
                (!extra.contains(&"--steps-per-run"))
                    .then_some(["--steps-per-run", "10"])
                    .into_iter()
                    .flatten(),
            ),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("step ") && first.contains("/1000000 loss "), "{first}");
    std::thread::spawn(move || for _ in lines {});
    std::thread::sleep(std::time::Duration::from_millis(1500));
    child
}

fn signal(child: &std::process::Child, name: &str) {
    let ok =
        Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

/// SIGINT finishes the current host call, saves a checkpoint, writes the losses of the
/// steps made, prints the summary and exits 130; the run then resumes from there. While
/// it runs, a second run on the same checkpoint directory is refused (its lock).
#[test]
fn sigint_saves_writes_the_losses_and_exits_130() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    let child = start_long_run(&dir, &["--checkpoint-dir", "ck", "--losses-json", "l.json"]);
    // A second run on the same directory: refused at once.
    let second = run_in(&dir, &[b"train", b"--steps", b"5", b"--checkpoint-dir", b"ck"]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(err.contains("another meshwork run"), "{err}");
    signal(&child, "INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stopped      by a signal"), "{stdout}");
    let losses: Vec<f64> =
        serde_json::from_slice(&std::fs::read(dir.join("l.json")).unwrap()).unwrap();
    let made = losses.len();
    assert!(made >= 10 && made.is_multiple_of(10), "{made} steps");
    let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{made:08}"));
    // Resume continues from there, into the same losses file.
    let out = run_in(
        &dir,
        &[
            b"train",
            b"--resume",
            b"ck",
            b"--checkpoint-dir",
            b"ck",
            b"--steps",
            format!("{}", made + 5).as_bytes(),
            b"--no-check",
            b"--losses-json",
            b"l.json",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: Vec<f64> =
        serde_json::from_slice(&std::fs::read(dir.join("l.json")).unwrap()).unwrap();
    assert_eq!(all.len(), made + 5);
    assert_eq!(all[..made], losses[..]);
    // SIGTERM does the same.
    let child = start_long_run(&dir, &["--checkpoint-dir", "ck2"]);
    signal(&child, "TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    assert!(dir.join("ck2/latest").exists());
}

/// kill -9 at any instant of a run that saves every step leaves a checkpoint and a
/// losses file that agree: the losses are written before the step is saved, so a
/// resume always finds the saved step's losses (it takes those, and trains the rest
/// again). A temporary the kill left beside the losses file is removed by the next
/// run.
#[test]
fn kill_9_mid_save_leaves_losses_a_resume_accepts() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    let args: &[&str] = &[
        "--checkpoint-dir",
        "ck",
        "--losses-json",
        "l.json",
        "--checkpoint-every",
        "1",
        "--steps-per-run",
        "1",
    ];
    for kill in 0..8u64 {
        let resume: &[&str] = if kill == 0 { &[] } else { &["--resume", "ck"] };
        let child = start_long_run(&dir, &[args, resume].concat());
        std::thread::sleep(std::time::Duration::from_millis(23 * kill * kill));
        signal(&child, "KILL");
        let _ = child.wait_with_output().unwrap();
        let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
        let saved: usize = latest.trim().trim_start_matches("step-").parse().unwrap();
        let losses: Vec<Option<f64>> =
            serde_json::from_slice(&std::fs::read(dir.join("l.json")).unwrap()).unwrap();
        assert!(losses.len() >= saved, "kill {kill}: {} losses, step {saved} saved", losses.len());
    }
    let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
    let saved: usize = latest.trim().trim_start_matches("step-").parse().unwrap();
    // A temporary of a process that no longer runs, as a kill leaves it.
    std::fs::write(dir.join(".l.json.meshwork-tmp-4194999-00000000000000aa-0"), b"[").unwrap();
    let steps = (saved + 2).to_string();
    let out = run_in(
        &dir,
        &[
            b"train",
            b"--resume",
            b"ck",
            b"--checkpoint-dir",
            b"ck",
            b"--steps",
            steps.as_bytes(),
            b"--no-check",
            b"--losses-json",
            b"l.json",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: Vec<Option<f64>> =
        serde_json::from_slice(&std::fs::read(dir.join("l.json")).unwrap()).unwrap();
    assert_eq!(all.len(), saved + 2);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("meshwork-tmp"))
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
}

/// A checkpoint that cannot be saved mid-run (here a file-size limit, as a full disk
/// would) ends the run with exit 1 and one line naming `--checkpoint-dir` and the step —
/// not a temporary path — and leaves no incomplete step behind.
#[test]
fn a_failed_save_names_the_checkpoint_directory_and_the_step() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    let script = format!(
        "trap '' XFSZ; ulimit -f 8; exec {BIN} train --steps 4 --hidden 256 --no-check --checkpoint-dir ck"
    );
    let out = Command::new("sh").arg("-c").arg(&script).current_dir(&dir).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap();
    assert!(last.starts_with("meshwork: error: --checkpoint-dir ck: cannot save step 4:"), "{err}");
    assert!(!last.contains(".partial"), "{err}");
    let names: Vec<String> = std::fs::read_dir(dir.join("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
}

/// A reader that closes the pipe stops a long run (after its host call, as a signal
/// would) and the command ends quietly with status 0, instead of training to the end.
#[test]
fn a_closed_pipe_stops_a_long_run() {
    let tmp = scratch();
    let started = std::time::Instant::now();
    let mut child = Command::new(BIN)
        .current_dir(tmp.path())
        .args(["train", "--steps", "10000000", "--no-check", "--losses-json", "l.json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "it trained on");
    let losses: Vec<f64> =
        serde_json::from_slice(&std::fs::read(tmp.path().join("l.json")).unwrap()).unwrap();
    assert!(!losses.is_empty() && losses.len() < 10_000_000, "{} losses", losses.len());
}
