//! float32 arithmetic as PyTorch's x86 CPU kernels do it, where Hugging Face's
//! Llama-family models compute in float32 whatever the model's dtype: RMSNorm's row
//! sum (PyTorch's cascade over 8-lane vectors, which a float32 `mean` over the last
//! axis is) and the rotary inverse frequencies' `θ^(2i/d)` (SLEEF's `powf_u10` on
//! whole 16-lane vectors, the C library's `powf` on the rest). Reproducing them bit
//! for bit is what lets a float64 model here follow `transformers`' float64 one: its
//! RMSNorm rounds every row to float32, and its rotary tables are float32.
//!
//! What is not reproduced is the tables' `sin` and `cos`: PyTorch takes them from
//! Intel MKL's vector library, whose float32 results are not the correctly rounded
//! ones in about 5% of cases and whose algorithm is not published. [`sin`] and
//! [`cos`] here are correctly rounded; a table entry differs from PyTorch's by one
//! unit in the last place where MKL's result does.
//!
//! `pow` is a port of SLEEF 3.x's `xpowf` (`src/libm/sleefsimdsp.c`, with FMA and
//! full rounding as its AVX2 and AVX-512 builds have them). SLEEF is Copyright Naoki
//! Shibata and contributors 2010–2025, distributed under the Boost Software License
//! 1.0.
//!
//! ```
//! use meshwork_nn::torch_cpu;
//!
//! // PyTorch's float32 `.sum(-1)` of a row of 10: one vector of 8 lanes, the tail of
//! // 2 first, then the lanes in order.
//! let row: Vec<f32> = (1..=10).map(|k| k as f32 * 0.1).collect();
//! let mut want = row[8] + row[9];
//! for &x in &row[..8] {
//!     want += x;
//! }
//! assert_eq!(torch_cpu::sum(&row), want);
//! ```

use meshwork_program::{Builder, Result, Value};
use meshwork_types::DType;

/// A float32 pair `x + y` (SLEEF's `vfloat2`).
#[derive(Clone, Copy)]
struct Df {
    x: f32,
    y: f32,
}

fn df(x: f32, y: f32) -> Df {
    Df { x, y }
}

fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// `a·b − c`, fused.
fn fmapn(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, -c)
}

/// `−a·b + c`, fused.
fn fmanp(a: f32, b: f32, c: f32) -> f32 {
    (-a).mul_add(b, c)
}

fn normalize(t: Df) -> Df {
    let s = t.x + t.y;
    df(s, (t.x - s) + t.y)
}

fn add2_ff(x: f32, y: f32) -> Df {
    let s = x + y;
    let v = s - x;
    df(s, (x - (s - v)) + (y - v))
}

fn add2_df_f(x: Df, y: f32) -> Df {
    let s = x.x + y;
    let v = s - x.x;
    let t = (x.x - (s - v)) + (y - v);
    df(s, t + x.y)
}

fn add_f_df(x: f32, y: Df) -> Df {
    let s = x + y.x;
    df(s, ((x - s) + y.x) + y.y)
}

fn add_dd(x: Df, y: Df) -> Df {
    let s = x.x + y.x;
    df(s, (((x.x - s) + y.x) + x.y) + y.y)
}

fn add2_dd(x: Df, y: Df) -> Df {
    let s = x.x + y.x;
    let v = s - x.x;
    let t = (x.x - (s - v)) + (y.x - v);
    df(s, t + (x.y + y.y))
}

fn mul_df_f(x: Df, y: f32) -> Df {
    let s = x.x * y;
    df(s, fma(x.y, y, fmapn(x.x, y, s)))
}

fn mul_dd(x: Df, y: Df) -> Df {
    let s = x.x * y.x;
    df(s, fma(x.x, y.y, fma(x.y, y.x, fmapn(x.x, y.x, s))))
}

fn squ(x: Df) -> Df {
    let s = x.x * x.x;
    df(s, fma(x.x + x.x, x.y, fmapn(x.x, x.x, s)))
}

fn div_dd(n: Df, d: Df) -> Df {
    let t = 1.0 / d.x;
    let s = n.x * t;
    let u = fmapn(t, n.x, s);
    let v = fmanp(d.y, t, fmanp(d.x, t, 1.0));
    df(s, fma(s, v, fma(n.y, t, u)))
}

fn scale(d: Df, s: f32) -> Df {
    df(d.x * s, d.y * s)
}

/// Round to nearest, ties to even, to an integer (`cvtps2dq`).
fn rint_i(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// `2^q · d` by adding to the exponent bits (`vldexp3`, no range checks).
fn ldexp3(d: f32, q: i32) -> f32 {
    f32::from_bits((d.to_bits() as i32).wrapping_add(q << 23) as u32)
}

/// `⌊log2 |d|⌋` of a normal `d`, from its exponent bits (`vilogb2k`).
fn ilogb2k(d: f32) -> i32 {
    ((d.to_bits() >> 23) & 0xff) as i32 - 0x7f
}

/// `x · 2^q` with the range handling of SLEEF's `vldexp`.
fn ldexp(x: f32, q: i32) -> f32 {
    let mut m = q >> 31;
    m = (((m + q) >> 6) - m) << 4;
    let q = q - (m << 2);
    let mut m = m + 0x7f;
    m = if m > 0 { m } else { 0 };
    if m > 0xff {
        m = 0xff;
    }
    let u = f32::from_bits((m as u32) << 23);
    let x = x * u * u * u * u;
    let u = f32::from_bits(((q + 0x7f) as u32) << 23);
    x * u
}

// SLEEF's constants, by their bits (their decimal forms in the comments).
const LN2_HI: f32 = f32::from_bits(0x3f31_7218); // 0.69314718246459960938
const LN2_LO: f32 = f32::from_bits(0xb102_e308); // -1.904654323148236017e-09
const C_HI: f32 = f32::from_bits(0x3f2a_aaaa); // 0.66666662693023681640625
const C_LO: f32 = f32::from_bits(0x317d_b383); // 3.69183861259614332084311e-09
const LT0: f32 = f32::from_bits(0x3e76_168a); // 0.240320354700088500976562
const LT1: f32 = f32::from_bits(0x3e91_fa4a); // 0.285112679004669189453125
const LT2: f32 = f32::from_bits(0x3ecc_cdd9); // 0.400007992982864379882812
const E0: f32 = f32::from_bits(0x3ab2_aef6); // 0.00136324646882712841033936
const E1: f32 = f32::from_bits(0x3c09_116b); // 0.00836596917361021041870117
const E2: f32 = f32::from_bits(0x3d2a_af4c); // 0.0416710823774337768554688
const E3: f32 = f32::from_bits(0x3e2a_aa5e); // 0.166665524244308471679688
const E4: f32 = f32::from_bits(0x3eff_fffb); // 0.499999850988388061523438
const L2UF: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125
const L2LF: f32 = f32::from_bits(0x35bf_be8e); // 1.428606765330187045e-06
const R_LN2F: f32 = f32::from_bits(0x3fb8_aa3b); // 1/ln 2

/// `log |d|` as a float32 pair (SLEEF's `logkf`), for a positive normal `d`.
fn logk(d: f32) -> Df {
    let e = ilogb2k(d * (1.0f32 / 0.75));
    let m = ldexp3(d, -e);
    let x = div_dd(add2_ff(-1.0, m), add2_ff(1.0, m));
    let x2 = squ(x);
    let mut t = LT0;
    t = fma(t, x2.x, LT1);
    t = fma(t, x2.x, LT2);
    let c = df(C_HI, C_LO);
    let mut s = mul_df_f(df(LN2_HI, LN2_LO), e as f32);
    s = add_dd(s, scale(x, 2.0));
    add_dd(s, mul_dd(mul_dd(x2, x), add2_dd(mul_df_f(x2, t), c)))
}

/// `exp` of a float32 pair (SLEEF's `expkf`).
fn expk(d: Df) -> f32 {
    let u = (d.x + d.y) * R_LN2F;
    let q = rint_i(u);
    let mut s = add2_df_f(d, q as f32 * -L2UF);
    s = add2_df_f(s, q as f32 * -L2LF);
    s = normalize(s);
    let mut u = E0;
    u = fma(u, s.x, E1);
    u = fma(u, s.x, E2);
    u = fma(u, s.x, E3);
    u = fma(u, s.x, E4);
    let t = add_dd(s, mul_df_f(squ(s), u));
    let t = add_f_df(1.0, t);
    let u = ldexp(t.x + t.y, q);
    if d.x < -104.0 { 0.0 } else { u }
}

/// `sin(x)` of float32 `x`, correctly rounded to float32.
pub fn sin(x: f32) -> f32 {
    f64::from(x).sin() as f32
}

/// `cos(x)` of float32 `x`, correctly rounded to float32.
pub fn cos(x: f32) -> f32 {
    f64::from(x).cos() as f32
}

/// `base ** (torch.arange(0, dim, 2).float() / dim)` as PyTorch computes it on an
/// AVX-512 CPU: the exponents `f32(2i) / f32(dim)`, then SLEEF's `powf` on each whole
/// chunk of 32 (two 16-lane vectors, its vectorized loop) and the C library's `powf`
/// (Rust's `f32::powf`) on the values left over.
pub fn pow_arange(base: f32, dim: usize) -> Vec<f32> {
    let n = dim.div_ceil(2);
    let vectorized = n / 32 * 32;
    (0..n)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            if i < vectorized { pow(base, e) } else { base.powf(e) }
        })
        .collect()
}

/// `x^y` in float32 as SLEEF's `Sleef_powf_u10` computes it, for a positive finite
/// base `x` (the inverse frequencies' `θ^(2i/d)`); `NaN` otherwise.
pub fn pow(x: f32, y: f32) -> f32 {
    if !(x > 0.0 && x.is_finite() && y.is_finite()) {
        return f32::NAN;
    }
    if y == 0.0 || x == 1.0 {
        return 1.0;
    }
    let r = expk(mul_df_f(logk(x), y));
    if r.is_nan() { f32::INFINITY } else { r }
}

/// PyTorch's float32 sum of a contiguous row (`Tensor.sum(-1)` on the CPU): 8-lane
/// vectors summed 4 at a time through its cascade of levels, the vectors left over
/// into the first, the four into one, then the scalar tail and the 8 lanes in order.
pub fn sum(row: &[f32]) -> f32 {
    if row.len() < 8 {
        return short_sum(row);
    }
    SumOrder::new(row.len()).eval(row)
}

/// A row shorter than a vector, as PyTorch's scalar path adds it: four accumulators
/// over the first four values, the rest into the first, then the four in order.
fn short_sum(row: &[f32]) -> f32 {
    let mut parts = [0.0f32; 4];
    let whole = row.len() / 4 * 4;
    parts.iter_mut().zip(&row[..whole]).for_each(|(p, &x)| *p += x);
    for &x in &row[whole..] {
        parts[0] += x;
    }
    parts[0] + parts[1] + parts[2] + parts[3]
}

/// The order PyTorch's float32 row sum adds a row of `n` in, as a plan over blocks
/// of 32 (4 vectors of 8 lanes): what [`sum`] computes on a slice and
/// [`sum_last`] writes as a program.
#[derive(Debug, Clone)]
struct SumOrder {
    n: usize,
    /// Vectors of 8.
    vectors: usize,
    /// Blocks of 4 vectors the cascade takes.
    blocks: usize,
    /// The cascade: each step adds block `Some(i)` into level 0, or level `j - 1`
    /// into level `j` (`None`, with `j`), clearing it.
    steps: Vec<Step>,
}

#[derive(Debug, Clone, Copy)]
enum Step {
    /// `acc[0] += block i`.
    Block(usize),
    /// `acc[j] += acc[j - 1]; acc[j - 1] = 0`.
    Carry(usize),
}

const LEVELS: usize = 4;

impl SumOrder {
    fn new(n: usize) -> SumOrder {
        let vectors = n / 8;
        let blocks = vectors / 4;
        let log2 = if blocks <= 1 { 0 } else { usize::BITS - (blocks - 1).leading_zeros() };
        let power = (log2 as usize / LEVELS).max(4);
        let step = 1usize << power;
        let mask = step - 1;
        let mut steps = Vec::new();
        let mut i = 0;
        while i + step <= blocks {
            for _ in 0..step {
                steps.push(Step::Block(i));
                i += 1;
            }
            for j in 1..LEVELS {
                steps.push(Step::Carry(j));
                if i & (mask << (j * power)) != 0 {
                    break;
                }
            }
        }
        while i < blocks {
            steps.push(Step::Block(i));
            i += 1;
        }
        SumOrder { n, vectors, blocks, steps }
    }

    /// The sum of `row` in this order.
    fn eval(&self, row: &[f32]) -> f32 {
        let block = |i: usize| -> [f32; 32] { row[32 * i..32 * i + 32].try_into().expect("32") };
        let mut acc = [[0.0f32; 32]; LEVELS];
        for step in &self.steps {
            match *step {
                Step::Block(i) => {
                    let b = block(i);
                    acc[0].iter_mut().zip(b).for_each(|(a, x)| *a += x);
                }
                Step::Carry(j) => {
                    let lower = acc[j - 1];
                    acc[j].iter_mut().zip(lower).for_each(|(a, x)| *a += x);
                    acc[j - 1] = [0.0; 32];
                }
            }
        }
        for j in 1..LEVELS {
            let level = acc[j];
            acc[0].iter_mut().zip(level).for_each(|(a, x)| *a += x);
        }
        let mut lanes = [0.0f32; 8];
        lanes.copy_from_slice(&acc[0][..8]);
        for v in 4 * self.blocks..self.vectors {
            lanes.iter_mut().zip(&row[8 * v..8 * v + 8]).for_each(|(a, x)| *a += x);
        }
        for k in 1..4 {
            lanes.iter_mut().zip(&acc[0][8 * k..8 * k + 8]).for_each(|(a, x)| *a += x);
        }
        let mut total = 0.0f32;
        for &x in &row[8 * self.vectors..self.n] {
            total += x;
        }
        for lane in lanes {
            total += lane;
        }
        total
    }
}

/// The sum over the last axis of float32 `x` `[…, n]`, kept as `[…, 1]`, added in the
/// order of PyTorch's CPU kernel ([`sum`]): the value is that order's, bit for bit, on
/// every back end (elementwise adds of slices, which no compiler reorders); its
/// gradient is a plain sum's (the ordered adds are held out of differentiation, so
/// the backward pass is one broadcast).
pub fn sum_last(b: &mut Builder, x: Value) -> Result<Value> {
    let spec = b.spec(x)?.clone();
    let dims = spec.shape.dims().to_vec();
    let rank = dims.len();
    let n = dims[rank - 1];
    let order = SumOrder::new(n);
    let cut = |b: &mut Builder, lo: usize, hi: usize| -> Result<Value> {
        let mut start = vec![0; rank];
        let mut stop = dims.clone();
        (start[rank - 1], stop[rank - 1]) = (lo, hi);
        b.slice(x, &start, &stop, &vec![1; rank])
    };
    let add = |b: &mut Builder, acc: Option<Value>, v: Value| -> Result<Option<Value>> {
        Ok(Some(match acc {
            None => v,
            Some(a) => b.add(a, v)?,
        }))
    };
    if (1..8).contains(&n) {
        // The scalar path ([`short_sum`]): four accumulators, the rest into the first.
        let whole = n / 4 * 4;
        let mut parts: [Option<Value>; 4] = [None; 4];
        for (k, part) in parts.iter_mut().enumerate().take(whole) {
            *part = Some(cut(b, k, k + 1)?);
        }
        for k in whole..n {
            let one = cut(b, k, k + 1)?;
            parts[0] = add(b, parts[0], one)?;
        }
        let mut total = parts[0];
        for p in parts[1..].iter().flatten() {
            total = add(b, total, *p)?;
        }
        let ordered = total.expect("a row of at least one value");
        let plain = b.reduce_sum(x, &[-1], true)?;
        let gap = b.sub(ordered, plain)?;
        let gap = b.stop_gradient(gap)?;
        return b.add(plain, gap);
    }
    let mut acc: [Option<Value>; LEVELS] = [None; LEVELS];
    for step in &order.steps {
        match *step {
            Step::Block(i) => {
                let block = cut(b, 32 * i, 32 * i + 32)?;
                acc[0] = add(b, acc[0], block)?;
            }
            Step::Carry(j) => {
                if let Some(lower) = acc[j - 1].take() {
                    acc[j] = add(b, acc[j], lower)?;
                }
            }
        }
    }
    for j in 1..LEVELS {
        if let Some(level) = acc[j] {
            acc[0] = add(b, acc[0], level)?;
        }
    }
    let part = |b: &mut Builder, v: Value, k: usize, width: usize| -> Result<Value> {
        let mut start = vec![0; rank];
        let mut stop = b.spec(v)?.shape.dims().to_vec();
        (start[rank - 1], stop[rank - 1]) = (k * width, (k + 1) * width);
        b.slice(v, &start, &stop, &vec![1; rank])
    };
    let mut lanes = match acc[0] {
        Some(a) => Some(part(b, a, 0, 8)?),
        None => None,
    };
    for v in 4 * order.blocks..order.vectors {
        let vector = cut(b, 8 * v, 8 * v + 8)?;
        lanes = add(b, lanes, vector)?;
    }
    if let Some(a) = acc[0] {
        for k in 1..4 {
            let p = part(b, a, k, 8)?;
            lanes = add(b, lanes, p)?;
        }
    }
    let mut total = None;
    for k in 8 * order.vectors..n {
        let one = cut(b, k, k + 1)?;
        total = add(b, total, one)?;
    }
    if let Some(l) = lanes {
        for j in 0..8 {
            let one = part(b, l, j, 1)?;
            total = add(b, total, one)?;
        }
    }
    let ordered = match total {
        Some(t) => t,
        None => {
            let zero = b.constant(0.0, spec.dtype)?;
            let mut shape = dims.clone();
            shape[rank - 1] = 1;
            return b.broadcast_to(zero, &shape);
        }
    };
    // plain + (ordered − plain): the difference of two roundings of one sum is exact,
    // so the value is `ordered`'s; only `plain` is differentiated.
    let plain = b.reduce_sum(x, &[-1], true)?;
    let gap = b.sub(ordered, plain)?;
    let gap = b.stop_gradient(gap)?;
    b.add(plain, gap)
}

/// `1/sqrt(x)` of positive float32 `x` as PyTorch's `rsqrt` computes it (a correctly rounded
/// square root, then a correctly rounded division), differentiated as its autograd
/// does: the gradient `(−0.5·g)·((r·r)·r)`. (The value comes from `sqrt` and `div`;
/// `(x − x)·c`, which is 0 and whose derivative is `c`, carries the gradient.) The
/// root reaches the division through a `select` (`x > −1`, true for every `x` a
/// root is taken of), so that XLA's simplifier does not turn `1/sqrt(x)` into its own
/// `rsqrt`, which rounds differently.
pub fn rsqrt(b: &mut Builder, x: Value) -> Result<Value> {
    let root = b.sqrt(x)?;
    let minus_one = b.scalar_like(x, -1.0)?;
    let real = b.gt(x, minus_one)?;
    let root = b.select(real, root, x)?;
    let one = b.scalar_like(x, 1.0)?;
    let r = b.div(one, root)?;
    let r = b.stop_gradient(r)?;
    let r2 = b.mul(r, r)?;
    let r3 = b.mul(r2, r)?;
    let half = b.scalar_like(x, -0.5)?;
    let slope = b.mul(half, r3)?;
    let slope = b.stop_gradient(slope)?;
    let held = b.stop_gradient(x)?;
    let zero = b.sub(x, held)?;
    let carried = b.mul(zero, slope)?;
    b.add(r, carried)
}

/// RMSNorm as Hugging Face's Llama-family models compute it: `x` rounded to float32
/// (whatever the model's dtype), `x · 1/sqrt(mean(x²) + eps)` in float32 with the
/// mean's sum in PyTorch's order ([`sum_last`]), rounded back to `x`'s dtype, times
/// the parameter `weight` `[n]` in the current scope.
pub fn rms_norm(b: &mut Builder, x: Value, eps: f64) -> Result<Value> {
    let spec = b.spec(x)?.clone();
    let dims = spec.shape.dims();
    let n = *dims.last().ok_or_else(|| {
        crate::layers::problem("rms_norm", b, &[x], "a scalar has no axis to normalize".into())
    })?;
    let weight = crate::layers::param(b, "weight", spec.dtype, &[n])?;
    let x32 = if spec.dtype == DType::F32 { x } else { b.convert(x, DType::F32)? };
    let sq = b.mul(x32, x32)?;
    let total = sum_last(b, sq)?;
    let count = b.constant(n as f64, DType::F32)?;
    let var = b.div(total, count)?;
    let e = b.constant(f64::from(eps as f32), DType::F32)?;
    let ve = b.add(var, e)?;
    let r = rsqrt(b, ve)?;
    let y = b.mul(x32, r)?;
    let y = if spec.dtype == DType::F32 { y } else { b.convert(y, spec.dtype)? };
    b.mul(weight, y)
}

#[cfg(test)]
mod tests;
