//! Optimizers whose state a checkpoint can hold.
//!
//! candle's optimizers keep their state (AdamW's moments and step count) in private
//! fields, so a trainer can checkpoint only their parameters. [`AdamW`] here is
//! candle's AdamW — the same formulas, in the same order of operations, so the same
//! bits — with its state readable and writable through [`Stateful`], which
//! [`Trainer::save_with_optimizer`](crate::Trainer::save_with_optimizer) and
//! [`restore_with_optimizer`](crate::Trainer::restore_with_optimizer) use.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

/// An optimizer whose per-variable state and update count can be read and put back.
pub trait Stateful: Optimizer {
    /// The names of each variable's state tensors (each of the variable's shape).
    const SLOTS: &'static [&'static str];

    /// Variable `k`'s state (in the order of [`Optimizer::new`]'s variables), one
    /// tensor per slot.
    fn slots(&self, k: usize) -> Vec<Tensor>;

    /// Puts variable `k`'s state.
    fn set_slots(&mut self, k: usize, values: &[Tensor]) -> candle_core::Result<()>;

    /// Updates made so far (AdamW's `t`).
    fn updates(&self) -> usize;

    /// Sets the updates made.
    fn set_updates(&mut self, t: usize);
}

/// One variable and its moments.
struct Moments {
    var: Var,
    m: Var,
    v: Var,
}

/// Adam with decoupled weight decay, exactly as `candle_nn::AdamW` computes it, with
/// its state open to checkpoints.
pub struct AdamW {
    vars: Vec<Moments>,
    step_t: usize,
    params: ParamsAdamW,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<AdamW> {
        let vars = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let (shape, dtype, device) =
                    (var.shape().clone(), var.dtype(), var.device().clone());
                Ok(Moments {
                    m: Var::zeros(&shape, dtype, &device)?,
                    v: Var::zeros(&shape, dtype, &device)?,
                    var,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW { vars, step_t: 0, params })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let (lr, beta1, beta2) = (p.lr, p.beta1, p.beta2);
        let lr_lambda = lr * p.weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for x in &self.vars {
            let Some(g) = grads.get(x.var.as_tensor()) else { continue };
            let next_m = ((x.m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((x.v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (x.var.as_tensor() * (1f64 - lr_lambda))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let next_theta = (next_theta - (adjusted * lr)?)?;
            x.m.set(&next_m)?;
            x.v.set(&next_v)?;
            x.var.set(&next_theta)?;
        }
        Ok(())
    }
}

impl Stateful for AdamW {
    const SLOTS: &'static [&'static str] = &["m", "v"];

    fn slots(&self, k: usize) -> Vec<Tensor> {
        self.vars
            .get(k)
            .map_or_else(Vec::new, |x| vec![x.m.as_tensor().clone(), x.v.as_tensor().clone()])
    }

    fn set_slots(&mut self, k: usize, values: &[Tensor]) -> candle_core::Result<()> {
        let (Some(x), [m, v]) = (self.vars.get(k), values) else {
            candle_core::bail!("AdamW has no variable {k} or the state is not [m, v]");
        };
        x.m.set(m)?;
        x.v.set(v)
    }

    fn updates(&self) -> usize {
        self.step_t
    }

    fn set_updates(&mut self, t: usize) {
        self.step_t = t;
    }
}
