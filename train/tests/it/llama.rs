//! The Llama family against Hugging Face `transformers` (`testdata/llama`: Llama with
//! grouped-query attention and llama3 rotary scaling, untied; `testdata/qwen3`: Qwen 3
//! with one key/value head, per-head q/k norms, tied; `testdata/qwen2`: Qwen 2's q/k/v
//! biases, linear rotary scaling, tied, a pad token; `testdata/mistral`: one key/value
//! head, a sliding window longer than the context; `testdata/llama-bias`: Llama's
//! attention and MLP biases, heads wider than hidden / heads, a pad token), made in
//! float64 by `transformers` 5.24 (`llama/FORMAT.md`).
//!
//! One part of `transformers`' computation is not reproduced: PyTorch takes the rotary
//! tables' float32 `cos` and `sin` from Intel MKL, whose results differ from the
//! correctly rounded ones (meshwork's) in about 5% of entries, and whose algorithm is
//! not published. Downstream, `transformers`' float32 RMSNorm turns those last-place
//! differences into float32-sized ones (about 1e-7 in the logits). So each case is also
//! checked against `transformers` with correctly rounded tables (`gen_rope_cr.py`:
//! `logits_rope_cr.npy`, `rope_cr.json`), whose logits meshwork gives to 1e-15
//! (measured: 6e-16 at worst; tested to 1e-14).

use meshwork_nn::Llama;
use meshwork_program::Builder;
use meshwork_types::{DType, Tensor};

use crate::testdata;

/// Every oracle case.
const CASES: [&str; 5] = ["llama", "qwen3", "qwen2", "mistral", "llama-bias"];

/// The oracle `case`'s model from its `config.json`, and its weights by name.
pub(crate) fn oracle_model(case: &str) -> (Llama, std::collections::HashMap<String, Tensor>) {
    let text = std::fs::read_to_string(testdata(&format!("{case}/model/config.json"))).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let model = Llama::from_config(&config).unwrap();
    let weights =
        meshwork_train::read_init(&testdata(&format!("{case}/model/model.safetensors")), 1 << 30)
            .unwrap();
    (model, weights)
}

/// The oracle's token rows.
pub(crate) fn rows(case: &str) -> ndarray::Array2<i32> {
    let a = meshwork_io::npy::read("--tokens", &testdata(&format!("{case}/tokens.npy")), 1 << 30)
        .unwrap();
    a.mapv(|x| x as i32).into_dimensionality().unwrap()
}

/// The largest difference of `got` from `want`, relative to `want`'s largest magnitude.
fn relative(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale
}

/// The logits of the oracle's first rows `[4, 16]` by `model` with `weights`.
fn logits_of(
    case: &str,
    model: &Llama,
    weights: &std::collections::HashMap<String, Tensor>,
) -> Tensor {
    let mut b = Builder::new();
    let ids = b.param("ids", "i32[4,16]".parse().unwrap()).unwrap();
    let logits = model.logits(&mut b, ids, DType::F64).unwrap();
    let program = b.finish(&[logits]).unwrap();
    let r = rows(case);
    let first: Vec<i32> = r.slice(ndarray::s![0..4, 0..16]).iter().copied().collect();
    let mut inputs = vec![Tensor::i32(&[4, 16], first).unwrap()];
    for p in &program.params()[1..] {
        inputs.push(weights[&p.name].clone());
    }
    meshwork_program::fast::evaluate(&program, &inputs).unwrap().remove(0)
}

#[test]
fn the_initial_logits_are_transformers() {
    for case in CASES {
        let (model, weights) = oracle_model(case);
        let mut b = Builder::new();
        let ids = b.param("ids", "i32[4,16]".parse().unwrap()).unwrap();
        let logits = model.logits(&mut b, ids, DType::F64).unwrap();
        let program = b.finish(&[logits]).unwrap();
        let names: Vec<(String, Vec<usize>)> = program.params()[1..]
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
            .collect();
        assert_eq!(names, model.parameters(), "{case}");
        // Every tensor of the checkpoint is a parameter.
        assert_eq!(weights.len(), names.len(), "{case}");
        let r = rows(case);
        let first: Vec<i32> = r.slice(ndarray::s![0..4, 0..16]).iter().copied().collect();
        let mut inputs = vec![Tensor::i32(&[4, 16], first).unwrap()];
        for (name, shape) in &names {
            let w = &weights[name];
            assert_eq!(w.shape(), &shape[..], "{case} {name}");
            inputs.push(w.clone());
        }
        let got = meshwork_program::fast::evaluate(&program, &inputs).unwrap();
        for (file, tolerance) in [("logits_rope_cr.npy", 1e-14), ("logits.npy", 2e-7)] {
            let path = testdata(&format!("{case}/{file}"));
            let want = meshwork_io::npy::read("--logits", &path, 1 << 30).unwrap();
            assert_eq!(got[0].shape(), want.shape());
            let rel = relative(&got[0].to_f64(), &want.iter().copied().collect::<Vec<_>>());
            assert!(rel <= tolerance, "{case}: logits off {file}'s by {rel:e}");
        }
    }
}

pub(crate) use crate::commands::llama::{adamw_command, expected, losses_adamw};

/// Each loss within `rel` of `want`'s (relative), as many.
fn within(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");

    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs(),
            "{what}, step {s}: {g} vs {w} ({:e})",
            (g - w).abs() / w
        );
    }
}

/// The AdamW run from the folder (its model, tokenizer and weights) on every mesh —
/// one key/value head (Qwen 3, Mistral) held whole by every model position, Qwen 2's
/// two over four — and with `--fsdp`, gives `transformers`' losses within 3e-9 at
/// every step, with MKL's rotary tables or correctly rounded ones. (Measured: 1.9e-9
/// at worst; every mesh's losses equal one device's to 1e-15. What is left is float32
/// rounding: PyTorch's RMSNorm backward sums each row's `g·x` in its 8-lane cascade,
/// meshwork's autodiff in its own order, and 10 AdamW steps carry those last-place
/// differences into the weights. PyTorch with that one sum reordered moves as far
/// from itself.)
#[test]
fn the_trainer_reproduces_transformers_adamw_run_on_meshes() {
    use meshwork_train::Config;
    for case in CASES {
        let cr = losses_adamw(case, "rope_cr.json");
        let theirs = losses_adamw(case, "expected.json");
        let meshes: &[((usize, usize), bool)] = match case {
            "llama" | "qwen3" => &[
                ((1, 1), false),
                ((2, 1), false),
                ((1, 2), false),
                ((2, 2), false),
                ((2, 1), true),
                ((2, 2), true),
            ],
            // Qwen 2's two key/value heads over four model positions.
            "qwen2" => &[((1, 1), false), ((1, 4), false), ((2, 2), true)],
            _ => &[((1, 1), false), ((1, 2), false), ((2, 1), true)],
        };
        for &(mesh, fsdp) in meshes {
            let got = crate::losses(&Config { mesh: Some(mesh), fsdp, ..adamw_command(case) });
            let what =
                format!("{case} on {}x{}{}", mesh.0, mesh.1, if fsdp { " --fsdp" } else { "" });
            within(&got, &cr, 3e-9, &what);
            within(&got, &theirs, 3e-9, &what);
        }
    }
}

fn ids_of(v: &serde_json::Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

/// A complete Hugging Face folder of `case` in `dir`: the model's files and the
/// tokenizer's (its `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).
pub(crate) fn whole_folder(case: &str, dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(testdata(&format!("{case}/model"))).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(testdata(&format!("{case}/{f}")), dir.join(f)).unwrap();
    }
}

/// Greedy decoding with the key-value cache (key/value heads only, positions rotated
/// as in training) gives `transformers`' `generate` ids; a text prompt through the
/// folder's tokenizer decodes back to its text.
#[test]
fn greedy_generation_gives_transformers_ids() {
    use meshwork_train::BackendKind;
    use meshwork_train::generate::{GenerateConfig, generate, prompt_ids};
    for case in CASES {
        let g = expected(case, "expected.json", "generate");
        let config = GenerateConfig {
            init: testdata(&format!("{case}/model")),
            prompt_ids: ids_of(&g["prompt_ids"]),
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
        assert_eq!(got.ids, ids_of(&g["ids"]), "{case}");
        // The cache holds the key/value heads: a smaller model's cache for Qwen 3.
        let tokenizer = testdata(&format!("{case}/tokenizer.json"));
        let text = "Every replica learns the gradient again.";
        let ids = prompt_ids(&tokenizer, text).unwrap();
        let want = ids_of(&expected(case, "expected.json", "encodings")[0]["ids"]);
        assert_eq!(ids, want, "{case}");
        let tok = meshwork_train::data::read_tokenizer(&tokenizer).unwrap();
        let back = tok.decode(&ids.iter().map(|&t| t as u32).collect::<Vec<_>>(), false).unwrap();
        assert_eq!(back, text);
    }
}

/// Decoding with the key-value cache, one token at a time along the oracle's first
/// row, gives `transformers`' logits of the whole row at every position (without a
/// cache), for every case: GQA and MQA caches, biases, q/k norms, every rotary
/// scaling, the pad row.
#[test]
fn cached_decoding_gives_the_whole_rows_logits() {
    use meshwork_nn::Decoder;
    for case in CASES {
        let (model, weights) = oracle_model(case);
        let t = 16;
        let mut b = Builder::new();
        let token = b.param("token", "i32[1]".parse().unwrap()).unwrap();
        let position = b.param("position", "i32[]".parse().unwrap()).unwrap();
        let outs = Decoder::decode_step(&model, &mut b, token, position, t, DType::F64).unwrap();
        let program = b.finish(&outs).unwrap();
        let caches = Decoder::cache(&model, 1, t);
        assert_eq!(outs.len(), 1 + caches.len());
        let mut state: Vec<Tensor> = program.params()[2..]
            .iter()
            .map(|p| match caches.iter().find(|(n, _)| *n == p.name) {
                Some((_, shape)) => Tensor::zeros(DType::F64, shape).unwrap(),
                None => weights[&p.name].clone(),
            })
            .collect();
        let row = rows(case);
        let want = meshwork_io::npy::read(
            "--logits",
            &testdata(&format!("{case}/logits_rope_cr.npy")),
            1 << 30,
        )
        .unwrap();
        let v = want.shape()[2];
        let mut worst = 0.0f64;
        for p in 0..t {
            let mut inputs = vec![
                Tensor::i32(&[1], vec![row[[0, p]]]).unwrap(),
                Tensor::i32(&[], vec![p as i32]).unwrap(),
            ];
            inputs.extend(state.iter().cloned());
            let got = meshwork_program::fast::evaluate(&program, &inputs).unwrap();
            let theirs: Vec<f64> = (0..v).map(|k| want[[0, p, k]]).collect();
            worst = worst.max(relative(&got[0].to_f64(), &theirs));
            // The caches carried into the next step.
            for (j, (name, _)) in caches.iter().enumerate() {
                let k = program.params()[2..].iter().position(|q| &q.name == name).unwrap();
                state[k] = got[1 + j].clone();
            }
        }
        assert!(worst <= 1e-12, "{case}: cached logits off by {worst:e}");
    }
}

/// `--chat`: the folder's template (`chat_template.jinja`, or 4.x's `chat_template`
/// string in `tokenizer_config.json`, its special tokens as strings or `AddedToken`
/// objects) rendered with a generation prompt gives `apply_chat_template`'s text and
/// ids.
#[test]
fn chat_templates_render_as_apply_chat_template_does() {
    use meshwork_train::chat::{ChatTemplate, chat_prompt_ids, read_messages};
    let tmp = tempfile::tempdir().unwrap();
    for case in ["llama", "qwen3"] {
        let chat = expected(case, "expected.json", "chat");
        let messages = tmp.path().join(format!("{case}-messages.json"));
        std::fs::write(&messages, chat["messages"].to_string()).unwrap();
        let v5 = tmp.path().join(format!("{case}-v5"));
        whole_folder(case, &v5);
        let template = ChatTemplate::of_folder("init", &v5).unwrap();
        let read = read_messages("chat", &messages).unwrap();
        assert_eq!(template.render("chat", &read).unwrap(), chat["text"].as_str().unwrap());
        let tokenizer = v5.join("tokenizer.json");
        assert_eq!(chat_prompt_ids(&v5, &tokenizer, &messages).unwrap(), ids_of(&chat["ids"]));
        // transformers 4.x's layout: the template inside tokenizer_config.json.
        let v4 = tmp.path().join(format!("{case}-v4"));
        whole_folder(case, &v4);
        let source = std::fs::read_to_string(v4.join("chat_template.jinja")).unwrap();
        std::fs::remove_file(v4.join("chat_template.jinja")).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<|endoftext|>", "lstrip": false, "normalized": false,
                          "rstrip": false, "single_word": false, "special": true},
            "eos_token": "<|endoftext|>",
            "chat_template": source,
        });
        std::fs::write(v4.join("tokenizer_config.json"), config.to_string()).unwrap();
        assert_eq!(chat_prompt_ids(&v4, &tokenizer, &messages).unwrap(), ids_of(&chat["ids"]));
    }
    // A template that raises, a folder without one, messages that are not a list or
    // none.
    let dir = tmp.path().join("raises");
    whole_folder("llama", &dir);
    std::fs::write(dir.join("chat_template.jinja"), "{{ raise_exception('no system role') }}")
        .unwrap();
    let messages = tmp.path().join("m.json");
    std::fs::write(&messages, r#"[{"role": "system", "content": "x"}]"#).unwrap();
    let e = chat_prompt_ids(&dir, &dir.join("tokenizer.json"), &messages).unwrap_err().to_string();
    assert!(e.starts_with("--chat: ") && e.contains("no system role"), "{e}");
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let e = chat_prompt_ids(&dir, &dir.join("tokenizer.json"), &messages).unwrap_err().to_string();
    assert!(e.contains("no chat template"), "{e}");
    std::fs::write(&messages, r#"{"role": "user"}"#).unwrap();
    let e = chat_prompt_ids(&dir, &dir.join("tokenizer.json"), &messages).unwrap_err().to_string();
    assert!(e.contains("not a JSON list of messages"), "{e}");
    // `apply_chat_template` refuses an empty conversation; so does meshwork.
    std::fs::write(&messages, "[]").unwrap();
    let e = chat_prompt_ids(&dir, &dir.join("tokenizer.json"), &messages).unwrap_err().to_string();
    assert!(e.contains("an empty conversation"), "{e}");
}

/// `config.json` as transformers 4.x wrote it: `rope_theta` and `rope_scaling` at the
/// top level, `torch_dtype` for `dtype`.
fn v4_layout(config: &serde_json::Value) -> serde_json::Value {
    let mut c = config.clone();
    let o = c.as_object_mut().unwrap();
    let mut rope = o.remove("rope_parameters").unwrap();
    let r = rope.as_object_mut().unwrap();
    o.insert("rope_theta".into(), r.remove("rope_theta").unwrap());
    let scaling = if r.get("rope_type").and_then(|t| t.as_str()) == Some("default") {
        serde_json::Value::Null
    } else {
        rope
    };
    o.insert("rope_scaling".into(), scaling);
    let dtype = o.remove("dtype").unwrap();
    o.insert("torch_dtype".into(), dtype);
    c
}

/// The oracle's folder copied into `dir` with its `config.json` edited by `edit`.
fn edited_folder(case: &str, dir: &std::path::Path, edit: &dyn Fn(&mut serde_json::Value)) {
    whole_folder(case, dir);
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&c).unwrap()).unwrap();
}

/// A 4.x-layout copy of each oracle's `config.json` is the same model, with the same
/// logits; a field that would change the computation and that meshwork does not
/// compute is refused naming it (the trainer's exit 2, one line), and the fields that
/// do not change it are accepted.
#[test]
fn configs_of_both_layouts_are_read_and_what_is_not_computed_is_refused() {
    use meshwork_train::Config;
    let tmp = tempfile::tempdir().unwrap();
    for case in ["llama", "qwen3"] {
        let text = std::fs::read_to_string(testdata(&format!("{case}/model/config.json"))).unwrap();
        let v5: serde_json::Value = serde_json::from_str(&text).unwrap();
        let v4 = v4_layout(&v5);
        assert!(v4.get("rope_theta").is_some() && v4.get("rope_parameters").is_none());
        let (a, b) = (Llama::from_config(&v5).unwrap(), Llama::from_config(&v4).unwrap());
        assert_eq!(a, b, "{case}");
        // Through the trainer's reader of a 4.x folder, the same weights, and the same
        // logits as transformers'.
        let dir = tmp.path().join(format!("{case}-v4"));
        edited_folder(case, &dir, &|c| *c = v4_layout(c));
        let weights = |dir: &std::path::Path| {
            let config = Config {
                init: Some(dir.to_path_buf()),
                seq: Some(16),
                batch: Some(4),
                dtype: Some(DType::F64),
                ..crate::config(meshwork_train::ModelKind::Auto)
            };
            meshwork_train::initial_weights(&config).unwrap()
        };
        let w4 = weights(&dir);
        assert_eq!(w4, weights(&testdata(&format!("{case}/model"))), "{case}");
        let got = logits_of(case, &b, &w4);
        let want = meshwork_io::npy::read(
            "--logits",
            &testdata(&format!("{case}/logits_rope_cr.npy")),
            1 << 30,
        )
        .unwrap();
        assert!(
            relative(&got.to_f64(), &want.iter().copied().collect::<Vec<_>>()) <= 1e-9,
            "{case}"
        );
    }
    // Refused, each naming its key.
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "llama",
            Box::new(|c| c["rope_parameters"]["rope_type"] = "yarn".into()),
            "rope_parameters.rope_type: \"yarn\"",
        ),
        (
            "llama",
            Box::new(|c| {
                *c = v4_layout(c);
                c["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
            }),
            "rope_scaling.rope_type: \"dynamic\"",
        ),
        (
            "llama",
            Box::new(|c| c["attn_logit_softcapping"] = 50.0.into()),
            "attn_logit_softcapping",
        ),
        (
            "llama",
            Box::new(|c| c["final_logit_softcapping"] = 30.0.into()),
            "final_logit_softcapping",
        ),
        ("llama", Box::new(|c| c["pretraining_tp"] = 2.into()), "pretraining_tp: 2"),
        ("llama", Box::new(|c| c["hidden_act"] = "gelu".into()), "hidden_act: \"gelu\""),
        ("llama", Box::new(|c| c["attention_dropout"] = 0.1.into()), "attention_dropout: 0.1"),
        (
            "llama",
            Box::new(|c| c["partial_rotary_factor"] = 0.5.into()),
            "partial_rotary_factor: 0.5",
        ),
        ("llama", Box::new(|c| c["rope_interleaved"] = true.into()), "rope_interleaved"),
        (
            "llama",
            Box::new(|c| c["quantization_config"] = serde_json::json!({"quant_method": "gptq"})),
            "quantization_config",
        ),
        (
            "llama",
            Box::new(|c| c["num_key_value_heads"] = 3.into()),
            "num_key_value_heads: 3 does not divide",
        ),
        ("llama", Box::new(|c| c["model_type"] = "falcon".into()), "model_type: \"falcon\""),
        (
            "qwen3",
            Box::new(|c| {
                c["use_sliding_window"] = true.into();
                c["sliding_window"] = 8.into();
                c["max_window_layers"] = 0.into();
                c.as_object_mut().unwrap().remove("layer_types");
            }),
            "sliding_window: 8 is shorter than the context of 16",
        ),
        (
            "qwen3",
            Box::new(|c| {
                c["use_sliding_window"] = true.into();
                c["sliding_window"] = 8.into();
                c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
            }),
            "sliding_window: 8",
        ),
        (
            "qwen3",
            Box::new(|c| {
                c["layer_types"] = serde_json::json!(["full_attention", "chunked_attention"])
            }),
            "layer_types",
        ),
        ("qwen3", Box::new(|c| c["model_type"] = "mistral".into()), "--model"),
    ];
    for (k, (case, edit, says)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("refused-{k}"));
        edited_folder(case, &dir, &*edit);
        let mut config = Config { init: Some(dir), ..adamw_command(case) };
        if says == "--model" {
            config.model = meshwork_train::ModelKind::Qwen3;
        }
        let m = crate::refused(&config);
        assert!(m.contains(says), "want {says:?} in {m:?}");
        assert!(
            m.starts_with("--init: ") || m.starts_with("--model: ") || m.starts_with("--seq "),
            "{m}"
        );
    }
    // Accepted: what does not change the computation (a window no shorter than the
    // context, sliding unused, ids, tp 1, no dropout, another architectures list).
    let accepted: Vec<Edit> = vec![
        Box::new(|c| {
            c["use_sliding_window"] = false.into();
            c["sliding_window"] = 8.into();
        }),
        Box::new(|c| {
            c["use_sliding_window"] = true.into();
            c["sliding_window"] = 16.into();
            c["max_window_layers"] = 0.into();
            c.as_object_mut().unwrap().remove("layer_types");
        }),
        Box::new(|c| {
            c["bos_token_id"] = 5.into();
            c["pad_token_id"] = 1.into();
            c["pretraining_tp"] = 1.into();
            c["attention_dropout"] = 0.0.into();
            c["use_cache"] = false.into();
            c["initializer_range"] = 0.5.into();
            c["architectures"] = serde_json::json!(["Qwen3Model"]);
        }),
    ];
    for (k, edit) in accepted.into_iter().enumerate() {
        let dir = tmp.path().join(format!("accepted-{k}"));
        edited_folder("qwen3", &dir, &*edit);
        let config = Config { init: Some(dir), steps: Some(1), ..adamw_command("qwen3") };
        assert_eq!(crate::losses(&config).len(), 1);
    }
}

/// `--export-hf` writes `save_pretrained`'s layout: the config as it was read (4.x's
/// stays 4.x, its `torch_dtype` set), the trained weights under their names, sharded
/// with an index past the shard size; the folder reads back to the same weights, and
/// a run from it continues.
#[test]
fn an_export_keeps_the_layout_and_reads_back() {
    use meshwork_train::Config;
    let tmp = tempfile::tempdir().unwrap();
    let v4 = tmp.path().join("v4");
    edited_folder("llama", &v4, &|c| *c = v4_layout(c));
    let out = tmp.path().join("export");
    let config = Config {
        init: Some(v4.clone()),
        steps: Some(2),
        export_hf: Some(out.clone()),
        ..adamw_command("llama")
    };
    crate::run(&config);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let read: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(v4.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["torch_dtype"], "float64");
    assert!(written.get("dtype").is_none() && written.get("rope_parameters").is_none());
    let mut same = written.clone();
    same["torch_dtype"] = read["torch_dtype"].clone();
    assert_eq!(same, read, "the config as it was read");
    let (net, _) = meshwork_train::hf::model_of("init", &out, 16).unwrap();
    let weights = meshwork_train::hf::read("init", &out, net.model(), DType::F64, 1 << 30).unwrap();
    // Sharded: the same weights from several files and an index.
    let sharded = tmp.path().join("sharded");
    meshwork_train::hf::write_sharded(
        "export-hf",
        &sharded,
        (net.model(), &written, None),
        &weights,
        40_000,
    )
    .unwrap();
    let files: Vec<String> = std::fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(files.contains(&"model.safetensors.index.json".to_string()), "{files:?}");
    let parts =
        files.iter().filter(|f| f.starts_with("model-") && f.ends_with(".safetensors")).count();
    assert!(parts >= 5, "{files:?}");
    let back =
        meshwork_train::hf::read("init", &sharded, net.model(), DType::F64, 1 << 30).unwrap();
    assert_eq!(back, weights);
    // Training on from the export takes the exported weights.
    let from_export = Config {
        init: Some(sharded),
        tokenizer: Some(testdata("llama/tokenizer.json")),
        export_hf: None,
        steps: Some(1),
        ..adamw_command("llama")
    };
    assert_eq!(meshwork_train::initial_weights(&from_export).unwrap(), weights);
}

/// The memory savers change how a step computes, never what: `--grad-accum 2`,
/// `--remat`, `--fsdp` (and all three), with the interpreter's attention by query
/// blocks and the loss by chunks, give the plain one-device run's losses to 1e-12; so
/// does attention as primitive ops (`--attention xla`) instead of the fused kernel.
#[test]
fn the_memory_savers_and_pieces_keep_the_losses() {
    use meshwork_train::Config;
    for case in ["llama", "qwen3"] {
        let base = Config { steps: Some(4), ..adamw_command(case) };
        let plain = crate::losses(&base);
        let runs = [
            ((1, 1), Some(2), false, false, None),
            ((2, 1), Some(2), false, false, None),
            ((1, 1), None, true, false, None),
            ((2, 2), None, true, false, None),
            ((2, 1), None, false, true, None),
            ((1, 2), None, false, true, None),
            ((2, 2), Some(2), true, true, None),
            (
                (1, 2),
                None,
                true,
                false,
                Some(meshwork_nn::Blocking { query_block: 5, loss_chunk: 3, ..Default::default() }),
            ),
        ];
        for (mesh, grad_accum, remat, fsdp, blocking) in runs {
            let config =
                Config { mesh: Some(mesh), grad_accum, remat, fsdp, blocking, ..base.clone() };
            let what = format!(
                "{case} {mesh:?} grad_accum {grad_accum:?} remat {remat} fsdp {fsdp} {blocking:?}"
            );
            within(&crate::losses(&config), &plain, 1e-12, &what);
        }
        // Attention's primitive ops (`--attention xla`) instead of the interpreter's
        // fused kernel, which the runs above take.
        for mesh in [(1, 1), (1, 2)] {
            let config = Config {
                mesh: Some(mesh),
                attention: Some(meshwork_train::AttentionKind::Xla),
                ..base.clone()
            };
            let what = format!("{case} {mesh:?} --attention xla");
            within(&crate::losses(&config), &plain, 1e-12, &what);
        }
    }
}

/// A Llama run saved at step 4 on 2x1 and resumed on 1x2 (its model from the
/// checkpoint) continues as the uninterrupted run; `--export-hf` of a resumed run
/// writes the folder's `config.json` as it was read (its dtype set) and its
/// `generation_config.json`, which the checkpoint carried; a flag that would change
/// the model is refused. Qwen 2's pad row stays held out after a resume.
#[test]
fn a_llama_run_resumes_on_another_mesh() {
    use meshwork_train::{Config, Data};
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let folder = tmp.path().join("folder");
    whole_folder("qwen3", &folder);
    let generation = serde_json::json!({"bos_token_id": 0, "eos_token_id": [0, 7],
                                        "do_sample": true, "temperature": 0.7});
    std::fs::write(folder.join("generation_config.json"), generation.to_string()).unwrap();
    let base = Config { init: Some(folder.clone()), ..adamw_command("qwen3") };
    let whole = crate::losses(&base);
    let first = crate::run(&Config {
        steps: Some(4),
        mesh: Some((2, 1)),
        checkpoint_dir: Some(ck.clone()),
        ..base.clone()
    });
    let rest = Config { init: None, resume: Some(ck.clone()), mesh: Some((1, 2)), ..base.clone() };
    let out = tmp.path().join("out");
    let rest = crate::run(&Config { export_hf: Some(out.clone()), ..rest });
    assert_eq!(rest.first_step, 4);
    let got: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    within(&got, &whole, 1e-12, "resumed");
    let (net, _) = meshwork_train::hf::model_of("init", &out, 16).unwrap();
    assert_eq!(net.name(), "qwen3");
    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(json(out.join("config.json")), json(folder.join("config.json")));
    assert_eq!(json(out.join("generation_config.json")), generation);
    let e = crate::refused(&Config {
        init: None,
        resume: Some(ck.clone()),
        preset: Some("tiny-llama".into()),
        ..base.clone()
    });
    assert!(e.contains("--preset: Qwen 3's sizes come from the checkpoint"), "{e}");
    let e = crate::refused(&Config {
        init: None,
        resume: Some(ck),
        seq: Some(8),
        data: Data::BuiltIn,
        tokenizer: None,
        ..base
    });
    assert!(e.contains("trained on a context of 16; --seq is 8"), "{e}");
    // Qwen 2's pad row stays held out across the resume (its model from the
    // checkpoint's metadata): the run continues as the uninterrupted one, which
    // follows `transformers`' (`the_trainer_reproduces_transformers_adamw_run_on_meshes`).
    let ck = tmp.path().join("ck-qwen2");
    let base = adamw_command("qwen2");
    let whole = crate::losses(&base);
    let first =
        crate::run(&Config { steps: Some(4), checkpoint_dir: Some(ck.clone()), ..base.clone() });
    let rest = crate::run(&Config { init: None, resume: Some(ck), mesh: Some((1, 2)), ..base });
    let got: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    within(&got, &whole, 1e-12, "qwen2 resumed");
}

/// bf16 products train a tiny Llama as f32 does (every loss within 2%); f16 with loss
/// scaling stays finite; presets build the real shapes.
#[test]
fn mixed_precision_and_presets() {
    use meshwork_train::{Config, ModelKind};
    let base = Config {
        preset: Some("tiny-llama".into()),
        steps: Some(20),
        batch: Some(4),
        seq: Some(32),
        ..crate::config(ModelKind::Llama)
    };
    let full = crate::losses(&base);
    let bf16 = crate::losses(&Config { precision: Some(DType::BF16), ..base.clone() });
    for (s, (b, f)) in bf16.iter().zip(&full).enumerate() {
        assert!((b - f).abs() <= 0.02 * f, "step {s}: bf16 {b}, f32 {f}");
    }
    assert!(full[19] < full[0], "it trains: {full:?}");
    let f16 = crate::losses(&Config { precision: Some(DType::F16), ..base.clone() });
    assert!(f16.iter().all(|l| l.is_finite()));
    // The presets' shapes, from their config.json's sizes (not trained: too large).
    for (name, params) in [
        ("smollm2-135m", 134_515_008.0),
        ("qwen2.5-0.5b", 494_032_768.0),
        ("llama-3.2-1b", 1_235_814_400.0),
    ] {
        let m = Llama::preset(name).unwrap();
        let lm = meshwork_nn::CausalLm { model: m, seq: 64 };
        assert_eq!(meshwork_nn::Model::parameter_count(&lm), params, "{name}");
    }
    // --model qwen3 without a folder: the tiny model as Qwen 3 computes it.
    let q = crate::run(&Config {
        preset: None,
        model: ModelKind::Qwen3,
        steps: Some(2),
        ..base.clone()
    });
    assert!(q.model.starts_with("Qwen3 "), "{}", q.model);
    let e = crate::refused(&Config { preset: Some("gpt2".into()), ..base });
    assert!(e.contains("--preset: gpt2 is a gpt2 model; the model is llama"), "{e}");
}

/// `inspect --json` of Qwen 3 on 1x2: q and the MLP's weights are held half per
/// device (Megatron's split), its one key/value head's k and v whole on both (the
/// head replicated over the model positions that share it); with `--fsdp` on 2x1
/// every weight large enough is held half, gathered and reduce-scattered.
#[test]
fn inspect_shows_the_kv_heads_replicated_and_fsdp_splitting_them() {
    use meshwork_train::Config;
    let held = |config: &Config| -> serde_json::Value {
        serde_json::from_str(&meshwork_train::inspect_json(config).unwrap()).unwrap()
    };
    let base = Config { check: meshwork_train::Check::Never, ..adamw_command("qwen3") };
    let json = held(&Config { mesh: Some((1, 2)), ..base.clone() });
    let share = |json: &serde_json::Value, name: &str| -> (u64, u64) {
        let w = json["weights"].as_array().unwrap().iter().find(|w| w["name"] == name).unwrap();
        (w["bytes"][0][1].as_u64().unwrap(), w["whole_bytes"].as_u64().unwrap())
    };
    let (q, q_whole) = share(&json, "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(2 * q, q_whole);
    let (k, k_whole) = share(&json, "model.layers.0.self_attn.k_proj.weight");
    assert_eq!(k, k_whole, "one key/value head, whole on each model position");
    let (down, down_whole) = share(&json, "model.layers.1.mlp.down_proj.weight");
    assert_eq!(2 * down, down_whole);
    let json = held(&Config { mesh: Some((2, 1)), fsdp: true, ..base });
    let (e, e_whole) = share(&json, "model.embed_tokens.weight");
    assert_eq!(2 * e, e_whole);
    let kinds: Vec<String> = json["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap().to_string())
        .collect();
    assert!(
        kinds.iter().any(|k| k.starts_with("all_gather"))
            && kinds.iter().any(|k| k.starts_with("reduce_scatter")),
        "{kinds:?}"
    );
}

/// Templates in the style of the Hub's (Llama 3.1, Qwen 2.5 with tool calls, Qwen 3's
/// thinking, Mistral's alternation check) and ones leaning on Jinja2's whitespace
/// control, loop controls, namespaces, Python's string and dict methods and `tojson`'s
/// options render as `transformers`' `render_jinja_template` does, after its
/// normalization (`testdata/chat/cases.json`, made by `gen_chat_cases.py` there); a
/// template's `raise_exception` is its message.
#[test]
fn chat_templates_render_as_transformers_does() {
    use meshwork_train::chat::{ChatTemplate, read_messages};
    let text = std::fs::read_to_string(testdata("chat/cases.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 12);
    let tmp = tempfile::tempdir().unwrap();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        // The messages as a user's file, their keys in its order.
        let file = tmp.path().join(format!("{name}.json"));
        std::fs::write(&file, case["file"].as_str().unwrap()).unwrap();
        let source = case["template"].as_str().unwrap();
        let messages = read_messages("chat", &file).unwrap();
        let template = ChatTemplate {
            source: source.to_string(),
            tokens: case["tokens"].as_object().unwrap().clone(),
        };
        let got = template.render("chat", &messages);
        match case.get("text") {
            Some(want) => assert_eq!(got.unwrap(), want.as_str().unwrap(), "{name}"),
            None => {
                let e = got.unwrap_err().to_string();
                assert!(e.contains(case["raises"].as_str().unwrap()), "{name}: {e}");
            }
        }
    }
}

/// A `config.json` that leaves fields out (or sets them to null, or counts its pad
/// token from the end) is the model `transformers`' config class makes of it: the
/// same sizes, rotary base, tying, sliding window and padding row, and the parameter
/// names and shapes `AutoModelForCausalLM.from_config` builds (`testdata/configs`,
/// made by `gen_config_cases.py` there). Where those defaults give key/value heads
/// that do not divide the query heads (Mistral's 8 and Qwen's 32 beside 4 query
/// heads, which `transformers` builds and cannot run), meshwork refuses naming the
/// field.
#[test]
fn configs_with_fields_left_out_take_transformers_defaults() {
    let text = std::fs::read_to_string(testdata("configs/cases.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 19);
    let mut built = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let want = &case["resolved"];
        let size = |key: &str| want[key].as_u64().unwrap() as usize;
        let made = Llama::from_config(&case["config"]);
        if !size("num_attention_heads").is_multiple_of(size("num_key_value_heads")) {
            let e = made.unwrap_err();
            assert_eq!(e.key, "num_key_value_heads", "{name}: {e}");
            continue;
        }
        let model = made.unwrap_or_else(|e| panic!("{name}: {e}"));
        built += 1;
        assert_eq!(
            (model.vocab, model.dim, model.ffn, model.layers, model.heads),
            (
                size("vocab_size"),
                size("hidden_size"),
                size("intermediate_size"),
                size("num_hidden_layers"),
                size("num_attention_heads")
            ),
            "{name}"
        );
        assert_eq!(model.kv_heads, size("num_key_value_heads"), "{name}");
        assert_eq!(model.head_dim, size("head_dim"), "{name}");
        assert_eq!(model.positions, size("max_position_embeddings"), "{name}");
        assert_eq!(model.eps, want["rms_norm_eps"].as_f64().unwrap(), "{name}");
        assert_eq!(model.rope_theta, want["rope_theta"].as_f64().unwrap(), "{name}");
        // The rotary scaling: its type and every number of it.
        let ours = model.config()["rope_parameters"].clone();
        let theirs = &want["rope_parameters"];
        for (key, value) in ours.as_object().unwrap() {
            assert_eq!(Some(value), theirs.get(key), "{name}: rope {key}");
        }
        let numbers = ["factor", "low_freq_factor", "high_freq_factor"];
        for key in numbers.iter().chain(&["original_max_position_embeddings", "rope_type"]) {
            assert_eq!(ours.get(*key), theirs.get(*key), "{name}: rope {key}");
        }
        assert_eq!(model.tie, want["tie_word_embeddings"].as_bool().unwrap(), "{name}");
        let window = want["sliding_window"].as_u64().map(|w| w as usize);
        assert_eq!(model.sliding_window, window, "{name}");
        let pad = case["padding_idx"].as_u64().map(|p| p as usize);
        assert_eq!(model.pad, pad, "{name}");
        // Tied: transformers lists the shared table once, as the embedding.
        let mut got = model.parameters();
        let mut theirs: Vec<(String, Vec<usize>)> = case["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let shape = p[1].as_array().unwrap().iter();
                (
                    p[0].as_str().unwrap().to_string(),
                    shape.map(|d| d.as_u64().unwrap() as usize).collect(),
                )
            })
            .collect();
        got.sort();
        theirs.sort();
        assert_eq!(got, theirs, "{name}");
        let lm = meshwork_nn::CausalLm { model: model.clone(), seq: 8 };
        let count: usize = theirs.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(meshwork_nn::Model::parameter_count(&lm), count as f64, "{name}");
    }
    assert!(built >= 16, "{built} cases built");
}
