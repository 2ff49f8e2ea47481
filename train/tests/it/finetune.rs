//! Fine-tuning as a Hugging Face user starts it: a pretrained folder given no optimizer
//! settings trains with `Trainer`'s defaults; the one-device check compares each step
//! from the partitioned run's own state, so a loss spike that makes trajectories drift
//! apart does not fail it; a failed run still writes its losses and plot; the outputs
//! and the schedule's flags are checked before any work.

use std::sync::atomic::AtomicBool;

use meshwork_train::{
    CheckOutcome, Config, Data, Error, ModelKind, OptimizerKind, OptimizerSettings, Schedule,
    Trainer,
};
use meshwork_types::DType;

use crate::{config, refused_with, run, testdata};

/// The GPT-2 oracle's model on its corpus (encoded by its tokenizer).
fn gpt2_text() -> Config {
    Config {
        init: Some(testdata("gpt2/model")),
        data: Data::Text(testdata("gpt2/corpus.txt")),
        tokenizer: Some(testdata("gpt2/tokenizer.json")),
        seq: Some(16),
        batch: Some(4),
        steps: Some(6),
        dtype: Some(DType::F64),
        ..config(ModelKind::Gpt2)
    }
}

/// The run's header line.
fn headline(config: &Config) -> String {
    struct Head(String);
    impl meshwork_train::Observer for Head {
        fn start(&mut self, s: &meshwork_train::Start) {
            self.0 = s.headline.clone();
        }
    }
    let mut head = Head(String::new());
    Trainer::new(config).unwrap().run(&mut head, &AtomicBool::new(false)).unwrap();
    head.0
}

/// No optimizer flag with a pretrained folder: AdamW without weight decay at 5e-5,
/// decaying linearly to 0 one step past the last, said in the header; the same
/// losses as those settings given by hand. Any optimizer flag given leaves the
/// family's defaults (Adam at 0.01, constant).
#[test]
fn a_pretrained_folder_trains_with_trainers_defaults() {
    let head = headline(&gpt2_text());
    assert!(
        head.contains(
            "(f64, adamw (decay 0), lr 5e-5, linear to 0; fine-tuning defaults, as transformers' Trainer)"
        ),
        "{head}"
    );
    let by_hand = Config {
        optimizer: Some(OptimizerKind::AdamW),
        optimizer_settings: OptimizerSettings { weight_decay: Some(0.0), ..Default::default() },
        lr: Some(5e-5),
        schedule: Some(Schedule::Linear),
        ..gpt2_text()
    };
    assert_eq!(run(&gpt2_text()).losses, run(&by_hand).losses);
    let constant = Config { schedule: Some(Schedule::Constant), ..by_hand.clone() };
    assert_ne!(run(&constant).losses, run(&by_hand).losses, "the schedule changes the steps");
    let head = headline(&Config { lr: Some(0.01), ..gpt2_text() });
    assert!(head.contains("(f64, adam, lr 0.01) on"), "{head}");
}

/// `--min-lr` ends a decay there at the last step (the metrics' lr), and is refused
/// without a decay or above the rate.
#[test]
fn min_lr_ends_the_decay_at_the_last_step() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    run(&Config {
        min_lr: Some(1e-5),
        schedule: Some(Schedule::Cosine),
        metrics_jsonl: Some(metrics.clone()),
        ..gpt2_text()
    });
    let lr: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"].as_f64().unwrap())
        .collect();
    assert_eq!(lr.len(), 6);
    assert!((lr[0] - 0.01).abs() < 1e-15 && (lr[5] - 1e-5).abs() < 1e-15, "{lr:?}");
    refused_with(
        &Config { min_lr: Some(1e-6), schedule: Some(Schedule::Constant), ..gpt2_text() },
        "--min-lr is where a decay ends",
    );
    refused_with(&Config { min_lr: Some(1.0), ..gpt2_text() }, "must be a number from 0 to --lr");
    refused_with(&Config { min_lr: Some(f64::NAN), ..gpt2_text() }, "must be a number from 0");
}

/// The first command of a Hugging Face user with the old defaults' rate (Adam at
/// 0.01): 100 steps on 2x1 in f64, the loss spiking to 11.3 at step 30. The mesh's
/// run and an independent one-device run drift apart after the spike (4.7e-5
/// relative by step 92, measured; in f32 2.2e-2), which failed the check when it
/// compared trajectories; compared step by step from the mesh's own weights and
/// optimizer state, the losses agree to 4e-16 and the state to 2e-13 (measured), far
/// inside the tolerance (1e-9).
#[test]
fn the_check_compares_steps_not_trajectories() {
    let spiky = Config {
        mesh: Some((2, 1)),
        steps: Some(100),
        seq: None,
        batch: None,
        lr: Some(0.01),
        ..gpt2_text()
    };
    let report = run(&spiky);
    let l = &report.losses;
    let before = l[10..29].iter().copied().fold(f64::MIN, f64::max);
    assert!(l[29] > 2.0 * before, "the loss spikes at step 30: {l:?}");
    match report.check {
        CheckOutcome::Checked { relative, tolerance, state, state_tolerance, .. } => {
            assert_eq!((tolerance, state_tolerance), (1e-9, 1e-9));
            assert!(relative < 1e-13 && state < 1e-11, "{relative:e} {state:e}");
        }
        other => panic!("not checked: {other:?}"),
    }
}

/// A run that fails (a loss that is not finite) writes its losses so far and its
/// plot, and says which step failed.
#[test]
fn a_failed_run_still_writes_its_losses_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let (losses, plot) = (dir.path().join("l.json"), dir.path().join("loss.svg"));
    let blowing_up = Config {
        lr: Some(1e30),
        optimizer: Some(OptimizerKind::Sgd),
        losses_json: Some(losses.clone()),
        plot: Some(plot.clone()),
        ..gpt2_text()
    };
    let e =
        Trainer::new(&blowing_up).unwrap().run(&mut meshwork_train::Quiet, &AtomicBool::new(false));
    let Err(Error::Failed(m)) = e else { panic!("{e:?}") };
    assert!(m.contains("the loss is"), "{m}");
    let written = crate::read_losses(&losses);
    assert!(written.len() >= 2 && written.last() == Some(&None), "{written:?}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
}

/// `--plot` writes SVG: another name is refused before any work, nothing made.
#[test]
fn a_plot_is_an_svg_file() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["loss.png", "loss", "loss.svg.txt"] {
        let plot = dir.path().join(name);
        refused_with(
            &Config { plot: Some(plot.clone()), ..gpt2_text() },
            "give a name ending .svg",
        );
        assert!(!plot.exists());
    }
    let upper = dir.path().join("LOSS.SVG");
    run(&Config { plot: Some(upper.clone()), steps: Some(1), ..gpt2_text() });
    assert!(std::fs::read_to_string(&upper).unwrap().starts_with("<svg"));
}

/// meshwork's interpreter with one collective wrong, as a partitioner bug would make
/// it: the first (`.1` false) or last (true) all-reduce over more than one position
/// reduces each position's own value alone (its replica groups cut to single
/// positions).
#[derive(Debug)]
struct ForgetsAReduction(meshwork_strategy::backend::Interpreter, bool);

impl meshwork_strategy::backend::Backend for ForgetsAReduction {
    fn name(&self) -> &'static str {
        "interpreter with a reduction forgotten"
    }
    fn compiles(&self) -> u64 {
        self.0.compiles()
    }
    fn compile_spmd(
        &self,
        part: &meshwork_partition::Partitioned,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> meshwork_strategy::Result<Box<dyn meshwork_strategy::backend::SpmdExecutable>> {
        let wrong = forget_a_reduction(part.program(), self.1);
        Ok(self.0.compile_per_device(&wrong, placement, resident, carry))
    }
    fn compile_placed(
        &self,
        parts: &[meshwork_partition::placed::Part],
        placement: &[usize],
        devices: usize,
    ) -> meshwork_strategy::Result<Box<dyn meshwork_strategy::backend::PlacedExecutable>> {
        self.0.compile_placed(parts, placement, devices)
    }
}

/// `program` with its first (or `last`) all-reduce over more than one position cut
/// to single positions.
fn forget_a_reduction(
    program: &meshwork_program::Program,
    last: bool,
) -> meshwork_program::Program {
    use meshwork_program::{Builder, Op};
    let reduces = |i: &meshwork_program::Instr| matches!(&i.op, Op::AllReduce { groups, .. } if groups.iter().any(|g| g.len() > 1));
    let all: Vec<usize> =
        program.instrs().iter().enumerate().filter(|(_, i)| reduces(i)).map(|(k, _)| k).collect();
    let target = if last { all.last() } else { all.first() }.copied();
    assert!(target.is_some(), "a partitioned step with an all-reduce to get wrong");
    let mut b = Builder::new();
    for p in program.params() {
        b.param(&p.name, p.spec.clone()).unwrap();
    }
    for (k, instr) in program.instrs().iter().enumerate() {
        let op = match &instr.op {
            Op::AllReduce { op, groups } if Some(k) == target => Op::AllReduce {
                op: *op,
                groups: groups.iter().flatten().map(|&r| vec![r]).collect(),
            },
            other => other.clone(),
        };
        b.push(op, &instr.args).unwrap();
    }
    b.finish(program.results()).unwrap()
}

/// The check catches a wrong collective: on a back end whose partitioned step
/// forgets the loss's reduction, step 1's loss fails it; one that forgets a
/// gradient's (the loss still right) fails on the state after step 1. On meshwork's
/// interpreter the same run passes.
#[test]
fn the_check_catches_a_wrong_collective() {
    let on_mesh = Config { mesh: Some((1, 2)), steps: Some(3), ..gpt2_text() };
    for (last, says) in [(false, "step 1: loss "), (true, "after step 1: ")] {
        let wrong = Config {
            backend: meshwork_train::BackendKind::Custom(meshwork_train::CustomBackend(
                std::sync::Arc::new(ForgetsAReduction(Default::default(), last)),
            )),
            ..on_mesh.clone()
        };
        let e =
            Trainer::new(&wrong).unwrap().run(&mut meshwork_train::Quiet, &AtomicBool::new(false));
        let Err(Error::Failed(m)) = e else { panic!("the wrong collective passed: {e:?}") };
        assert!(m.starts_with(says), "{m}");
        assert!(m.contains("--no-check skips this comparison"), "{m}");
    }
    let report = run(&on_mesh);
    assert!(matches!(report.check, CheckOutcome::Checked { .. }));
    // A run resumed from a good step-2 checkpoint onto the wrong back end fails at
    // step 3: the checkpoint stays the latest, and the losses (every step, the
    // failing one's too), the metrics (its line saying why) and the plot are written.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let (losses, metrics, plot) =
        (dir.path().join("l.json"), dir.path().join("m.jsonl"), dir.path().join("p.svg"));
    run(&Config {
        steps: Some(2),
        checkpoint_dir: Some(ck.clone()),
        losses_json: Some(losses.clone()),
        ..on_mesh.clone()
    });
    let resumed = Config {
        resume: Some(ck.clone()),
        steps: Some(4),
        mesh: Some((1, 2)),
        losses_json: Some(losses.clone()),
        metrics_jsonl: Some(metrics.clone()),
        plot: Some(plot.clone()),
        backend: meshwork_train::BackendKind::Custom(meshwork_train::CustomBackend(
            std::sync::Arc::new(ForgetsAReduction(Default::default(), false)),
        )),
        ..config(ModelKind::Auto)
    };
    let e =
        Trainer::new(&resumed).unwrap().run(&mut meshwork_train::Quiet, &AtomicBool::new(false));
    let Err(Error::Failed(m)) = e else { panic!("{e:?}") };
    assert!(m.starts_with("step 3: loss "), "{m}");
    let mut steps: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    assert_eq!(steps, ["step-00000002"]);
    assert_eq!(crate::read_losses(&losses).len(), 3);
    let text = std::fs::read_to_string(&metrics).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(line["step"], 3);
    assert!(line["failed"].as_str().unwrap().starts_with("step 3: loss "), "{line}");
    assert!(std::fs::read_to_string(&plot).unwrap().contains("<polyline"));
    // Resumed on the interpreter, the run goes on from the step-2 checkpoint.
    let on = run(&Config { resume: Some(ck.clone()), steps: Some(4), ..config(ModelKind::Auto) });
    assert_eq!(on.first_step, 2);
}

/// `evaluate` over every full row of the GPT-2 case's corpus equals transformers' mean
/// next-token cross-entropy over the same rows (`testdata/gpt2/eval.json`, float64)
/// within 1e-9, at two contexts, with a batch that leaves rows over, on one device and
/// on 2x1; a checkpoint (given as `init`) evaluates its trained weights, lower, with
/// the run's data remembered.
#[test]
fn evaluate_equals_transformers_mean_cross_entropy() {
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("gpt2/eval.json")).unwrap()).unwrap();
    for case in oracle["cases"].as_array().unwrap() {
        let seq = case["seq"].as_u64().unwrap() as usize;
        let want = case["loss"].as_f64().unwrap();
        for mesh in [None, Some((2, 1))] {
            let e = meshwork_train::evaluate(&Config {
                seq: Some(seq),
                batch: Some(10),
                mesh,
                ..gpt2_text()
            })
            .unwrap();
            assert!(((e.loss - want) / want).abs() < 1e-9, "T {seq} {mesh:?}: {} {want}", e.loss);
            assert_eq!(e.tokens, case["tokens"].as_u64().unwrap() as usize);
            assert_eq!(e.rows, case["rows"].as_u64().unwrap() as usize);
            assert!((e.perplexity - want.exp()).abs() < 1e-9 * want.exp());
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let trained =
        Config { steps: Some(20), lr: Some(0.01), checkpoint_dir: Some(ck.clone()), ..gpt2_text() };
    run(&trained);
    let before = meshwork_train::evaluate(&gpt2_text()).unwrap();
    let after = meshwork_train::evaluate(&Config {
        init: Some(ck.join("step-00000020")),
        ..config(ModelKind::Auto)
    })
    .unwrap();
    assert_eq!(after.tokens, before.tokens);
    assert!(after.loss < before.loss - 0.1, "{} {}", after.loss, before.loss);
}

/// `--data-jsonl`: the corpus as one document trains to the same losses as `--text`;
/// as two documents, to those of the rows of their ids (encoded apart by the
/// tokenizers library, the end-of-text id between them) given as `--data-tokens`; a
/// line that is not an object with the field, or a file without documents, is
/// refused naming the flag and the line.
#[test]
fn jsonl_documents_train_as_their_ids() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = std::fs::read_to_string(testdata("gpt2/corpus.txt")).unwrap();
    let jsonl = |name: &str, docs: &[&str]| {
        let path = dir.path().join(name);
        let lines: Vec<String> =
            docs.iter().map(|d| serde_json::json!({"id": 1, "body": d}).to_string()).collect();
        std::fs::write(&path, lines.join("\n") + "\n\n").unwrap();
        path
    };
    let as_jsonl = |path: std::path::PathBuf| Config {
        data: Data::Jsonl { path, field: "body".into() },
        ..gpt2_text()
    };
    let one = jsonl("one.jsonl", &[&corpus]);
    assert_eq!(crate::losses(&as_jsonl(one)), crate::losses(&gpt2_text()));
    // Two documents, cut at a line.
    let cut = corpus[..corpus.len() / 2].rfind('\n').unwrap() + 1;
    let (a, b) = corpus.split_at(cut);
    let two = jsonl("two.jsonl", &[a, b]);
    let t = tokenizers::Tokenizer::from_file(testdata("gpt2/tokenizer.json")).unwrap();
    let eos = t.token_to_id("<|endoftext|>").unwrap();
    let mut ids: Vec<u32> = t.encode(a, true).unwrap().get_ids().to_vec();
    ids.push(eos);
    ids.extend(t.encode(b, true).unwrap().get_ids());
    let rows = ids.len() / 17;
    let values: Vec<i32> = ids[..rows * 17].iter().map(|&i| i as i32).collect();
    let tokens = crate::write_npy_i32(&dir.path().join("two.npy"), rows, 17, &values);
    let by_ids = Config { data: Data::Tokens(tokens), tokenizer: None, ..gpt2_text() };
    assert_eq!(crate::losses(&as_jsonl(two)), crate::losses(&by_ids));
    // Refused, naming the flag and where.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"body\": \"a\"}\n{\"text\": \"b\"}\n").unwrap();
    refused_with(&as_jsonl(bad.clone()), "line 2: no string field \"body\"");
    std::fs::write(&bad, "{\"body\": \"a\"}\nnot json\n").unwrap();
    refused_with(&as_jsonl(bad.clone()), "line 2: not a JSON object");
    std::fs::write(&bad, "\n\n").unwrap();
    refused_with(&as_jsonl(bad), "holds no documents");
}

/// `export` of a checkpoint writes the folder the run's `--export-hf` wrote had it
/// ended there: the same files, byte for byte, the weights' file with `{"format":
/// "pt"}` and the run's tokenizer (the checkpoint given as `init`, its model
/// remembered, its data no longer there); refused without a destination or a
/// checkpoint, and into a folder that is not empty, before anything is read.
#[test]
fn export_writes_a_checkpoint_as_the_run_would_have() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, at_end, later) =
        (dir.path().join("ck"), dir.path().join("at_end"), dir.path().join("later"));
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(testdata("gpt2/corpus.txt"), &corpus).unwrap();
    run(&Config {
        steps: Some(3),
        checkpoint_dir: Some(ck.clone()),
        export_hf: Some(at_end.clone()),
        data: Data::Text(corpus.clone()),
        ..gpt2_text()
    });
    // Exporting needs the weights, not the data.
    std::fs::remove_file(&corpus).unwrap();
    let from = |init: std::path::PathBuf, to: &std::path::Path| Config {
        init: Some(init),
        export_hf: Some(to.to_path_buf()),
        ..config(ModelKind::Auto)
    };
    meshwork_train::export(&from(ck.join("step-00000003"), &later)).unwrap();
    let mut names: Vec<_> = std::fs::read_dir(&at_end)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(
        std::fs::read(at_end.join("tokenizer.json")).unwrap(),
        std::fs::read(testdata("gpt2/tokenizer.json")).unwrap()
    );
    // With `{"format": "pt"}`, which older transformers require.
    let bytes = std::fs::read(later.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt", "{header}");
    for name in &names {
        assert_eq!(
            std::fs::read(at_end.join(name)).unwrap(),
            std::fs::read(later.join(name)).unwrap(),
            "{name}"
        );
    }
    let refused = |c: &Config| match meshwork_train::export(c) {
        Err(Error::Usage(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(refused(&from(ck.clone(), &later)).contains("not an empty folder"));
    let m = refused(&Config { export_hf: None, ..from(ck.clone(), &dir.path().join("x")) });
    assert!(m.contains("give --hf DIR or --lora DIR"), "{m}");
    let m = refused(&from(testdata("gpt2/model"), &dir.path().join("y")));
    assert!(m.contains("give the checkpoint"), "{m}");
}

/// `generate` from a checkpoint step decodes as from the folder `export` writes of
/// it: the same ids and the same logits (f64, bit for bit), its prompt encoded by
/// the run's tokenizer; a checkpoint of a model without a Hugging Face layout is
/// refused naming `--init`.
#[test]
fn generate_reads_a_checkpoint_step() {
    use meshwork_train::generate::{GenerateConfig, generate, tokenizer_of};
    let dir = tempfile::tempdir().unwrap();
    let (ck, out) = (dir.path().join("ck"), dir.path().join("out"));
    run(&Config { steps: Some(2), checkpoint_dir: Some(ck.clone()), ..gpt2_text() });
    let step = ck.join("step-00000002");
    meshwork_train::export(&Config {
        init: Some(step.clone()),
        export_hf: Some(out.clone()),
        ..config(ModelKind::Auto)
    })
    .unwrap();
    assert_eq!(tokenizer_of(&step), Some(testdata("gpt2/tokenizer.json")));
    assert_eq!(tokenizer_of(&out), Some(out.join("tokenizer.json")));
    assert_eq!(tokenizer_of(&dir.path().join("nothing")), None);
    // A checkpoint whose run's tokenizer is gone has none (its model folder has none).
    let moved = dir.path().join("tokenizer.json");
    std::fs::copy(testdata("gpt2/tokenizer.json"), &moved).unwrap();
    let ck2 = dir.path().join("ck2");
    run(&Config {
        steps: Some(1),
        tokenizer: Some(moved.clone()),
        checkpoint_dir: Some(ck2.clone()),
        ..gpt2_text()
    });
    assert_eq!(tokenizer_of(&ck2), Some(moved.clone()));
    std::fs::remove_file(&moved).unwrap();
    assert_eq!(tokenizer_of(&ck2), None);
    let prompt =
        meshwork_train::generate::prompt_ids(&testdata("gpt2/tokenizer.json"), "The mesh").unwrap();
    let g = GenerateConfig {
        init: step.clone(),
        prompt_ids: prompt,
        tokenizer: None,
        max_new_tokens: 6,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        dtype: DType::F64,
        backend: meshwork_train::BackendKind::Interpreter,
        max_memory: 1 << 30,
        lora: None,
        keep_logits: true,
    };
    let from_step = generate(&g).unwrap();
    let from_folder = generate(&GenerateConfig { init: out.clone(), ..g.clone() }).unwrap();
    assert_eq!(from_step.ids, from_folder.ids);
    assert_eq!(from_step.logits, from_folder.logits);
    let new = from_step.ids.len() - from_step.prompt_ids.len();
    assert_eq!(from_step.logits.len(), new);
    assert!(from_step.logits.iter().all(|row| row.len() == 320), "the oracle's vocabulary");
    // Each new token is the first largest of its logits (greedy).
    for (row, &t) in from_step.logits.iter().zip(&from_step.ids[from_step.prompt_ids.len()..]) {
        let best = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(row[t as usize], best);
    }
    // The .npy file: [new tokens, vocabulary] of float64.
    let npy = from_step.logits_npy();
    let header = String::from_utf8_lossy(&npy[..128]);
    assert!(
        header.contains("'descr': '<f8'") && header.contains(&format!("({new}, 320)")),
        "{header}"
    );
    let header_len = 10 + u16::from_le_bytes([npy[8], npy[9]]) as usize;
    let values: Vec<f64> = npy[header_len..]
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values, from_step.logits.concat());
    // In f32, the f64 checkpoint's weights rounded: the same greedy ids here.
    let f32 = generate(&GenerateConfig { dtype: DType::F32, keep_logits: false, ..g.clone() });
    assert!(f32.unwrap().logits.is_empty());
    // A classifier's checkpoint does not generate.
    let mlp = dir.path().join("mlp");
    run(&Config { steps: Some(1), checkpoint_dir: Some(mlp.clone()), ..config(ModelKind::Mlp) });
    match generate(&GenerateConfig { init: mlp, ..g }) {
        Err(Error::Usage(m)) => {
            assert!(m.starts_with("--init: ") && m.contains("no Hugging Face layout"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}

/// An export copies the tokenizer's companion files from beside its
/// `tokenizer.json` (a Llama's `tokenizer_config.json` and chat template), byte for
/// byte; one that cannot be read leaves the export without a tokenizer, said in a
/// warning, rather than failing the run.
#[test]
fn an_export_carries_the_tokenizers_files() {
    let dir = tempfile::tempdir().unwrap();
    let llama = |export: &std::path::Path, tokenizer: std::path::PathBuf| Config {
        init: Some(testdata("llama/model")),
        data: Data::Text(testdata("llama/corpus.txt")),
        tokenizer: Some(tokenizer),
        seq: Some(16),
        batch: Some(2),
        steps: Some(1),
        dtype: Some(DType::F64),
        export_hf: Some(export.to_path_buf()),
        ..config(ModelKind::Auto)
    };
    let out = dir.path().join("out");
    run(&llama(&out, testdata("llama/tokenizer.json")));
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert_eq!(
            std::fs::read(out.join(name)).unwrap(),
            std::fs::read(testdata(&format!("llama/{name}"))).unwrap(),
            "{name}"
        );
    }
    // A companion that is not a regular file: a warning, and no tokenizer.
    let odd = dir.path().join("odd");
    std::fs::create_dir_all(odd.join("tokenizer_config.json")).unwrap();
    std::fs::copy(testdata("llama/tokenizer.json"), odd.join("tokenizer.json")).unwrap();
    let out2 = dir.path().join("out2");
    let c = llama(&out2, odd.join("tokenizer.json"));
    let mut observer = Warnings(Vec::new());
    Trainer::new(&c).unwrap().run(&mut observer, &AtomicBool::new(false)).unwrap();
    assert!(
        observer
            .0
            .iter()
            .any(|w| w.contains("will hold no tokenizer") && w.contains("tokenizer_config.json")),
        "{:?}",
        observer.0
    );
    assert!(out2.join("model.safetensors").is_file() && !out2.join("tokenizer.json").exists());
}

/// The start's warnings.
struct Warnings(Vec<String>);

impl meshwork_train::Observer for Warnings {
    fn start(&mut self, s: &meshwork_train::Start) {
        self.0.extend(s.warnings.iter().cloned());
    }
}

/// `eval_data`: a separate validation set evaluated every `eval_every` steps and after
/// the last, on all its rows (a batch that leaves rows over), each evaluation equal
/// to `evaluate` of that step's checkpoint on the file (whose mean is transformers',
/// tested above) within 1e-12; the training losses are those of a run without it;
/// given alone, evaluated after the last step. Its rows as `.npy` evaluate alike.
/// Refused: beside `eval_fraction`, for a classifier, a text without a tokenizer,
/// without a full row.
#[test]
fn eval_data_is_evaluated_every_n_steps() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, valid) = (dir.path().join("ck"), dir.path().join("valid.txt"));
    let corpus = std::fs::read_to_string(testdata("gpt2/corpus.txt")).unwrap();
    std::fs::write(&valid, &corpus[corpus.len() / 2..]).unwrap();
    let base = Config { steps: Some(6), batch: Some(5), lr: Some(0.003), ..gpt2_text() };
    let with = Config {
        eval_data: Some(Data::Text(valid.clone())),
        eval_every: Some(3),
        checkpoint_dir: Some(ck.clone()),
        checkpoint_every: Some(3),
        ..base.clone()
    };
    let report = run(&with);
    assert_eq!(report.losses, run(&base).losses, "the validation set is not trained on");
    let steps: Vec<usize> = report.evals.iter().map(|e| e.0).collect();
    assert_eq!(steps, [2, 5]);
    for (k, &(s, loss, _)) in report.evals.iter().enumerate() {
        let want = meshwork_train::evaluate(&Config {
            init: Some(ck.join(format!("step-{:08}", s + 1))),
            data: Data::Text(valid.clone()),
            tokenizer: Some(testdata("gpt2/tokenizer.json")),
            seq: Some(16),
            batch: Some(5),
            ..config(ModelKind::Auto)
        })
        .unwrap();
        assert_eq!(report.eval_rows, want.rows, "every row");
        assert_ne!(want.rows % 5, 0, "a batch that leaves rows over");
        assert!(((loss - want.loss) / want.loss).abs() < 1e-12, "eval {k}: {loss} {}", want.loss);
    }
    // Remembered by --resume alone.
    let resumed =
        run(&Config { resume: Some(ck.join("step-00000003")), ..config(ModelKind::Auto) });
    assert_eq!(resumed.evals.len(), 1);
    let (a, b) = (resumed.evals[0].1, report.evals[1].1);
    assert!(((a - b) / b).abs() < 1e-12, "{a} {b}");
    // The checkpoint evaluated on its training data: every row, the validation set
    // not needed.
    let saved = std::fs::read(&valid).unwrap();
    std::fs::remove_file(&valid).unwrap();
    let e = meshwork_train::evaluate(&Config {
        init: Some(ck.join("step-00000003")),
        ..config(ModelKind::Auto)
    })
    .unwrap();
    assert_eq!(e.rows, 376);
    // A validation set changed since: refused on resume, unless --data-changed-ok.
    std::fs::write(&valid, &saved[..saved.len() - 40]).unwrap();
    let again = Config { resume: Some(ck.join("step-00000003")), ..config(ModelKind::Auto) };
    refused_with(&again, "has changed since the resumed run read it");
    run(&Config { data_changed_ok: true, ..again });
    std::fs::write(&valid, &saved).unwrap();
    // Alone: after the last step. As .npy rows: the same loss.
    let alone = run(&Config { eval_data: Some(Data::Text(valid.clone())), ..base.clone() });
    assert_eq!(alone.evals.len(), 1);
    assert_eq!(alone.evals[0].0, 5);
    let rows_file = dir.path().join("valid.npy");
    meshwork_train::tokenize::tokenize_to(
        &valid,
        &testdata("gpt2/tokenizer.json"),
        16,
        &rows_file,
        1 << 30,
    )
    .unwrap();
    let npy = run(&Config { eval_data: Some(Data::Tokens(rows_file.clone())), ..base.clone() });
    assert_eq!(npy.evals[0].1, alone.evals[0].1);
    refused_with(
        &Config { eval_fraction: Some(0.2), eval_every: Some(2), ..with.clone() },
        "give it or --eval-fraction, not both",
    );
    refused_with(
        &Config { eval_data: Some(Data::Tokens(rows_file.clone())), ..config(ModelKind::Mlp) },
        "--eval-data: is a language model's validation set",
    );
    refused_with(
        &Config {
            data: Data::Tokens(testdata("gpt2/tokens.npy")),
            tokenizer: None,
            init: Some(testdata("gpt2/model")),
            eval_data: Some(Data::Text(valid.clone())),
            ..base.clone()
        },
        "--eval-data: a text is encoded by a tokenizer",
    );
    std::fs::write(&valid, &corpus[..20]).unwrap();
    refused_with(
        &Config { eval_data: Some(Data::Text(valid.clone())), ..base },
        "valid.txt encodes to 11 tokens: fewer than one row",
    );
}

/// `epochs`: as many steps as take that many passes over the training rows (the
/// held-out rows left out), the same run as those steps given; refused beside
/// `steps`, at 0, and past the most steps a run takes.
#[test]
fn epochs_are_passes_over_the_training_rows() {
    let rows = 376; // The corpus at T 16 (testdata/gpt2/tokens.npy).
    // A constant rate, so that a run resumed with more epochs continues the shorter one.
    let base = Config {
        steps: None,
        batch: Some(50),
        shuffle: true,
        optimizer: Some(OptimizerKind::Adam),
        lr: Some(1e-3),
        ..gpt2_text()
    };
    let two = run(&Config { epochs: Some(2), ..base.clone() });
    assert_eq!(two.losses.len(), (2 * rows as usize).div_ceil(50));
    assert_eq!(two.losses, run(&Config { steps: Some(16), ..base.clone() }).losses);
    // Held-out rows are not trained on: 376 − ⌈37.6⌉ = 338 rows, 7 steps a pass.
    let held = run(&Config { epochs: Some(1), eval_every: Some(3), ..base.clone() });
    assert_eq!(held.losses.len(), 7);
    // Resumed with more epochs: on to their last step.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    run(&Config { epochs: Some(1), checkpoint_dir: Some(ck.clone()), ..base.clone() });
    let more = run(&Config { resume: Some(ck), epochs: Some(2), ..config(ModelKind::Auto) });
    assert_eq!((more.first_step, more.steps), (8, 16));
    for (a, b) in more.losses.iter().zip(&two.losses[8..]) {
        assert!(((a - b) / b).abs() < 1e-12, "{a} {b}");
    }
    refused_with(&Config { epochs: Some(1), steps: Some(3), ..base.clone() }, "not both");
    refused_with(&Config { epochs: Some(0), ..base.clone() }, "--epochs must be at least 1");
    refused_with(&Config { epochs: Some(usize::MAX / 2), ..base }, "more than 100000000");
}

/// Several files as documents (a directory's `.txt` and `.jsonl` files by name,
/// others and hidden ones passed over): each text one document, each `.jsonl` line
/// one, the end-of-text id between them, training as the rows of those ids given as
/// `data_tokens`; their rows cached, read back from the cache the second time, and
/// encoded again when a file changes. A directory without such files is refused.
#[test]
fn several_files_are_documents() {
    use meshwork_train::tokenize::{documents_rows, text_files};
    let dir = tempfile::tempdir().unwrap();
    let corpus = std::fs::read_to_string(testdata("gpt2/corpus.txt")).unwrap();
    let cut = corpus[..corpus.len() / 2].rfind('\n').unwrap() + 1;
    let (a, rest) = corpus.split_at(cut);
    let cut = rest[..rest.len() / 2].rfind('\n').unwrap() + 1;
    let (b1, b2) = rest.split_at(cut);
    let docs = dir.path().join("docs");
    std::fs::create_dir(&docs).unwrap();
    std::fs::write(docs.join("a.txt"), a).unwrap();
    let lines = [b1, b2].map(|d| serde_json::json!({"body": d}).to_string()).join("\n");
    std::fs::write(docs.join("b.jsonl"), lines).unwrap();
    std::fs::write(docs.join("c.md"), "not read").unwrap();
    std::fs::write(docs.join(".d.txt"), "not read").unwrap();
    let files = text_files(std::slice::from_ref(&docs)).unwrap();
    assert_eq!(files, [docs.join("a.txt"), docs.join("b.jsonl")]);
    let as_docs = Config {
        data: Data::Documents { paths: files.clone(), field: "body".into() },
        ..gpt2_text()
    };
    let t = tokenizers::Tokenizer::from_file(testdata("gpt2/tokenizer.json")).unwrap();
    let eos = t.token_to_id("<|endoftext|>").unwrap();
    let mut ids: Vec<u32> = Vec::new();
    for (k, d) in [a, b1, b2].into_iter().enumerate() {
        if k > 0 {
            ids.push(eos);
        }
        ids.extend(t.encode(d, true).unwrap().get_ids());
    }
    let rows = ids.len() / 17;
    let values: Vec<i32> = ids[..rows * 17].iter().map(|&i| i as i32).collect();
    let tokens = crate::write_npy_i32(&dir.path().join("docs.npy"), rows, 17, &values);
    let by_ids = Config { data: Data::Tokens(tokens), tokenizer: None, ..gpt2_text() };
    assert_eq!(crate::losses(&as_docs), crate::losses(&by_ids));
    // Cached, read back, encoded again when a file changes.
    let cache = dir.path().join("cache");
    let tokenizer = testdata("gpt2/tokenizer.json");
    let rows_of = || {
        documents_rows("text", &files, "body", &tokenizer, (320, 16), 1 << 30, Some(&cache))
            .unwrap()
    };
    let first = rows_of();
    assert!(!first.hit && first.cached.is_some());
    assert_eq!(first.tokens, values);
    let second = rows_of();
    assert!(second.hit);
    assert_eq!(second.tokens, values);
    std::fs::write(docs.join("a.txt"), &a[..a.len() / 2]).unwrap();
    let third = rows_of();
    assert!(!third.hit && third.tokens != values);
    // A directory without documents.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("notes.md"), "x").unwrap();
    let e = text_files(&[empty]).unwrap_err().to_string();
    assert!(e.starts_with("--text: ") && e.contains("holds no .txt or .jsonl file"), "{e}");
}

/// `--metrics-jsonl` holds each step's gradient norm and learning rate: the first
/// step's norm is `transformers`' (`clip_grad_norm_`'s total over every parameter's
/// gradient of the mean loss on the first 4 rows, float64; testdata/gpt2/eval.json)
/// within 1e-9, on one device, on meshes, with gradient accumulation and with
/// `--fsdp`; a pipeline's (the reference transformer's) are one device's; clipping to a norm below it leaves the reported norm the unclipped one.
#[test]
fn metrics_hold_the_gradient_norm() {
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(testdata("gpt2/eval.json")).unwrap()).unwrap();
    let want = oracle["grad_norm"]["norm"].as_f64().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let variants: [(&str, Config); 5] = [
        ("1x1", Config { ..gpt2_text() }),
        ("2x1", Config { mesh: Some((2, 1)), ..gpt2_text() }),
        ("1x2", Config { mesh: Some((1, 2)), ..gpt2_text() }),
        ("accum", Config { mesh: Some((2, 1)), grad_accum: Some(2), ..gpt2_text() }),
        ("fsdp", Config { mesh: Some((2, 1)), fsdp: true, clip_norm: Some(0.5), ..gpt2_text() }),
    ];
    for (name, c) in variants {
        let path = dir.path().join(format!("{name}.jsonl"));
        run(&Config { steps: Some(3), metrics_jsonl: Some(path.clone()), ..c });
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{name}");
        let got = lines[0]["grad_norm"].as_f64().unwrap_or_else(|| panic!("{name}: {}", lines[0]));
        assert!(((got - want) / want).abs() < 1e-9, "{name}: {got} {want}");
        assert!(lines.iter().all(|l| l["grad_norm"].as_f64().is_some_and(|n| n > 0.0)));
        assert!(lines.iter().all(|l| l["lr"].as_f64().is_some()));
    }
    let norms = |c: Config| -> Vec<f64> {
        let path = dir.path().join("t.jsonl");
        let _ = std::fs::remove_file(&path);
        run(&Config { steps: Some(4), metrics_jsonl: Some(path.clone()), ..c });
        std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["grad_norm"].as_f64().unwrap()
            })
            .collect()
    };
    let t = Config { dtype: Some(DType::F64), ..config(ModelKind::Transformer) };
    let one = norms(t.clone());
    let piped = norms(Config { stages: Some(2), microbatches: Some(2), ..t });
    assert_eq!(one.len(), 4);
    for (a, b) in piped.iter().zip(&one) {
        assert!(((a - b) / b).abs() < 1e-9, "pipeline {a}, one device {b}");
    }
}
