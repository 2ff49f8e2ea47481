//! A placed program on the interpreter: each part cut into segments and run as a
//! dataflow on its device's thread ([`dataflow`](super::dataflow)), its variables held
//! beside it.

use std::sync::{Arc, Mutex};

use meshwork_partition::placed::{Part, Sink, Source};
use meshwork_program::Env;
use meshwork_program::fast::{Input, Options};
use meshwork_types::Tensor;

use super::dataflow::Segments;
use super::{ReplicaChannels, lock, run_replicas};
use crate::backend::PlacedExecutable;
use crate::backend::placed_sinks;
use crate::{Result, Strategy};

/// The parts, on their devices.
pub(super) struct Parts {
    /// Each part cut into segments, shared with the device threads.
    exes: Arc<Vec<Segments>>,
    /// Each part's inputs.
    sources: Arc<Vec<Vec<Source>>>,
    /// Per part, its variables' values (in its sources' order), on its device.
    resident: Arc<Vec<Mutex<Vec<Option<Tensor>>>>>,
    /// Per part, where each result goes: `Some(slot)` for the variable it updates,
    /// `None` for a step result (or nothing).
    sinks: Vec<Vec<Option<usize>>>,
    /// Per part, its sinks as declared.
    kinds: Vec<Vec<Sink>>,
    /// The device of each part.
    placement: Vec<usize>,
    /// What its steps moved.
    traffic: Arc<crate::backend::TrafficCounter>,
}

impl Parts {
    pub(super) fn compile(parts: &[Part], placement: &[usize], devices: usize) -> Result<Parts> {
        // A device is a fixed share of the machine's cores, used or not: a placement
        // that leaves devices idle does not get their cores.
        let options = Options::for_devices(devices);
        let exes =
            parts.iter().map(|p| Segments::new(&p.program, options)).collect::<Result<Vec<_>>>()?;
        let resident = parts
            .iter()
            .map(|p| {
                let n = p.sources.iter().filter(|s| matches!(s, Source::Variable(_))).count();
                Mutex::new(vec![None; n])
            })
            .collect();
        Ok(Parts {
            exes: Arc::new(exes),
            sources: Arc::new(parts.iter().map(|p| p.sources.clone()).collect()),
            resident: Arc::new(resident),
            sinks: parts.iter().map(placed_sinks).collect::<Result<_>>()?,
            kinds: parts.iter().map(|p| p.sinks.clone()).collect(),
            placement: placement.to_vec(),
            traffic: Arc::default(),
        })
    }
}

impl PlacedExecutable for Parts {
    fn put(&self, part: usize, slot: usize, value: Tensor) -> Result<()> {
        lock(&self.resident[part])[slot] = Some(value);
        Ok(())
    }

    fn fetch(&self, part: usize, slot: usize) -> Result<Option<Tensor>> {
        Ok(lock(&self.resident[part])[slot].clone())
    }

    fn is_set(&self, part: usize, slot: usize) -> bool {
        lock(&self.resident[part])[slot].is_some()
    }

    fn held_bytes(&self, part: usize, slot: usize) -> Result<Option<u64>> {
        Ok(lock(&self.resident[part])[slot].as_ref().map(|t| t.byte_size() as u64))
    }

    fn traffic(&self) -> crate::backend::Traffic {
        self.traffic.get()
    }

    fn run(&self, strategy: &Strategy, feeds: Vec<Vec<Tensor>>) -> Result<Vec<Vec<Tensor>>> {
        let n = self.exes.len();
        self.traffic.fed(crate::backend::bytes_of(feeds.iter().flatten()));
        let traffic = self.traffic.clone();
        let slots: Arc<Vec<Mutex<Vec<Tensor>>>> =
            Arc::new(feeds.into_iter().map(Mutex::new).collect());
        let outs: Arc<Vec<Mutex<Vec<Tensor>>>> =
            Arc::new((0..n).map(|_| Mutex::new(Vec::new())).collect());
        let (exes, resident, o) = (self.exes.clone(), self.resident.clone(), outs.clone());
        let sources = self.sources.clone();
        run_replicas(
            strategy.runtime(),
            &self.placement,
            Arc::new(move |ctx| {
                let r = ctx.replica_id();
                let mut fed = std::mem::take(&mut *lock(&slots[r])).into_iter();
                let held = lock(&resident[r]);
                let mut vars = held.iter();
                let mut inputs = Vec::with_capacity(sources[r].len());
                for s in &sources[r] {
                    inputs.push(match s {
                        Source::Feed(_) => Input::Owned(fed.next().expect("a feed per source")),
                        Source::Variable(_) => Input::Borrowed(
                            vars.next().and_then(Option::as_ref).expect("checked before the step"),
                        ),
                    });
                }
                let channels =
                    ReplicaChannels { ctx, peer: Mutex::new(None), counter: Some(&traffic) };
                let env = Env::local().with_channels(&channels);
                let out = exes[r].run(ctx, inputs, &env, &|e| channels.failure(e))?;
                *lock(&o[r]) = out;
                Ok(())
            }),
        )?;
        // Every device finished: updates to the variables, results out.
        let mut results = Vec::with_capacity(n);
        for (p, o) in outs.iter().enumerate() {
            let out = std::mem::take(&mut *lock(o));
            let mut held = lock(&self.resident[p]);
            let mut kept = Vec::new();
            for ((to, kind), t) in self.sinks[p].iter().zip(&self.kinds[p]).zip(out) {
                match (to, kind) {
                    (Some(j), _) => held[*j] = Some(t),
                    (None, Sink::Result(_)) => kept.push(t),
                    (None, _) => {}
                }
            }
            results.push(kept);
        }
        self.traffic.returned(crate::backend::bytes_of(results.iter().flatten()));
        self.traffic.stepped(1);
        Ok(results)
    }
}
