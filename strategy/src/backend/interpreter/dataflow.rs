//! A device's part run as a dataflow: the part is cut into segments — runs of
//! instructions, in program order, that depend on the same last transfer (none, or
//! the `k`-th receive in the part's order) — and the device runs the first ready
//! segment in program order (all its inputs there), taking transfers as they arrive,
//! as TensorFlow's executor starts a node once its inputs are there, at the grain of
//! what waits for the same transfer. A device waits only when no segment is ready,
//! and then for the first transfer to come.
//!
//! No deadlock: take the first instruction, in the one global program order, not yet
//! run on any device. It is the first of its segment (segments are runs and run whole,
//! so an earlier member would be an earlier instruction not yet run). Its segment's
//! other inputs come from earlier instructions (run) or from receipts whose index is
//! at most the segment's key — `recv`s before that first instruction, whose `send`s,
//! earlier still, have run. So that segment is ready once those transfers land.

use std::collections::BTreeSet;

use meshwork_executor::ReplicaContext;
use meshwork_program::fast::{Executable, Input, Options};
use meshwork_program::{Builder, Env, Op, Program, Tensor, Value};
use meshwork_types::{DType, TensorSpec};

use super::{ReplicaError, boolean};
use crate::Result;

/// A value the part receives.
struct Receipt {
    /// The replica that sends it.
    peer: usize,
    channel: u32,
    value: Value,
    bool: bool,
}

/// Instructions of a part between two groups of receives, as a program of their own.
struct Segment {
    exe: Executable,
    /// Part values it reads, in its parameters' order.
    inputs: Vec<Value>,
    /// Part values it makes that others read, in its results' order.
    outputs: Vec<Value>,
}

/// A part cut into segments.
pub(crate) struct Segments {
    receipts: Vec<Receipt>,
    segments: Vec<Segment>,
    /// Per part value, the segments that read it.
    readers: Vec<Vec<usize>>,
    /// Per part value, how many segments read it plus how often the part returns it.
    uses: Vec<usize>,
    /// Per segment, how many of its inputs are not parameters of the part.
    missing: Vec<usize>,
    params: usize,
    results: Vec<Value>,
}

impl Segments {
    /// Cuts `part` (parameters, then instructions with `recv`s right before first
    /// uses) into segments.
    pub(crate) fn new(part: &Program, options: Options) -> Result<Segments> {
        let np = part.params().len();
        let n = part.num_values();
        let mut receipts = Vec::new();
        // Each value's key: the last receipt it depends on (0 for none, k + 1 for
        // receipt k). A segment is a run of instructions of one key, in program order
        // — what does not wait for a transfer is not held up behind one — except that
        // an instruction without operands (a constant) joins the run it is in.
        let mut key = vec![0usize; n];
        let mut cuts: Vec<Vec<usize>> = Vec::new();
        let mut last: Option<usize> = None;
        for (i, instr) in part.instrs().iter().enumerate() {
            let v = np + i;
            if let Op::Recv { channel, peer, dtype, .. } = &instr.op {
                receipts.push(Receipt {
                    peer: *peer,
                    channel: *channel,
                    value: Value(v as u32),
                    bool: *dtype == DType::Bool,
                });
                key[v] = receipts.len();
                continue;
            }
            key[v] = instr.args.iter().map(|a| key[a.index()]).max().unwrap_or(0);
            let joins = instr.args.is_empty() && last.is_some();
            if !joins && last != Some(key[v]) {
                cuts.push(Vec::new());
                last = Some(key[v]);
            }
            if let Some(cut) = cuts.last_mut() {
                cut.push(i);
            }
        }
        let mut owner = vec![usize::MAX; n];
        for (s, cut) in cuts.iter().enumerate() {
            for &i in cut {
                owner[np + i] = s;
            }
        }
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut uses = vec![0usize; n];
        let mut inputs: Vec<Vec<Value>> = vec![Vec::new(); cuts.len()];
        for (s, cut) in cuts.iter().enumerate() {
            for &i in cut {
                for &a in &part.instrs()[i].args {
                    if owner[a.index()] != s && !inputs[s].contains(&a) {
                        inputs[s].push(a);
                        readers[a.index()].push(s);
                        uses[a.index()] += 1;
                    }
                }
            }
        }
        for r in part.results() {
            uses[r.index()] += 1;
        }
        let mut segments = Vec::with_capacity(cuts.len());
        for (s, cut) in cuts.iter().enumerate() {
            let outputs: Vec<Value> = cut
                .iter()
                .map(|&i| Value((np + i) as u32))
                .filter(|v| {
                    readers[v.index()].iter().any(|&r| r != s) || part.results().contains(v)
                })
                .collect();
            let mut b = Builder::new();
            let mut local: Vec<Option<Value>> = vec![None; n];
            for (k, &v) in inputs[s].iter().enumerate() {
                let spec: TensorSpec = part.spec(v).expect("a part value").clone();
                local[v.index()] = Some(b.param(&format!("in{k}"), spec)?);
            }
            for &i in cut {
                let instr = &part.instrs()[i];
                let args: Vec<Value> =
                    instr.args.iter().map(|a| local[a.index()].expect("defined before")).collect();
                local[np + i] = Some(b.push(instr.op.clone(), &args)?);
            }
            let mut outs: Vec<Value> =
                outputs.iter().map(|v| local[v.index()].expect("made here")).collect();
            if outs.is_empty() {
                outs.push(b.constant(0.0, DType::I32)?);
            }
            let program = b.finish(&outs)?;
            segments.push(Segment {
                exe: Executable::compile(&program, options),
                inputs: std::mem::take(&mut inputs[s]),
                outputs,
            });
        }
        let missing =
            segments.iter().map(|s| s.inputs.iter().filter(|v| v.index() >= np).count()).collect();
        Ok(Segments {
            receipts,
            segments,
            readers,
            uses,
            missing,
            params: np,
            results: part.results().to_vec(),
        })
    }

    /// How many segments the part runs as.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.segments.len()
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
        if inputs.len() != self.params {
            return Err(ReplicaError::Program(meshwork_program::Error::Inputs {
                expected: self.params,
                actual: inputs.len(),
                problem: "a placed part's inputs".into(),
            }));
        }
        let mut slots: Vec<Option<Input<'a>>> = Vec::with_capacity(self.uses.len());
        slots.extend(inputs.into_iter().map(Some));
        slots.resize_with(self.uses.len(), || None);
        let mut uses = self.uses.clone();
        let mut missing = self.missing.clone();
        let mut ready: BTreeSet<usize> =
            (0..self.segments.len()).filter(|&s| missing[s] == 0).collect();
        let mut waiting: Vec<usize> = (0..self.receipts.len()).collect();
        let mut done = 0;
        // Value `v` is there: the segments reading it may be ready.
        let arrive = |v: Value, missing: &mut Vec<usize>, ready: &mut BTreeSet<usize>| {
            for &s in &self.readers[v.index()] {
                missing[s] -= 1;
                if missing[s] == 0 {
                    ready.insert(s);
                }
            }
        };
        while done < self.segments.len() || !waiting.is_empty() {
            // Take every transfer that has arrived; wait for one if nothing is ready.
            loop {
                let wanted: Vec<(usize, u64)> = waiting
                    .iter()
                    .map(|&r| (self.receipts[r].peer, u64::from(self.receipts[r].channel)))
                    .collect();
                let got = if ready.is_empty() && !wanted.is_empty() {
                    Some(ctx.recv_any(&wanted).map_err(ReplicaError::Peer)?)
                } else {
                    ctx.try_recv_any(&wanted).map_err(ReplicaError::Peer)?
                };
                let Some((i, t)) = got else { break };
                let receipt = &self.receipts[waiting.swap_remove(i)];
                let t = if receipt.bool { boolean(t) } else { t };
                slots[receipt.value.index()] = Some(Input::Owned(t));
                arrive(receipt.value, &mut missing, &mut ready);
            }
            let Some(s) = ready.pop_first() else {
                if done == self.segments.len() {
                    continue; // only receipts the part returns are left
                }
                return Err(ReplicaError::Program(meshwork_program::Error::Communication {
                    at: "a placed program's device".into(),
                    problem: "no segment is ready and no transfer is awaited".into(),
                }));
            };
            let segment = &self.segments[s];
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
            let out = segment.exe.run_inputs(args, env).map_err(failure)?;
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
        let mut results = Vec::with_capacity(self.results.len());
        for v in &self.results {
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
                let channels = ReplicaChannels { ctx, peer: Mutex::new(None) };
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
