//! `cargo xtask mpi-test`: the executor's MPI check, 2 processes × 2 devices under
//! `mpirun` on loopback, the strategy over 2 processes, training on 2 processes × 2
//! XLA CPU devices (the pinned plugin, fetched unless `MESHWORK_PJRT_PLUGIN` names
//! one), a candle model through the bridge over 2 processes, the two ways a
//! process can die without hanging the job, and the `meshwork` binary built with
//! `--features mpi` under `mpirun` (`binary_checks`): losses equal to one process's,
//! checkpoints across process counts, a bad input on one rank, `kill -9` of a rank
//! and SIGTERM.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, cargo, run, workspace_root};

/// Open MPI's launcher, kept on loopback and shared memory, allowed to run as root
/// (CI does) and to put 2 processes on fewer cores.
fn mpirun(args: &[&str]) -> Command {
    mpirun_n(2, args)
}

/// [`mpirun`] of `n` processes.
fn mpirun_n(n: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    let n = n.to_string();
    cmd.args(["--oversubscribe", "-np", n.as_str()])
        .args(["--mca", "btl", "self,vader"])
        .args(["--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .current_dir(workspace_root());
    cmd
}

/// Runs `cmd` for at most `limit`: its exit success, elapsed time and output.
fn run_for(cmd: &mut Command, limit: Duration) -> Result<(bool, Duration, String)> {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?} (is openmpi-bin installed?): {e}"))?;
    loop {
        if let Some(_status) = child.try_wait().map_err(|e| e.to_string())? {
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            return Ok((out.status.success(), start.elapsed(), text));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{cmd:?} still ran after {limit:?}: a hang"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn mpi_test() -> Result {
    // Everything the checks run, in one build: the crates compiled once with MPI,
    // both cores busy throughout.
    cargo(&[
        "build",
        "-p",
        "meshwork-executor",
        "-p",
        "meshwork-strategy",
        "-p",
        "meshwork-candle",
        "-p",
        "meshwork-cli",
        "--features",
        "meshwork-executor/mpi,meshwork-strategy/mpi,meshwork-candle/mpi,meshwork-cli/mpi",
        "--example",
        "mpi_check",
        "--example",
        "mpi_strategy",
        "--example",
        "mpi_xla",
        "--example",
        "mpi_candle",
        "--bin",
        "meshwork",
    ])?;
    let exe = "target/debug/examples/mpi_check";

    let (ok, took, out) = run_for(&mut mpirun(&[exe]), Duration::from_secs(120))?;
    print!("{out}");
    if !ok {
        return Err(format!("the 2-process check failed after {took:.1?}"));
    }
    println!("mpi-test: 2 processes x 2 devices equal 4 local devices ({took:.1?})");

    // A checkpoint directory of this run's own (a checkpoint never replaces one).
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let ckpt =
        std::env::temp_dir().join(format!("meshwork-mpi-strategy-{}-{stamp}", std::process::id()));
    let ckpt_arg = ckpt.to_string_lossy().into_owned();
    let result = run_for(
        &mut mpirun(&["target/debug/examples/mpi_strategy", &ckpt_arg]),
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&ckpt);
    let (ok, took, out) = result?;
    print!("{out}");
    if !ok {
        return Err(format!("the 2-process strategy check failed after {took:.1?}"));
    }
    println!("mpi-test: a strategy over 2 processes trains like one process ({took:.1?})");

    let plugin = crate::xla::plugin()?;
    let ckpt =
        std::env::temp_dir().join(format!("meshwork-mpi-xla-{}-{stamp}", std::process::id()));
    let ckpt_arg = ckpt.to_string_lossy().into_owned();
    let mut cmd = mpirun(&["target/debug/examples/mpi_xla", &ckpt_arg]);
    cmd.env("MESHWORK_PJRT_PLUGIN", &plugin).env("TF_CPP_MIN_LOG_LEVEL", "2");
    let result = run_for(&mut cmd, Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&ckpt);
    let (ok, took, out) = result?;
    print!("{out}");
    if !ok {
        return Err(format!("the 2-process XLA check failed after {took:.1?}"));
    }
    println!(
        "mpi-test: 2 processes x 2 XLA devices (collectives over MPI) train like 4 local ones ({took:.1?})"
    );

    let (ok, took, out) =
        run_for(&mut mpirun(&["target/debug/examples/mpi_candle"]), Duration::from_secs(120))?;
    print!("{out}");
    if !ok {
        return Err(format!("the 2-process candle check failed after {took:.1?}"));
    }
    println!(
        "mpi-test: a candle model with DDP and FSDP on 2 processes x 2 devices trains as on 4 local devices ({took:.1?})"
    );

    for (mode, says) in [
        ("panic", "a panic ends this process; aborting the MPI job"),
        ("absent", "for the other processes at a collective; aborting the MPI job"),
    ] {
        let (ok, took, out) = run_for(&mut mpirun(&[exe, mode]), Duration::from_secs(60))?;
        if ok || !out.contains(says) || took > Duration::from_secs(30) {
            return Err(format!(
                "mode {mode}: want the job aborted with \"{says}\" within 30 s; got success={ok} \
                 after {took:.1?}:\n{out}"
            ));
        }
        println!("mpi-test: {mode}: the job was aborted after {took:.1?}, as it must be");
    }
    binary_checks(&plugin)
}

/// A directory of this run's own under the temporary directory (removed on drop).
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(what: &str) -> Result<Scratch> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("meshwork-{what}-{}-{stamp}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Scratch(dir))
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The losses a run wrote (every one finite).
fn losses(path: &str) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let text = text.trim().trim_start_matches('[').trim_end_matches(']');
    text.split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("{path}: {x:?}: {e}")))
        .collect()
}

/// Whether `got` equals `want` within `rel` at every step.
fn same_losses(got: &[f64], want: &[f64], rel: f64) -> bool {
    got.len() == want.len()
        && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= rel * b.abs().max(1e-300))
}

/// The pid of the `meshwork` process that is rank `rank` of a running job.
fn rank_pid(rank: usize) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        (comm.trim() == "meshwork" && env.split(|&b| b == 0).any(|v| v == want.as_bytes()))
            .then_some(pid)
    })
}

/// `meshwork train` built with `--features mpi`, under `mpirun`: JAX's reference
/// transformer run on `2x1` and `2x2` over 2 and 4 ranks (interpreter and XLA-CPU)
/// and the GPT-2 case from its Hugging Face folder and text on `4x1` over 2 ranks,
/// each equal (1e-9 relative, every step) to one process of the same binary; a
/// checkpoint saved by 4 ranks (written by each, its index says) resumed in one
/// process, and one saved in one process resumed on 2 ranks; a file missing on one
/// rank refused by every rank with that rank's one line and exit 2; `kill -9` of a
/// rank mid-run ending the job within 60 s, its latest step complete and resumable;
/// SIGTERM to the ranks saving once and exiting 130.
fn binary_checks(plugin: &std::path::Path) -> Result {
    let exe = workspace_root().join("target/debug/meshwork");
    let exe = exe.to_string_lossy().into_owned();
    let root = workspace_root();
    let nn = |f: &str| root.join("nn/testdata").join(f).to_string_lossy().into_owned();
    let gpt2 = |f: &str| root.join("train/testdata/gpt2").join(f).to_string_lossy().into_owned();
    let scratch = Scratch::new("mpi-train")?;
    let (tokens, init) = (nn("tokens.npy"), nn("init.safetensors"));
    let jax: Vec<String> = [
        "train",
        "--model",
        "transformer",
        "--data-tokens",
        &tokens,
        "--init",
        &init,
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
        "--quiet",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let (model, text, tokenizer) = (gpt2("model"), gpt2("corpus.txt"), gpt2("tokenizer.json"));
    let gpt: Vec<String> = [
        "train",
        "--model",
        "gpt2",
        "--init",
        &model,
        "--text",
        &text,
        "--tokenizer",
        &tokenizer,
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
        "--quiet",
        "--cache-dir",
        &scratch.path("cache"),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let plugin = plugin.to_string_lossy().into_owned();
    let run_one = |args: &[String], extra: &[&str]| -> Result<(bool, String)> {
        let mut cmd = Command::new(&exe);
        cmd.args(args).args(extra).env("MESHWORK_PJRT_PLUGIN", &plugin);
        let (ok, _, out) = run_for(&mut cmd, Duration::from_secs(300))?;
        Ok((ok, out))
    };
    let run_job = |n: usize, args: &[String], extra: &[&str]| -> Result<(bool, Duration, String)> {
        let mut all: Vec<&str> = vec![exe.as_str()];
        all.extend(args.iter().map(String::as_str));
        all.extend(extra);
        let mut cmd = mpirun_n(n, &all);
        cmd.env("MESHWORK_PJRT_PLUGIN", &plugin);
        run_for(&mut cmd, Duration::from_secs(300))
    };
    // (what, arguments, ranks, mesh, more flags)
    type Case<'a> = (&'a str, &'a [String], usize, &'a str, &'a [&'a str]);
    let cases: [Case<'_>; 6] = [
        ("JAX's transformer case", &jax, 2, "2x1", &["--steps", "20"]),
        ("JAX's transformer case", &jax, 2, "2x2", &["--steps", "20"]),
        ("JAX's transformer case", &jax, 4, "2x2", &["--steps", "20"]),
        ("JAX's transformer case on XLA", &jax, 2, "2x2", &["--steps", "20", "--backend", "xla"]),
        ("JAX's transformer case on XLA", &jax, 4, "2x2", &["--steps", "20", "--backend", "xla"]),
        ("the GPT-2 case", &gpt, 2, "4x1", &[]),
    ];
    for (k, (what, args, n, mesh, extra)) in cases.into_iter().enumerate() {
        let one = scratch.path(&format!("one-{k}.json"));
        let many = scratch.path(&format!("many-{k}.json"));
        let mut flags = vec!["--mesh", mesh];
        flags.extend(extra);
        let (ok, out) = run_one(args, &[&flags[..], &["--losses-json", &one]].concat())?;
        if !ok {
            return Err(format!("{what} on {mesh} in one process failed:\n{out}"));
        }
        let (ok, took, out) = run_job(n, args, &[&flags[..], &["--losses-json", &many]].concat())?;
        if !ok {
            return Err(format!("{what} on {mesh} over {n} ranks failed after {took:.1?}:\n{out}"));
        }
        let (want, got) = (losses(&one)?, losses(&many)?);
        if !same_losses(&got, &want, 1e-9) {
            return Err(format!(
                "{what} on {mesh} over {n} ranks: losses {got:?}, one process {want:?}"
            ));
        }
        println!(
            "mpi-test: meshwork train, {what} on {mesh} over {n} ranks: {} losses equal one process's ({took:.1?})",
            got.len()
        );
    }

    // A checkpoint of 4 ranks, written by each, resumed in one process; and back.
    let ckpt = scratch.path("ckpt4");
    let resumed = scratch.path("resumed.json");
    let saved = [
        &["--mesh", "2x2", "--steps", "12", "--checkpoint-every", "4"][..],
        &["--checkpoint-dir", &ckpt, "--losses-json", &resumed],
    ]
    .concat();
    let (ok, _, out) = run_job(4, &jax, &saved)?;
    if !ok {
        return Err(format!("saving over 4 ranks failed:\n{out}"));
    }
    let index = std::fs::read_to_string(format!("{ckpt}/step-00000008/index.json"))
        .map_err(|e| format!("the step saved over 4 ranks: {e}"))?;
    for r in 0..4 {
        if !index.contains(&format!("\"rank\": {r}")) {
            return Err(format!(
                "the index of a step saved by 4 ranks names no file of rank {r}:\n{index}"
            ));
        }
    }
    let whole = scratch.path("whole.json");
    let (ok, out) = run_one(&jax, &["--mesh", "1x1", "--steps", "20", "--losses-json", &whole])?;
    let step8 = format!("{ckpt}/step-00000008");
    // The resumed run takes the checkpoint's weights: no `--init`.
    let resume: Vec<String> =
        jax.iter().filter(|a| *a != "--init" && **a != init).cloned().collect();
    let (ok2, out2) = run_one(
        &resume,
        &["--mesh", "1x1", "--steps", "20", "--resume", &step8, "--losses-json", &resumed],
    )?;
    if !ok || !ok2 {
        return Err(format!("resuming a 4-rank checkpoint in one process failed:\n{out}{out2}"));
    }
    let (got, want) = (losses(&resumed)?, losses(&whole)?);
    // The losses file holds every step: the 4 ranks' 8, then this run's 12.
    if !same_losses(&got, &want, 1e-9) {
        return Err(format!("resumed in one process: {got:?}, the whole run's {want:?}"));
    }
    println!(
        "mpi-test: a checkpoint written by 4 ranks (each named in its index) resumes in one process on 1x1"
    );
    let one_ckpt = scratch.path("ckpt1");
    let back = scratch.path("back.json");
    let (ok, out) = run_one(
        &jax,
        &["--mesh", "1x2", "--steps", "6", "--checkpoint-dir", &one_ckpt, "--losses-json", &back],
    )?;
    let (ok2, _, out2) = run_job(
        2,
        &resume,
        &["--mesh", "2x1", "--steps", "20", "--resume", &one_ckpt, "--losses-json", &back],
    )?;
    if !ok || !ok2 {
        return Err(format!("resuming a one-process checkpoint on 2 ranks failed:\n{out}{out2}"));
    }
    let (got, want) = (losses(&back)?, losses(&whole)?);
    if !same_losses(&got, &want, 1e-9) {
        return Err(format!("resumed on 2 ranks: {got:?}, the whole run's {want:?}"));
    }
    println!("mpi-test: a checkpoint of one process resumes on 2 ranks to the whole run's losses");

    // A file missing on rank 1 only: every rank exits 2, one line from rank 0.
    let tokens0 = scratch.path("tokens-0.npy");
    std::fs::copy(&tokens, &tokens0).map_err(|e| e.to_string())?;
    let script = format!(
        "exec {exe} train --model transformer --heads 4 --seq 16 --mesh 2x1 --steps 3 --data-tokens {}/tokens-$OMPI_COMM_WORLD_RANK.npy",
        scratch.0.display()
    );
    let mut cmd = mpirun(&["sh", "-c", &script]);
    let child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&child.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("meshwork")).collect();
    if child.status.code() != Some(2)
        || lines.len() != 1
        || !lines[0].starts_with("meshwork: error: process 1: --data-tokens")
    {
        return Err(format!(
            "a file missing on rank 1: want exit 2 and one line from it; got {:?}:\n{err}",
            child.status
        ));
    }
    println!("mpi-test: a file missing on one rank: every rank exits 2, one line: {}", lines[0]);

    // kill -9 of rank 1 mid-run: the job ends within 60 s; the latest step resumes.
    let ckpt = scratch.path("killed");
    let long: Vec<&str> = vec![
        exe.as_str(),
        "train",
        "--model",
        "transformer",
        "--mesh",
        "2x1",
        "--steps",
        "100000",
        "--checkpoint-every",
        "5",
        "--checkpoint-dir",
        &ckpt,
        "--quiet",
    ];
    let mut job = mpirun(&long)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let latest = std::path::Path::new(&ckpt).join("latest");
    let start = Instant::now();
    while !latest.exists() && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let Some(pid) = rank_pid(1) else {
        let _ = job.kill();
        return Err("kill -9: no rank 1 to kill (did the run start?)".into());
    };
    run(Command::new("kill").args(["-9", &pid.to_string()]))?;
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = job.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = job.kill();
            return Err("kill -9 of rank 1: mpirun still ran 60 s later (a hang)".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = killed.elapsed();
    if status.success() {
        return Err("kill -9 of rank 1: mpirun exited 0".into());
    }
    let step = std::fs::read_to_string(&latest).map_err(|e| e.to_string())?;
    let (ok, out) = run_one(
        &["train", "--model", "transformer", "--mesh", "1x1", "--resume"]
            .iter()
            .map(ToString::to_string)
            .chain([ckpt.clone()])
            .collect::<Vec<_>>(),
        &[
            "--steps",
            &(step
                .trim()
                .trim_start_matches("step-")
                .parse::<usize>()
                .map_err(|e| e.to_string())?
                + 2)
            .to_string(),
            "--quiet",
        ],
    )?;
    if !ok {
        return Err(format!(
            "the latest step after kill -9 ({}) does not resume:\n{out}",
            step.trim()
        ));
    }
    println!(
        "mpi-test: kill -9 of rank 1: mpirun exited ({status}) {took:.1?} later; {} resumes",
        step.trim()
    );

    // SIGTERM to the ranks: they stop after the same step, save it once, exit 130.
    let ckpt = scratch.path("stopped");
    let metrics = scratch.path("metrics.jsonl");
    let long: Vec<&str> = vec![
        exe.as_str(),
        "train",
        "--model",
        "transformer",
        "--mesh",
        "2x1",
        "--steps",
        "100000",
        "--checkpoint-every",
        "100000",
        "--checkpoint-dir",
        &ckpt,
        "--quiet",
        "--metrics-jsonl",
        &metrics,
    ];
    let mut job = mpirun(&long)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    // Signalled once training is under way (rank 0 wrote two steps' metrics): every
    // rank's handlers are installed by then.
    let trained = || std::fs::read_to_string(&metrics).is_ok_and(|t| t.lines().count() >= 2);
    while !trained() && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(100));
    }
    for r in 0..2 {
        if let Some(pid) = rank_pid(r) {
            run(Command::new("kill").args(["-TERM", &pid.to_string()]))?;
        }
    }
    let status = loop {
        if let Some(s) = job.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > Duration::from_secs(240) {
            let _ = job.kill();
            return Err("SIGTERM: the job still ran after 240 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let steps: Vec<String> = std::fs::read_dir(&ckpt)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    if status.code() != Some(130) || steps.len() != 1 {
        return Err(format!(
            "SIGTERM to the ranks: want exit 130 and one step saved; got {status}, {steps:?}"
        ));
    }
    println!("mpi-test: SIGTERM to the ranks: one step saved ({}), exit 130", steps[0]);
    Ok(())
}

/// The median of `xs` (not empty).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// A number after `label` on a line of `out` (`throughput   6123 tokens/s`).
fn figure(out: &str, label: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.trim_start().starts_with(label))?;
    line.trim_start()[label.len()..].split_whitespace().next()?.parse().ok()
}

/// The byte count after `after` on the summary's `processes` line.
fn bytes_after(out: &str, after: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.trim_start().starts_with("processes"))?;
    let mut words = line[line.find(after)? + after.len()..].split_whitespace();
    words.next()?.trim_start_matches('(').trim_end_matches([';', ')']).parse().ok()
}

/// `cargo xtask mpi-bench [steps=N] [runs=K]`: the transformer benchmark (V256 T128
/// D256 H8 L4 F1024, f32, batch 16, Adam) with `meshwork train` built `--release
/// --features mpi`: 2 ranks under `mpirun` (`--bind-to core`: one core each, and
/// `--bind-to none`) against 1 process on this machine's cores, on the meshes 2x1
/// and 2x2, on the interpreter and XLA-CPU; the median tokens/s of K runs each, the
/// ratio to one process, and rank 0's bytes per step over MPI beside the
/// collectives' minimum.
pub(crate) fn mpi_bench() -> Result {
    let arg = |name: &str, default: usize| {
        std::env::args().find_map(|a| a.strip_prefix(name)?.parse().ok()).unwrap_or(default)
    };
    let (steps, runs) = (arg("steps=", 12), arg("runs=", 3));
    let plugin = crate::xla::plugin()?;
    cargo(&["build", "--release", "-p", "meshwork-cli", "--features", "mpi"])?;
    let exe = workspace_root().join("target/release/meshwork").to_string_lossy().into_owned();
    let steps_text = steps.to_string();
    let model = [
        "train",
        "--model",
        "transformer",
        "--vocab",
        "256",
        "--seq",
        "128",
        "--dim",
        "256",
        "--heads",
        "8",
        "--layers",
        "4",
        "--ffn",
        "1024",
        "--batch",
        "16",
        "--dtype",
        "f32",
        "--optimizer",
        "adam",
        "--no-check",
        "--steps",
        steps_text.as_str(),
    ];
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "Transformer V256 T128 D256 H8 L4 F1024, f32, batch 16, Adam, {steps} steps per run, \
         median of {runs} runs, tokens/s ({cores} cores here):"
    );
    println!(
        "{:<12} {:<5} {:>16} {:>18} {:>6} {:>18} {:>6} {:>14} {:>14}",
        "back end",
        "mesh",
        "1 process",
        "2 ranks, core",
        "ratio",
        "2 ranks, none",
        "ratio",
        "MPI B/step",
        "minimum"
    );
    let only = std::env::args().find_map(|a| a.strip_prefix("backend=").map(str::to_string));
    for backend in ["interpreter", "xla"] {
        if only.as_deref().is_some_and(|o| o != backend) {
            continue;
        }
        for mesh in ["2x1", "2x2"] {
            let mut flags: Vec<&str> = model.to_vec();
            flags.extend(["--mesh", mesh]);
            if backend == "xla" {
                flags.extend(["--backend", "xla"]);
            }
            let once = |bind: Option<&str>| -> Result<(f64, Option<f64>, Option<f64>)> {
                let mut cmd = match bind {
                    None => {
                        let mut c = Command::new(&exe);
                        c.args(&flags);
                        c
                    }
                    Some(b) => {
                        let mut all = vec!["--bind-to", b, exe.as_str()];
                        all.extend(&flags);
                        mpirun(&all)
                    }
                };
                cmd.env("MESHWORK_PJRT_PLUGIN", &plugin);
                let (ok, _, out) = run_for(&mut cmd, Duration::from_secs(600))?;
                let rate = figure(&out, "throughput").filter(|_| ok).ok_or_else(|| {
                    format!("{backend} {mesh} {bind:?}: no throughput in:\n{out}")
                })?;
                Ok((rate, bytes_after(&out, "sent"), bytes_after(&out, "need")))
            };
            let sample = |bind: Option<&str>| -> Result<(f64, Option<f64>, Option<f64>)> {
                let mut rates = Vec::new();
                let mut bytes = (None, None);
                for _ in 0..runs {
                    let (r, sent, least) = once(bind)?;
                    rates.push(r);
                    bytes = (sent, least);
                }
                Ok((median(rates), bytes.0, bytes.1))
            };
            // A run that fails is reported as such (XLA-CPU's own collectives can
            // deadlock on a 2x1 mesh on 2 cores: its rendezvous aborts the process).
            let tried = |bind: Option<&str>| match sample(bind) {
                Ok(x) => Some(x),
                Err(e) => {
                    eprintln!(
                        "mpi-bench: {backend} {mesh} {bind:?} failed: {}",
                        e.lines().last().unwrap_or("")
                    );
                    None
                }
            };
            let one = tried(None).map(|x| x.0);
            let (core, sent, least) =
                tried(Some("core")).map_or((None, None, None), |x| (Some(x.0), x.1, x.2));
            let none = tried(Some("none")).map(|x| x.0);
            let b = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}"));
            let ratio = |x: Option<f64>| match (x, one) {
                (Some(x), Some(one)) => format!("{:.2}x", x / one),
                _ => "-".into(),
            };
            println!(
                "{backend:<12} {mesh:<5} {:>16} {:>18} {:>6} {:>18} {:>6} {:>14} {:>14}",
                b(one),
                b(core),
                ratio(core),
                b(none),
                ratio(none),
                b(sent),
                b(least)
            );
        }
    }
    Ok(())
}
