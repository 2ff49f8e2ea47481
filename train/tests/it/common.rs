//! The helpers every trainer test uses: configs, runs, refusals, files. Shared by
//! the `it` binary and the XLA binary (`tests/xla`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use meshwork_train::{Config, Error, ModelKind, Observer, Quiet, Report, Step, Trainer};

/// A file of this crate's test data.
pub(crate) fn testdata(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(rel)
}

/// A file of the transformer's JAX reference run (kept with the model, in `nn`).
pub(crate) fn reference(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/testdata").join(name)
}

/// The JAX reference run's losses under `key` (`losses_adam`, `losses_sgd`).
pub(crate) fn expected(key: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(reference("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// A config of `model`, every other setting at its default but quiet ones.
pub(crate) fn config(model: ModelKind) -> Config {
    Config::new(model)
}

/// Runs `config` to the end; panics with the trainer's words if it does not.
pub(crate) fn run(config: &Config) -> Report {
    let trainer = Trainer::new(config).unwrap_or_else(|e| panic!("{config:?}: {e}"));
    trainer.run(&mut Quiet, &AtomicBool::new(false)).unwrap_or_else(|e| panic!("{config:?}: {e}"))
}

/// The losses of running `config`.
pub(crate) fn losses(config: &Config) -> Vec<f64> {
    run(config).losses
}

/// The one line `config` is refused with before anything runs.
pub(crate) fn refused(config: &Config) -> String {
    match Trainer::new(config) {
        Err(Error::Usage(m)) => {
            assert_eq!(m.lines().count(), 1, "one line: {m}");
            m
        }
        Err(other) => panic!("{config:?}: refused as a failure: {other}"),
        Ok(_) => panic!("{config:?}: accepted"),
    }
}

/// Asserts `config` is refused with a line containing `says`.
pub(crate) fn refused_with(config: &Config, says: &str) {
    let m = refused(config);
    assert!(m.contains(says), "want {says:?} in {m:?}");
}

/// A losses list a run wrote (`null` for a loss that was not finite).
pub(crate) fn read_losses(path: &Path) -> Vec<Option<f64>> {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// [`read_losses`], every loss finite.
pub(crate) fn read_finite(path: &Path) -> Vec<f64> {
    read_losses(path).into_iter().map(|l| l.expect("a finite loss")).collect()
}

/// Each `got[k]` within `rel` (relative) of `want[k]`, as many of each.
pub(crate) fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * w.abs(), "{what}: step {k}: {g} vs {w}");
    }
}

/// An observer that asks the run to stop once step `after` is done.
pub(crate) struct StopAfter {
    pub(crate) after: usize,
    pub(crate) flag: Arc<AtomicBool>,
    pub(crate) seen: Vec<usize>,
}

impl Observer for StopAfter {
    fn step(&mut self, step: &Step) {
        self.seen.push(step.step);
        if step.step >= self.after {
            self.flag.store(true, Ordering::SeqCst);
        }
    }
}

/// Writes `data` (little-endian values of NumPy type `descr`) of `shape` as `.npy`.
pub(crate) fn write_npy(path: &Path, descr: &str, shape: &[usize], data: Vec<u8>) -> PathBuf {
    std::fs::write(path, [meshwork_io::npy::header(descr, shape), data].concat()).unwrap();
    path.to_path_buf()
}

/// Int32 rows `[rows, cols]` as `.npy`.
pub(crate) fn write_npy_i32(path: &Path, rows: usize, cols: usize, values: &[i32]) -> PathBuf {
    write_npy(path, "<i4", &[rows, cols], values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// F32 values of `shape` as `.npy`.
pub(crate) fn write_npy_f32(path: &Path, shape: &[usize], values: &[f32]) -> PathBuf {
    write_npy(path, "<f4", shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// A tensor's shape and f64 values.
pub(crate) type Values = (Vec<usize>, Vec<f64>);

/// A safetensors file of f64 tensors.
pub(crate) fn write_safetensors_f64(path: &Path, tensors: &[(&str, Values)]) -> PathBuf {
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
    path.to_path_buf()
}

/// bf16's value nearest `x` (ties to even), rounded from f64 directly by the test's own
/// arithmetic: keep f64's top 7 mantissa bits (bf16's), rounding the 45 dropped.
/// (Normal bf16 values only, which a model's weights are: asserted.)
pub(crate) fn bf16_nearest(x: f64) -> f64 {
    assert!(x == 0.0 || (1e-37..3e38).contains(&x.abs()), "{x} is outside bf16's normal range");
    let bits = x.to_bits();
    let dropped = bits & ((1u64 << 45) - 1);
    let half = 1u64 << 44;
    let mut kept = bits >> 45;
    if dropped > half || (dropped == half && kept & 1 == 1) {
        kept += 1;
    }
    f64::from_bits(kept << 45)
}

/// A copy of the Hugging Face folder `model` in `out` (made), its weights rounded to
/// bf16 ([`bf16_nearest`]) and stored in f64: what a run holding the base in bf16
/// computes from.
pub(crate) fn bf16_rounded_folder(model: &Path, out: &Path) -> PathBuf {
    std::fs::create_dir_all(out).unwrap();
    for f in ["config.json", "generation_config.json"] {
        if model.join(f).exists() {
            std::fs::copy(model.join(f), out.join(f)).unwrap();
        }
    }
    let weights = meshwork_train::read_init(&model.join("model.safetensors"), 1 << 30).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let rounded: Vec<(&str, Values)> = names
        .into_iter()
        .map(|n| {
            let t = &weights[n];
            (n.as_str(), (t.shape().to_vec(), t.to_f64().into_iter().map(bf16_nearest).collect()))
        })
        .collect();
    write_safetensors_f64(&out.join("model.safetensors"), &rounded);
    out.to_path_buf()
}

/// The names of the `step-…` directories in `dir`, sorted.
pub(crate) fn step_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    names
}

/// Checks `inspect --json` of `config`, a transformer on a `1xM` mesh of `m` devices:
/// Megatron-sharded weights and their Adam slots at 1/m per device (the rest whole),
/// a step's uploads exactly each device's batch and scalars, one compilation.
pub(crate) fn check_inspect_json(config: &Config, m: u64) {
    let text = meshwork_train::inspect_json(config).unwrap_or_else(|e| panic!("{e}"));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut split = 0;
    for w in json["weights"].as_array().unwrap() {
        let name = w["name"].as_str().unwrap();
        let weight = name.strip_prefix("optimizer.").map_or(name, |r| r.split_once('.').unwrap().1);
        let whole = w["whole_bytes"].as_u64().unwrap();
        // Megatron's: the attention's projections and the MLP's weights (and its
        // first bias) split over `model`; embeddings, norms and other biases whole.
        let megatron = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.b1"];
        let sharded = megatron.iter().any(|s| weight.ends_with(s));
        let at = w["bytes"].as_array().unwrap();
        assert_eq!(at.len() as u64, m, "{name}: held on every device");
        for d in at {
            let bytes = d[1].as_u64().unwrap();
            let want = if sharded { whole / m } else { whole };
            assert_eq!(bytes, want, "{name} on device {}: {bytes} of {whole}", d[0]);
        }
        split += usize::from(sharded);
    }
    assert!(split >= 12, "{split} sharded weights and slots: {text}");
    let per_step = &json["per_step"];
    let batch = per_step["batch_bytes"].as_u64().unwrap();
    // Each device the whole batch, a learning rate and a step count (f32 and i32).
    assert_eq!(per_step["host_to_device_bytes"].as_u64().unwrap(), m * (batch + 8), "{text}");
    // Each device's copy of the loss.
    assert_eq!(per_step["device_to_host_bytes"].as_u64().unwrap(), m * 4, "{text}");
    assert!(per_step["collective_bytes"].as_u64().unwrap() > 0, "{text}");
    assert_eq!(json["compiles"], 1, "{text}");
    assert_eq!(json["compiles_in_steps"], 0, "{text}");
    assert_eq!(json["steps"], 3, "{text}");
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len() as u64, m);
    for d in devices {
        let (p, o) = (d["param_bytes"].as_u64().unwrap(), d["optimizer_bytes"].as_u64().unwrap());
        assert_eq!(o, 2 * p, "Adam's two slots per weight: {text}");
    }
}

/// A copy of `llama/lora_init` in `dir` whose `adapter_config.json` sets
/// `lora_dropout` to `dropout`.
pub(crate) fn dropped_folder(dir: &Path, dropout: f64) -> PathBuf {
    let folder = dir.join("dropped");
    std::fs::create_dir(&folder).unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(testdata("llama/lora_init").join(f), folder.join(f)).unwrap();
    }
    let path = folder.join("adapter_config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["lora_dropout"] = serde_json::json!(dropout);
    std::fs::write(&path, c.to_string()).unwrap();
    folder
}
