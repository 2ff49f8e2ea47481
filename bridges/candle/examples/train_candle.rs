//! Trains two small candle models — an MLP and a CNN written with `candle_nn` — with
//! DDP and FSDP on 4 meshwork devices, and prints each loss curve beside plain
//! candle's on one device (same initial values, same global batches), then the memory
//! each replica keeps for parameters and AdamW's state, and the most it holds during a
//! step (DDP, FSDP with the model as one unit, FSDP with a unit per layer), measured by
//! counting the heap.
//!
//! `cargo run --release -p meshwork-candle --example train_candle [-- STEPS]`

#![allow(clippy::print_stdout, missing_docs)]
// The counting allocator below forwards every call unchanged to the system's.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::{
    AdamW, Conv2dConfig, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap, conv2d, linear, loss,
};
use meshwork_candle::{Config, Devices, Trainer};

/// The heap's live bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now =
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed) + layout.size() as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static HEAP: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// A two-layer MLP on 64 features, 10 classes.
struct Mlp(Linear, Linear);

impl Mlp {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Mlp> {
        Ok(Mlp(linear(64, 256, vb.pp("fc1"))?, linear(256, 10, vb.pp("fc2"))?))
    }
}

/// A CNN on 12x12 one-channel images: conv 3x3 (8) + ReLU, conv 3x3 stride 2 (16) +
/// ReLU, a linear head over 4 classes.
struct Cnn(candle_nn::Conv2d, candle_nn::Conv2d, Linear);

impl Cnn {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Cnn> {
        let same = Conv2dConfig { padding: 1, ..Default::default() };
        let down = Conv2dConfig { padding: 1, stride: 2, ..Default::default() };
        Ok(Cnn(
            conv2d(1, 8, 3, same, vb.pp("conv1"))?,
            conv2d(8, 16, 3, down, vb.pp("conv2"))?,
            linear(16 * 6 * 6, 4, vb.pp("head"))?,
        ))
    }
}

trait Model: Send + 'static {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self>
    where
        Self: Sized;
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor>;
}

impl Model for Mlp {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Mlp::new(vb)
    }
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        loss::cross_entropy(&self.1.forward(&self.0.forward(&b[0])?.relu()?)?, &b[1])
    }
}

impl Model for Cnn {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Cnn::new(vb)
    }
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        let h = self.0.forward(&b[0])?.relu()?;
        let h = self.1.forward(&h)?.relu()?.flatten_from(1)?;
        loss::cross_entropy(&self.2.forward(&h)?, &b[1])
    }
}

/// Step `s`'s batch of 64: MLP rows whose class is the argmax of 10 feature sums; CNN
/// images whose class is the brightest quadrant.
fn batch(cnn: bool, s: usize) -> candle_core::Result<Vec<Tensor>> {
    let dev = Device::Cpu;
    let seed = |i: usize| (((i * 2_654_435_761 + s * 40_503) % 10_007) as f32 / 10_007.0) - 0.5;
    if cnn {
        let mut x = vec![0f32; 64 * 144];
        let mut y = vec![0u32; 64];
        for (n, label) in y.iter_mut().enumerate() {
            let q = (n + s) % 4;
            *label = q as u32;
            for p in 0..144 {
                let (r, c) = (p / 12, p % 12);
                let bright = (r < 6) == (q < 2) && (c < 6) == q.is_multiple_of(2);
                x[n * 144 + p] = 2.0 * seed(n * 144 + p) + if bright { 0.5 } else { 0.0 };
            }
        }
        Ok(vec![Tensor::from_vec(x, (64, 1, 12, 12), &dev)?, Tensor::from_vec(y, 64, &dev)?])
    } else {
        let x: Vec<f32> = (0..64 * 64).map(seed).collect();
        let x = Tensor::from_vec(x, (64, 64), &dev)?;
        let y = x.narrow(1, 0, 60)?.reshape((64, 10, 6))?.sum(D::Minus1)?.argmax(D::Minus1)?;
        Ok(vec![x, y])
    }
}

fn curves<M: Model>(cnn: bool, steps: usize) -> Result<(), Box<dyn std::error::Error>> {
    let adamw = ParamsAdamW { lr: 0.003, ..Default::default() };
    let devices = Devices::cpu(4)?;
    let mut ddp = Trainer::<M, AdamW>::new(&devices, Config::ddp(), adamw.clone(), M::new)?;
    let init: std::collections::HashMap<String, Tensor> = ddp.parameters()?.into_iter().collect();
    let mut fsdp = Trainer::<M, AdamW>::with_values(
        &devices,
        Config::fsdp(),
        adamw.clone(),
        init.clone(),
        M::new,
    )?;
    // Plain candle on one device from the same values.
    let map = VarMap::new();
    let model = M::new(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    for (name, var) in map.data().lock().map_err(|_| "a poisoned VarMap")?.iter() {
        var.set(&init[name])?;
    }
    let mut opt = AdamW::new(map.all_vars(), adamw)?;
    println!("{} on 4 devices, AdamW, global batch 64", if cnn { "CNN" } else { "MLP" });
    println!("  step   one device        DDP       FSDP");
    let mut worst: f64 = 0.0;
    for s in 0..steps {
        let b = batch(cnn, s)?;
        let l = model.loss(&b)?;
        let one = f64::from(l.to_scalar::<f32>()?);
        opt.backward_step(&l)?;
        let d = ddp.step(&b, |m: &M, b: &[Tensor]| m.loss(b))?;
        let f = fsdp.step(&b, |m: &M, b: &[Tensor]| m.loss(b))?;
        worst = worst.max((d - one).abs()).max((f - one).abs());
        if s % (steps / 10).max(1) == 0 || s + 1 == steps {
            println!("  {s:>4}   {one:>10.6} {d:>10.6} {f:>10.6}");
        }
    }
    println!("  largest difference from one device: {worst:.1e} (f32)\n");
    Ok(())
}

/// A deep MLP for the memory count: 8 layers of 1024 -> 1024 (8.4M parameters), ReLU
/// between them.
struct Deep(Vec<DeepLayer>);

const WIDTH: usize = 1024;
const DEPTH: usize = 8;

/// Layer `k` of [`Deep`]; also an FSDP unit.
struct DeepLayer(Linear, bool);

impl Module for DeepLayer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.0.forward(x)?;
        if self.1 { y.relu() } else { Ok(y) }
    }
}

fn deep_layer(k: usize, vb: VarBuilder<'_>) -> candle_core::Result<DeepLayer> {
    Ok(DeepLayer(linear(WIDTH, WIDTH, vb.pp(format!("fc{k}")))?, k + 1 < DEPTH))
}

impl Deep {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Deep> {
        (0..DEPTH).map(|k| deep_layer(k, vb.clone())).collect::<candle_core::Result<_>>().map(Deep)
    }
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        let mut x = b[0].clone();
        for l in &self.0 {
            x = l.forward(&x)?;
        }
        loss::cross_entropy(&x, &b[1])
    }
}

/// A batch of 8 for the memory count.
fn deep_batch() -> candle_core::Result<[Tensor; 2]> {
    let x = Tensor::randn(0f32, 1.0, (8, WIDTH), &Device::Cpu)?;
    Ok([x, Tensor::from_vec((0..8u32).collect::<Vec<u32>>(), 8, &Device::Cpu)?])
}

/// Live heap bytes a trainer of `config` keeps on its 4 replicas between steps (after
/// two steps, so AdamW's state exists), and the most it held during the third.
fn resident(config: Config) -> Result<(isize, isize), Box<dyn std::error::Error>> {
    let b = deep_batch()?;
    let devices = Devices::cpu(4)?;
    let before = live();
    let mut t = Trainer::<Deep, AdamW>::new(&devices, config, ParamsAdamW::default(), Deep::new)?;
    for _ in 0..2 {
        t.step(&b, |m: &Deep, b: &[Tensor]| m.loss(b))?;
    }
    let after = live();
    PEAK.store(after, Ordering::Relaxed);
    t.step(&b, |m: &Deep, b: &[Tensor]| m.loss(b))?;
    let peak = PEAK.load(Ordering::Relaxed);
    drop(t);
    Ok((after - before, peak - before))
}

/// [`resident`] for the deep MLP as FSDP units, one layer each.
fn resident_units() -> Result<(isize, isize), Box<dyn std::error::Error>> {
    let b = deep_batch()?;
    let devices = Devices::cpu(4)?;
    let before = live();
    let mut t = Trainer::<meshwork_candle::Units, AdamW>::units(
        &devices,
        Config::fsdp(),
        ParamsAdamW::default(),
        DEPTH,
        deep_layer,
    )?;
    let head = |out: &Tensor, b: &[Tensor]| loss::cross_entropy(out, &b[1]);
    for _ in 0..2 {
        t.step_units(&b, head)?;
    }
    let after = live();
    PEAK.store(after, Ordering::Relaxed);
    t.step_units(&b, head)?;
    let peak = PEAK.load(Ordering::Relaxed);
    drop(t);
    Ok((after - before, peak - before))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(60);
    curves::<Mlp>(false, steps)?;
    curves::<Cnn>(true, steps)?;
    let params = DEPTH * (WIDTH * WIDTH + WIDTH) * 4;
    let (ddp, ddp_peak) = resident(Config::ddp())?;
    let (fsdp, fsdp_peak) = resident(Config::fsdp())?;
    println!(
        "memory per replica (of 4), MLP of {DEPTH} layers {WIDTH} -> {WIDTH} (f32), counted on the heap:"
    );
    println!("  the parameters once                        {:>8.1} MB", params as f64 / 1e6);
    println!(
        "  DDP, kept between steps (params + AdamW)   {:>8.1} MB   during a step {:>8.1} MB",
        ddp as f64 / 4e6,
        ddp_peak as f64 / 4e6
    );
    println!(
        "  FSDP, kept between steps (shards + AdamW)  {:>8.1} MB   during a step {:>8.1} MB",
        fsdp as f64 / 4e6,
        fsdp_peak as f64 / 4e6
    );
    let (units, units_peak) = resident_units()?;
    println!(
        "  FSDP, one unit per layer                   {:>8.1} MB   during a step {:>8.1} MB",
        units as f64 / 4e6,
        units_peak as f64 / 4e6
    );
    println!(
        "  FSDP / DDP: {:.2}x between steps; during a step {:.2}x as one unit (gathered whole), {:.2}x with a unit per layer",
        fsdp as f64 / ddp as f64,
        fsdp_peak as f64 / ddp_peak as f64,
        units_peak as f64 / ddp_peak as f64
    );
    Ok(())
}
