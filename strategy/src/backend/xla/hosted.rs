//! An SPMD program on XLA whose collectives run on the host, through meshwork's
//! executor: how a mesh spreads over processes when the plugin has no collectives
//! across them (the pinned CPU plugin has none), and, in one process, the way to
//! measure what that costs against XLA's own collectives.
//!
//! The per-device program is cut ([`Cut::at`]) at every instruction that
//! communicates or depends on its position — the collectives, `shard_slice` and
//! `shard_pad` (which read the position), `emit` — into segments, each compiled once
//! as a portable executable that runs on any of this process's devices. A step runs on the executor's
//! replicas, one per position, each on its own thread: its segments in program order
//! on its device, and at each cut the operands come to the host, the instruction
//! runs on the fast interpreter with the executor's collectives ([`MeshCollectives`],
//! across processes over the interconnect), and its result goes back to the device.
//! So XLA computes, and meshwork's collectives move the data, folding in their fixed
//! order.
//!
//! Costs, against an executable with XLA's collectives: a round trip to the host per
//! cut, and a compilation per segment. Segments read
//! their inputs without donating them, so a resident parameter and its update are
//! both held during a step. The traffic counted: the feeds in, the results and what
//! is emitted out, each collective's result between devices (the round trips through
//! the host that carry it are not counted again).

use std::sync::{Arc, Mutex, PoisonError};

use meshwork_program::fast::{Executable as Interpreted, Input, Options};
use meshwork_program::{Builder, Env, Op, Program, Value};
use meshwork_types::{Tensor, TensorSpec};
use meshwork_xla::session::Compiled;
use meshwork_xla::{Arg, Buffer, Device, Session};

use crate::backend::cut::Cut;
use crate::backend::interpreter::{FirstReplicaHost, MeshCollectives, ReplicaError, run_replicas};
use crate::backend::{SpmdExecutable, Traffic, TrafficCounter, bytes_of};
use crate::{Error, Result, Strategy};

/// What runs on the host: every op that communicates or reads its position.
fn on_host(op: &Op) -> bool {
    op.communicates()
}

/// One thing a step does, in program order.
#[derive(Debug, Clone, Copy)]
enum Item {
    /// A segment, on the device.
    Segment(usize),
    /// A cut instruction (a receipt of the [`Cut`]), on the host.
    Host(usize),
}

/// One position: its device, its resident parts, and what a run feeds, stages and
/// returns.
struct Position {
    device: Device,
    params: Vec<Option<Buffer>>,
    /// Each step's feeds (a run may take several steps).
    feed: Vec<Vec<Tensor>>,
    /// The last step's carried results, `(parameter, buffer)`, until committed.
    staged: Vec<(usize, Buffer)>,
    /// Each step's results that are not carried.
    out: Vec<Vec<Tensor>>,
}

/// What the replicas of a run share.
struct Shared {
    session: Arc<Session>,
    cut: Cut,
    /// Each segment, compiled once to run on any device (portable).
    pieces: Vec<Arc<Compiled>>,
    /// Per receipt, the instruction as a program of its own on the interpreter.
    host: Vec<Interpreted>,
    /// Per receipt, the values it reads.
    operands: Vec<Vec<Value>>,
    order: Vec<Item>,
    /// The mesh position of this process's first position.
    first: usize,
    resident: Vec<bool>,
    carry: Vec<(usize, usize)>,
    positions: Vec<Mutex<Position>>,
    traffic: TrafficCounter,
    /// A failed run's errors that are not the program's (XLA's), by position.
    errors: Mutex<Vec<(usize, Error)>>,
}

/// An SPMD program on this process's XLA devices, its collectives on the host.
pub(super) struct XlaHosted {
    shared: Arc<Shared>,
    /// Each position's executor device.
    placement: Vec<usize>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn problem(p: impl Into<String>) -> Error {
    Error::Compiled { problem: p.into() }
}

impl XlaHosted {
    /// `program` (a per-device program) for positions `first..first + placement.len()`
    /// of its mesh, position `first + i` on the client's device `placement[i]`.
    pub(super) fn compile(
        session: &Arc<Session>,
        program: &Program,
        first: usize,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<XlaHosted> {
        if program.instrs().iter().any(|i| matches!(i.op, Op::Send { .. } | Op::Recv { .. })) {
            return Err(problem(
                "an SPMD program that sends or receives: on XLA, transfers between devices run \
                 in placed programs (Strategy::place)",
            ));
        }
        let cut = Cut::at(program, on_host)?;
        let mut order: Vec<(usize, Item)> =
            cut.starts.iter().enumerate().map(|(s, &at)| (at, Item::Segment(s))).collect();
        order.extend(cut.receipts.iter().enumerate().map(|(j, r)| (r.instr, Item::Host(j))));
        order.sort_by_key(|&(at, _)| at);
        let mut host = Vec::with_capacity(cut.receipts.len());
        let mut operands = Vec::with_capacity(cut.receipts.len());
        for r in &cut.receipts {
            let instr = &program.instrs()[r.instr];
            let mut b = Builder::new();
            let args = instr
                .args
                .iter()
                .enumerate()
                .map(|(k, &a)| {
                    let spec: TensorSpec = program.spec(a).expect("a program value").clone();
                    b.param(&format!("in{k}"), spec)
                })
                .collect::<meshwork_program::Result<Vec<_>>>()?;
            let v = b.push(instr.op.clone(), &args)?;
            let one = b.finish(&[v])?;
            host.push(Interpreted::compile(&one, Options::default().threads(1)));
            operands.push(instr.args.clone());
        }
        let client = session.client();
        let np = program.params().len();
        // Each segment compiled once, run on every position's device.
        let pieces = cut
            .pieces
            .iter()
            .map(|p| session.compile_portable(&p.program))
            .collect::<meshwork_xla::Result<Vec<_>>>()?;
        let mut positions = Vec::with_capacity(placement.len());
        for &d in placement {
            positions.push(Mutex::new(Position {
                device: client.device(d)?.clone(),
                params: (0..np).map(|_| None).collect(),
                feed: Vec::new(),
                staged: Vec::new(),
                out: Vec::new(),
            }));
        }
        Ok(XlaHosted {
            shared: Arc::new(Shared {
                session: Arc::clone(session),
                cut,
                pieces,
                host,
                operands,
                order: order.into_iter().map(|(_, item)| item).collect(),
                first,
                resident: resident.to_vec(),
                carry: carry.to_vec(),
                positions,
                traffic: TrafficCounter::default(),
                errors: Mutex::default(),
            }),
            placement: placement.to_vec(),
        })
    }

    fn position(&self, r: usize) -> Result<std::sync::MutexGuard<'_, Position>> {
        let n = self.shared.positions.len();
        self.shared
            .positions
            .get(r)
            .map(lock)
            .ok_or_else(|| problem(format!("position {r} of {n} run here")))
    }
}

/// Value `v` of a step: made (or fed, or carried) in it, or a resident parameter.
fn value<'a>(
    values: &'a [Option<Buffer>],
    params: &'a [Option<Buffer>],
    v: Value,
) -> Result<&'a Buffer> {
    let k = v.index();
    values
        .get(k)
        .and_then(Option::as_ref)
        .or_else(|| params.get(k).and_then(Option::as_ref))
        .ok_or_else(|| problem(format!("value {k} is not there (a cutting bug)")))
}

impl Shared {
    /// Position `pos`'s share of a run's steps, as replica `ctx`.
    fn steps(
        &self,
        pos: &mut Position,
        coll: &MeshCollectives<'_>,
        tag: u64,
        counter: &TrafficCounter,
    ) -> Result<()> {
        let client = self.session.client();
        let np = self.resident.len();
        let feeds = std::mem::take(&mut pos.feed);
        let mut carried: Vec<Option<Buffer>> = (0..np).map(|_| None).collect();
        let mut outs = Vec::with_capacity(feeds.len());
        for (i, feed) in feeds.into_iter().enumerate() {
            let sink =
                FirstReplicaHost { ctx: coll.ctx, step: tag + i as u64, counter: Some(counter) };
            let env = Env::local().with_collectives(coll).with_host(&sink);
            let mut values: Vec<Option<Buffer>> = (0..self.cut.uses.len()).map(|_| None).collect();
            let mut feed = feed.into_iter();
            for (p, slot) in values.iter_mut().take(np).enumerate() {
                *slot = if self.resident[p] {
                    carried[p].take()
                } else {
                    let t = feed
                        .next()
                        .ok_or_else(|| problem("a feed is missing (a partitioner bug)"))?;
                    Some(client.put(&t, &pos.device)?)
                };
            }
            for &item in &self.order {
                match item {
                    Item::Segment(s) => {
                        let piece = &self.cut.pieces[s];
                        let out = {
                            let args = piece
                                .inputs
                                .iter()
                                .map(|&v| value(&values, &pos.params, v).map(Arg::Borrowed))
                                .collect::<Result<Vec<_>>>()?;
                            self.pieces[s].executable.execute_on(&pos.device, args)?
                        };
                        for (&v, b) in piece.outputs.iter().zip(out) {
                            values[v.index()] = Some(b);
                        }
                    }
                    Item::Host(j) => {
                        let inputs = self.operands[j]
                            .iter()
                            .map(|&v| Ok(Input::Owned(value(&values, &pos.params, v)?.to_host()?)))
                            .collect::<Result<Vec<_>>>()?;
                        let out = self.host[j].run_inputs(inputs, &env)?.into_iter().next();
                        let out = out.ok_or_else(|| problem("a host instruction gave nothing"))?;
                        values[self.cut.receipts[j].value.index()] =
                            Some(client.put(&out, &pos.device)?);
                    }
                }
            }
            // The results that come back, then those carried (taken, or copied
            // where a value is carried twice or is a parameter held across steps).
            let mut step_out = Vec::new();
            let mut next: Vec<Option<Buffer>> = (0..np).map(|_| None).collect();
            let results = &self.cut.results;
            for (k, &v) in results.iter().enumerate() {
                if !self.carry.iter().any(|&(r, _)| r == k) {
                    step_out.push(value(&values, &pos.params, v)?.to_host()?);
                }
            }
            for &(k, p) in &self.carry {
                let v = results[k];
                let shared = results.iter().filter(|&&w| w == v).count() > 1;
                let b = match values[v.index()].take() {
                    Some(b) if !shared => b,
                    Some(b) => {
                        let copy = client.put(&b.to_host()?, &pos.device)?;
                        values[v.index()] = Some(b);
                        copy
                    }
                    None => client.put(&value(&values, &pos.params, v)?.to_host()?, &pos.device)?,
                };
                next[p] = Some(b);
            }
            carried = next;
            outs.push(step_out);
        }
        pos.staged = carried.into_iter().enumerate().filter_map(|(p, b)| Some((p, b?))).collect();
        pos.out = outs;
        Ok(())
    }
}

impl SpmdExecutable for XlaHosted {
    fn positions(&self) -> usize {
        self.shared.positions.len()
    }

    fn buffer(&self, _r: usize, spec: &TensorSpec) -> Result<Tensor> {
        Ok(Tensor::zeros(spec.dtype, spec.shape.dims())?)
    }

    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()> {
        let mut pos = self.position(r)?;
        let buffer = self.shared.session.client().put(&part, &pos.device)?;
        let slot =
            pos.params.get_mut(param).ok_or_else(|| problem(format!("parameter {param}")))?;
        *slot = Some(buffer);
        Ok(())
    }

    fn put_all(&self, parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        // Every part uploaded first, then swapped in: a failed upload changes nothing.
        let client = self.shared.session.client();
        let mut uploaded = Vec::with_capacity(parts.len());
        for (r, param, part) in parts {
            let device = self.position(r)?.device.clone();
            if param >= self.shared.resident.len() {
                return Err(problem(format!("parameter {param}")));
            }
            uploaded.push((r, param, client.put(&part, &device)?));
        }
        for (r, param, b) in uploaded {
            self.position(r)?.params[param] = Some(b);
        }
        Ok(())
    }

    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>> {
        let pos = self.position(r)?;
        match pos.params.get(param) {
            Some(Some(b)) => Ok(Some(b.to_host()?)),
            Some(None) => Ok(None),
            None => Err(problem(format!("parameter {param}"))),
        }
    }

    fn is_set(&self, r: usize, param: usize) -> bool {
        self.position(r).is_ok_and(|p| p.params.get(param).is_some_and(Option::is_some))
    }

    fn held_bytes(&self, r: usize, param: usize) -> Result<Option<u64>> {
        let pos = self.position(r)?;
        match pos.params.get(param) {
            Some(Some(b)) => Ok(Some(b.device_bytes()? as u64)),
            Some(None) => Ok(None),
            None => Err(problem(format!("parameter {param}"))),
        }
    }

    fn traffic(&self) -> Traffic {
        self.shared.traffic.get()
    }

    fn run(
        &self,
        strategy: &Strategy,
        feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        let n = self.shared.positions.len();
        if feeds.len() != n {
            return Err(problem(format!("feeds for {} positions of {n}", feeds.len())));
        }
        let steps = feeds.first().map_or(0, Vec::len);
        let want = self.shared.resident.iter().filter(|&&r| !r).count();
        if feeds.iter().flatten().any(|f| f.len() != want) || feeds.iter().any(|f| f.len() != steps)
        {
            return Err(problem("positions fed unlike their parameters (a partitioner bug)"));
        }
        for r in 0..n {
            let pos = self.position(r)?;
            if let Some(p) =
                (0..pos.params.len()).find(|&p| self.shared.resident[p] && pos.params[p].is_none())
            {
                return Err(problem(format!("resident parameter {p} was never set")));
            }
        }
        self.shared.traffic.fed(bytes_of(feeds.iter().flatten().flatten()));
        for (r, feed) in feeds.into_iter().enumerate() {
            self.position(r)?.feed = feed;
        }
        lock(&self.shared.errors).clear();
        let shared = Arc::clone(&self.shared);
        let run = run_replicas(
            strategy.runtime(),
            &self.placement,
            Arc::new(move |ctx| {
                let i = ctx.replica_id() - shared.first;
                let mut pos = lock(&shared.positions[i]);
                let coll = MeshCollectives::counted(ctx, &shared.traffic);
                match shared.steps(&mut pos, &coll, tag, &shared.traffic) {
                    Ok(()) => Ok(()),
                    Err(Error::Program(e)) => Err(coll.failure(e)),
                    Err(e) => {
                        let message = e.to_string();
                        lock(&shared.errors).push((i, e));
                        Err(ReplicaError::Program(meshwork_program::Error::Runtime {
                            at: "xla".into(),
                            problem: message,
                        }))
                    }
                }
            }),
        );
        if let Err(e) = run {
            self.commit(false);
            let mut errors = lock(&self.shared.errors);
            errors.sort_by_key(|(i, _)| *i);
            return Err(if errors.is_empty() { e } else { errors.swap_remove(0).1 });
        }
        let out: Vec<Vec<Vec<Tensor>>> = (0..n)
            .map(|r| self.position(r).map(|mut p| std::mem::take(&mut p.out)))
            .collect::<Result<_>>()?;
        self.shared.traffic.returned(bytes_of(out.iter().flatten().flatten()));
        self.shared.traffic.stepped(steps as u64);
        Ok(out)
    }

    fn commit(&self, keep: bool) {
        for pos in &self.shared.positions {
            let mut pos = lock(pos);
            let staged = std::mem::take(&mut pos.staged);
            if keep {
                for (p, b) in staged {
                    pos.params[p] = Some(b);
                }
            } else {
                pos.out.clear();
                pos.feed.clear();
            }
        }
    }
}
