//! What the strategy's benchmark examples share: medians, a deterministic noise
//! stream, and the benchmark transformer's initial weights and token batches (the
//! reference run's initialisation scales).

#![allow(dead_code)]

use meshwork_program::{Program, Tensor, nn};
use meshwork_strategy::types::{DType, Shape, TensorSpec};

/// The median of `v` (the upper one of an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A deterministic standard-normal-ish stream (sum of uniforms), scaled.
pub(crate) struct Noise(pub(crate) u64);

impl Noise {
    pub(crate) fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.uniform()).sum::<f64>() * 3f64.sqrt() - 2.0 * 3f64.sqrt()
    }
    pub(crate) fn f32s(&mut self, n: usize, scale: f64, shift: f64) -> Vec<f32> {
        (0..n).map(|_| (shift + scale * self.normal()) as f32).collect()
    }
}

pub(crate) fn spec(dims: &[usize], dtype: DType) -> TensorSpec {
    TensorSpec::new(dtype, Shape::new(dims).expect("a small shape"))
}

/// The benchmark transformer: V256 T128 D256 H8 L4 F1024.
pub(crate) const TRANSFORMER: nn::Transformer =
    nn::Transformer { vocab: 256, seq: 128, dim: 256, heads: 8, layers: 4, ffn: 1024 };

/// Initial f32 values of a transformer program's weights (every parameter after the
/// first, the rows), at the reference run's scales.
pub(crate) fn transformer_init(
    program: &Program,
    noise: &mut Noise,
) -> Result<Vec<(String, Tensor)>, meshwork_program::Error> {
    program.params()[1..]
        .iter()
        .map(|p| {
            let d = p.spec.shape.dims();
            let n = p.spec.shape.num_elements();
            let fan_in = d[0] as f64;
            let name = p.name.as_str();
            let v = if name == "embed" {
                noise.f32s(n, 0.5, 0.0)
            } else if name == "pos" {
                noise.f32s(n, 0.1, 0.0)
            } else if name.ends_with(".scale") {
                noise.f32s(n, if name.starts_with("ln_f") { 0.0 } else { 0.1 }, 1.0)
            } else if name.ends_with(".bias") {
                noise.f32s(n, if name.starts_with("ln_f") { 0.0 } else { 0.1 }, 0.0)
            } else if name.ends_with(".b1") || name.ends_with(".b2") {
                vec![0.0; n]
            } else {
                noise.f32s(n, 1.0 / fan_in.sqrt(), 0.0)
            };
            Ok((p.name.clone(), Tensor::f32(d, v)?))
        })
        .collect()
}

/// `steps` batches of `batch` token rows `[batch, seq + 1]`, cycling through
/// `rows_total` random rows.
pub(crate) fn token_batches(
    model: &nn::Transformer,
    batch: usize,
    rows_total: usize,
    steps: usize,
    noise: &mut Noise,
) -> Result<Vec<Tensor>, meshwork_program::Error> {
    let width = model.seq + 1;
    let vocab = model.vocab as f64;
    let tokens: Vec<i32> = (0..rows_total * width)
        .map(|_| (noise.uniform() * vocab) as i32 % model.vocab as i32)
        .collect();
    (0..steps)
        .map(|s| {
            let mut rows = Vec::with_capacity(batch * width);
            for i in 0..batch {
                let r = (s * batch + i) % rows_total;
                rows.extend_from_slice(&tokens[r * width..(r + 1) * width]);
            }
            Tensor::i32(&[batch, width], rows)
        })
        .collect()
}
