//! The cost model's rates and link, measured on this machine: the fast interpreter's
//! kernels timed, and a transfer between two of a strategy's devices.

use std::time::{Duration, Instant};

use meshwork_partition::placed::{DeviceRates, PlaceOptions, ProgramCost, Rates};
use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Builder, Env, Program, Tensor};
use meshwork_types::{DType, TensorSpec};

use crate::{Error, Result, Strategy};

impl Strategy {
    /// A cost model for [`place_with_cost`](Self::place_with_cost) measured on this
    /// machine: kernel rates timed with the fast interpreter, with the threads a
    /// device of this strategy gets (every device type runs on the CPU here: each gets
    /// the CPU's rates), and the link timed by sending between two of its devices
    /// (none with one device). Takes about a second.
    pub fn measure_cost(&self) -> Result<ProgramCost> {
        let strategy = self;
        let devices = strategy.runtime().devices();
        let options = Options::for_devices(devices);
        let rates = DeviceRates {
            single: measure_rates(DType::F32, options)?,
            double: measure_rates(DType::F64, options)?,
        };
        let (bandwidth, latency) =
            if devices > 1 { measure_link(strategy, &rates.single)? } else { (f64::INFINITY, 0.0) };
        Ok(ProgramCost::uniform(rates, bandwidth, latency))
    }
}

/// The median seconds of `run` over repeats filling about `budget`.
fn median_seconds(budget: Duration, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?; // warm up: pools, pages
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed() < budget && times.len() < 200) {
        let t = Instant::now();
        run()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn measure_rates(dtype: DType, options: Options) -> Result<Rates> {
    let budget = Duration::from_millis(60);
    let time = |program: Program, inputs: Vec<Tensor>| -> Result<f64> {
        let exe = Executable::compile(&program, options);
        let env = Env::local();
        median_seconds(budget, || exe.run(&inputs, &env).map(drop).map_err(Error::from))
    };
    let spec = |dims: &[usize]| -> Result<TensorSpec> {
        Ok(TensorSpec::new(dtype, meshwork_types::Shape::new(dims)?))
    };
    let tensor = |dims: &[usize]| -> Result<Tensor> {
        let n = dims.iter().product();
        let values: Vec<f64> = (0..n).map(|i| ((i % 7) as f64 - 3.0) * 0.1).collect();
        Ok(match dtype {
            DType::F64 => Tensor::f64(dims, values)?,
            _ => Tensor::f32(dims, values.into_iter().map(|v| v as f32).collect())?,
        })
    };
    // Dispatch: a chain of small reductions the interpreter cannot fuse.
    const CHAIN: usize = 32;
    let mut b = Builder::new();
    let mut x = b.param("x", spec(&[1])?)?;
    for _ in 0..CHAIN {
        x = b.reduce_sum(x, &[0], true)?;
    }
    let overhead = time(b.finish(&[x])?, vec![tensor(&[1])?])? / CHAIN as f64;
    let n = 256;
    let mut b = Builder::new();
    let (l, r) = (b.param("l", spec(&[n, n])?)?, b.param("r", spec(&[n, n])?)?);
    let y = b.matmul(l, r)?;
    let t = time(b.finish(&[y])?, vec![tensor(&[n, n])?, tensor(&[n, n])?])?;
    let matmul_flops = 2.0 * (n * n * n) as f64 / (t - overhead).max(1e-9);
    let m = 1 << 20;
    let mut b = Builder::new();
    let (l, r) = (b.param("l", spec(&[m])?)?, b.param("r", spec(&[m])?)?);
    let y = b.add(l, r)?;
    let t = time(b.finish(&[y])?, vec![tensor(&[m])?, tensor(&[m])?])?;
    let elements = m as f64 / (t - overhead).max(1e-9);
    let mut b = Builder::new();
    let l = b.param("l", spec(&[m])?)?;
    let y = b.tanh(l)?;
    let t = time(b.finish(&[y])?, vec![tensor(&[m])?])?;
    let transcendentals = m as f64 / (t - overhead).max(1e-9);
    Ok(Rates { matmul_flops, elements, transcendentals, overhead })
}

/// (bandwidth, latency) between devices 0 and 1 of `strategy`: a scalar bounced
/// between them, then a 4 MiB tensor.
fn measure_link(strategy: &Strategy, rates: &Rates) -> Result<(f64, f64)> {
    const HOPS: usize = 16;
    let bounce = |elements: usize| -> Result<f64> {
        let spec = TensorSpec::new(DType::F32, meshwork_types::Shape::new(&[elements])?);
        let mut b = Builder::new();
        let mut x = b.device("CPU:0", |b| b.param("x", spec.clone()))?;
        for h in 0..HOPS {
            x = b.device(&format!("CPU:{}", (h + 1) % 2), |b| b.neg(x))?;
        }
        let program = b.finish(&[x])?;
        let placed = strategy.place(&program, &[], &PlaceOptions::default())?;
        let input = Tensor::f32(&[elements], vec![1.0; elements])?;
        let seconds = median_seconds(Duration::from_millis(60), || {
            placed.step(std::slice::from_ref(&input)).map(drop)
        })?;
        let ops = HOPS as f64 * (rates.overhead + elements as f64 / rates.elements);
        Ok(((seconds - ops) / HOPS as f64).max(1e-9))
    };
    let latency = bounce(1)?;
    let big = 1 << 20;
    let per = bounce(big)?;
    let bandwidth = (4 * big) as f64 / (per - latency).max(1e-9);
    Ok((bandwidth, latency))
}
