//! A placed program's part cut into segments: runs of instructions, in program order,
//! that depend on the same last transfer (none, or the `k`-th receive in the part's
//! order), each a program of its own. [`Cut::at`] cuts at other instructions the same
//! way: an SPMD program whose collectives run on the host is cut at its collectives
//! (`backend::xla::hosted`), each collective's operands then outputs of the segments
//! that make them. A device runs a segment once its inputs are
//! there, as TensorFlow's executor starts a node once its inputs are, at the grain of
//! what waits for the same transfer — the interpreter on its device thread
//! ([`dataflow`](super::interpreter)), XLA as one executable per segment.
//!
//! No deadlock: take the first instruction, in the one global program order, not yet
//! run on any device. It is the first of its segment (segments are runs and run whole,
//! so an earlier member would be an earlier instruction not yet run). Its segment's
//! other inputs come from earlier instructions (run) or from receipts whose index is
//! at most the segment's key — `recv`s before that first instruction, whose `send`s,
//! earlier still, have run. So that segment is ready once those transfers land.

use meshwork_program::{Builder, Op, Program, Value};
use meshwork_types::{DType, TensorSpec};

use crate::Result;

/// A value the part receives (a `recv`), or the result of another instruction it was
/// cut at.
pub(crate) struct Receipt {
    /// The part (replica) that sends it (a `recv`'s; `usize::MAX`, which no part is,
    /// for another instruction).
    pub(crate) peer: usize,
    /// A `recv`'s channel (`u32::MAX` for another instruction).
    pub(crate) channel: u32,
    /// The instruction (its index among the part's instructions).
    pub(crate) instr: usize,
    /// The part value it becomes.
    pub(crate) value: Value,
    /// Whether it is a bool (moved as i32 by the interpreter's mailbox).
    pub(crate) bool: bool,
}

/// Instructions of a part between two groups of receives, as a program of their own:
/// its parameters are `inputs`, its results `outputs` (or one `i32` zero when nothing
/// it makes is read elsewhere); its `send`s stay in it.
pub(crate) struct Piece {
    pub(crate) program: Program,
    /// Part values it reads, in its parameters' order.
    pub(crate) inputs: Vec<Value>,
    /// Part values it makes that others read, in its results' order.
    pub(crate) outputs: Vec<Value>,
}

/// A part cut into segments, with what says when each is ready.
pub(crate) struct Cut {
    pub(crate) receipts: Vec<Receipt>,
    pub(crate) pieces: Vec<Piece>,
    /// Per part value, the segments that read it.
    pub(crate) readers: Vec<Vec<usize>>,
    /// Per part value, how many segments read it plus how often the part returns it.
    pub(crate) uses: Vec<usize>,
    /// Per segment, how many of its inputs are not parameters of the part.
    pub(crate) missing: Vec<usize>,
    /// Per segment, the index of its first instruction among the part's: segments
    /// and receipts in the order of their first instructions is an order to run them
    /// one after another (see [`Cut::at`]).
    pub(crate) starts: Vec<usize>,
    /// The part's parameters.
    pub(crate) params: usize,
    /// The part's results.
    pub(crate) results: Vec<Value>,
}

impl Cut {
    /// Cuts `part` (parameters, then instructions with `recv`s right before first
    /// uses) into segments.
    pub(crate) fn new(part: &Program) -> Result<Cut> {
        Cut::at(part, |op| matches!(op, Op::Recv { .. }))
    }

    /// Cuts `part` at the instructions `at` picks (each a receipt: it runs outside
    /// the segments, its operands are outputs of the segments that make them).
    ///
    /// Run one after another, segments and receipts in the order of their first
    /// instructions: a segment's first instruction waits for its key's receipt, so
    /// every receipt it depends on comes before it; a segment's instructions are
    /// consecutive among those not cut at, so whatever it reads from another segment
    /// was made before it starts; and a receipt's operands are made before it.
    pub(crate) fn at(part: &Program, at: impl Fn(&Op) -> bool) -> Result<Cut> {
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
        // Values a receipt reads: outputs of the segments that make them.
        let mut cut_reads = vec![false; n];
        for (i, instr) in part.instrs().iter().enumerate() {
            let v = np + i;
            if at(&instr.op) {
                let (peer, channel) = match instr.op {
                    Op::Recv { channel, peer, .. } => (peer, channel),
                    _ => (usize::MAX, u32::MAX),
                };
                for a in &instr.args {
                    cut_reads[a.index()] = true;
                }
                receipts.push(Receipt {
                    peer,
                    channel,
                    instr: i,
                    value: Value(v as u32),
                    bool: part.spec(Value(v as u32)).is_some_and(|s| s.dtype == DType::Bool),
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
        for (v, &read) in cut_reads.iter().enumerate() {
            uses[v] += usize::from(read);
        }
        let mut pieces = Vec::with_capacity(cuts.len());
        for (s, cut) in cuts.iter().enumerate() {
            let outputs: Vec<Value> = cut
                .iter()
                .map(|&i| Value((np + i) as u32))
                .filter(|v| {
                    readers[v.index()].iter().any(|&r| r != s)
                        || part.results().contains(v)
                        || cut_reads[v.index()]
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
            pieces.push(Piece { program, inputs: std::mem::take(&mut inputs[s]), outputs });
        }
        let missing =
            pieces.iter().map(|s| s.inputs.iter().filter(|v| v.index() >= np).count()).collect();
        let starts = cuts.iter().map(|c| c[0]).collect();
        Ok(Cut {
            receipts,
            pieces,
            readers,
            uses,
            missing,
            starts,
            params: np,
            results: part.results().to_vec(),
        })
    }
}
