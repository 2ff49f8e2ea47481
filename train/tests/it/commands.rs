//! The oracles' commands (JAX's reference run, the GPT-2 and Llama-family runs of
//! `transformers`), shared by the `it` binary and the XLA binary (`tests/xla`).

use meshwork_train::{Config, Data, ModelKind, OptimizerKind};
use meshwork_types::DType;

use crate::common::{config, reference};

/// JAX's reference command: its tokens and initial weights, 20 steps of 8 rows in f64.
pub(crate) fn reference_run(optimizer: OptimizerKind, lr: f64) -> Config {
    Config {
        data: Data::Tokens(reference("tokens.npy")),
        init: Some(reference("init.safetensors")),
        heads: Some(4),
        batch: Some(8),
        dtype: Some(DType::F64),
        optimizer: Some(optimizer),
        lr: Some(lr),
        steps: Some(20),
        ..config(ModelKind::Transformer)
    }
}

/// GPT-2's oracle (`testdata/gpt2`).
pub(crate) mod gpt2 {
    use meshwork_types::DType;

    use crate::common::{config, testdata};

    /// The command, in-process: `--model gpt2 --init model/ --data-tokens
    /// tokens.npy --seq 16 --batch 4 --steps 10 --optimizer adamw --lr 0.003
    /// --weight-decay 0.1 --dtype f64`.
    pub(crate) fn adamw_command() -> meshwork_train::Config {
        use meshwork_train::{Config, Data, ModelKind, OptimizerKind, OptimizerSettings};
        Config {
            init: Some(testdata("gpt2/model")),
            data: Data::Tokens(testdata("gpt2/tokens.npy")),
            seq: Some(16),
            batch: Some(4),
            steps: Some(10),
            optimizer: Some(OptimizerKind::AdamW),
            optimizer_settings: OptimizerSettings {
                weight_decay: Some(0.1),
                ..OptimizerSettings::default()
            },
            lr: Some(0.003),
            dtype: Some(DType::F64),
            ..config(ModelKind::Gpt2)
        }
    }
}

/// The Llama family's oracles (`testdata/<case>`).
pub(crate) mod llama {
    use meshwork_types::DType;

    use crate::common::{config, testdata};

    /// `key` of the oracle `case`'s `file`.
    pub(crate) fn expected(case: &str, file: &str, key: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(testdata(&format!("{case}/{file}"))).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()[key].clone()
    }

    /// `transformers`' losses of the oracle's AdamW run (`file`: `expected.json`, or
    /// `rope_cr.json` with correctly rounded rotary tables).
    pub(crate) fn losses_adamw(case: &str, file: &str) -> Vec<f64> {
        expected(case, file, "losses_adamw")
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    }

    /// The command in-process: `--init DIR --text corpus.txt --seq 16 --batch 4
    /// --steps 10 --optimizer adamw --lr 0.003 --weight-decay 0.1 --dtype f64` (the model
    /// and the tokenizer from the folder).
    pub(crate) fn adamw_command(case: &str) -> meshwork_train::Config {
        use meshwork_train::{Config, Data, ModelKind, OptimizerKind, OptimizerSettings};
        Config {
            init: Some(testdata(&format!("{case}/model"))),
            tokenizer: Some(testdata(&format!("{case}/tokenizer.json"))),
            data: Data::Text(testdata(&format!("{case}/corpus.txt"))),
            seq: Some(16),
            batch: Some(4),
            steps: Some(10),
            optimizer: Some(OptimizerKind::AdamW),
            optimizer_settings: OptimizerSettings {
                weight_decay: Some(0.1),
                ..OptimizerSettings::default()
            },
            lr: Some(0.003),
            dtype: Some(DType::F64),
            ..config(ModelKind::Auto)
        }
    }
}
