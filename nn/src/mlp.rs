//! A two-layer perceptron classifier: `relu(x·w1 + b1)·w2 + b2`.

use meshwork_program::{Builder, Result, Value};
use meshwork_types::DType;

use crate::layers::linear;

/// The MLP's sizes. Its parameters are `w1` `[features, hidden]`, `b1` `[hidden]`,
/// `w2` `[hidden, classes]` and `b2` `[classes]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mlp {
    /// Features per row.
    pub features: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Classes.
    pub classes: usize,
}

impl Mlp {
    /// The logits `[B, classes]` of `x` `[B, features]`.
    pub fn logits(&self, b: &mut Builder, x: Value) -> Result<Value> {
        self.logits_on(b, x, &[])
    }

    /// [`logits`](Self::logits) with the first layer on the first of `stages` and the
    /// second on the last (no stages: no device scopes).
    pub fn logits_on(&self, b: &mut Builder, x: Value, stages: &[&str]) -> Result<Value> {
        let first = |b: &mut Builder| -> Result<Value> {
            let h = linear(b, x, self.hidden, "w1", Some("b1"))?;
            b.relu(h)
        };
        let h = match stages.first() {
            Some(device) => b.device(device, first)?,
            None => first(b)?,
        };
        let second = |b: &mut Builder| linear(b, h, self.classes, "w2", Some("b2"));
        match stages.last() {
            Some(device) => b.device(device, second),
            None => second(b),
        }
    }

    /// Its parameters' element count.
    pub fn weight_count(&self) -> usize {
        let (f, h, c) = (self.features, self.hidden, self.classes);
        f * h + h + h * c + c
    }
}

impl crate::Model for Mlp {
    fn family(&self) -> &'static str {
        "mlp"
    }
    fn describe(&self) -> String {
        format!("MLP {} -> {} -> {}", self.features, self.hidden, self.classes)
    }
    fn meta(&self) -> serde_json::Value {
        serde_json::json!({
            "model": "mlp", "features": self.features, "hidden": self.hidden, "classes": self.classes,
        })
    }
    fn inputs(&self) -> Vec<crate::Input> {
        vec![
            crate::Input { name: "x", dtype: None, dims: vec![self.features] },
            crate::Input { name: "y", dtype: Some(DType::I32), dims: Vec::new() },
        ]
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let (f, h, c) = (self.features, self.hidden, self.classes);
        vec![
            ("w1".into(), vec![f, h]),
            ("b1".into(), vec![h]),
            ("w2".into(), vec![h, c]),
            ("b2".into(), vec![c]),
        ]
    }
    fn parameter_count(&self) -> f64 {
        self.weight_count() as f64
    }
    fn loss(&self, b: &mut Builder, inputs: &[Value], _: &crate::Build<'_>) -> Result<Value> {
        let logits = self.logits(b, inputs[0])?;
        crate::softmax_cross_entropy(b, logits, inputs[1])
    }
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &crate::Build<'_>,
    ) -> Result<(Value, Value)> {
        let dtype = build.dtype;
        let logits = self.logits(b, inputs[0])?;
        crate::model::class_metrics(b, logits, inputs[1], dtype, &[0])
    }
    fn max_stages(&self) -> usize {
        2
    }
    fn loss_pipelined(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: DType,
        pipeline: &crate::Pipeline,
    ) -> Result<Value> {
        let logits_on = |b: &mut Builder, x: Value, st: &[&str]| self.logits_on(b, x, st);
        crate::loss_pipelined(b, inputs[0], inputs[1], pipeline, &logits_on)
    }
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String> {
        if self.hidden.is_multiple_of(model) {
            return Ok(());
        }
        Err(format!(
            "--hidden {} does not split over the {model} model devices of --mesh {data}x{model}",
            self.hidden
        ))
    }
    /// The hidden layer over the model axis: W1 by columns, b1 with it, W2 by rows.
    fn split(&self, name: &str, _model: usize) -> Option<usize> {
        match name {
            "w1" => Some(1),
            "b1" | "w2" => Some(0),
            _ => None,
        }
    }
    /// As the main job has always drawn them: scaled normals (`1/sqrt(fan_in)`), zero
    /// biases (no draws), one stream.
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        let n: usize = dims.iter().product();
        let scale = match name {
            "w1" => 1.0 / (self.features as f64).sqrt(),
            "w2" => 1.0 / (self.hidden as f64).sqrt(),
            _ => return vec![0.0; n],
        };
        (0..n).map(|_| normal() * scale).collect()
    }
    fn init_stream(&self) -> u64 {
        0x696e_6974
    }
    fn activations_per_row(&self, _remat: bool) -> f64 {
        let [f, h, k] = [self.features, self.hidden, self.classes].map(|x| x as f64);
        f + 3.0 * h + 3.0 * k
    }
    fn per_row(&self) -> (usize, &'static str) {
        (1, "samples")
    }
    fn classifies(&self) -> bool {
        true
    }
}
