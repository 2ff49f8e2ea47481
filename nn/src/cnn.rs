//! A small convolutional classifier on NHWC images: conv(3×3, F1) + ReLU, conv(3×3
//! stride 2, F2) + ReLU, then a linear head.

use meshwork_program::{Builder, Padding, Result, Value};

use crate::layers::{conv2d, linear};

/// The CNN's sizes: images `[H, W, C]`, classes, and the two convolutions' filters.
/// Its parameters are `conv1.weight` `[3, 3, C, F1]`, `conv1.bias`, `conv2.weight`
/// `[3, 3, F1, F2]`, `conv2.bias`, `head.weight` `[⌈H/2⌉·⌈W/2⌉·F2, classes]` and
/// `head.bias`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cnn {
    /// Images `[H, W, C]`.
    pub image: [usize; 3],
    /// Classes.
    pub classes: usize,
    /// The two convolutions' output channels.
    pub filters: [usize; 2],
}

impl Cnn {
    /// The logits `[B, classes]` of images `x` `[B, H, W, C]`.
    pub fn logits(&self, b: &mut Builder, x: Value) -> Result<Value> {
        self.logits_on(b, x, &[])
    }

    /// [`logits`](Self::logits) with the three layers spread over `stages` devices as
    /// a pipeline is written in TensorFlow: layer `i` of 3 in a `device` scope of stage
    /// `i·K/3` (no stages: no scopes).
    pub fn logits_on(&self, b: &mut Builder, x: Value, stages: &[&str]) -> Result<Value> {
        type Layer<'f> = &'f mut dyn FnMut(&mut Builder) -> Result<Value>;
        let batch = b.spec(x)?.shape.dims()[0];
        let on = |b: &mut Builder, layer: usize, f: Layer<'_>| match stages
            .get(layer * stages.len() / 3)
        {
            Some(device) => b.device(device, |b| f(b)),
            None => f(b),
        };
        let [f1, f2] = self.filters;
        let a = on(b, 0, &mut |b| {
            let a = conv2d(b, x, [3, 3], f1, [1, 1], Padding::Same, "conv1.weight", "conv1.bias")?;
            b.relu(a)
        })?;
        let a = on(b, 1, &mut |b| {
            let a = conv2d(b, a, [3, 3], f2, [2, 2], Padding::Same, "conv2.weight", "conv2.bias")?;
            b.relu(a)
        })?;
        on(b, 2, &mut |b| {
            let d = b.spec(a)?.shape.dims().to_vec();
            let flat = b.reshape(a, &[batch, d[1] * d[2] * d[3]])?;
            linear(b, flat, self.classes, "head.weight", Some("head.bias"))
        })
    }

    /// Its parameters' element count.
    pub fn parameters(&self) -> usize {
        let [h, w, c] = self.image;
        let [f1, f2] = self.filters;
        let flat = h.div_ceil(2) * w.div_ceil(2) * f2;
        9 * c * f1 + f1 + 9 * f1 * f2 + f2 + flat * self.classes + self.classes
    }
}
