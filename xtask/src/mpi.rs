//! `cargo xtask mpi-test`: the executor's MPI check, 2 processes × 2 devices under
//! `mpirun` on loopback, the strategy over 2 processes, training on 2 processes × 2
//! XLA CPU devices (the pinned plugin, fetched unless `MESHWORK_PJRT_PLUGIN` names
//! one), a candle model through the bridge over 2 processes, and the two ways a
//! process can die without hanging the job.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, cargo, workspace_root};

/// Open MPI's launcher, kept on loopback and shared memory, allowed to run as root
/// (CI does) and to put 2 processes on fewer cores.
fn mpirun(args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", "2"])
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
    cargo(&["build", "-p", "meshwork-executor", "--features", "mpi", "--example", "mpi_check"])?;
    let exe = "target/debug/examples/mpi_check";

    let (ok, took, out) = run_for(&mut mpirun(&[exe]), Duration::from_secs(120))?;
    print!("{out}");
    if !ok {
        return Err(format!("the 2-process check failed after {took:.1?}"));
    }
    println!("mpi-test: 2 processes x 2 devices equal 4 local devices ({took:.1?})");

    cargo(&["build", "-p", "meshwork-strategy", "--features", "mpi", "--example", "mpi_strategy"])?;
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
    cargo(&["build", "-p", "meshwork-strategy", "--features", "mpi", "--example", "mpi_xla"])?;
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

    cargo(&["build", "-p", "meshwork-candle", "--features", "mpi", "--example", "mpi_candle"])?;
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
    Ok(())
}
