//! `meshwork shard`, `reshard` and `place` end to end: index maps for every rank, the
//! reshard totals against the array, stray arguments, oversize shapes and meshes,
//! unreadable graph files, and a closed or full standard output — every error one line
//! naming the flag, status 2, never a panic.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// No case here should take more than a few seconds; a hang (an unbounded read, a
/// quadratic plan over a million devices) fails instead of stalling the suite.
const DEADLINE: Duration = Duration::from_secs(60);

fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_meshwork"));
    c.args(args).stdin(Stdio::null());
    c
}

/// Waits for `child` (its pipes drained on threads), killing it past [`DEADLINE`].
fn finish(mut child: Child, what: &str) -> Output {
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{what}: still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output { status, stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}

fn meshwork(args: &[&str]) -> Output {
    let child = command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    finish(child, &format!("{args:?}"))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Succeeds with nothing on stderr, and returns stdout.
fn ok(args: &[&str]) -> String {
    let out = meshwork(args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    assert!(out.stderr.is_empty(), "{args:?}: {}", stderr(&out));
    stdout(&out)
}

/// The error line of `out`: status 2, exactly one line on stderr, no panic, nothing on
/// stdout.
fn one_error(out: &Output, what: &str) -> String {
    let err = stderr(out);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_eq!(out.status.code(), Some(2), "{what}: {err}");
    assert!(err.ends_with('\n') && err.matches('\n').count() == 1, "{what}: not one line: {err:?}");
    assert!(err.starts_with("meshwork: error: "), "{what}: {err}");
    assert!(out.stdout.is_empty(), "{what}: printed {:?}", stdout(out));
    err.trim_end().to_string()
}

/// Fails with one line that contains every one of `needles`.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let line = one_error(&meshwork(args), &format!("{args:?}"));
    for n in needles {
        assert!(line.contains(n), "{args:?}: {line:?} lacks {n:?}");
    }
    line
}

/// A temporary directory, removed when the test ends (failing too).
fn temp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn graph() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/graph.json").to_str().unwrap().to_string()
}

fn with_mesh<'a>(command: &'a str, shape: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![command, "--mesh", "2x4", "--axes", "a,b", "--shape", shape];
    v.extend(rest);
    v
}

#[test]
fn shard_prints_the_index_map_for_every_rank() {
    // Rank 3: no picture, but the shard shape, the XLA text and every device's block.
    let text = ok(&with_mesh("shard", "8,8,2", &["--spec", "P('a','b')"]));
    assert!(text.contains("no picture for rank 3"), "{text}");
    assert!(!text.contains('┌'), "{text}");
    assert!(text.contains("shard shape: [4, 2, 2] of [8, 8, 2]"), "{text}");
    assert!(text.contains("XLA sharding: {devices=[2,4,1]<=[8]}"), "{text}");
    for d in 0..8 {
        let (a, b) = (d / 4, d % 4);
        let line =
            format!("  device {d}: [{}:{}, {}:{}, 0:2]\n", 4 * a, 4 * a + 4, 2 * b, 2 * b + 2);
        assert!(text.contains(&line), "{line:?} missing from\n{text}");
    }
    assert!(!text.contains("replica"), "nothing is replicated:\n{text}");

    // Replicated over 'b': each block has four holders, numbered by replica id.
    let text = ok(&with_mesh("shard", "8,8,2", &["--spec", "P('a')"]));
    assert!(text.contains("shard shape: [4, 8, 2] of [8, 8, 2]"), "{text}");
    for d in 0..8 {
        let a = d / 4;
        let line =
            format!("  device {d}: [{}:{}, 0:8, 0:2] (replica {})\n", 4 * a, 4 * a + 4, d % 4);
        assert!(text.contains(&line), "{line:?} missing from\n{text}");
    }

    // Rank 4, through an XLA sharding.
    let text = ok(&with_mesh("shard", "2,4,6,8", &["--spec", "{devices=[1,2,1,4]<=[8]}"]));
    assert!(text.contains("shard shape: [2, 2, 6, 2] of [2, 4, 6, 8]"), "{text}");
    assert!(text.contains("  device 7: [0:2, 2:4, 0:6, 6:8]\n"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("  device ")).count(), 8, "{text}");

    // Rank 1 and 2 still draw the picture, and list the index map too.
    let text = ok(&with_mesh("shard", "8,8", &["--spec", "P('a','b')"]));
    assert!(text.contains('┌') && text.contains("[4:8, 6:8]"), "{text}");
    assert!(text.contains("shard shape: [4, 2] of [8, 8]"), "{text}");
    assert!(text.contains("  device 7: [4:8, 6:8]\n"), "{text}");
    let text = ok(&with_mesh("shard", "16", &["--spec", "P(('a','b'))"]));
    assert!(text.contains('┌') && text.contains("  device 5: [10:12]\n"), "{text}");
}

#[test]
fn a_spec_longer_than_the_rank_blames_spec() {
    let line = refused(&with_mesh("shard", "8,8", &["--spec", "P('a','b',None)"]), &["--spec"]);
    assert!(line.contains("3 entries") && line.contains("rank 2"), "{line}");
    refused(
        &with_mesh("reshard", "8,8", &["--from", "P('a')", "--to", "P(None,'b',None)"]),
        &["--to", "3 entries"],
    );
    refused(
        &with_mesh("reshard", "8", &["--from", "P('a','b')", "--to", "P('a')"]),
        &["--from", "2 entries"],
    );
}

#[test]
fn stray_positional_arguments_are_refused() {
    refused(
        &with_mesh("shard", "8,8", &["--spec", "P('a','b')", "extra"]),
        &["'extra'", "meshwork help shard"],
    );
    refused(&with_mesh("shard", "8,8", &["stray", "--spec", "P('a')"]), &["'stray'"]);
    refused(
        &with_mesh("reshard", "8,8", &["--from", "P('a')", "--to", "P('b')", "more"]),
        &["'more'", "meshwork help reshard"],
    );
    let g = graph();
    refused(&["place", &g, "second.json", "--devices", "CPU:0"], &["'second.json'"]);
    refused(&["place", "--devices", "CPU:0"], &["GRAPH.json", "help place"]);
}

#[test]
fn missing_flags_point_at_their_own_commands_help() {
    refused(
        &with_mesh("reshard", "8,8", &["--from", "P('a')"]),
        &["--to", "meshwork help reshard"],
    );
    refused(&with_mesh("shard", "8,8", &[]), &["--spec", "meshwork help shard"]);
}

#[test]
fn reshard_counts_against_the_arrays_total() {
    // Source and target alike: nothing moves, and the totals are the array's 64
    // elements (256 bytes of f32), not the 256 elements the replicated shards hold.
    let text = ok(&with_mesh("reshard", "8,8", &["--from", "P('a')", "--to", "P('a')"]));
    assert!(text.contains("  array          64 elements, 256 bytes\n"), "{text}");
    assert!(
        text.contains(
            "  moved          0 of 64 elements (0.0%), 0 of 256 bytes, against the array's total"
        ),
        "{text}"
    );
    assert!(text.contains("each device keeps what it holds"), "{text}");
    assert!(
        text.contains(
            "  target shards  256 elements, 1024 bytes on 8 devices (the array 4 times over)"
        ),
        "{text}"
    );
    assert!(!text.contains("of 256 elements") && !text.contains("of 1024 bytes"), "{text}");

    // A transpose of the tiling moves three quarters of the array.
    let text = ok(&with_mesh("reshard", "8,8", &["--from", "P('a','b')", "--to", "P('b','a')"]));
    assert!(text.contains("moved          48 of 64 elements (75.0%), 192 of 256 bytes"), "{text}");
    assert!(!text.contains("keeps what it holds"), "{text}");

    // Replicating a tiled array sends each device the seven eighths it lacks: 7x the
    // array, in f64 bytes.
    let text = ok(&with_mesh(
        "reshard",
        "8,8",
        &["--from", "P('a','b')", "--to", "P()", "--dtype", "f64"],
    ));
    assert!(text.contains("  array          64 elements, 512 bytes\n"), "{text}");
    assert!(
        text.contains("moved          448 of 64 elements (700.0%), 3584 of 512 bytes"),
        "{text}"
    );
}

#[test]
fn oversize_shapes_blame_shape_before_anything_is_built() {
    for (command, rest) in [
        ("reshard", &["--from", "P('a')", "--to", "P('b')"][..]),
        ("reshard", &["--from", "P('a')", "--to", "P('b')", "--dtype", "f64"][..]),
        ("shard", &["--spec", "P('a','b')"][..]),
    ] {
        for shape in
            ["100000000,100000000", "100000000,100000000,1000", "100000000,100000000,100000"]
        {
            let args = with_mesh(command, shape, rest);
            let line = refused(&args, &["--shape"]);
            for other in ["--to", "--from", "--spec", "--dtype"] {
                assert!(!line.contains(other), "{args:?}: {line}");
            }
        }
    }
    // The largest array taken plans without allocating per element.
    let text = ok(&with_mesh(
        "reshard",
        "65536,65536,65536",
        &["--from", "P('a')", "--to", "P('b')", "--dtype", "f64"],
    ));
    assert!(
        text.contains("moved          281474976710656 of 281474976710656 elements (100.0%)"),
        "{text}"
    );
    // One element more is refused.
    refused(&with_mesh("shard", "65536,65536,65537", &["--spec", "P('a')"]), &["--shape", "2^48"]);
}

#[test]
fn oversize_meshes_are_refused_not_planned_for_ever() {
    refused(
        &["reshard", "--shape", "1024,1024", "--mesh", "1024x1024", "--axes", "a,b"]
            .into_iter()
            .chain(["--from", "P('a','b')", "--to", "P('b','a')"])
            .collect::<Vec<_>>(),
        &["--mesh", "8192"],
    );
    refused(
        &["shard", "--shape", "8,8", "--mesh", "4096x4096", "--axes", "a,b", "--spec", "P('a')"],
        &["--mesh"],
    );
    refused(
        &["shard", "--mesh", "2x4", "--axes", "a,a", "--shape", "8", "--spec", "P()"],
        &["--axes"],
    );
}

#[test]
fn place_explain_of_a_missing_node_names_the_node() {
    let g = graph();
    let out = meshwork(&[
        "place",
        &g,
        "--devices",
        "CPU:0,CPU:1,XLA_CPU:0",
        "--soft",
        "--explain",
        "nope",
    ]);
    let line = one_error(&out, "--explain nope");
    assert_eq!(line, format!("meshwork: error: --explain: no node \"nope\" in {g}"));
    // Looked for in the graph before the op catalog is needed (this one has none).
    let tmp = temp();
    let dir = tmp.path();
    let bare = dir.join("bare.json");
    std::fs::write(&bare, br#"{"nodes": []}"#).unwrap();
    let bare = bare.to_str().unwrap();
    let out = meshwork(&["place", bare, "--devices", "CPU:0", "--explain", "nope"]);
    let line = one_error(&out, "--explain nope, no catalog");
    assert_eq!(line, format!("meshwork: error: --explain: no node \"nope\" in {bare}"));
    // An existing node is still explained.
    let text =
        ok(&["place", &g, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft", "--explain", "log"]);
    assert!(text.contains("constraint: log requests '/device:XLA_CPU:0'"), "{text}");
}

#[test]
fn unreadable_graph_files_are_one_line_and_read_no_more_than_the_cap() {
    let tmp = temp();
    let dir = tmp.path();
    let d = |name: &str| dir.join(name).to_str().unwrap().to_string();
    fn place(path: &str) -> Vec<&str> {
        vec!["place", path, "--devices", "CPU:0"]
    }
    let missing = d("missing.json");
    refused(&place(&missing), &["GRAPH.json", &missing, "cannot read"]);
    let dir_path = dir.to_str().unwrap().to_string();
    refused(&place(&dir_path), &["GRAPH.json", "is a directory"]);
    // An endless device, and a FIFO: refused at once (never read, never waited on).
    let fifo = d("fifo.json");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    refused(&place(&fifo), &["GRAPH.json", "a named pipe"]);
    refused(&place("/dev/zero"), &["GRAPH.json", "/dev/zero", "a device, not a regular file"]);
    // A regular file over the cap is refused from its size, unread (sparse here).
    let big = d("big.json");
    std::fs::File::create(&big).unwrap().set_len((64 << 20) + 1).unwrap();
    refused(&place(&big), &["GRAPH.json", "64 MiB"]);
    let latin1 = d("latin1.json");
    std::fs::write(&latin1, b"{\"nodes\": [\xe9]}").unwrap();
    refused(&place(&latin1), &["GRAPH.json", "UTF-8"]);
    // The op catalog is read the same way, and blamed on --ops.
    let g = graph();
    refused(&["place", &g, "--devices", "CPU:0", "--ops", &missing], &["--ops", "cannot read"]);
    refused(&["place", &g, "--devices", "CPU:0", "--ops", "/dev/zero"], &["--ops", "a device"]);
}

#[test]
fn errors_that_span_lines_are_joined_into_one() {
    // The parser quotes its input, newline and all.
    refused(&with_mesh("shard", "8,8", &["--spec", "P('a'\n'b')"]), &["--spec", "cannot parse"]);
    refused(&with_mesh("shard", "8,8", &["--spec", "P('a\n')"]), &["--spec"]);
    refused(
        &with_mesh(
            "reshard",
            "8,8",
            &["--from", "P('a')", "--to", "{devices=[2,4]\r\n<=[8] bogus}"],
        ),
        &["--to"],
    );
    let tmp = temp();
    let dir = tmp.path();
    let path = dir.join("two\nlines.json");
    refused(&["place", path.to_str().unwrap(), "--devices", "CPU:0"], &["GRAPH.json"]);
}

/// Runs with standard output closed by its reader after `keep` lines.
fn closed_after(args: &[&str], keep: usize) -> Output {
    let mut child = command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let pipe = child.stdout.take().unwrap();
    let mut lines = BufReader::new(pipe).lines();
    for _ in 0..keep {
        lines.next().unwrap().unwrap();
    }
    drop(lines); // the read end goes
    finish(child, &format!("{args:?}"))
}

fn assert_quiet_success(out: &Output, what: &str) {
    let err = stderr(out);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_eq!(out.status.code(), Some(0), "{what}: {err}");
    assert!(err.is_empty(), "{what}: {err}");
}

#[test]
fn a_closed_pipe_ends_quietly() {
    // Each output is far larger than a pipe holds, so the command is certainly still
    // writing when its reader goes.
    let picture = ["shard", "--shape", "4096", "--mesh", "4096", "--axes", "a", "--spec", "P('a')"];
    assert_quiet_success(&closed_after(&picture, 0), "picture, closed at once");
    assert_quiet_success(&closed_after(&picture, 1), "picture, closed after a line");
    let map =
        ["shard", "--shape", "64,64,2", "--mesh", "64x64", "--axes", "a,b", "--spec", "P('a','b')"];
    assert_quiet_success(&closed_after(&map, 3), "index map, closed after three lines");

    // A graph of 3000 nodes: its placement table and its dot file overflow the pipe too.
    let tmp = temp();
    let dir = tmp.path();
    let nodes: Vec<String> = (0..3000)
        .map(|i| format!(r#"{{"name": "node{i:05}", "op": "Const", "inputs": []}}"#))
        .collect();
    let catalog =
        r#"{"Const": {"inputs": [], "outputs": ["float"], "supported_device_types": ["CPU"]}}"#;
    let path = dir.join("big.json");
    std::fs::write(
        &path,
        format!(r#"{{"nodes": [{}], "op_catalog": {catalog}}}"#, nodes.join(",")),
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let table = ok(&["place", p, "--devices", "CPU:0"]);
    assert!(table.len() > 128 << 10 && table.contains("node02999  Const"), "{}", table.len());
    assert_quiet_success(&closed_after(&["place", p, "--devices", "CPU:0"], 1), "place");
    assert_quiet_success(&closed_after(&["place", p, "--devices", "CPU:0", "--dot"], 1), "dot");

    // Short outputs: the reader is usually gone before the first write.
    assert_quiet_success(
        &closed_after(&with_mesh("reshard", "8,8", &["--from", "P('a')", "--to", "P('b')"]), 0),
        "reshard",
    );
    assert_quiet_success(
        &closed_after(&with_mesh("shard", "8,8,8", &["--spec", "P('a')"]), 0),
        "shard",
    );
}

#[test]
fn a_full_disk_is_one_line_and_status_2() {
    let g = graph();
    let cases: Vec<Vec<&str>> = vec![
        with_mesh("shard", "8,8", &["--spec", "P('a','b')"]),
        with_mesh("shard", "8,8,2", &["--spec", "P('a')"]),
        with_mesh("reshard", "8,8", &["--from", "P('a')", "--to", "P('b')"]),
        vec!["place", &g, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft"],
        vec!["place", &g, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft", "--dot"],
        vec!["place", &g, "--devices", "CPU:0,CPU:1,XLA_CPU:0", "--soft", "--explain", "log"],
    ];
    for args in cases {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let child = command(&args).stdout(full).stderr(Stdio::piped()).spawn().unwrap();
        let out = finish(child, &format!("{args:?}"));
        let line = one_error(&out, &format!("{args:?} > /dev/full"));
        assert!(line.contains("standard output"), "{args:?}: {line}");
    }
}

#[test]
fn help_describes_the_index_map_the_totals_and_the_limits() {
    let page = |topic: &str| {
        let text = ok(&["help", topic]);
        assert_eq!(ok(&[topic, "--help"]), text);
        text
    };
    let shard = page("shard");
    assert!(shard.contains("index map") && shard.contains("rank 3"), "{shard}");
    let reshard = page("reshard");
    assert!(reshard.contains("against the array's total"), "{reshard}");
    for text in [&shard, &reshard] {
        assert!(text.contains("2^48 elements") && text.contains("8192"), "{text}");
    }
    let place = page("place");
    assert!(place.contains("64 MiB") && place.contains("op_catalog"), "{place}");
}

/// `inspect --json` runs 3 steps of any model and prints one JSON object of what the
/// runtime measured; without `--json` a pipeline or XLA's partitioner is refused.
#[test]
fn inspect_json_prints_what_three_steps_measured() {
    let out = meshwork(&["inspect", "--model", "mlp", "--mesh", "2x1", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["steps"], 3);
    assert_eq!(json["devices"].as_array().unwrap().len(), 2);
    let per_step = &json["per_step"];
    // Each of the 2 devices gets half the batch and the two scalars.
    let batch = per_step["batch_bytes"].as_u64().unwrap();
    assert_eq!(per_step["host_to_device_bytes"].as_u64().unwrap(), batch + 2 * 8, "{json}");
    // The MLP on 2x1: the gradients all-reduced over `data` each step.
    assert!(per_step["collective_bytes"].as_u64().unwrap() > 0, "{json}");
    let out = meshwork(&["inspect", "--model", "transformer", "--stages", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--stages and --microbatches need --json"), "{}", stderr(&out));
}
