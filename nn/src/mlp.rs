//! A two-layer perceptron classifier: `relu(x·w1 + b1)·w2 + b2`.

use meshwork_program::{Builder, Result, Value};

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
    pub fn parameters(&self) -> usize {
        let (f, h, c) = (self.features, self.hidden, self.classes);
        f * h + h + h * c + c
    }
}
