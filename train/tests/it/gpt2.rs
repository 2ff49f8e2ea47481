//! GPT-2 against Hugging Face `transformers` (`testdata/gpt2`, made in f64 by
//! `transformers` 5.24: `FORMAT.md` there): the model read from `save_pretrained`'s
//! `model.safetensors` gives the initial logits within 1e-9, and 10 steps of
//! `torch.optim.AdamW` (lr 3e-3, weight decay 0.1 on every parameter) give
//! `losses_adamw` within 1e-9 at every step, on meshes 1x1, 2x1, 1x2, 2x2 and 4x1
//! (the batch over `data`, Megatron's split of the blocks over `model`).

use std::collections::HashMap;

use meshwork_nn::{Gpt2, Optimizer};
use meshwork_program::{Builder, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::Mesh;
use meshwork_types::{DType, Tensor};

use crate::testdata;

/// The oracle's model: its sizes from `config.json`, its weights by name.
fn oracle_model() -> (Gpt2, HashMap<String, Tensor>) {
    let text = std::fs::read_to_string(testdata("gpt2/model/config.json")).unwrap();
    let c: serde_json::Value = serde_json::from_str(&text).unwrap();
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let gpt = Gpt2 {
        vocab: n("vocab_size"),
        positions: n("n_positions"),
        dim: n("n_embd"),
        layers: n("n_layer"),
        heads: n("n_head"),
        inner: c["n_inner"].as_u64().map_or(4 * n("n_embd"), |v| v as usize),
        eps: c["layer_norm_epsilon"].as_f64().unwrap(),
    };
    let weights =
        meshwork_train::read_init(&testdata("gpt2/model/model.safetensors"), 1 << 30).unwrap();
    (gpt, weights)
}

/// The oracle's token rows `[N, 17]`.
fn rows() -> ndarray::Array2<i32> {
    let a = meshwork_io::npy::read("--tokens", &testdata("gpt2/tokens.npy"), 1 << 30).unwrap();
    a.mapv(|x| x as i32).into_dimensionality().unwrap()
}

fn expected(key: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(testdata("gpt2/expected.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()[key].clone()
}

/// The oracle's `losses_adamw`.
pub(crate) fn losses_adamw() -> Vec<f64> {
    expected("losses_adamw").as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

pub(crate) use crate::commands::gpt2::adamw_command;

/// `got` within `rel` of `want`, relative to `want`'s largest magnitude.
fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst <= rel * scale, "{what}: off by {worst:e} (scale {scale})");
}

#[test]
fn the_initial_logits_are_transformers_within_1e_9() {
    let (gpt, weights) = oracle_model();
    let rows = rows();
    let mut b = Builder::new();
    let ids = b.param("ids", "i32[4,16]".parse().unwrap()).unwrap();
    let logits = gpt.logits(&mut b, ids, DType::F64).unwrap();
    let program = b.finish(&[logits]).unwrap();
    // Every parameter the model makes is in the checkpoint, of its shape.
    let names: Vec<(String, Vec<usize>)> = program.params()[1..]
        .iter()
        .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
        .collect();
    assert_eq!(names, gpt.parameters());
    let first: Vec<i32> = rows.slice(ndarray::s![0..4, 0..16]).iter().copied().collect();
    let mut inputs = vec![Tensor::i32(&[4, 16], first).unwrap()];
    for (name, shape) in &names {
        let w = &weights[name];
        assert_eq!(w.shape(), &shape[..], "{name}");
        inputs.push(w.clone());
    }
    let got = meshwork_program::fast::Executable::compile(&program, Default::default())
        .run(&inputs, &meshwork_program::Env::local())
        .unwrap();
    let want = meshwork_io::npy::read("--logits", &testdata("gpt2/logits.npy"), 1 << 30).unwrap();
    assert_eq!(got[0].shape(), want.shape());
    assert_close(&got[0].to_f64(), &want.iter().copied().collect::<Vec<_>>(), 1e-9, "logits");
}

/// 10 AdamW steps of batch 4 (step `s` on rows `(4s + i) mod N`) on `mesh`, the
/// rows split over its `data` axis, the weights by Megatron's specs over `model`.
fn adamw_losses(mesh: Mesh) -> Vec<f64> {
    let (gpt, weights) = oracle_model();
    let rows = rows();
    let mut b = Builder::new();
    let batch = b.param("rows", "i32[4,17]".parse().unwrap()).unwrap();
    let loss = gpt.loss(&mut b, batch, DType::F64).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let trained: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let adamw = Optimizer::adamw(0.1);
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')").unwrap();
    for (name, shape) in gpt.parameters() {
        shardings = shardings.with_spec(&name, megatron_spec(&name, shape.len()));
    }
    let strategy = Strategy::data_parallel(shardings.mesh().size()).unwrap();
    let mut step =
        strategy.compile_train_step(&program, loss, &trained, adamw, &shardings).unwrap();
    for (name, _) in gpt.parameters() {
        step.set(&name, &weights[&name]).unwrap();
    }
    let n = rows.nrows();
    (0..10)
        .map(|s| {
            let picked: Vec<i32> =
                (0..4).flat_map(|i| rows.row((4 * s + i) % n).to_vec()).collect();
            step.step(&[Tensor::i32(&[4, 17], picked).unwrap()], 3e-3).unwrap()
        })
        .collect()
}

#[test]
fn adamw_reproduces_transformers_losses_on_meshes() {
    let want = losses_adamw();
    for (d, m) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)] {
        let mesh = Mesh::iota(&[("data", d), ("model", m)]).unwrap();
        let got = adamw_losses(mesh);
        assert_eq!(got.len(), want.len());
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{d}x{m}, step {s}: {g} vs {w}");
        }
    }
}

/// The oracle's checkpoint folder copied into `dir`, its tensors renamed by `rename`
/// (`None`: dropped), `extra` tensors added, stored as `dtype`, in `shards` files (an
/// index naming them when more than one).
fn rewrite(
    dir: &std::path::Path,
    rename: &dyn Fn(&str) -> Option<String>,
    extra: &[(&str, Vec<usize>)],
    dtype: safetensors::Dtype,
    shards: usize,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(testdata("gpt2/model/config.json"), dir.join("config.json")).unwrap();
    let (_, weights) = oracle_model();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    for name in names {
        let Some(new) = rename(name) else { continue };
        let t = &weights[name];
        let bytes = match dtype {
            safetensors::Dtype::BF16 => t
                .to_f64()
                .iter()
                .flat_map(|&x| meshwork_types::bf16::from_f64(x).to_le_bytes())
                .collect(),
            _ => t.to_le_bytes(),
        };
        tensors.push((new, t.shape().to_vec(), bytes));
    }
    for (name, shape) in extra {
        let n: usize = shape.iter().product();
        tensors.push((name.to_string(), shape.clone(), vec![0; n * 8]));
    }
    let per = tensors.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    for (k, chunk) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", k + 1)
        };
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = chunk
            .iter()
            .map(|(n, s, b)| {
                let d = if n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") {
                    safetensors::Dtype::F64
                } else {
                    dtype
                };
                (n.clone(), safetensors::tensor::TensorView::new(d, s.clone(), b).unwrap())
            })
            .collect();
        std::fs::write(dir.join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
        for (n, _, _) in chunk {
            map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    if shards > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

/// A checkpoint folder read whole: its model (over one position), its config as
/// written and its weights as f64, reading at most `limit` bytes of weights.
pub(crate) fn read_folder(
    dir: &std::path::Path,
    limit: u64,
) -> meshwork_train::Result<(meshwork_train::Net, serde_json::Value, HashMap<String, Tensor>)> {
    let (net, config) = meshwork_train::hf::model_of("init", dir, 1)?;
    let weights = meshwork_train::hf::read("init", dir, net.model(), DType::F64, limit)?;
    Ok((net, config, weights))
}

#[test]
fn both_checkpoint_layouts_sharded_or_not_and_half_precision_load() {
    let (gpt, want) = oracle_model();
    let tmp = tempfile::tempdir().unwrap();
    let read = |dir: &std::path::Path| read_folder(dir, 1 << 30).unwrap().2;
    let (net, _, weights) = read_folder(&testdata("gpt2/model"), 1 << 30).unwrap();
    assert_eq!(
        net.model().meta(),
        meshwork_nn::Model::meta(&meshwork_nn::CausalLm { model: gpt, seq: 1 })
    );
    assert_eq!(weights, want);
    // The original checkpoints' names (no `transformer.` prefix), with the mask
    // buffers and a stored tied head, in 3 shards.
    let original = tmp.path().join("original");
    let buffers: Vec<(String, Vec<usize>)> = (0..gpt.layers)
        .flat_map(|i| {
            [
                (format!("h.{i}.attn.bias"), vec![1, 1, gpt.positions, gpt.positions]),
                (format!("h.{i}.attn.masked_bias"), vec![]),
            ]
        })
        .chain([("lm_head.weight".to_string(), vec![gpt.vocab, gpt.dim])])
        .collect();
    let extra: Vec<(&str, Vec<usize>)> =
        buffers.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    rewrite(
        &original,
        &|n| Some(n.strip_prefix("transformer.").unwrap().to_string()),
        &extra,
        safetensors::Dtype::F64,
        3,
    );
    assert_eq!(read(&original), want);
    // bf16: every value the nearest bf16, read back as f64.
    let half = tmp.path().join("bf16");
    rewrite(&half, &|n| Some(n.to_string()), &[], safetensors::Dtype::BF16, 1);
    let got = read(&half);
    for (name, t) in &want {
        let rounded: Vec<f64> =
            t.to_f64().iter().map(|&x| meshwork_types::bf16::from_f64(x).to_f64()).collect();
        assert_eq!(got[name].to_f64(), rounded, "{name}");
    }
}

#[test]
fn a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |dir: &std::path::Path| read_folder(dir, 1 << 30).unwrap_err().to_string();
    let missing = tmp.path().join("missing");
    rewrite(
        &missing,
        &|n| (n != "transformer.h.1.mlp.c_fc.bias").then(|| n.to_string()),
        &[],
        safetensors::Dtype::F64,
        1,
    );
    let e = refused(&missing);
    assert!(
        e.starts_with("--init: ") && e.contains("no tensor transformer.h.1.mlp.c_fc.bias"),
        "{e}"
    );
    let unknown = tmp.path().join("unknown");
    rewrite(
        &unknown,
        &|n| Some(n.to_string()),
        &[("transformer.h.0.adapter", vec![2])],
        safetensors::Dtype::F64,
        1,
    );
    assert!(refused(&unknown).contains("transformer.h.0.adapter is not a tensor of the gpt2"));
    // A config whose sizes disagree with the tensors: the shape is named.
    let wider = tmp.path().join("wider");
    rewrite(&wider, &|n| Some(n.to_string()), &[], safetensors::Dtype::F64, 1);
    let config = std::fs::read_to_string(wider.join("config.json")).unwrap();
    std::fs::write(
        wider.join("config.json"),
        config.replace("\"vocab_size\": 320", "\"vocab_size\": 321"),
    )
    .unwrap();
    let e = refused(&wider);
    assert!(
        e.contains("transformer.wte.weight is [320, 32]; the config makes it [321, 32]"),
        "{e}"
    );
    std::fs::write(wider.join("config.json"), config.replace("\"gpt2\"", "\"falcon\"")).unwrap();
    assert!(refused(&wider).contains("model_type: \"falcon\" is not llama"), "{}", refused(&wider));
    // An attention variant meshwork does not compute is refused, not ignored.
    let by_layer = config.replace(
        "\"scale_attn_by_inverse_layer_idx\": false",
        "\"scale_attn_by_inverse_layer_idx\": true",
    );
    assert_ne!(by_layer, config);
    std::fs::write(wider.join("config.json"), by_layer).unwrap();
    assert!(refused(&wider).contains("scale_attn_by_inverse_layer_idx: true"));
    // Weights beyond the memory limit are refused before they are read.
    let e = read_folder(&testdata("gpt2/model"), 1000).unwrap_err().to_string();
    assert!(e.contains("the limit is 1000"), "{e}");
    assert!(refused(&tmp.path().join("absent")).contains("config.json"));
}

/// Exported weights load back the same, in a folder laid out as `save_pretrained`'s
/// (`config.json`, `model.safetensors` with its names); a folder with anything in it
/// is refused untouched.
#[test]
fn an_export_reads_back_and_never_replaces_a_file() {
    use meshwork_train::hf::write;
    let (net, config, weights) = read_folder(&testdata("gpt2/model"), 1 << 30).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    write("export-hf", &out, (net.model(), &config, None), &weights).unwrap();
    let (back_net, _, back) = read_folder(&out, 1 << 30).unwrap();
    assert_eq!(back, weights);
    // Byte for byte the oracle's tensors, under its names.
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let theirs = std::fs::read(testdata("gpt2/model/model.safetensors")).unwrap();
    let (ours, theirs) = (
        safetensors::SafeTensors::deserialize(&ours).unwrap(),
        safetensors::SafeTensors::deserialize(&theirs).unwrap(),
    );
    for (name, view) in theirs.tensors() {
        let mine = ours.tensor(&name).unwrap();
        assert_eq!(
            (mine.dtype(), mine.shape(), mine.data()),
            (view.dtype(), view.shape(), view.data()),
            "{name}"
        );
    }
    assert_eq!(ours.len(), theirs.len());
    assert_eq!(back_net.describe(), net.describe());
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    let mut want: Vec<String> = net.model().parameters().into_iter().map(|(n, _)| n).collect();
    want.sort();
    assert_eq!(names.into_iter().map(String::from).collect::<Vec<_>>(), want);
    let before = std::fs::read(out.join("config.json")).unwrap();
    let e = write("export-hf", &out, (net.model(), &config, None), &weights).unwrap_err();
    assert!(e.to_string().contains("exists and is not an empty folder"), "{e}");
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), before);
}

/// The issue's command, in-process: `--model gpt2 --init model/ --data-tokens
/// tokens.npy --seq 16 --batch 4 --steps 10 --optimizer adamw --lr 0.003
/// --weight-decay 0.1 --dtype f64`, on every mesh, reproduces `losses_adamw` (and
/// passes its one-device check).
#[test]
fn the_trainer_reproduces_transformers_adamw_run_on_meshes() {
    use meshwork_train::Config;
    let want = losses_adamw();
    for mesh in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)] {
        let config = Config { mesh: Some(mesh), ..adamw_command() };
        let got = crate::losses(&config);
        assert_eq!(got.len(), want.len(), "{mesh:?}");
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{mesh:?}, step {s}: {g} vs {w}");
        }
    }
}

/// Greedy decoding of 12 new tokens with the key-value cache from the oracle's
/// 5-token prompt gives `transformers`' `generate` ids; sampling is reproducible from
/// its seed, differs between seeds, and among the top 1 is greedy.
#[test]
fn greedy_generation_gives_transformers_ids() {
    use meshwork_train::BackendKind;
    use meshwork_train::generate::{GenerateConfig, generate};
    let g = expected("generate");
    let ids = |v: &serde_json::Value| -> Vec<i64> {
        v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
    };
    let config = GenerateConfig {
        init: testdata("gpt2/model"),
        prompt_ids: ids(&g["prompt_ids"]),
        tokenizer: None,
        max_new_tokens: 12,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        dtype: DType::F64,
        backend: BackendKind::Interpreter,
        max_memory: 1 << 30,
        lora: None,
        keep_logits: false,
    };
    let got = generate(&config).unwrap();
    assert_eq!(got.ids, ids(&g["ids"]));
    assert_eq!(got.prompt_ids, ids(&g["prompt_ids"]));
    let sampled = |seed| {
        generate(&GenerateConfig { temperature: 1.0, top_k: Some(3), seed, ..config.clone() })
            .unwrap()
            .ids
    };
    assert_eq!(sampled(7), sampled(7));
    assert_ne!(sampled(7), sampled(8));
    // Sampling among the top 1, or the smallest nucleus, is greedy.
    let top1 = GenerateConfig { temperature: 1.0, top_k: Some(1), seed: 3, ..config.clone() };
    assert_eq!(generate(&top1).unwrap().ids, ids(&g["ids"]));
    let nucleus = GenerateConfig { temperature: 1.0, top_p: Some(1e-9), seed: 3, ..config.clone() };
    assert_eq!(generate(&nucleus).unwrap().ids, ids(&g["ids"]));
    // It stops at the end-of-text id, `generation_config.json`'s before `config.json`'s,
    // and returns it: here the first new token, 228.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(testdata("gpt2/model").join(f), tmp.path().join(f)).unwrap();
    }
    std::fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": [7, 228]}"#)
        .unwrap();
    let stopping = GenerateConfig { init: tmp.path().to_path_buf(), ..config.clone() };
    let mut want = ids(&g["prompt_ids"]);
    want.push(228);
    assert_eq!(generate(&stopping).unwrap().ids, want);
    // With a tokenizer, a text prompt is its encoding (the oracle's), and the new
    // tokens come back decoded.
    let entry = &expected("encodings")[0];
    let text_prompt = meshwork_train::generate::prompt_ids(
        &testdata("gpt2/tokenizer.json"),
        entry["text"].as_str().unwrap(),
    )
    .unwrap();
    assert_eq!(text_prompt, ids(&entry["ids"]));
    let decoded = generate(&GenerateConfig {
        prompt_ids: text_prompt,
        tokenizer: Some(testdata("gpt2/tokenizer.json")),
        max_new_tokens: 3,
        ..config.clone()
    })
    .unwrap();
    assert!(decoded.text.is_some());
    // A prompt and new tokens past the model's positions are refused.
    let long = GenerateConfig { max_new_tokens: 60, ..config.clone() };
    assert!(generate(&long).unwrap_err().to_string().contains("the model has 64"));
}

/// `--export-hf` writes the trained weights as a checkpoint folder: training on from
/// it with SGD (no optimizer state to lose) continues the run exactly — one step then
/// an export then one step from it gives the losses of two steps in one run. The
/// folder is checked before any work: one with anything in it is refused untouched.
#[test]
fn an_exported_run_continues_from_its_folder() {
    use meshwork_train::{Config, Data, ModelKind, OptimizerKind};
    let tmp = tempfile::tempdir().unwrap();
    // The same 4 rows every step.
    let four: Vec<i32> = rows().slice(ndarray::s![0..4, ..]).iter().copied().collect();
    let tokens = crate::write_npy_i32(&tmp.path().join("t.npy"), 4, 17, &four);
    let run = |init: std::path::PathBuf, steps: usize, export: Option<std::path::PathBuf>| {
        crate::losses(&Config {
            init: Some(init),
            data: Data::Tokens(tokens.clone()),
            seq: Some(16),
            batch: Some(4),
            steps: Some(steps),
            optimizer: Some(OptimizerKind::Sgd),
            lr: Some(0.5),
            dtype: Some(DType::F64),
            export_hf: export,
            ..crate::config(ModelKind::Gpt2)
        })
    };
    let both = run(testdata("gpt2/model"), 2, None);
    let out = tmp.path().join("exported");
    let first = run(testdata("gpt2/model"), 1, Some(out.clone()));
    let second = run(out.clone(), 1, None);
    assert_eq!([first[0], second[0]], [both[0], both[1]]);
    assert_ne!(both[0], both[1]);
    let config = std::fs::read(out.join("config.json")).unwrap();
    let e = crate::refused(&Config {
        init: Some(testdata("gpt2/model")),
        export_hf: Some(out.clone()),
        ..crate::config(ModelKind::Gpt2)
    });
    assert!(e.contains("--export-hf") && e.contains("exists and is not an empty folder"), "{e}");
    // Nothing else may be written inside the export folder.
    std::fs::create_dir(tmp.path().join("fresh")).unwrap();
    let e = crate::refused(&Config {
        init: Some(testdata("gpt2/model")),
        export_hf: Some(tmp.path().join("fresh")),
        losses_json: Some(tmp.path().join("fresh/l.json")),
        ..crate::config(ModelKind::Gpt2)
    });
    assert!(e.contains("is inside --export-hf"), "{e}");
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), config);
}

/// The export folder is made and held from the start: a link put at its path during
/// the run (here by the observer, at the first step) is never followed — the export
/// lands in the folder the run made, and the link's target stays empty.
#[test]
fn an_export_never_follows_a_link_put_in_its_place() {
    use meshwork_train::{Config, Data, ModelKind, Observer, OptimizerKind, Step, Trainer};
    struct Swap {
        out: std::path::PathBuf,
        moved: std::path::PathBuf,
        target: std::path::PathBuf,
        done: bool,
    }
    impl Observer for Swap {
        fn step(&mut self, _: &Step) {
            if !self.done {
                std::fs::rename(&self.out, &self.moved).unwrap();
                std::os::unix::fs::symlink(&self.target, &self.out).unwrap();
                self.done = true;
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let four: Vec<i32> = rows().slice(ndarray::s![0..4, ..]).iter().copied().collect();
    let tokens = crate::write_npy_i32(&tmp.path().join("t.npy"), 4, 17, &four);
    let out = tmp.path().join("exported");
    let swap = Swap {
        out: out.clone(),
        moved: tmp.path().join("moved"),
        target: tmp.path().join("elsewhere"),
        done: false,
    };
    std::fs::create_dir(&swap.target).unwrap();
    let config = Config {
        init: Some(testdata("gpt2/model")),
        data: Data::Tokens(tokens),
        seq: Some(16),
        batch: Some(4),
        steps: Some(2),
        optimizer: Some(OptimizerKind::Sgd),
        lr: Some(0.5),
        dtype: Some(DType::F64),
        export_hf: Some(out.clone()),
        ..crate::config(ModelKind::Gpt2)
    };
    let mut observer = swap;
    Trainer::new(&config)
        .unwrap()
        .run(&mut observer, &std::sync::atomic::AtomicBool::new(false))
        .unwrap();
    assert_eq!(std::fs::read_dir(&observer.target).unwrap().count(), 0, "the link was followed");
    assert!(observer.moved.join("config.json").is_file());
    assert!(observer.moved.join("model.safetensors").is_file());
}

/// Hugging Face's tokenizer through the `tokenizers` crate: every `encodings` entry
/// of the oracle (whitespace runs, tabs, non-ASCII, the empty string) gives its ids;
/// `corpus.txt` encoded and cut into consecutive rows of 17 is `tokens.npy`; and the
/// issue's command with `--text corpus.txt --tokenizer tokenizer.json` reproduces
/// `losses_adamw`.
#[test]
fn text_through_the_tokenizer_gives_transformers_ids_rows_and_losses() {
    use meshwork_train::data::{encode, read_tokenizer};
    use meshwork_train::tokenize::token_rows;
    use meshwork_train::{Config, Data, ModelKind};
    let tokenizer = read_tokenizer(&testdata("gpt2/tokenizer.json")).unwrap();
    let encodings = expected("encodings");
    let entries = encodings.as_array().unwrap();
    assert!(entries.len() >= 5);
    for e in entries {
        let text = e["text"].as_str().unwrap();
        let want: Vec<u32> =
            e["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(encode(&tokenizer, text).unwrap(), want, "{text:?}");
    }
    let rows_of_text = token_rows(
        &testdata("gpt2/corpus.txt"),
        &testdata("gpt2/tokenizer.json"),
        320,
        16,
        1 << 30,
        None,
    )
    .unwrap();
    let (n, tokens) = (rows_of_text.n, rows_of_text.tokens);
    let want = rows();
    assert_eq!(n, want.nrows());
    assert_eq!(tokens, want.iter().copied().collect::<Vec<_>>());
    let config = Config {
        data: Data::Text(testdata("gpt2/corpus.txt")),
        tokenizer: Some(testdata("gpt2/tokenizer.json")),
        ..adamw_command()
    };
    let got = crate::losses(&config);
    let want = losses_adamw();
    assert_eq!(got.len(), want.len());
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "step {s}: {g} vs {w}");
    }
    // A tokenizer without --text, or for another model, is refused naming the flag.
    let e = crate::refused(&Config { data: Data::BuiltIn, ..config.clone() });
    assert!(e.contains("--tokenizer encodes --text FILE"), "{e}");
    let e = crate::refused(&Config { model: ModelKind::Transformer, init: None, ..config });
    assert!(e.contains("--tokenizer is for GPT-2 and the Llama family"), "{e}");
}

/// A GPT-2 run saved at step 4 on 2x1 and resumed on 1x2 (its sizes and context from
/// the checkpoint) continues to `transformers`' losses; a size flag on resume is
/// refused naming the checkpoint.
#[test]
fn a_gpt2_run_resumes_on_another_mesh() {
    use meshwork_train::Config;
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let base = Config { init: None, ..adamw_command() };
    let first = crate::run(&Config {
        init: Some(testdata("gpt2/model")),
        steps: Some(4),
        mesh: Some((2, 1)),
        checkpoint_dir: Some(ck.clone()),
        ..base.clone()
    });
    let rest = crate::run(&Config { resume: Some(ck.clone()), mesh: Some((1, 2)), ..base.clone() });
    assert_eq!(rest.first_step, 4);
    let want = losses_adamw();
    let got: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(got.len(), want.len());
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "step {s}: {g} vs {w}");
    }
    let e = crate::refused(&Config { resume: Some(ck), layers: Some(3), ..base });
    assert!(e.contains("--layers: GPT-2's sizes come from the checkpoint"), "{e}");
}

/// The memory savers change how a step computes, never what: the issue's AdamW command
/// with `--grad-accum 2`, `--remat`, `--fsdp` and all three together, on meshes,
/// reproduces `losses_adamw` within 1e-9 at every step (and, over more than one
/// device, passes the one-device check of the plain step beside it).
#[test]
fn the_memory_savers_reproduce_transformers_adamw_run() {
    use meshwork_train::Config;
    let want = losses_adamw();
    let base = adamw_command();
    let runs = [
        ((1, 1), Some(2), false, false),
        ((2, 1), Some(2), false, false),
        ((1, 1), None, true, false),
        ((2, 2), None, true, false),
        ((2, 1), None, false, true),
        ((4, 1), None, false, true),
        ((1, 2), None, false, true),
        ((2, 2), Some(2), true, true),
    ];
    for (mesh, grad_accum, remat, fsdp) in runs {
        let config = Config { mesh: Some(mesh), grad_accum, remat, fsdp, ..base.clone() };
        let what = format!("{mesh:?} grad_accum {grad_accum:?} remat {remat} fsdp {fsdp}");
        assert_close(&crate::losses(&config), &want, 1e-9, &what);
    }
}

/// `inspect --json` shows what each saver does, read from the compiled steps:
/// `--fsdp` holds 1/D of every parameter and optimizer byte per device (the weights
/// whose only dimension the model axis already splits stay whole, and it says so),
/// replacing the gradients' all-reduces by all-gathers and reduce-scatters of exactly
/// the weights' bytes; `--remat` and `--grad-accum` lower one device's peak (its
/// per-device step as the interpreter plans it) and the activation estimate.
#[test]
fn inspect_shows_fsdp_splitting_state_and_remat_and_accumulation_lowering_the_peak() {
    use meshwork_train::{Config, inspect_json};
    let json = |mesh, grad_accum, remat, fsdp| -> serde_json::Value {
        let config = Config {
            mesh: Some(mesh),
            grad_accum,
            remat,
            fsdp,
            batch: Some(8),
            preset: Some("tiny".into()),
            steps: Some(3),
            check: meshwork_train::Check::Never,
            ..crate::config(meshwork_train::ModelKind::Gpt2)
        };
        serde_json::from_str(&inspect_json(&config).unwrap()).unwrap()
    };
    let bytes = |j: &serde_json::Value, key: &str| -> Vec<u64> {
        j["devices"].as_array().unwrap().iter().map(|d| d[key].as_u64().unwrap()).collect()
    };
    let collective = |j: &serde_json::Value, kind: &str| -> u64 {
        let all = j["collectives"].as_array().unwrap();
        all.iter().filter(|c| c["kind"] == kind).map(|c| c["bytes"].as_u64().unwrap()).sum()
    };
    for data in [2u64, 4] {
        let plain = json((data as usize, 1), None, false, false);
        let split = json((data as usize, 1), None, false, true);
        for key in ["param_bytes", "optimizer_bytes"] {
            for (s, p) in bytes(&split, key).iter().zip(bytes(&plain, key)) {
                assert_eq!(s * data, p, "{key} on {data}x1");
            }
        }
        assert_eq!(split["savers"]["fsdp_replicated"], serde_json::json!([]));
        // Every weight is gathered once and its gradient scattered once: each device
        // receives the (D-1)/D of the weights it lacks, (D-1) whole weights in all.
        let weights: u64 = bytes(&plain, "param_bytes")[0];
        assert_eq!(collective(&split, "all_gather over data"), (data - 1) * weights);
        assert_eq!(collective(&split, "reduce_scatter over data"), (data - 1) * weights);
        assert!(collective(&split, "all_reduce over data") < 64, "{}", split["collectives"]);
        assert!(collective(&plain, "all_reduce over data") >= weights);
    }
    // On 2x2 the biases the model axis splits stay whole over the data axis.
    let split = json((2, 2), None, false, true);
    let kept = split["savers"]["fsdp_replicated"].as_array().unwrap();
    assert!(kept.iter().any(|n| n == "transformer.h.0.attn.c_attn.bias"), "{kept:?}");
    assert!(!kept.iter().any(|n| n == "transformer.wte.weight"), "{kept:?}");
    let peak = |j: &serde_json::Value| j["memory"]["step_peak_bytes"].as_u64().unwrap();
    let activations =
        |j: &serde_json::Value| j["memory"]["estimate"]["activation_bytes"].as_f64().unwrap();
    // --fsdp with --remat gathers a block's weights again in its backward pass (more
    // gathers, no other movement) and lowers the peak below --remat's alone.
    let remat = json((4, 1), None, true, false);
    let both = json((4, 1), None, true, true);
    assert!(peak(&both) < peak(&remat), "{} vs {}", peak(&both), peak(&remat));
    let split = json((4, 1), None, false, true);
    assert!(collective(&both, "all_gather over data") > collective(&split, "all_gather over data"));
    assert_eq!(collective(&both, "all_to_all over data"), 0, "{}", both["collectives"]);
    let plain = json((2, 1), None, false, false);
    for (what, saver) in [
        ("remat", json((2, 1), None, true, false)),
        ("grad-accum", json((2, 1), Some(2), false, false)),
    ] {
        assert!(
            peak(&saver) * 10 < peak(&plain) * 8,
            "{what}: {} vs {}",
            peak(&saver),
            peak(&plain)
        );
        assert!(activations(&saver) < activations(&plain), "{what}");
    }
}

/// The savers' flags are refused where they cannot apply, before any work.
#[test]
fn the_memory_savers_are_refused_where_they_do_not_apply() {
    use meshwork_train::{Config, ModelKind};
    let base = adamw_command();
    crate::refused_with(&Config { grad_accum: Some(0), ..base.clone() }, "--grad-accum");
    crate::refused_with(
        &Config { grad_accum: Some(3), ..base.clone() },
        "does not split into --grad-accum 3",
    );
    crate::refused_with(
        &Config { mesh: Some((2, 1)), grad_accum: Some(4), ..base.clone() },
        "over the 2 data replicas",
    );
    crate::refused_with(&Config { remat: true, ..crate::config(ModelKind::Mlp) }, "--remat");
    let pipeline = Config {
        stages: Some(2),
        mesh: Some((1, 1)),
        layers: Some(2),
        ..crate::config(ModelKind::Transformer)
    };
    for config in [
        Config { fsdp: true, ..pipeline.clone() },
        Config { remat: true, ..pipeline.clone() },
        Config { grad_accum: Some(2), ..pipeline },
    ] {
        crate::refused_with(&config, "--microbatches");
    }
}

/// Random texts in the oracle's alphabet and worse (runs of spaces and newlines, tabs,
/// non-ASCII letters, ideographic spaces, contractions, digits, punctuation).
fn text_pieces() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let piece = prop_oneof![
        Just("the"),
        Just(" cat"),
        Just("'s"),
        Just("\n"),
        Just("\n\n"),
        Just(" \n"),
        Just("  "),
        Just("\t"),
        Just("é"),
        Just(" naïve"),
        Just("日本"),
        Just("\u{3000}"),
        Just("42"),
        Just("!?"),
        Just("x"),
        Just("Mesh"),
    ];
    proptest::collection::vec(piece, 0..200).prop_map(|v| v.concat())
}

/// Long random texts (several kilobytes: longer than the check's windows), with CRLF
/// line ends mixed in.
fn long_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    (text_pieces(), text_pieces(), text_pieces(), 0u8..3).prop_map(|(a, b, c, crlf)| {
        let text = [a, b, c].join("x\ny").repeat(4);
        if crlf == 0 { text.replace('\n', "\r\n") } else { text }
    })
}

/// `text` encoded by the oracle's tokenizer from a file `chunk` bytes at a time, and
/// whole (the oracle: the tokenizer's own `encode`).
fn chunked_and_whole(text: &str, chunk: usize) -> (meshwork_train::tokenize::Encoded, Vec<u32>) {
    use meshwork_train::data::{encode, read_tokenizer};
    let tokenizer = read_tokenizer(&testdata("gpt2/tokenizer.json")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.txt");
    std::fs::write(&path, text).unwrap();
    let chunked = meshwork_train::tokenize::encode_file(&tokenizer, &path, chunk, 1 << 30);
    (chunked.unwrap(), encode(&tokenizer, text).unwrap())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

    /// Encoding a text in chunks gives the ids of encoding it whole, for any chunk
    /// size (the cuts land where the tokenizer's pre-tokenizer splits anyway, and each
    /// is checked).
    #[test]
    fn prop_chunked_encoding_equals_whole_encoding(text in text_pieces(), chunk in 8usize..300) {
        let (chunked, whole) = chunked_and_whole(&text, chunk);
        proptest::prop_assert_eq!(chunked.ids, whole, "{:?}", text);
        // A text several chunks long with a place to cut in each is cut.
        let cuts = (1..text.len()).filter(|&i| {
            let b = text.as_bytes();
            i >= 2 && b[i - 1] == b'\n' && b[i - 2].is_ascii_graphic() && b[i].is_ascii_graphic()
        });
        if text.len() > 4 * chunk && cuts.count() * chunk > 2 * text.len() {
            proptest::prop_assert!(chunked.chunks > 1, "{} bytes in one piece", text.len());
        }
    }

    /// The same for texts longer than the check's windows, cut in chunks of 64 bytes to
    /// 2 KiB: cuts are made (each text has places to cut every few hundred bytes), and
    /// the ids are the whole text's.
    #[test]
    fn prop_long_texts_are_cut_and_keep_their_ids(text in long_text(), chunk in 64usize..2048) {
        let (chunked, whole) = chunked_and_whole(&text, chunk);
        proptest::prop_assert_eq!(&chunked.ids, &whole);
        if text.len() > 8 * chunk.max(1024) {
            proptest::prop_assert!(chunked.chunks > 1, "{} bytes, chunk {}, one piece", text.len(), chunk);
        }
    }
}

/// The corpus repeated past several chunks, encoded 200 bytes at a time, gives the
/// whole encoding's ids; a text whose ids would pass `--max-memory` is refused naming
/// it, and bytes that are not UTF-8 are refused with their offset.
#[test]
fn a_long_text_is_encoded_in_chunks_within_the_memory_limit() {
    use meshwork_train::data::{encode, read_tokenizer};
    use meshwork_train::tokenize::encode_file;
    let tokenizer = read_tokenizer(&testdata("gpt2/tokenizer.json")).unwrap();
    let corpus = std::fs::read_to_string(testdata("gpt2/corpus.txt")).unwrap();
    let text = corpus.repeat(6);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("long.txt");
    std::fs::write(&path, &text).unwrap();
    let whole = encode(&tokenizer, &text).unwrap();
    let chunked = encode_file(&tokenizer, &path, 200, 1 << 30).unwrap();
    assert_eq!(chunked.ids, whole);
    assert!(chunked.chunks > text.len() / 400, "{} pieces", chunked.chunks);
    let e = encode_file(&tokenizer, &path, 200, 2000).unwrap_err().to_string();
    assert!(e.contains("--max-memory"), "{e}");
    let mut bad = text.clone().into_bytes();
    let at = bad.len() - 10;
    bad[at] = 0xFF;
    std::fs::write(&path, &bad).unwrap();
    let e = encode_file(&tokenizer, &path, 200, 1 << 30).unwrap_err().to_string();
    assert!(e.contains("not UTF-8 at byte"), "{e}");
}

/// GPT-2's tokenizer.json with `edit` applied to its JSON, written into `dir`.
fn edited_tokenizer(
    dir: &std::path::Path,
    edit: impl FnOnce(&mut serde_json::Value),
) -> std::path::PathBuf {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("gpt2/tokenizer.json")).unwrap()).unwrap();
    edit(&mut json);
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

/// Finite weights whose logits overflow f32 (the final layer norm's scale 1e25 times,
/// the embeddings 1e19 times): generation stops with an error naming the position, never
/// a token picked from an infinity (greedy took the first +inf, sampling fell
/// through to the last token).
#[test]
fn generation_from_logits_that_overflow_is_an_error() {
    use meshwork_train::BackendKind;
    use meshwork_train::generate::{GenerateConfig, generate};
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(testdata("gpt2/model").join(f), tmp.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(testdata("gpt2/model/model.safetensors")).unwrap();
    let header = meshwork_io::safetensors::parse(&bytes).unwrap();
    let mut scaled = bytes.clone();
    for e in &header.entries {
        let scale = match e.name.as_str() {
            n if n.ends_with("wte.weight") => 1e19,
            n if n.ends_with("ln_f.weight") => 1e25,
            _ => continue,
        };
        let (a, z) = (e.start as usize, (e.start + e.bytes) as usize);
        assert_eq!(e.dtype, meshwork_io::safetensors::Dtype::F64, "{}", e.name);
        for c in scaled[a..z].chunks_exact_mut(8) {
            let v = f64::from_le_bytes(c.try_into().unwrap()) * scale;
            c.copy_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(tmp.path().join("model.safetensors"), scaled).unwrap();
    let config = GenerateConfig {
        init: tmp.path().to_path_buf(),
        prompt_ids: vec![1, 2, 3],
        tokenizer: None,
        max_new_tokens: 4,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        dtype: DType::F32,
        backend: BackendKind::Interpreter,
        max_memory: 1 << 30,
        lora: None,
        keep_logits: false,
    };
    for temperature in [0.0, 1.0] {
        let e = generate(&GenerateConfig { temperature, ..config.clone() }).unwrap_err();
        assert!(matches!(e, meshwork_train::Error::Failed(_)), "{e}");
        assert!(e.to_string().contains("not finite"), "{e}");
    }
}

/// A GPT-2 folder whose safetensors header names a tensor twice (JSON keeps the last),
/// or gives an entry the model skips (`lm_head.weight`) bytes another tensor holds, is
/// refused naming the tensor: every entry's range is checked, read or not.
#[test]
fn a_gpt2_folder_with_a_repeated_or_aliased_entry_is_refused() {
    use meshwork_train::{Config, ModelKind};
    let bytes = std::fs::read(testdata("gpt2/model/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let parsed = meshwork_io::safetensors::parse(&bytes).unwrap();
    let first = &parsed.entries[0];
    let data = &bytes[8 + n..];
    let with_entry = |entry: String| {
        let json = format!("{{{entry},{}", &header.trim_end()[1..]);
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend(json.as_bytes());
        out.extend(data);
        out
    };
    let entry = |name: &str, shape: &[usize], end: u64| {
        format!(r#""{name}":{{"dtype":"F64","shape":{shape:?},"data_offsets":[0,{end}]}}"#)
    };
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            "twice",
            entry(&first.name, &first.shape, first.bytes),
            format!("{} is listed twice", first.name),
        ),
        ("aliased", entry("lm_head.weight", &[1], 8), "overlaps".to_string()),
    ];
    for (name, extra, says) in cases {
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(testdata("gpt2/model/config.json"), dir.join("config.json")).unwrap();
        std::fs::write(dir.join("model.safetensors"), with_entry(extra)).unwrap();
        let e = crate::refused(&Config { init: Some(dir), ..crate::config(ModelKind::Gpt2) });
        assert!(e.starts_with("--init") && e.contains(&says), "{name}: {e}");
    }
}

/// A post-processor template naming a special token its `special_tokens` do not
/// define (on which the tokenizers crate panics when encoding), or one whose ids lie
/// past the vocabulary, is refused on load naming `--tokenizer`: never a panic.
#[test]
fn a_tokenizer_the_library_would_panic_on_is_refused_on_load() {
    use meshwork_train::data::read_tokenizer;
    let tmp = tempfile::tempdir().unwrap();
    let undefined = edited_tokenizer(tmp.path(), |j| {
        j["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {}
        });
    });
    let e = read_tokenizer(&undefined).unwrap_err().to_string();
    assert!(e.starts_with("--tokenizer: ") && e.contains("\"[CLS]\""), "{e}");
    let past = edited_tokenizer(tmp.path(), |j| {
        j["post_processor"] = serde_json::json!({
            "type": "Sequence",
            "processors": [{
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [99999999], "tokens": ["<s>"]}}
            }]
        });
    });
    let e = read_tokenizer(&past).unwrap_err().to_string();
    assert!(e.starts_with("--tokenizer: ") && e.contains("outside the vocabulary"), "{e}");
}

/// A normalizer that expands each `a` a thousandfold would take gigabytes to encode
/// a megabyte of them; its expansion is measured on samples of the text, and the run
/// refused in one line under `--max-memory`, before the tokenizer works on it.
#[test]
fn a_normalizer_that_expands_text_is_bounded_by_max_memory() {
    use meshwork_train::data::read_tokenizer;
    use meshwork_train::tokenize::encode_file;
    let tmp = tempfile::tempdir().unwrap();
    let path = edited_tokenizer(tmp.path(), |j| {
        j["normalizer"] = serde_json::json!({
            "type": "Replace", "pattern": {"String": "a"}, "content": "b".repeat(1000)
        });
    });
    let tokenizer = read_tokenizer(&path).unwrap();
    let text = tmp.path().join("a.txt");
    std::fs::write(&text, "a\n".repeat(1 << 19)).unwrap();
    let e = encode_file(&tokenizer, &text, 1 << 20, 16 << 20).unwrap_err().to_string();
    assert!(e.contains("normalizer expands") && e.contains("--max-memory"), "{e}");
    // A text it expands little encodes as before.
    std::fs::write(&text, "the dog sit\n".repeat(100)).unwrap();
    let short = encode_file(&tokenizer, &text, 1 << 20, 16 << 20).unwrap();
    assert!(!short.ids.is_empty());
}

/// `--cache-dir`: the first run encodes and writes `tokens-<sha256>.npy` there (and
/// nothing beside the text), the second reads the same rows back; another `--seq` is
/// another key; a damaged cache file is encoded again and replaced; a run through the
/// trainer with the cache reproduces `losses_adamw`.
#[test]
fn encoded_rows_are_cached_by_what_made_them() {
    use meshwork_train::tokenize::{cache_key, cached_entry, token_rows};
    use meshwork_train::{Config, Data};
    let tmp = tempfile::tempdir().unwrap();
    let (text, tok) = (tmp.path().join("text").join("corpus.txt"), testdata("gpt2/tokenizer.json"));
    std::fs::create_dir(text.parent().unwrap()).unwrap();
    std::fs::copy(testdata("gpt2/corpus.txt"), &text).unwrap();
    let cache = tmp.path().join("cache");
    let first = token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap();
    assert!(!first.hit);
    let file = first.cached.clone().unwrap();
    assert_eq!(cached_entry(&cache, &cache_key(&text, &tok, 17).unwrap()).unwrap().0, file);
    assert!(file.is_file());
    let beside: Vec<_> = std::fs::read_dir(text.parent().unwrap()).unwrap().collect();
    assert_eq!(beside.len(), 1, "only the text is beside the text");
    let second = token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap();
    assert!(second.hit);
    assert_eq!((second.n, &second.tokens), (first.n, &first.tokens));
    assert_ne!(cache_key(&text, &tok, 9).unwrap(), cache_key(&text, &tok, 17).unwrap());
    std::fs::write(&file, b"not an npy").unwrap();
    let again = token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap();
    assert!(!again.hit && again.warning.as_deref().unwrap().contains("damaged"));
    assert_eq!(again.tokens, first.tokens);
    assert!(token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap().hit);
    // Ids changed to other valid ids: the structure checks pass, the checksum does not.
    let entry = again.cached.clone().unwrap();
    let mut wrong = first.tokens.clone();
    wrong[5] = (wrong[5] + 1) % 320;
    std::fs::write(&entry, meshwork_train::tokenize::npy_bytes(first.n, 17, &wrong)).unwrap();
    let damaged = token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap();
    assert!(!damaged.hit, "rows whose ids were changed are not used");
    assert!(damaged.warning.as_deref().unwrap().contains("damaged"));
    assert_eq!(damaged.tokens, first.tokens);
    let healed = token_rows(&text, &tok, 320, 16, 1 << 30, Some(&cache)).unwrap();
    assert!(healed.hit && healed.warning.is_none());
    assert_eq!(healed.tokens, first.tokens);
    let config = Config {
        data: Data::Text(text.clone()),
        tokenizer: Some(tok.clone()),
        cache_dir: Some(cache.clone()),
        ..adamw_command()
    };
    assert_close(&crate::losses(&config), &losses_adamw(), 1e-9, "from the cache");
    crate::refused_with(
        &Config { tokenizer: None, data: Data::Text(text), ..config },
        "--cache-dir caches --text encoded by --tokenizer",
    );
}

/// A text that changes while it is encoded never has its rows stored under the other
/// text's key: whatever key an entry is under, its rows are that text's. (Two texts
/// swapped underneath by a thread; each run's entry checked against a fresh encoding.)
#[test]
fn a_text_changing_underneath_never_poisons_the_cache() {
    use meshwork_train::tokenize::{cache_key, cached_entry, token_rows};
    let tmp = tempfile::tempdir().unwrap();
    let tok = testdata("gpt2/tokenizer.json");
    let corpus = std::fs::read_to_string(testdata("gpt2/corpus.txt")).unwrap();
    let texts = [corpus.clone(), corpus.to_uppercase()];
    let path = tmp.path().join("t.txt");
    let (a, b) = (tmp.path().join("a.txt"), tmp.path().join("b.txt"));
    std::fs::write(&a, &texts[0]).unwrap();
    std::fs::write(&b, &texts[1]).unwrap();
    let want: Vec<Vec<i32>> = [&a, &b]
        .iter()
        .map(|p| token_rows(p, &tok, 1 << 20, 16, 1 << 30, None).unwrap().tokens)
        .collect();
    let keys = [cache_key(&a, &tok, 17).unwrap(), cache_key(&b, &tok, 17).unwrap()];
    std::fs::write(&path, &texts[0]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (stop, path, dir) = (stop.clone(), path.clone(), tmp.path().to_path_buf());
        let texts = texts.clone();
        std::thread::spawn(move || {
            let mut k = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let tmp = dir.join("swap.tmp");
                std::fs::write(&tmp, &texts[k % 2]).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
                k += 1;
            }
        })
    };
    for run in 0..40 {
        let cache = tmp.path().join(format!("cache-{run}"));
        if token_rows(&path, &tok, 1 << 20, 16, 1 << 30, Some(&cache)).is_err() {
            continue;
        }
        for (key, rows) in keys.iter().zip(&want) {
            if let Some((file, _)) = cached_entry(&cache, key) {
                let stored = meshwork_io::npy::read("--x", &file, 1 << 30).unwrap();
                let stored: Vec<i32> = stored.iter().map(|&v| v as i32).collect();
                assert_eq!(&stored, rows, "run {run}: another text's rows under this key");
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    swapper.join().unwrap();
}

/// bf16 products (`--precision bf16`, the weights and Adam's state in f32) track f32
/// over 60 steps of the tiny GPT-2 on its built-in rows: every loss within 2% of
/// f32's (they are not equal: the products do round).
#[test]
fn bf16_training_of_a_tiny_gpt2_tracks_f32() {
    use meshwork_train::{Config, ModelKind};
    let base = Config {
        preset: Some("tiny".into()),
        steps: Some(60),
        batch: Some(8),
        ..crate::config(ModelKind::Gpt2)
    };
    let full = crate::losses(&base);
    let bf16 = crate::losses(&Config { precision: Some(DType::BF16), ..base });
    assert_eq!(bf16.len(), 60);
    let worst = bf16.iter().zip(&full).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    assert!(worst < 0.02, "a bf16 loss is {worst} off f32's");
    assert!(worst > 0.0, "bf16 products round");
    assert!(full[59] < 0.5 * full[0], "it trains: {} -> {}", full[0], full[59]);
}

/// The oracle's first rows (one batch, so a step that changes nothing repeats its
/// loss exactly).
fn one_batch_of_rows(dir: &std::path::Path) -> std::path::PathBuf {
    let rows: Vec<i32> = rows().iter().copied().take(8 * 17).collect();
    let path = dir.join("rows8.npy");
    std::fs::write(&path, meshwork_train::tokenize::npy_bytes(8, 17, &rows)).unwrap();
    path
}

/// f16 products with dynamic loss scaling survive overflow: started at a scale of
/// 1e12, the f16 gradients overflow, so the first steps are skipped (the weights stay
/// as they were: the same batch gives the same loss, exactly) while the scale halves,
/// then training goes on, every loss finite; at `GradScaler`'s 65536 f16 tracks f32.
#[test]
fn f16_with_loss_scaling_survives_an_overflow() {
    use meshwork_train::{Config, Data, OptimizerKind};
    let tmp = tempfile::tempdir().unwrap();
    let base = Config {
        data: Data::Tokens(one_batch_of_rows(tmp.path())),
        batch: Some(8),
        steps: Some(40),
        optimizer: Some(OptimizerKind::Adam),
        dtype: Some(DType::F32),
        optimizer_settings: Default::default(),
        ..adamw_command()
    };
    let overflow =
        Config { precision: Some(DType::F16), loss_scale_init: Some(1e12), ..base.clone() };
    let got = crate::losses(&overflow);
    assert!(got.iter().all(|l| l.is_finite()), "{got:?}");
    let skipped = got.iter().take_while(|&&l| l == got[0]).count();
    // 1e12 halves below f16's range of about 65504 · 2^k after some 10–30 steps.
    assert!((5..35).contains(&skipped), "{skipped} steps skipped: {got:?}");
    assert!(got[39] < 0.8 * got[0], "it trains after the overflow: {got:?}");
    let full = crate::losses(&base);
    let f16 = crate::losses(&Config { precision: Some(DType::F16), ..base.clone() });
    let worst = f16.iter().zip(&full).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    assert!(worst < 0.1, "f16 at 65536 is {worst} off f32: {f16:?} vs {full:?}");
    assert!(f16[1] != f16[0], "the first f16 step is taken");
    // The scale is f16's: refused elsewhere, and not positive.
    crate::refused_with(
        &Config { loss_scale_init: Some(8.0), ..base.clone() },
        "needs --precision f16",
    );
    crate::refused_with(
        &Config { precision: Some(DType::F16), loss_scale_init: Some(-1.0), ..base.clone() },
        "--loss-scale-init",
    );
    crate::refused_with(&Config { precision: Some(DType::F32), ..base }, "--precision f32");
}

/// A run with loss scaling checkpoints its scale; resumed without `--precision` it
/// goes on in f16 (the checkpoint's run's), and resuming a run without scaling with
/// `--precision f16` is refused naming `--resume`.
#[test]
fn loss_scaling_resumes_only_with_f16() {
    use meshwork_train::{Config, Data};
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let base = Config {
        data: Data::Tokens(one_batch_of_rows(tmp.path())),
        batch: Some(8),
        steps: Some(4),
        dtype: Some(DType::F32),
        checkpoint_dir: Some(ck.clone()),
        ..adamw_command()
    };
    let f16 = Config { precision: Some(DType::F16), ..base.clone() };
    let first = crate::losses(&f16);
    let on = Config { resume: Some(ck.clone()), init: None, steps: Some(6), ..f16.clone() };
    let more = crate::losses(&on);
    assert_eq!(more.len(), 2);
    assert!(more.iter().all(|l| l.is_finite() && *l < first[0]));
    // --precision not given: the checkpoint's run's (f16, its loss scale) goes on.
    let remembered = crate::losses(&Config { precision: None, steps: Some(8), ..on.clone() });
    assert_eq!(remembered.len(), 2);
    assert!(remembered.iter().all(|l| l.is_finite() && *l < first[0]));
    let ck2 = tmp.path().join("ck2");
    crate::losses(&Config { checkpoint_dir: Some(ck2.clone()), ..base });
    crate::refused_with(
        &Config { resume: Some(ck2), checkpoint_dir: None, ..on },
        "saved by a run without loss scaling",
    );
}

/// Blocked attention and a chunked loss give the same losses: the issue's AdamW
/// command with queries 5 at a time and the loss in chunks of 3 positions (neither
/// dividing the context of 16) reproduces `losses_adamw` within 1e-9 on meshes, with
/// `--remat` too (the pieces nest in the blocks); and on a context of 64 the pieces
/// lower the step's peak, so that no `[T, T]` scores or whole `[B, T, V]` logits are
/// held at once.
#[test]
fn blocked_attention_and_a_chunked_loss_reproduce_transformers_losses() {
    use meshwork_nn::Blocking;
    use meshwork_train::{Config, ModelKind, inspect_json};
    let want = losses_adamw();
    let blocking = Some(Blocking { query_block: 5, loss_chunk: 3, ..Default::default() });
    for (mesh, remat) in [((1, 1), false), ((2, 1), true), ((1, 2), false), ((2, 2), true)] {
        let config = Config { mesh: Some(mesh), blocking, remat, ..adamw_command() };
        assert_close(&crate::losses(&config), &want, 1e-9, &format!("blocked on {mesh:?}"));
    }
    let peak = |blocking| -> u64 {
        let config = Config {
            preset: Some("tiny".into()),
            batch: Some(4),
            blocking: Some(blocking),
            check: meshwork_train::Check::Never,
            ..crate::config(ModelKind::Gpt2)
        };
        let json: serde_json::Value =
            serde_json::from_str(&inspect_json(&config).unwrap()).unwrap();
        json["memory"]["step_peak_bytes"].as_u64().unwrap()
    };
    let whole = peak(Blocking::default());
    let pieces = peak(Blocking { query_block: 8, loss_chunk: 8, ..Default::default() });
    // At this size the blocks' other activations dominate; the pieces still take a
    // fifth off (their share grows with the context and vocabulary).
    assert!(pieces * 100 < whole * 85, "peak {pieces} in pieces, {whole} whole");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Any box of any tensor of the oracle's checkpoint, read from the safetensors
    /// headers' offsets alone, equals that box of the tensor as the `safetensors`
    /// crate reads the whole file, and only the box's bytes are read.
    #[test]
    fn prop_a_box_of_a_checkpoint_tensor_reads_only_its_bytes(
        pick in 0usize..1000,
        cuts in proptest::collection::vec((0usize..1000, 0usize..1000), 2),
    ) {
        let dir = testdata("gpt2/model");
        let (net, _) = meshwork_train::hf::model_of("init", &dir, 1).unwrap();
        let shards = meshwork_train::hf::index("init", &dir, net.model(), DType::F64, 1 << 30).unwrap();
        let params = net.model().parameters();
        let (name, shape) = &params[pick % params.len()];
        let ranges: Vec<std::ops::Range<usize>> = shape
            .iter()
            .zip(&cuts)
            .map(|(&d, &(a, b))| {
                let (a, b) = (a % (d + 1), b % (d + 1));
                a.min(b)..a.max(b)
            })
            .collect();
        let before = shards.bytes_read();
        let got = shards.read(name, &ranges, DType::F64).unwrap();
        let count: usize = ranges.iter().map(|r| r.end - r.start).product();
        // The oracle is stored in f64.
        proptest::prop_assert_eq!(shards.bytes_read() - before, (count * 8) as u64);
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let view = st.tensor(name).unwrap();
        let whole: Vec<f64> =
            view.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        let whole = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), whole).unwrap();
        let want = whole.slice_each_axis(|ax| {
            let r = &ranges[ax.axis.index()];
            ndarray::Slice::from(r.start..r.end)
        });
        proptest::prop_assert_eq!(got.shape(), want.shape());
        proptest::prop_assert_eq!(got.to_f64(), want.iter().copied().collect::<Vec<_>>());
    }
}
