//! A small convolutional classifier on NHWC images: conv(3×3, F1) + ReLU, conv(3×3
//! stride 2, F2) + ReLU, then a linear head.

use meshwork_program::{Builder, Padding, Result, Value};
use meshwork_types::DType;

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
    pub fn weight_count(&self) -> usize {
        let [h, w, c] = self.image;
        let [f1, f2] = self.filters;
        let flat = h.div_ceil(2) * w.div_ceil(2) * f2;
        9 * c * f1 + f1 + 9 * f1 * f2 + f2 + flat * self.classes + self.classes
    }
}

impl crate::Model for Cnn {
    fn family(&self) -> &'static str {
        "cnn"
    }
    fn describe(&self) -> String {
        format!(
            "CNN conv3x3x{} conv3x3x{}/2 linear({}) on {}x{}x{} images",
            self.filters[0],
            self.filters[1],
            self.classes,
            self.image[0],
            self.image[1],
            self.image[2]
        )
    }
    fn meta(&self) -> serde_json::Value {
        serde_json::json!({
            "model": "cnn", "image": self.image, "classes": self.classes, "filters": self.filters,
        })
    }
    fn inputs(&self) -> Vec<crate::Input> {
        vec![
            crate::Input { name: "x", dtype: None, dims: self.image.to_vec() },
            crate::Input { name: "y", dtype: Some(DType::I32), dims: Vec::new() },
        ]
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        crate::model::declared_parameters(self)
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
        3
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
        if model == 1 {
            return Ok(());
        }
        Err(format!(
            "--mesh {data}x{model}: the CNN's weights are not split over a model axis (--mesh Dx1, or --stages K)"
        ))
    }
    fn split(&self, _name: &str, _model: usize) -> Option<usize> {
        None
    }
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        crate::transformer::fan_in_init(name, dims, normal)
    }
    fn activations_per_row(&self, _remat: bool) -> f64 {
        let [hh, w, ch] = self.image.map(|x| x as f64);
        let [f1, f2, k] = [self.filters[0], self.filters[1], self.classes].map(|x| x as f64);
        hh * w * (ch + 3.0 * f1 + 3.0 * f2) + 3.0 * k
    }
    fn per_row(&self) -> (usize, &'static str) {
        (1, "samples")
    }
    fn classifies(&self) -> bool {
        true
    }
}
