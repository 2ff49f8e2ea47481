//! A placed program on XLA: each part cut into segments ([`Cut`]), each segment one
//! executable compiled for the part's device (its `send`s extra outputs), the
//! transfers between parts PJRT device-to-device copies — no host round trip for an
//! activation or a gradient between stages.
//!
//! A step enqueues every segment of every part before reading anything back: the host
//! goes round the devices, each taking its first ready segment in program order (all
//! its inputs enqueued), so a device's queue is its part's segments in the order they
//! become ready — for a pipeline, its GPipe schedule's order — and the devices can run
//! their queues side by side, as JAX's asynchronous dispatch lets them (how much they
//! overlap is XLA's runtime's; it is not measured here). Then the results come back,
//! and the variables' updates, already on their devices, become the variables.
//!
//! Segments read their inputs without donating them, so a variable and its update
//! are both held during a step (the SPMD path donates; a pipeline's stages hold a
//! part of the model each).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

use meshwork_partition::placed::{Part, Sink, Source};
use meshwork_program::{Op, Value};
use meshwork_types::Tensor;
use meshwork_xla::lower::LowerOptions;
use meshwork_xla::session::Compiled;
use meshwork_xla::{Arg, Buffer, Device, Session};

use crate::backend::PlacedExecutable;
use crate::backend::cut::Cut;
use crate::backend::placed_sinks;
use crate::{Error, Result, Strategy};

/// One part on its device.
struct PartExe {
    device: Device,
    cut: Cut,
    /// Each segment, compiled for the device.
    pieces: Vec<Arc<Compiled>>,
    /// Per segment, where each of its sends goes: (part, receipt of that part).
    sends: Vec<Vec<(usize, usize)>>,
    /// Its parameters' sources.
    sources: Vec<Source>,
    /// Per parameter, its index among the fed (`Ok`) or the variables (`Err`).
    param_at: Vec<std::result::Result<usize, usize>>,
    /// Per result: the variable slot it updates, if it is an update.
    updates: Vec<Option<usize>>,
    /// Per result, whether it is a step result.
    returned: Vec<bool>,
}

/// The parts of a placed program compiled for their devices, with the variables there.
pub(super) struct XlaPlaced {
    session: Arc<Session>,
    parts: Vec<PartExe>,
    /// Per part, its variables (in its sources' order) on its device.
    resident: Mutex<Vec<Vec<Option<Buffer>>>>,
    /// What its steps moved.
    traffic: crate::backend::TrafficCounter,
}

fn problem(p: impl Into<String>) -> Error {
    Error::Compiled { problem: p.into() }
}

impl XlaPlaced {
    pub(super) fn compile(
        session: &Arc<Session>,
        parts: &[Part],
        placement: &[usize],
    ) -> Result<XlaPlaced> {
        if placement.len() != parts.len() {
            return Err(problem(format!(
                "{} devices for a placed program of {} parts",
                placement.len(),
                parts.len()
            )));
        }
        let client = session.client();
        let cuts = parts.iter().map(|p| Cut::new(&p.program)).collect::<Result<Vec<_>>>()?;
        let mut exes = Vec::with_capacity(parts.len());
        for (p, (part, cut)) in parts.iter().zip(cuts.iter()).enumerate() {
            let device = client.device(placement[p])?.clone();
            let id = [i64::from(device.id())];
            let mut pieces = Vec::with_capacity(cut.pieces.len());
            let mut sends = Vec::with_capacity(cut.pieces.len());
            let mut sent: std::collections::HashMap<(usize, u32), usize> = Default::default();
            for piece in &cut.pieces {
                let compiled = session.compile_on(&piece.program, &LowerOptions::default(), &id)?;
                if !compiled.lowered.emits.is_empty() {
                    return Err(problem(
                        "a placed program emits to the host, which the XLA back end runs only \
                         in SPMD programs",
                    ));
                }
                // The k-th send from this part on a channel to a peer is that peer's
                // k-th receipt from this part on the channel (in program order, as
                // the interpreter's mailbox delivers them in order).
                // The channels are read from the segment itself: a cached executable
                // of the same text may come from a segment on other channels.
                let mut to = Vec::with_capacity(compiled.lowered.sends.len());
                let transfers = piece.program.instrs().iter().filter_map(|i| match i.op {
                    Op::Send { channel, peer } => Some((channel, peer)),
                    _ => None,
                });
                for (channel, q) in transfers {
                    let k = sent.entry((q, channel)).or_insert(0usize);
                    let r = cuts
                        .get(q)
                        .and_then(|c| {
                            c.receipts
                                .iter()
                                .enumerate()
                                .filter(|(_, r)| r.peer == p && r.channel == channel)
                                .nth(*k)
                                .map(|(r, _)| r)
                        })
                        .ok_or_else(|| {
                            problem(format!(
                                "part {p} sends on channel {channel} to part {q} more often than it \
                                 receives (a partitioner bug)"
                            ))
                        })?;
                    *k += 1;
                    to.push((q, r));
                }
                pieces.push(compiled);
                sends.push(to);
            }
            let (mut fed, mut held) = (0, 0);
            let param_at = part
                .sources
                .iter()
                .map(|s| match s {
                    Source::Feed(_) => {
                        fed += 1;
                        Ok(fed - 1)
                    }
                    Source::Variable(_) => {
                        held += 1;
                        Err(held - 1)
                    }
                })
                .collect();
            exes.push((device, pieces, sends, param_at, held));
        }
        let mut out = Vec::with_capacity(parts.len());
        let mut resident = Vec::with_capacity(parts.len());
        for ((part, cut), (device, pieces, sends, param_at, held)) in
            parts.iter().zip(cuts).zip(exes)
        {
            resident.push((0..held).map(|_| None).collect());
            out.push(PartExe {
                device,
                cut,
                pieces,
                sends,
                sources: part.sources.clone(),
                param_at,
                updates: placed_sinks(part)?,
                returned: part.sinks.iter().map(|s| matches!(s, Sink::Result(_))).collect(),
            });
        }
        Ok(XlaPlaced {
            session: Arc::clone(session),
            parts: out,
            resident: Mutex::new(resident),
            traffic: crate::backend::TrafficCounter::default(),
        })
    }

    fn resident(&self) -> std::sync::MutexGuard<'_, Vec<Vec<Option<Buffer>>>> {
        self.resident.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn part(&self, part: usize) -> Result<&PartExe> {
        self.parts.get(part).ok_or_else(|| {
            problem(format!("part {part} of a placed program of {}", self.parts.len()))
        })
    }
}

/// A step's values on one part's device.
struct Values<'a> {
    /// Its fed parameters, uploaded.
    fed: Vec<Buffer>,
    /// Its variables.
    held: &'a [Option<Buffer>],
    /// The values its segments made and its receipts, by part value.
    made: Vec<Option<Buffer>>,
}

impl Values<'_> {
    fn get(&self, exe: &PartExe, v: Value) -> Result<&Buffer> {
        let k = v.index();
        let found = if k < exe.cut.params {
            match exe.param_at[k] {
                Ok(f) => self.fed.get(f),
                Err(j) => self.held.get(j).and_then(Option::as_ref),
            }
        } else {
            self.made.get(k).and_then(Option::as_ref)
        };
        found.ok_or_else(|| problem(format!("value {k} of a part is not there (a scheduler bug)")))
    }
}

impl PlacedExecutable for XlaPlaced {
    fn put(&self, part: usize, slot: usize, value: Tensor) -> Result<()> {
        let exe = self.part(part)?;
        let buffer = self.session.client().put(&value, &exe.device)?;
        let mut resident = self.resident();
        let held = resident[part]
            .get_mut(slot)
            .ok_or_else(|| problem(format!("variable {slot} of part {part}")))?;
        *held = Some(buffer);
        Ok(())
    }

    fn fetch(&self, part: usize, slot: usize) -> Result<Option<Tensor>> {
        self.part(part)?;
        let resident = self.resident();
        match resident[part].get(slot) {
            Some(Some(b)) => Ok(Some(b.to_host()?)),
            Some(None) => Ok(None),
            None => Err(problem(format!("variable {slot} of part {part}"))),
        }
    }

    fn is_set(&self, part: usize, slot: usize) -> bool {
        self.resident().get(part).and_then(|p| p.get(slot)).is_some_and(Option::is_some)
    }

    fn held_bytes(&self, part: usize, slot: usize) -> Result<Option<u64>> {
        self.part(part)?;
        match self.resident()[part].get(slot) {
            Some(Some(b)) => Ok(Some(b.device_bytes()? as u64)),
            Some(None) => Ok(None),
            None => Err(problem(format!("variable {slot} of part {part}"))),
        }
    }

    fn traffic(&self) -> crate::backend::Traffic {
        self.traffic.get()
    }

    fn run(&self, _strategy: &Strategy, feeds: Vec<Vec<Tensor>>) -> Result<Vec<Vec<Tensor>>> {
        let n = self.parts.len();
        if feeds.len() != n {
            return Err(problem(format!("feeds for {} parts of {n}", feeds.len())));
        }
        let client = self.session.client();
        let moved_before = client.transfers();
        let mut resident = self.resident();
        let mut values: Vec<Values<'_>> = Vec::with_capacity(n);
        for ((exe, feed), held) in self.parts.iter().zip(&feeds).zip(resident.iter()) {
            let want = exe.sources.iter().filter(|s| matches!(s, Source::Feed(_))).count();
            if feed.len() != want {
                return Err(problem(format!("{} feeds for {want} fed inputs", feed.len())));
            }
            if let Some(j) = held.iter().position(Option::is_none) {
                return Err(problem(format!("variable {j} of a part is not on its device")));
            }
            let fed = feed
                .iter()
                .map(|t| client.put(t, &exe.device))
                .collect::<meshwork_xla::Result<_>>()?;
            values.push(Values {
                fed,
                held,
                made: (0..exe.cut.uses.len()).map(|_| None).collect(),
            });
        }
        drop(feeds);
        // Enqueue: round the devices, each its first ready segment, until all are.
        let mut missing: Vec<Vec<usize>> =
            self.parts.iter().map(|e| e.cut.missing.clone()).collect();
        let mut ready: Vec<BTreeSet<usize>> = missing
            .iter()
            .map(|m| m.iter().enumerate().filter(|&(_, &k)| k == 0).map(|(s, _)| s).collect())
            .collect();
        let total: usize = self.parts.iter().map(|e| e.pieces.len()).sum();
        let mut done = 0;
        let arrive =
            |exe: &PartExe, v: Value, missing: &mut Vec<usize>, ready: &mut BTreeSet<usize>| {
                for &s in &exe.cut.readers[v.index()] {
                    missing[s] -= 1;
                    if missing[s] == 0 {
                        ready.insert(s);
                    }
                }
            };
        loop {
            let mut progressed = false;
            for p in 0..n {
                let Some(s) = ready[p].pop_first() else { continue };
                progressed = true;
                let exe = &self.parts[p];
                let piece = &exe.cut.pieces[s];
                let outs = {
                    let args = piece
                        .inputs
                        .iter()
                        .map(|&v| values[p].get(exe, v).map(Arg::Borrowed))
                        .collect::<Result<Vec<_>>>()?;
                    exe.pieces[s].executable.execute(vec![args])?
                };
                let mut outs = outs.into_iter().next().unwrap_or_default().into_iter();
                let made = piece.outputs.len().max(1);
                for (k, b) in outs.by_ref().take(made).enumerate() {
                    if let Some(&v) = piece.outputs.get(k) {
                        values[p].made[v.index()] = Some(b);
                        arrive(exe, v, &mut missing[p], &mut ready[p]);
                    }
                }
                for (b, &(q, r)) in outs.zip(&exe.sends[s]) {
                    let to = &self.parts[q];
                    let v = to.cut.receipts[r].value;
                    // `b` may be dropped once the copy is enqueued: PJRT frees a
                    // buffer's memory only after the work using it is done.
                    let copy = b.copy_to(&to.device)?;
                    values[q].made[v.index()] = Some(copy);
                    arrive(to, v, &mut missing[q], &mut ready[q]);
                }
                done += 1;
            }
            if !progressed {
                break;
            }
        }
        if done < total {
            return Err(problem(format!(
                "{} of {total} segments of a placed program never became ready (a partitioner bug)",
                total - done
            )));
        }
        // Everything is enqueued: the results come back (waiting for them), then the
        // updates, already on the devices, become the variables.
        let mut results = Vec::with_capacity(n);
        for (exe, vals) in self.parts.iter().zip(&values) {
            let mut kept = Vec::new();
            for (i, &v) in exe.cut.results.iter().enumerate() {
                if exe.returned[i] {
                    kept.push(vals.get(exe, v)?.to_host()?);
                }
            }
            results.push(kept);
        }
        let mut next: Vec<Vec<(usize, Buffer)>> = Vec::with_capacity(n);
        for (exe, vals) in self.parts.iter().zip(values.iter_mut()) {
            let mut mine = Vec::new();
            for (i, &v) in exe.cut.results.iter().enumerate() {
                let Some(j) = exe.updates[i] else { continue };
                let k = v.index();
                let b = if k >= exe.cut.params && vals.made[k].is_some() {
                    vals.made[k].take()
                } else {
                    None
                };
                let b = match b {
                    Some(b) => b,
                    // A variable updated to a value the part did not make here (a
                    // parameter, or a value updating two variables): a copy.
                    None => client.put(&vals.get(exe, v)?.to_host()?, &exe.device)?,
                };
                mine.push((j, b));
            }
            next.push(mine);
        }
        drop(values);
        for (held, updates) in resident.iter_mut().zip(next) {
            for (j, b) in updates {
                held[j] = Some(b);
            }
        }
        // What the client moved for this step, by its counts.
        let moved = client.transfers() - moved_before;
        self.traffic.fed(moved.host_to_device);
        self.traffic.returned(moved.device_to_host);
        self.traffic.moved(moved.device_to_device);
        self.traffic.stepped(1);
        Ok(results)
    }
}
