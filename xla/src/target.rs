//! Compiling for NVIDIA GPUs that are not here: named targets (`h100`, `h100x8`,
//! `2xh100x8`), their XLA target configs shipped as data (`xla/targets/*.txtpb`), the
//! peak rates a roofline needs, and a [`TargetSession`] that compiles programs for a
//! target through the CUDA plugin's `PJRT_TopologyDescription_Create` and `PJRT_Compile`
//! without a device, reading XLA's own memory per device.
//!
//! A deviceless compile runs XLA's whole GPU pipeline (fusion, GEMM rewriting, LLVM,
//! ptxas, buffer assignment, SPMD partitioning); it does not build cuDNN graphs, so a
//! cuDNN call's constraints are the caller's to check.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use meshwork_program::Program;

use crate::lower::{LowerOptions, Lowered, lower};
use crate::{
    CompileOptions, CompiledMemory, Error, NamedValueOf, Plugin, Result, Topology, Unloaded,
};

/// One GPU model meshwork can compile for: its XLA target config and peak rates.
///
/// Peak rates are NVIDIA's datasheet figures, dense (without structured sparsity):
/// H100 SXM5 80 GB — BF16 tensor 989.4 TFLOP/s, TF32 tensor 494.7, HBM3 3.35 TB/s,
/// NVLink 4 900 GB/s both directions (450 each way); A100 SXM4 80 GB — BF16 312,
/// TF32 156, HBM2e 2.039 TB/s, NVLink 3 600 GB/s (300 each way). Between hosts, one
/// 400 Gb/s (H100, DGX H100's ConnectX-7) or 200 Gb/s (A100, DGX A100's ConnectX-6)
/// InfiniBand port per GPU. The shipped configs' `memory_bandwidth` agrees; XLA's
/// newer H100 config's `matrix_unit_description` gives the same tensor-core rates.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// The name in `--target` (`h100`).
    pub key: &'static str,
    /// What it is (`NVIDIA H100 SXM5 80 GB`).
    pub description: &'static str,
    /// XLA's text `stream_executor.GpuTargetConfigProto` for it.
    pub config: &'static str,
    /// Dense BF16/F16 tensor-core FLOP/s.
    pub bf16_flops: f64,
    /// Dense TF32 tensor-core FLOP/s (what XLA's default precision uses for f32 dots).
    pub f32_flops: f64,
    /// Device memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// NVLink bandwidth per GPU, each way, bytes/s.
    pub nvlink_bandwidth: f64,
    /// Network bandwidth per GPU between hosts, each way, bytes/s.
    pub network_bandwidth: f64,
}

/// The GPUs meshwork ships target configs for. (XLA publishes no config of an L4.)
pub const GPUS: [Gpu; 2] = [
    Gpu {
        key: "h100",
        description: "NVIDIA H100 SXM5 80 GB",
        config: include_str!("../targets/h100_sxm.txtpb"),
        bf16_flops: 989.4e12,
        f32_flops: 494.7e12,
        memory_bandwidth: 3.35e12,
        nvlink_bandwidth: 450e9,
        network_bandwidth: 50e9,
    },
    Gpu {
        key: "a100",
        description: "NVIDIA A100 SXM4 80 GB",
        config: include_str!("../targets/a100_sxm_80.txtpb"),
        bf16_flops: 312e12,
        f32_flops: 156e12,
        memory_bandwidth: 2.039e12,
        nvlink_bandwidth: 300e9,
        network_bandwidth: 25e9,
    },
];

/// The most devices a target may have.
pub const MAX_TARGET_DEVICES: usize = 1024;

/// GPUs to compile for: `hosts` hosts of `per_host` GPUs of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The GPU model.
    pub gpu: &'static Gpu,
    /// Hosts.
    pub hosts: usize,
    /// GPUs per host.
    pub per_host: usize,
    /// The target config compiled against: the GPU's own, or one the user gave.
    config: Cow<'static, str>,
    /// Its `device_memory_size`.
    memory: u64,
    /// Its CUDA compute capability's major version (9: Hopper).
    compute_major: u32,
}

impl Target {
    /// Parses `h100` (one GPU), `h100xN` (N on one host) or `HxGPUxN` (H hosts of N).
    pub fn parse(name: &str) -> Result<Target> {
        let bad = |why: String| Error::Target(format!("--target {name}: {why}"));
        let known = || GPUS.iter().map(|g| g.key).collect::<Vec<_>>().join(", ");
        let parts: Vec<&str> = name.split('x').collect();
        let number = |s: &str| -> Result<usize> {
            s.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("`{s}` is not a count of at least 1")))
        };
        let (hosts, key, per_host) = match parts.as_slice() {
            [gpu] => (1, *gpu, 1),
            [gpu, n] => (1, *gpu, number(n)?),
            [h, gpu, n] => (number(h)?, *gpu, number(n)?),
            _ => {
                return Err(bad("give GPU, GPUxN or HOSTSxGPUxN (h100, h100x8, 2xh100x8)".into()));
            }
        };
        let gpu = GPUS
            .iter()
            .find(|g| g.key.eq_ignore_ascii_case(key))
            .ok_or_else(|| bad(format!("no GPU `{key}`; known: {}", known())))?;
        let devices = hosts.checked_mul(per_host).filter(|&d| d <= MAX_TARGET_DEVICES);
        if devices.is_none() {
            return Err(bad(format!("more than {MAX_TARGET_DEVICES} GPUs")));
        }
        let (memory, compute_major) =
            check_config(gpu.config).map_err(|e| bad(format!("shipped config: {e}")))?;
        Ok(Target {
            gpu,
            hosts,
            per_host,
            config: Cow::Borrowed(gpu.config),
            memory,
            compute_major,
        })
    }

    /// This target with the target config `text` (a `GpuTargetConfigProto` in text
    /// form, as XLA's `specs/*.txtpb`) in place of the shipped one, checked for what
    /// the plugin needs (see [`check_config`]); `source` names it in errors.
    pub fn with_config(self, text: String, source: &str) -> Result<Target> {
        let (memory, compute_major) =
            check_config(&text).map_err(|e| Error::Target(format!("{source}: {e}")))?;
        Ok(Target { config: Cow::Owned(text), memory, compute_major, ..self })
    }

    /// Its name as `--target` takes it (`h100`, `h100x8`, `2xh100x8`).
    pub fn name(&self) -> String {
        match (self.hosts, self.per_host) {
            (1, 1) => self.gpu.key.to_string(),
            (1, n) => format!("{}x{n}", self.gpu.key),
            (h, n) => format!("{h}x{}x{n}", self.gpu.key),
        }
    }

    /// All its GPUs.
    pub fn devices(&self) -> usize {
        self.hosts * self.per_host
    }

    /// One device's memory (the config's `device_memory_size`), bytes.
    pub fn device_memory(&self) -> u64 {
        self.memory
    }

    /// Whether cuDNN's fused (flash) attention runs on its GPUs: compute capability 8
    /// (Ampere) or later, as JAX's cuDNN path requires.
    pub fn cudnn_attention(&self) -> bool {
        self.compute_major >= 8
    }

    /// The target config compiled against.
    pub fn config(&self) -> &str {
        &self.config
    }

    /// The CUDA plugin's `topology` option: `1x<hosts>x<per host>`.
    pub fn topology(&self) -> String {
        format!("1x{}x{}", self.hosts, self.per_host)
    }
}

/// The fields of a config's `gpu_device_info` that must be there and above zero: every
/// count and size the shipped configs give (XLA's cost models divide by them; an empty
/// config passes the plugin's parser and then crashes its compile with SIGFPE).
pub const REQUIRED_FIELDS: [&str; 17] = [
    "threads_per_block_limit",
    "threads_per_warp",
    "shared_memory_per_block",
    "shared_memory_per_core",
    "threads_per_core_limit",
    "core_count",
    "fpus_per_core",
    "block_dim_limit_x",
    "block_dim_limit_y",
    "block_dim_limit_z",
    "memory_bandwidth",
    "l2_cache_size",
    "clock_rate_ghz",
    "device_memory_size",
    "shared_memory_per_block_optin",
    "registers_per_core_limit",
    "registers_per_block_limit",
];

/// Checks a text target config before the plugin sees it: a `gpu_device_info` with
/// every one of [`REQUIRED_FIELDS`] above zero and a CUDA compute capability. Returns
/// its device memory and its compute capability's major version.
pub fn check_config(text: &str) -> std::result::Result<(u64, u32), String> {
    if !text.contains("gpu_device_info") {
        return Err("not a GpuTargetConfigProto: no gpu_device_info".into());
    }
    if !text.contains("cuda_compute_capability") {
        return Err("no cuda_compute_capability: not an NVIDIA GPU's config".into());
    }
    // Comments dropped; a field is `name: value` anywhere (text protos need no lines).
    let text: String =
        text.lines().map(|l| l.split('#').next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let raw = |name: &str| -> Option<&str> {
        text.match_indices(name)
            .filter(|&(at, _)| {
                !text[..at].ends_with(word) && !text[at + name.len()..].starts_with(word)
            })
            .find_map(|(at, _)| text[at + name.len()..].trim_start().strip_prefix(':'))
            .map(|rest| {
                let rest = rest.trim_start();
                let end = rest.find(|c: char| c.is_whitespace() || c == '}').unwrap_or(rest.len());
                &rest[..end]
            })
    };
    let field = |name: &str| -> std::result::Result<f64, String> {
        let value = raw(name).ok_or_else(|| format!("no {name}"))?;
        let v: f64 = value.parse().map_err(|_| format!("{name}: `{value}` is not a number"))?;
        if v > 0.0 && v.is_finite() { Ok(v) } else { Err(format!("{name} must be above 0")) }
    };
    for name in REQUIRED_FIELDS {
        field(name)?;
    }
    let memory = field("device_memory_size")?;
    if memory > u64::MAX as f64 || memory.fract() != 0.0 {
        return Err("device_memory_size is not a byte count".into());
    }
    // `cuda_compute_capability { major: 9 … }`: the first `major` after it.
    let at = text.find("cuda_compute_capability").unwrap_or(0);
    let major = text[at..]
        .match_indices("major")
        .find_map(|(i, _)| text[at + i + 5..].trim_start().strip_prefix(':'))
        .and_then(|rest| {
            rest.split(|c: char| c.is_whitespace() || c == '}').find(|s| !s.is_empty())
        })
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or("cuda_compute_capability has no major version")?;
    Ok((memory as u64, major))
}

/// A program compiled for a target's devices.
#[derive(Debug)]
pub struct TargetCompiled {
    /// The lowered module.
    pub lowered: Lowered,
    /// XLA's executable (not loaded: there is no device).
    pub executable: Unloaded,
    /// One device's compiled memory.
    pub memory: CompiledMemory,
    /// Replicas and partitions it was compiled for.
    pub replicas: usize,
    /// Partitions (XLA's partitioner) it was compiled for.
    pub partitions: usize,
}

/// The CUDA plugin's topology of a [`Target`], and the programs compiled for it (each
/// module once).
#[derive(Debug)]
pub struct TargetSession {
    target: Target,
    /// Before the topology: its executables are destroyed first.
    cache: Mutex<HashMap<String, Arc<TargetCompiled>>>,
    topology: Topology,
    compiles: AtomicUsize,
}

impl TargetSession {
    /// The topology of `target` made by `plugin` (the CUDA plugin). A plugin that
    /// cannot make one (the CPU plugin) or refuses the target is an error saying so.
    pub fn new(plugin: &Plugin, target: Target) -> Result<TargetSession> {
        let options = [
            ("topology", NamedValueOf::Str(target.topology())),
            ("target_config", NamedValueOf::Str(target.config().to_string())),
        ];
        let topology = plugin.topology(&options).map_err(|e| {
            Error::Target(format!(
                "{}: the plugin {} made no topology of {} ({e}); --target needs the CUDA plugin (jax-cuda13-pjrt)",
                target.name(),
                plugin.path().display(),
                target.topology()
            ))
        })?;
        if topology.devices() != target.devices() {
            return Err(Error::Target(format!(
                "{}: the plugin's topology has {} devices, not {}",
                target.name(),
                topology.devices(),
                target.devices()
            )));
        }
        Ok(TargetSession {
            target,
            cache: Mutex::new(HashMap::new()),
            topology,
            compiles: AtomicUsize::new(0),
        })
    }

    /// The target.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The kind of its devices, as the plugin names it.
    pub fn device_kind(&self) -> &str {
        self.topology.kind()
    }

    /// Programs compiled so far (cache misses).
    pub fn compiles(&self) -> usize {
        self.compiles.load(Ordering::Relaxed)
    }

    /// `program` lowered with `options` and compiled for the target's first
    /// `replicas × partitions` devices (replica `r`, partition `p` on device
    /// `r·P + p`), from the cache when the same module was compiled before.
    pub fn compile(
        &self,
        program: &Program,
        options: &LowerOptions,
    ) -> Result<Arc<TargetCompiled>> {
        let lowered = lower(program, options)?;
        let replicas = options.replicas.max(1);
        let partitions = options.partitions.max(1);
        let n = replicas * partitions;
        if n > self.target.devices() {
            return Err(Error::Target(format!(
                "{} has {} devices; the program needs {n}",
                self.target.name(),
                self.target.devices()
            )));
        }
        let key = lowered.text.clone();
        if let Some(c) = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(Arc::clone(c));
        }
        let compile = CompileOptions {
            replicas,
            partitions,
            spmd_partitioning: partitions > 1,
            devices: (0..n as i64).collect(),
            ..CompileOptions::default()
        };
        let executable = self
            .topology
            .compile("mlir", lowered.text.as_bytes(), &compile.encode())
            .map_err(|e| e.during("compile"))?;
        let memory = executable.memory()?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let compiled =
            Arc::new(TargetCompiled { lowered, executable, memory, replicas, partitions });
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, Arc::clone(&compiled));
        Ok(compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_by_gpus_and_hosts() {
        let one = Target::parse("h100").unwrap();
        assert_eq!((one.hosts, one.per_host, one.devices()), (1, 1, 1));
        assert_eq!(one.topology(), "1x1x1");
        let eight = Target::parse("h100x8").unwrap();
        assert_eq!(
            (eight.devices(), eight.name(), eight.topology()),
            (8, "h100x8".into(), "1x1x8".into())
        );
        let sixteen = Target::parse("2xh100x8").unwrap();
        assert_eq!((sixteen.devices(), sixteen.name()), (16, "2xh100x8".into()));
        assert_eq!(sixteen.topology(), "1x2x8");
        assert_eq!(Target::parse("A100x4").unwrap().gpu.key, "a100");
        // The shipped configs' own memory sizes.
        assert_eq!(one.device_memory(), 84_978_434_048);
        assert_eq!(Target::parse("a100").unwrap().device_memory(), 85_100_068_864);
    }

    #[test]
    fn bad_targets_say_what_is_wrong() {
        for (name, says) in [
            ("l4", "no GPU `l4`"),
            ("h100x0", "at least 1"),
            ("h100x", "at least 1"),
            ("0xh100x8", "at least 1"),
            ("2xh100x8x1", "HOSTSxGPUxN"),
            ("h100x99999999999999999999", "at least 1"),
            ("64xh100x64", "more than 1024"),
        ] {
            let e = Target::parse(name).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(name), "{name}: {e}");
        }
    }

    #[test]
    fn configs_the_plugin_would_crash_on_are_refused() {
        let h100 = Target::parse("h100").unwrap();
        for (text, says) in [
            ("", "no gpu_device_info"),
            ("garbage", "no gpu_device_info"),
            ("gpu_device_info { core_count: 1 }", "cuda_compute_capability"),
            (
                "gpu_device_info { cuda_compute_capability { major: 9 } core_count: 132 }",
                "no threads_per_block_limit",
            ),
        ] {
            let e = h100.clone().with_config(text.into(), "cfg.txtpb").unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("cfg.txtpb"), "{text:?}: {e}");
        }
        let zero = GPUS[0].config.replace("core_count: 132", "core_count: 0");
        let e = h100.clone().with_config(zero, "z").unwrap_err().to_string();
        assert!(e.contains("core_count must be above 0"), "{e}");
        let small = GPUS[0].config.replace("84978434048", "1000");
        assert_eq!(h100.clone().with_config(small, "s").unwrap().device_memory(), 1000);
        // Every required field, left out, is refused by name.
        for name in REQUIRED_FIELDS {
            let without: String = GPUS[0]
                .config
                .lines()
                .filter(|l| l.trim().split(':').next() != Some(name))
                .collect::<Vec<_>>()
                .join("\n");
            let e = h100.clone().with_config(without, "w").unwrap_err().to_string();
            assert!(e.contains(&format!("no {name}")), "{name}: {e}");
        }
        // A Turing config passes, without cuDNN's flash attention.
        let turing = GPUS[0].config.replace(
            "cuda_compute_capability { major: 9 }",
            "cuda_compute_capability { major: 7 minor: 5 }",
        );
        assert!(!h100.clone().with_config(turing, "t").unwrap().cudnn_attention());
        assert!(h100.cudnn_attention() && Target::parse("a100").unwrap().cudnn_attention());
    }
}
