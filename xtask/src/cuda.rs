//! Compiling for NVIDIA GPUs without one: the pinned CUDA plugin (`jax-cuda13-pjrt`
//! and the `nvidia-*` wheels that give it ptxas and libdevice, hash-checked, kept in
//! the wheel cache between runs and unpacked under `target/pjrt-cuda/` in their pip
//! layout), its tests, and a fixed set of `meshwork inspect --target` compiles whose
//! reports are checked. On a machine with a GPU, `gpu-bench` runs the GPU benchmark.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, cargo_cmd, run, workspace_root};

/// The pinned wheels and their SHA-256 (pip checks them: `--require-hashes`).
const WHEELS: [(&str, &str); 5] = [
    ("jax-cuda13-pjrt==0.11.2", "e5ff589d43064913bb74027682d89639c7ea48f9f81c2bae6fc75117e913f93e"),
    (
        "nvidia-cuda-nvcc==13.5.37",
        "f5c4f7ead5d964fb4af42bbf1e6d3ec3c1e6e9d83b53749f691d387e7fcaa3a7",
    ),
    (
        "nvidia-cuda-crt==13.5.37",
        "e898b7f73d3035fa89915a3f7bf3b54a73e90249746111aed295822c4729bb29",
    ),
    (
        "nvidia-cuda-runtime==13.5.37",
        "df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d",
    ),
    ("nvidia-nvvm==13.5.37", "c41bfa362e407405163f103c2229f0765f8cc2ed7d148b754dc77f228bf7e070"),
];

/// The plugin inside the unpacked wheels.
const PLUGIN: &str = "jax_plugins/xla_cuda13/xla_cuda_plugin.so";

/// Where downloaded wheels are kept between runs (and between clones):
/// `$MESHWORK_WHEEL_CACHE`, else `~/.cache/meshwork-ci/wheels`.
fn wheel_cache() -> PathBuf {
    if let Some(d) = std::env::var_os("MESHWORK_WHEEL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache").join("meshwork-ci").join("wheels")
}

/// The CUDA plugin: `MESHWORK_CUDA_PLUGIN` if set (it must exist), else the pinned
/// wheels' under `target/pjrt-cuda/site/`, installed on first use.
pub(crate) fn plugin() -> Result<PathBuf> {
    if let Some(p) = crate::xla::file_named_by("MESHWORK_CUDA_PLUGIN") {
        return p;
    }
    let root = workspace_root().join("target").join("pjrt-cuda");
    let site = root.join("site");
    let so = site.join(PLUGIN);
    if so.is_file() {
        return Ok(so);
    }
    install(&root, &site)?;
    Ok(so)
}

/// Downloads the pinned wheels into the cache (pip reuses what is there when its hash
/// matches) and unpacks them with `pip install --target`, to a temporary folder renamed
/// into place: an interrupted install leaves no half-made plugin.
fn install(root: &Path, site: &Path) -> Result {
    let cache = wheel_cache();
    println!("xtask: installing the CUDA plugin's wheels (cache {})", cache.display());
    std::fs::create_dir_all(&cache)
        .map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    std::fs::create_dir_all(root).map_err(|e| format!("cannot create {}: {e}", root.display()))?;
    let requirements = root.join("requirements.txt");
    let text: String =
        WHEELS.iter().map(|(req, sha)| format!("{req} --hash=sha256:{sha}\n")).collect();
    std::fs::write(&requirements, text)
        .map_err(|e| format!("cannot write {}: {e}", requirements.display()))?;
    run(Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"])
        .args(["--require-hashes", "-r"])
        .arg(&requirements)
        .arg("-d")
        .arg(&cache))
    .map_err(|e| format!("{e} (the CUDA checks need python3 with pip to fetch the plugin)"))?;
    let wheels: Vec<PathBuf> = WHEELS
        .iter()
        .map(|(req, _)| {
            let (name, version) = req.split_once("==").expect("pinned");
            let stem = format!("{}-{version}-", name.replace('-', "_"));
            std::fs::read_dir(&cache)
                .map_err(|e| e.to_string())?
                .flatten()
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&stem) && n.ends_with(".whl"))
                })
                .ok_or_else(|| format!("pip left no wheel of {req} in {}", cache.display()))
        })
        .collect::<Result<_>>()?;
    let partial = root.join("site.partial");
    let _ = std::fs::remove_dir_all(&partial);
    run(Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target"])
        .arg(&partial)
        .args(&wheels))?;
    std::fs::rename(&partial, site).map_err(|e| format!("cannot rename {}: {e}", partial.display()))
}

/// One `meshwork inspect --target` compile CI makes, and what its report must say.
struct Compile {
    what: &'static str,
    args: &'static [&'static str],
    fits: bool,
    attention: &'static str,
}

/// The fixed set: the transformer in f32 with both partitioners, GPT-2 small in bf16
/// with cuDNN attention and `--fsdp` on eight H100s with and without `--remat` (which
/// must lower XLA's peak), a Llama-family step, and a 6.7B-parameter GPT-2 that does
/// not fit one H100.
const COMPILES: [Compile; 6] = [
    Compile {
        what: "transformer, meshwork's partitioner, h100x8",
        args: &["--model", "transformer", "--mesh", "4x2", "--target", "h100x8"],
        fits: true,
        attention: "xla",
    },
    Compile {
        what: "transformer, XLA's partitioner, h100x8",
        args: &[
            "--model",
            "transformer",
            "--mesh",
            "2x4",
            "--partitioner",
            "xla",
            "--target",
            "h100x8",
        ],
        fits: true,
        attention: "xla",
    },
    Compile {
        what: "GPT-2 small, bf16, cuDNN attention, --fsdp --remat, h100x8",
        args: &[
            "--model",
            "gpt2",
            "--preset",
            "gpt2",
            "--seq",
            "1024",
            "--batch",
            "16",
            "--precision",
            "bf16",
            "--mesh",
            "8x1",
            "--fsdp",
            "--remat",
            "--target",
            "h100x8",
        ],
        fits: true,
        attention: "cudnn",
    },
    Compile {
        what: "GPT-2 small, bf16, cuDNN attention, --fsdp (no --remat), h100x8",
        args: &[
            "--model",
            "gpt2",
            "--preset",
            "gpt2",
            "--seq",
            "1024",
            "--batch",
            "16",
            "--precision",
            "bf16",
            "--mesh",
            "8x1",
            "--fsdp",
            "--target",
            "h100x8",
        ],
        fits: true,
        attention: "cudnn",
    },
    Compile {
        what: "SmolLM2-135M (Llama family), bf16, cuDNN attention, h100",
        args: &[
            "--model",
            "llama",
            "--preset",
            "smollm2-135m",
            "--seq",
            "512",
            "--batch",
            "4",
            "--precision",
            "bf16",
            "--mesh",
            "1x1",
            "--target",
            "h100",
        ],
        fits: true,
        attention: "cudnn",
    },
    Compile {
        what: "GPT-2 6.7B, f32, Adam, h100 (does not fit)",
        args: &[
            "--model",
            "gpt2",
            "--layers",
            "32",
            "--dim",
            "4096",
            "--heads",
            "32",
            "--vocab",
            "50304",
            "--positions",
            "2048",
            "--seq",
            "2048",
            "--batch",
            "1",
            "--mesh",
            "1x1",
            "--target",
            "h100",
        ],
        fits: false,
        attention: "xla",
    },
];

/// The CUDA plugin's tests and the fixed compiles, each report checked: XLA's memory
/// read (arguments and peak above 0), `fits` and `attention` as expected, and GPT-2's
/// optimized module holding cuDNN's forward and backward calls.
pub(crate) fn cuda_aot() -> Result {
    let so = plugin()?;
    println!("xtask: CUDA plugin {}", so.display());
    // Over the workspace, as the test step built: its libraries are used as they are.
    let mut tests = cargo_cmd(&["test", "--workspace", "--test", "cuda"]);
    tests.env("MESHWORK_CUDA_PLUGIN", &so).env("TF_CPP_MIN_LOG_LEVEL", "3");
    run(&mut tests)?;
    let bin = crate::workspace_cli()?;
    let out = tempfile_dir()?;
    let mut peaks = Vec::new();
    for (k, c) in COMPILES.iter().enumerate() {
        let hlo = out.join(format!("step{k}.hlo.pb"));
        let started = std::time::Instant::now();
        let output = Command::new(&bin)
            .arg("inspect")
            .args(c.args)
            .arg("--json")
            .arg("--optimized-hlo")
            .arg(&hlo)
            .env("MESHWORK_PJRT_PLUGIN", &so)
            .env("TF_CPP_MIN_LOG_LEVEL", "3")
            .output()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        if !output.status.success() {
            return Err(format!(
                "{}: meshwork inspect exited with {}: {}",
                c.what,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let report: serde_json::Value = serde_json::from_slice(&output.stdout)
            .map_err(|e| format!("{}: the report is not JSON: {e}", c.what))?;
        let compiled = &report["compiled"];
        let (args, peak) = (compiled["argument_bytes"].as_u64(), compiled["peak_bytes"].as_u64());
        let ok = args.is_some_and(|a| a > 0)
            && peak.is_some_and(|p| p > 0)
            && report["fits"] == c.fits
            && report["attention"] == c.attention;
        println!(
            "xtask: {} — {:.1} s: peak {:.3} GB, fits {}, attention {}, estimate {:.3} GB, {:.0} tokens/s",
            c.what,
            started.elapsed().as_secs_f64(),
            peak.unwrap_or(0) as f64 / 1e9,
            report["fits"],
            report["attention"],
            report["memory"]["estimate"]["total_bytes"].as_f64().unwrap_or(0.0) / 1e9,
            report["estimate"]["tokens_per_second"].as_f64().unwrap_or(0.0),
        );
        if !ok {
            return Err(format!("{}: unexpected report:\n{report:#}", c.what));
        }
        peaks.push(peak.unwrap_or(0));
        if c.attention == "cudnn" {
            let module = std::fs::read(&hlo).map_err(|e| format!("{}: {e}", hlo.display()))?;
            for call in [&b"__cudnn$fmhaSoftmax"[..], b"__cudnn$fmhaSoftmaxBackward"] {
                if !module.windows(call.len()).any(|w| w == call) {
                    return Err(format!(
                        "{}: the optimized module has no {}",
                        c.what,
                        String::from_utf8_lossy(call)
                    ));
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    no_gpu(&bin, &so)?;
    if peaks[2] >= peaks[3] {
        return Err(format!(
            "--remat does not lower XLA's peak of GPT-2 small: {} bytes with, {} without",
            peaks[2], peaks[3]
        ));
    }
    println!("xtask: {} compiles for H100 targets checked", COMPILES.len());
    Ok(())
}

/// Training with the CUDA plugin on a machine without a GPU: exit 2, the last line
/// saying that no GPU was found and that `--target` compiles without one. (Where a GPU
/// is at hand, this says so and checks nothing.)
fn no_gpu(bin: &Path, plugin: &Path) -> Result {
    let gpus = Command::new("nvidia-smi").arg("-L").output();
    if gpus.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("GPU ")) {
        println!("xtask: a GPU is here: the no-GPU refusal is not checked");
        return Ok(());
    }
    let o = Command::new(bin)
        .args(["train", "--backend", "xla", "--steps", "1", "--pjrt-plugin"])
        .arg(plugin)
        .env("TF_CPP_MIN_LOG_LEVEL", "3")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let err = String::from_utf8_lossy(&o.stderr);
    let last = err.lines().last().unwrap_or("");
    if o.status.code() != Some(2)
        || !last.contains("no GPU was found")
        || !last.contains("--target")
    {
        return Err(format!("the CUDA plugin without a GPU: exit {}, {err}", o.status));
    }
    println!("xtask: without a GPU: {last}");
    Ok(())
}

/// A fresh folder under `target/` for the compiles' modules.
fn tempfile_dir() -> Result<PathBuf> {
    let dir = workspace_root().join("target").join("cuda-aot");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// A benchmark row: its name, the model's flags, more flags, batch and context.
type Row<'a> = (&'a str, &'a [&'a str], &'a [&'a str], usize, usize);

/// The GPU benchmark, where an NVIDIA GPU is at hand: meshwork on XLA (the CUDA plugin
/// `MESHWORK_PJRT_PLUGIN` names, else JAX's installed one) beside JAX and PyTorch in
/// the same run, the cuDNN attention step checked against the plain lowering, and
/// `inspect --target h100`'s compiled peak against the device's measured one. Every
/// figure and log goes to `out`; `summary.md` holds the table.
pub(crate) fn gpu_bench(out: &Path) -> Result {
    let gpus = Command::new("nvidia-smi").arg("-L").output();
    let listed =
        gpus.as_ref().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    if !listed.contains("GPU ") {
        return Err("no NVIDIA GPU here (`nvidia-smi -L` lists none); `cargo xtask cuda-aot` compiles for GPUs without one".into());
    }
    // Its files are written into `out`, which must be new or empty: nothing a person
    // put there is replaced.
    let taken = std::fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(false);
    if taken {
        return Err(format!("{} is not empty; give a new or empty folder", out.display()));
    }
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let plugin = match std::env::var_os("MESHWORK_PJRT_PLUGIN").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => {
            let find = "import os, jax_plugins.xla_cuda13 as m; print(os.path.join(os.path.dirname(m.__file__), 'xla_cuda_plugin.so'))";
            let o =
                Command::new("python3").args(["-c", find]).output().map_err(|e| e.to_string())?;
            PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())
        }
    };
    if !plugin.is_file() {
        return Err(format!(
            "no CUDA plugin: set MESHWORK_PJRT_PLUGIN (tried {})",
            plugin.display()
        ));
    }
    run(&mut cargo_cmd(&["build", "--release", "-p", "meshwork-cli"]))?;
    let bin = workspace_root().join("target").join("release").join("meshwork");
    let mut summary = format!(
        "# GPU benchmark\n\n{listed}\nplugin {}\n\n| row | meshwork tokens/s |\n|---|---|\n",
        plugin.display()
    );
    let meshwork = |args: &[&str], log: &str| -> Result<(f64, String)> {
        let started = std::time::Instant::now();
        let o = Command::new(&bin)
            .args(args)
            .env("MESHWORK_PJRT_PLUGIN", &plugin)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let secs = started.elapsed().as_secs_f64();
        let text = format!(
            "$ meshwork {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::write(out.join(log), &text).map_err(|e| e.to_string())?;
        if o.status.success() {
            Ok((secs, String::from_utf8_lossy(&o.stdout).into_owned()))
        } else {
            Err(text)
        }
    };
    // Tokens/s of a training step: the time of 12 steps less that of 2 (which holds
    // the compile and the first step), over 10 steps' tokens.
    let transformer = [
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
    ];
    let gpt2 = ["--model", "gpt2", "--preset", "gpt2", "--vocab", "50304", "--seq", "1024"];
    let rows: [Row<'_>; 5] = [
        ("transformer f32 b16 (JAX 1,434k)", &transformer, &[], 16, 128),
        ("transformer f32 b64 (JAX 2,280k)", &transformer, &[], 64, 128),
        ("GPT-2 small f32 b8 (JAX 137k, torch.compile 152k)", &gpt2, &[], 8, 1024),
        (
            "GPT-2 small bf16 b8 (JAX cuDNN 387k, torch.compile 412k)",
            &gpt2,
            &["--precision", "bf16"],
            8,
            1024,
        ),
        (
            "GPT-2 small bf16 b32 (JAX cuDNN 443k, torch.compile 485k)",
            &gpt2,
            &["--precision", "bf16"],
            32,
            1024,
        ),
    ];
    for (k, (name, model, extra, batch, seq)) in rows.iter().enumerate() {
        let b = batch.to_string();
        let time = |steps: &str| -> Result<f64> {
            let mut args = vec![
                "train",
                "--backend",
                "xla",
                "--optimizer",
                "adam",
                "--no-check",
                "--batch",
                &b,
                "--steps",
                steps,
                "--max-memory",
                "4T",
            ];
            args.extend_from_slice(model);
            args.extend_from_slice(extra);
            meshwork(&args, &format!("row{k}-steps{steps}.txt")).map(|r| r.0)
        };
        let rate = match (time("2"), time("12")) {
            (Ok(a), Ok(b)) if b > a => format!("{:.0}", 10.0 * (*batch * *seq) as f64 / (b - a)),
            (Err(e), _) | (_, Err(e)) => format!("failed: {}", e.lines().last().unwrap_or("")),
            _ => "no timing".into(),
        };
        println!("gpu-bench: {name}: {rate}");
        summary += &format!("| {name} | {rate} |\n");
    }
    // cuDNN's attention against XLA's own: three bf16 steps of GPT-2 from one seed.
    let mut losses = Vec::new();
    for attention in ["cudnn", "xla"] {
        let file = out.join(format!("losses-{attention}.json"));
        let f = file.to_string_lossy().into_owned();
        let mut args = vec![
            "train",
            "--backend",
            "xla",
            "--steps",
            "3",
            "--batch",
            "8",
            "--precision",
            "bf16",
            "--no-check",
            "--max-memory",
            "4T",
            "--attention",
            attention,
            "--losses-json",
            &f,
        ];
        args.extend_from_slice(&gpt2);
        let r = meshwork(&args, &format!("attention-{attention}.txt"));
        let read = r.and_then(|_| std::fs::read_to_string(&file).map_err(|e| e.to_string()));
        losses.push(read.ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()));
    }
    let agree = match (&losses[0], &losses[1]) {
        (Some(a), Some(b)) => {
            // `--losses-json` writes a list of every step's loss.
            let l = |v: &serde_json::Value| -> Vec<f64> {
                v.as_array()
                    .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
                    .unwrap_or_default()
            };
            let (a, b) = (l(a), l(b));
            let ok = !a.is_empty()
                && a.len() == b.len()
                && a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 2e-2 * y.abs().max(1.0));
            format!(
                "cuDNN attention losses {a:?} vs XLA's {b:?}: {}",
                if ok { "equal within bf16 tolerance (2e-2)" } else { "DIFFER" }
            )
        }
        _ => "the cuDNN attention check did not run (see attention-*.txt)".into(),
    };
    println!("gpu-bench: {agree}");
    summary += &format!("\n{agree}\n");
    // The compiled peak beside the device's measured one.
    let step = [
        "--model",
        "gpt2",
        "--preset",
        "gpt2",
        "--seq",
        "1024",
        "--batch",
        "8",
        "--precision",
        "bf16",
        "--mesh",
        "1x1",
    ];
    let planned = meshwork(
        &[&["inspect", "--target", "h100", "--json"][..], &step].concat(),
        "inspect-target.json",
    );
    let measured = meshwork(
        &[&["inspect", "--backend", "xla", "--json", "--max-memory", "4T"][..], &step].concat(),
        "inspect-measured.json",
    );
    let peaks = match (planned, measured) {
        (Ok((_, p)), Ok((_, m))) => {
            let p: serde_json::Value = serde_json::from_str(&p).unwrap_or_default();
            let m: serde_json::Value = serde_json::from_str(&m).unwrap_or_default();
            let (p, m) =
                (p["compiled"]["peak_bytes"].as_f64(), m["memory"]["device_peak_bytes"].as_f64());
            match (p, m) {
                (Some(p), Some(m)) => format!(
                    "compiled peak {:.3} GB, device peak {:.3} GB: {:.1}% apart (target: within 10%)",
                    p / 1e9,
                    m / 1e9,
                    100.0 * (p - m).abs() / m
                ),
                _ => "a peak is missing (see inspect-*.json)".into(),
            }
        }
        _ => "the peak check did not run (see inspect-*.json)".into(),
    };
    println!("gpu-bench: {peaks}");
    summary += &format!("\n{peaks}\n");
    // JAX and PyTorch in the same run, where the scripts are beside the repository.
    let bench = workspace_root().join("..").join("shared").join("bench");
    for (script, args) in [
        ("gpu_bench.py", &["small", "small64", "gpt2", "gpt2bf16", "gpt2bf16b32"][..]),
        ("torch_bench.py", &["f32", "bf16"][..]),
    ] {
        let path = bench.join(script);
        let text = match Command::new("python3").arg(&path).args(args).output() {
            Ok(o) => format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => format!("{} did not run: {e}", path.display()),
        };
        std::fs::write(out.join(script.replace(".py", ".txt")), &text)
            .map_err(|e| e.to_string())?;
        summary += &format!("\n## {script}\n\n```\n{text}```\n");
    }
    std::fs::write(out.join("summary.md"), &summary).map_err(|e| e.to_string())?;
    println!("gpu-bench: figures in {}", out.display());
    Ok(())
}
