//! A device's part run as a dataflow on its device thread: the part cut into segments
//! ([`Cut`](crate::backend::cut::Cut)), and the device runs the first ready segment in
//! program order (all its inputs there), taking transfers as they arrive. A device
//! waits only when no segment is ready, and then for the first transfer to come.

use std::collections::BTreeSet;

use meshwork_executor::ReplicaContext;
use meshwork_program::fast::{Executable, Input, Options};
use meshwork_program::{Env, Program, Tensor, Value};

use super::{ReplicaError, boolean};
use crate::Result;
use crate::backend::cut::Cut;

/// A part cut into segments, each compiled for the fast interpreter.
pub(crate) struct Segments {
    cut: Cut,
    exes: Vec<Executable>,
}

impl Segments {
    /// Cuts `part` into segments and compiles each.
    pub(crate) fn new(part: &Program, options: Options) -> Result<Segments> {
        let cut = Cut::new(part)?;
        let exes = cut.pieces.iter().map(|p| Executable::compile(&p.program, options)).collect();
        Ok(Segments { cut, exes })
    }

    /// How many segments the part runs as.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.exes.len()
    }

    /// Runs the part on replica `ctx` with its parameters `inputs`; `env` carries its
    /// sends. `failure` maps a segment's error (a failed send: the peer's).
    pub(crate) fn run<'a>(
        &self,
        ctx: &ReplicaContext,
        inputs: Vec<Input<'a>>,
        env: &Env<'_>,
        failure: &dyn Fn(meshwork_program::Error) -> ReplicaError,
    ) -> std::result::Result<Vec<Tensor>, ReplicaError> {
        let cut = &self.cut;
        if inputs.len() != cut.params {
            return Err(ReplicaError::Program(meshwork_program::Error::Inputs {
                expected: cut.params,
                actual: inputs.len(),
                problem: "a placed part's inputs".into(),
            }));
        }
        let mut slots: Vec<Option<Input<'a>>> = Vec::with_capacity(cut.uses.len());
        slots.extend(inputs.into_iter().map(Some));
        slots.resize_with(cut.uses.len(), || None);
        let mut uses = cut.uses.clone();
        let mut missing = cut.missing.clone();
        let mut ready: BTreeSet<usize> =
            (0..cut.pieces.len()).filter(|&s| missing[s] == 0).collect();
        let mut waiting: Vec<usize> = (0..cut.receipts.len()).collect();
        let mut done = 0;
        // Value `v` is there: the segments reading it may be ready.
        let arrive = |v: Value, missing: &mut Vec<usize>, ready: &mut BTreeSet<usize>| {
            for &s in &cut.readers[v.index()] {
                missing[s] -= 1;
                if missing[s] == 0 {
                    ready.insert(s);
                }
            }
        };
        while done < cut.pieces.len() || !waiting.is_empty() {
            // Take every transfer that has arrived; wait for one if nothing is ready.
            loop {
                let wanted: Vec<(usize, u64)> = waiting
                    .iter()
                    .map(|&r| (cut.receipts[r].peer, u64::from(cut.receipts[r].channel)))
                    .collect();
                let got = if ready.is_empty() && !wanted.is_empty() {
                    Some(ctx.recv_any(&wanted).map_err(ReplicaError::Peer)?)
                } else {
                    ctx.try_recv_any(&wanted).map_err(ReplicaError::Peer)?
                };
                let Some((i, t)) = got else { break };
                let receipt = &cut.receipts[waiting.swap_remove(i)];
                let t = if receipt.bool { boolean(t) } else { t };
                slots[receipt.value.index()] = Some(Input::Owned(t));
                arrive(receipt.value, &mut missing, &mut ready);
            }
            let Some(s) = ready.pop_first() else {
                if done == cut.pieces.len() {
                    continue; // only receipts the part returns are left
                }
                return Err(ReplicaError::Program(meshwork_program::Error::Communication {
                    at: "a placed program's device".into(),
                    problem: "no segment is ready and no transfer is awaited".into(),
                }));
            };
            let segment = &cut.pieces[s];
            // The last reader takes a value it owns; others borrow it.
            let mut owned = Vec::with_capacity(segment.inputs.len());
            for v in &segment.inputs {
                let k = v.index();
                uses[k] -= 1;
                owned.push(match slots[k] {
                    Some(Input::Owned(_)) if uses[k] == 0 => slots[k].take(),
                    _ => None,
                });
            }
            let args: Vec<Input<'_>> = segment
                .inputs
                .iter()
                .zip(owned)
                .map(|(v, o)| match (o, &slots[v.index()]) {
                    (Some(taken), _) => taken,
                    (None, Some(Input::Owned(t))) => Input::Borrowed(t),
                    (None, Some(Input::Borrowed(t))) => Input::Borrowed(t),
                    (None, None) => unreachable!("a ready segment's inputs are there"),
                })
                .collect();
            let out = self.exes[s].run_inputs(args, env).map_err(failure)?;
            for (v, t) in segment.outputs.iter().zip(out) {
                slots[v.index()] = Some(Input::Owned(t));
                arrive(*v, &mut missing, &mut ready);
            }
            for v in &segment.inputs {
                if uses[v.index()] == 0 {
                    slots[v.index()] = None;
                }
            }
            done += 1;
        }
        let mut results = Vec::with_capacity(cut.results.len());
        for v in &cut.results {
            let k = v.index();
            uses[k] -= 1;
            results.push(match slots[k].take() {
                Some(Input::Owned(t)) if uses[k] == 0 => t,
                Some(Input::Owned(t)) => {
                    let copy = t.clone();
                    slots[k] = Some(Input::Owned(t));
                    copy
                }
                Some(Input::Borrowed(t)) => {
                    slots[k] = Some(Input::Borrowed(t));
                    t.clone()
                }
                None => unreachable!("every segment ran, so every result is there"),
            });
        }
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use meshwork_executor::Runtime;
    use meshwork_program::fast::{Input, Options};
    use meshwork_program::{Builder, Env, Tensor};

    use super::Segments;
    use crate::backend::interpreter::{ReplicaChannels, run_replicas};

    /// Device 0 first receives `u` then makes `w`; device 1 makes `u` from `w`. Run in
    /// program order, both would wait for ever; as a dataflow, device 0 makes and sends
    /// `w` first (it waits for nothing), and the step completes.
    #[test]
    fn a_device_runs_what_is_ready_before_what_waits() {
        let spec = "f64[2]".parse().unwrap();
        let mut b = Builder::new();
        let q = b.param("q", "f64[2]".parse().unwrap()).unwrap();
        let u = b.recv(&spec, 7, 1).unwrap();
        let v = b.neg(u).unwrap();
        let w = b.add(q, q).unwrap();
        b.send(w, 8, 1).unwrap();
        let zero = b.finish(&[v]).unwrap();
        let mut b = Builder::new();
        let w = b.recv(&spec, 8, 0).unwrap();
        let u = b.exp(w).unwrap();
        b.send(u, 7, 0).unwrap();
        let one = b.finish(&[u]).unwrap();
        let options = Options::for_devices(2);
        let parts = Arc::new([
            Segments::new(&zero, options).unwrap(),
            Segments::new(&one, options).unwrap(),
        ]);
        assert_eq!(parts[0].len(), 2, "w does not wait behind u's receipt");
        let out: Arc<Mutex<Vec<Vec<f64>>>> = Arc::new(Mutex::new(vec![Vec::new(); 2]));
        let o = out.clone();
        let runtime = Runtime::new(2).unwrap().with_timeout(std::time::Duration::from_secs(5));
        run_replicas(
            &runtime,
            &[0, 1],
            Arc::new(move |ctx| {
                let r = ctx.replica_id();
                let q = Tensor::f64(&[2], vec![0.5, -1.0]).unwrap();
                let inputs = if r == 0 { vec![Input::Owned(q)] } else { Vec::new() };
                let channels = ReplicaChannels { ctx, peer: Mutex::new(None), counter: None };
                let env = Env::local().with_channels(&channels);
                let got = parts[r].run(ctx, inputs, &env, &|e| channels.failure(e))?;
                o.lock().unwrap()[r] = got[0].to_f64();
                Ok(())
            }),
        )
        .unwrap();
        let out = out.lock().unwrap();
        assert_eq!(out[1], vec![1f64.exp(), (-2f64).exp()]);
        assert_eq!(out[0], vec![-(1f64.exp()), -((-2f64).exp())]);
    }
}
