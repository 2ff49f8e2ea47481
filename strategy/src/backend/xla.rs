//! The XLA back end: each program lowered to StableHLO and compiled by XLA through a
//! PJRT plugin ([`meshwork_xla`]), its resident parameters kept on the device as PJRT
//! buffers between steps.
//!
//! - A step's carried results are the next step's parameters on the device: each is
//!   donated (`tf.aliasing_output`, as `jax.jit(donate_argnums=…)`), so XLA updates
//!   the parameters and optimizer slots in place. A run of several steps enqueues
//!   them all before reading any result back (asynchronous dispatch).
//! - A step moves only its fed parameters (the batch) in and its results (loss,
//!   metrics, what it `emit`s) out.
//! - Programs are compiled once per module text (the session's cache).
//! - One device for now: a mesh of more than one position, or a placed program, is an
//!   error saying so.
//!
//! Donation has JAX's cost: a step that fails on the device after its state was
//! donated leaves that state unset (the next step reports the parameter lost), where
//! the interpreter keeps the state from before the step. Everything that can fail on
//! the host — the feeds' uploads for every step of the call, a metrics stream for what
//! the program emits — is done or checked before anything is donated, so only a
//! failure of the device itself loses the state.

use std::sync::{Arc, Mutex, PoisonError};

use meshwork_partition::placed::Part;
use meshwork_program::Program;
use meshwork_types::{Tensor, TensorSpec};
use meshwork_xla::lower::LowerOptions;
use meshwork_xla::session::Compiled;
use meshwork_xla::{Arg, Buffer, Plugin, Session};

use super::{Backend, PlacedExecutable, SpmdExecutable};
use crate::{Error, Result, Strategy};

/// XLA on a PJRT plugin's device 0.
#[derive(Debug, Clone)]
pub struct Xla {
    session: Arc<Session>,
}

impl Xla {
    /// A back end on a new client of `plugin` (one device).
    pub fn new(plugin: &Plugin) -> Result<Xla> {
        Ok(Xla { session: Arc::new(Session::new(plugin, 1)?) })
    }

    /// The session: its client and its compiled programs.
    pub fn session(&self) -> &Session {
        &self.session
    }
}

fn one_device(what: &str, n: usize) -> Error {
    Error::Compiled {
        problem: format!(
            "the XLA back end runs one device; this {what} needs {n} (meshes and pipelines \
             on XLA come next)"
        ),
    }
}

impl Backend for Xla {
    fn name(&self) -> &'static str {
        "xla"
    }

    fn compile_spmd(
        &self,
        program: &Program,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        if placement.len() != 1 {
            return Err(one_device("mesh", placement.len()));
        }
        let options = LowerOptions { replicas: 1, donate: carry.to_vec() };
        let compiled = self.session.compile(program, &options)?;
        let lowered = &compiled.lowered;
        if !lowered.sends.is_empty() || !lowered.recvs.is_empty() {
            return Err(Error::Compiled {
                problem: "the program sends or receives, which the XLA back end does not run \
                          yet (transfers between devices come with meshes and pipelines)"
                    .into(),
            });
        }
        // What each emit streams: the outputs after the results, in emit order.
        let mut at = program.results().len();
        let emits = lowered
            .emits
            .iter()
            .map(|&(consumer, n)| {
                let specs = lowered.outputs[at..at + n].to_vec();
                at += n;
                (consumer, specs)
            })
            .collect();
        let np = program.params().len();
        Ok(Box::new(XlaSpmd {
            session: Arc::clone(&self.session),
            compiled,
            carry: carry.to_vec(),
            results: program.results().len(),
            resident: resident.to_vec(),
            state: Mutex::new(State {
                params: (0..np).map(|_| None).collect(),
                staged: Vec::new(),
            }),
            pool: Mutex::new(Vec::new()),
            emits,
        }))
    }

    fn compile_placed(
        &self,
        parts: &[Part],
        _placement: &[usize],
        _devices: usize,
    ) -> Result<Box<dyn PlacedExecutable>> {
        Err(one_device("placed program", parts.len()))
    }
}

/// The device's resident parameters and a run's staged results.
struct State {
    params: Vec<Option<Buffer>>,
    /// The last run's carried results, `(parameter, buffer)`, until committed.
    staged: Vec<(usize, Buffer)>,
}

/// A program compiled by XLA on one device.
struct XlaSpmd {
    session: Arc<Session>,
    compiled: Arc<Compiled>,
    carry: Vec<(usize, usize)>,
    results: usize,
    resident: Vec<bool>,
    state: Mutex<State>,
    /// Host tensors a step's feeds were split into, kept after their upload for the
    /// next step's feeds: no fresh pages to fault in and zero each step.
    pool: Mutex<Vec<Tensor>>,
    /// Each `emit`: its consumer and what it streams.
    emits: Vec<(u32, Vec<TensorSpec>)>,
}

/// The most host tensors [`XlaSpmd::pool`] keeps.
const POOL: usize = 64;

impl XlaSpmd {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn position(r: usize) -> Result<()> {
        if r == 0 { Ok(()) } else { Err(one_device("position", r + 1)) }
    }
}

impl SpmdExecutable for XlaSpmd {
    fn buffer(&self, _r: usize, spec: &TensorSpec) -> Result<Tensor> {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        match pool.iter().position(|t| t.dtype() == spec.dtype && t.shape() == spec.shape.dims()) {
            Some(k) => Ok(pool.swap_remove(k)),
            None => Ok(Tensor::zeros(spec.dtype, spec.shape.dims())?),
        }
    }

    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()> {
        Self::position(r)?;
        let device = self.session.client().device(0)?;
        let buffer = self.session.client().put(&part, device)?;
        self.state().params[param] = Some(buffer);
        Ok(())
    }

    fn put_all(&self, parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        // Every part uploaded first, then swapped in: a failed upload changes nothing.
        let device = self.session.client().device(0)?;
        let mut uploaded = Vec::with_capacity(parts.len());
        for (r, param, part) in parts {
            Self::position(r)?;
            uploaded.push((param, self.session.client().put(&part, device)?));
        }
        let mut state = self.state();
        for (param, buffer) in uploaded {
            state.params[param] = Some(buffer);
        }
        Ok(())
    }

    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>> {
        Self::position(r)?;
        let state = self.state();
        Ok(match &state.params[param] {
            Some(b) => Some(b.to_host()?),
            None => None,
        })
    }

    fn is_set(&self, r: usize, param: usize) -> bool {
        r == 0 && self.state().params[param].is_some()
    }

    fn run(
        &self,
        strategy: &Strategy,
        feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        let steps = feeds.into_iter().next().unwrap_or_default();
        // Every emit's consumer must take what it emits: checked now, as a failure to
        // stream after the state is donated would lose the state.
        for (consumer, specs) in &self.emits {
            strategy.takes_metrics(*consumer, specs)?;
        }
        let client = self.session.client();
        let device = client.device(0)?;
        // Every step's feeds on the device before anything is donated.
        let mut uploaded: Vec<Vec<Buffer>> = Vec::with_capacity(steps.len());
        for step_feed in &steps {
            let want = self.resident.iter().filter(|&&r| !r).count();
            if step_feed.len() != want {
                return Err(Error::Compiled {
                    problem: format!(
                        "{} feeds for {want} fed parameters (a partitioner bug)",
                        step_feed.len()
                    ),
                });
            }
            uploaded.push(
                step_feed
                    .iter()
                    .map(|t| client.put(t, device))
                    .collect::<meshwork_xla::Result<_>>()?,
            );
        }
        {
            // Uploaded: the host copies go back to the pool for the next call's feeds.
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            for t in steps.into_iter().flatten() {
                if pool.len() < POOL {
                    pool.push(t);
                }
            }
        }
        let mut state = self.state();
        let np = state.params.len();
        if let Some(p) = (0..np).find(|&p| self.resident[p] && state.params[p].is_none()) {
            return Err(unset(p));
        }
        let carried_into: Vec<Option<usize>> =
            (0..np).map(|p| self.carry.iter().find(|&&(_, q)| q == p).map(|&(r, _)| r)).collect();
        // The carried results so far, by parameter: the next step's inputs.
        let mut carried: Vec<Option<Buffer>> = (0..np).map(|_| None).collect();
        let mut pending: Vec<Vec<Buffer>> = Vec::with_capacity(uploaded.len());
        for step_feed in uploaded {
            let mut feed = step_feed.into_iter();
            let uploads: Vec<Option<Buffer>> =
                (0..np).map(|p| if self.resident[p] { None } else { feed.next() }).collect();
            // What the step owns (fed, carried, or a resident parameter the step
            // replaces, donated to it), then what it only reads.
            let mut owned: Vec<Option<Buffer>> = Vec::with_capacity(np);
            for (p, upload) in uploads.into_iter().enumerate() {
                owned.push(match (upload, carried[p].take()) {
                    (Some(b), _) | (None, Some(b)) => Some(b),
                    (None, None) if carried_into[p].is_some() => {
                        Some(state.params[p].take().ok_or_else(|| unset(p))?)
                    }
                    (None, None) => None,
                });
            }
            let mut args: Vec<Arg<'_>> = Vec::with_capacity(np);
            for (p, b) in owned.into_iter().enumerate() {
                args.push(match b {
                    Some(b) => Arg::Donated(b),
                    None => Arg::Borrowed(state.params[p].as_ref().ok_or_else(|| unset(p))?),
                });
            }
            let mut outs: Vec<Option<Buffer>> = self
                .compiled
                .executable
                .execute(vec![args])?
                .into_iter()
                .next()
                .unwrap_or_default()
                .into_iter()
                .map(Some)
                .collect();
            for &(r, p) in &self.carry {
                carried[p] = outs.get_mut(r).and_then(Option::take);
            }
            pending.push(outs.into_iter().flatten().collect());
        }
        state.staged = carried.into_iter().enumerate().filter_map(|(p, b)| Some((p, b?))).collect();
        drop(state);
        // Every step is enqueued; now the results come back, in order.
        let kept = self.results - self.carry.len();
        let mut results = Vec::with_capacity(pending.len());
        for (i, outs) in pending.into_iter().enumerate() {
            let mut host =
                outs.iter().map(Buffer::to_host).collect::<meshwork_xla::Result<Vec<_>>>()?;
            let emitted = host.split_off(kept.min(host.len()));
            let mut rest = emitted.into_iter();
            for (consumer, specs) in &self.emits {
                let values: Vec<Tensor> = rest.by_ref().take(specs.len()).collect();
                strategy.host_emit(0, *consumer, tag + i as u64, values)?;
            }
            results.push(host);
        }
        Ok(vec![results])
    }

    fn commit(&self, keep: bool) {
        let mut state = self.state();
        let staged = std::mem::take(&mut state.staged);
        if keep {
            for (p, b) in staged {
                state.params[p] = Some(b);
            }
        }
    }
}

fn unset(p: usize) -> Error {
    Error::Compiled {
        problem: format!(
            "resident parameter {p} is not on the device (never set, or lost in a failed step)"
        ),
    }
}
