//! What a program needs from outside one device: the collectives over replica groups,
//! point-to-point channels between devices and the host's consumers.
//!
//! The program crate does not communicate by itself. Both interpreters run a
//! collective, `send`/`recv` or `emit` by calling the traits of the [`Env`] they are
//! given; the strategy crate implements them over the executor's collectives and the
//! outfeed. [`Env::local`] has none of them, and an instruction that needs one is then
//! an [`Error::Runtime`] naming it.

use meshwork_types::{ReduceOp, TensorSpec};

use crate::{Error, Result};
use meshwork_types::{Element, Tensor};
use ndarray::{ArrayD, Axis, Slice};

/// The collectives of the device running a program (one replica of a group).
///
/// Each method is called by every replica of `groups` that runs the instruction and
/// returns this replica's result (of the instruction's spec; the interpreter checks).
/// Replica groups are the instruction's, as `Op` documents them. `Sync`, so a run can
/// move to a thread of the interpreter's pool.
pub trait Collectives: Sync {
    /// This replica's id, as replica groups name replicas.
    fn replica_id(&self) -> usize;
    /// Reduces `x` across this replica's group.
    fn all_reduce(&self, x: Tensor, op: ReduceOp, groups: &[Vec<usize>]) -> Result<Tensor>;
    /// Concatenates the group's operands along `axis`, in group order.
    fn all_gather(&self, x: Tensor, axis: usize, groups: &[Vec<usize>]) -> Result<Tensor>;
    /// Reduces across the group and keeps this replica's part of `axis`.
    fn reduce_scatter(
        &self,
        x: Tensor,
        op: ReduceOp,
        axis: usize,
        groups: &[Vec<usize>],
    ) -> Result<Tensor>;
    /// Splits `split_axis` over the group, exchanges and concatenates on `concat_axis`.
    fn all_to_all(
        &self,
        x: Tensor,
        split_axis: usize,
        concat_axis: usize,
        groups: &[Vec<usize>],
    ) -> Result<Tensor>;
    /// Sends `x` along `(source, target)` pairs; a replica that is no target gets zeros.
    fn collective_permute(&self, x: Tensor, pairs: &[(usize, usize)]) -> Result<Tensor>;
}

/// Point-to-point transfers between devices (TensorFlow's `Send`/`Recv` pairs).
pub trait Channels: Sync {
    /// Sends `x` to device `peer` on `channel`.
    fn send(&self, channel: u32, peer: usize, x: Tensor) -> Result<()>;
    /// Receives the tensor of `spec` that device `peer` sends on `channel`.
    fn recv(&self, channel: u32, peer: usize, spec: &TensorSpec) -> Result<Tensor>;
    /// Whether `send` may wait for the receiver (then a run that sends keeps a thread
    /// of its own). `false` only for channels that leave what they send and return.
    fn sends_wait(&self) -> bool {
        true
    }
}

/// The host's side of `emit`: the outfeed's consumers.
pub trait HostSink: Sync {
    /// Streams `values` to consumer `consumer`.
    fn emit(&self, consumer: u32, values: &[Tensor]) -> Result<()>;
}

/// What a run may use beyond its own device. `Env::local()` has nothing.
#[derive(Clone, Copy, Default)]
pub struct Env<'a> {
    /// The collectives, if the program runs as one replica of several.
    pub collectives: Option<&'a dyn Collectives>,
    /// The channels to other devices.
    pub channels: Option<&'a dyn Channels>,
    /// The host's consumers.
    pub host: Option<&'a dyn HostSink>,
}

impl std::fmt::Debug for Env<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env")
            .field("collectives", &self.collectives.is_some())
            .field("channels", &self.channels.is_some())
            .field("host", &self.host.is_some())
            .finish()
    }
}

impl<'a> Env<'a> {
    /// A device on its own: no collectives, channels or host.
    pub fn local() -> Env<'static> {
        Env { collectives: None, channels: None, host: None }
    }

    /// With these collectives.
    pub fn with_collectives(mut self, c: &'a dyn Collectives) -> Env<'a> {
        self.collectives = Some(c);
        self
    }

    /// With these channels.
    pub fn with_channels(mut self, c: &'a dyn Channels) -> Env<'a> {
        self.channels = Some(c);
        self
    }

    /// With this host sink.
    pub fn with_host(mut self, h: &'a dyn HostSink) -> Env<'a> {
        self.host = Some(h);
        self
    }
}

/// Runs one communicating instruction through `env`: `args` are its operands, `spec`
/// its result's. Shared by both interpreters so they communicate identically.
pub(crate) fn communicate(
    env: &Env<'_>,
    op: &crate::Op,
    args: Vec<Tensor>,
    spec: &TensorSpec,
    at: &str,
) -> Result<Tensor> {
    use crate::Op;
    let missing = |what: &str| Error::Runtime {
        at: at.to_string(),
        problem: format!(
            "{} needs {what}, and this run has none (run it through a strategy's devices)",
            op.name()
        ),
    };
    let wrap = |e: Error| Error::Communication { at: at.to_string(), problem: e.to_string() };
    let token = || Tensor::bool(&[], vec![true]);
    let mut args = args.into_iter();
    let mut first = || args.next().expect("inference checked the operand count");
    let out = match op {
        Op::AllReduce { op, groups } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            c.all_reduce(first(), *op, groups).map_err(wrap)?
        }
        Op::AllGather { axis, groups } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            c.all_gather(first(), *axis, groups).map_err(wrap)?
        }
        Op::ReduceScatter { op, axis, groups } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            c.reduce_scatter(first(), *op, *axis, groups).map_err(wrap)?
        }
        Op::AllToAll { split_axis, concat_axis, groups } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            c.all_to_all(first(), *split_axis, *concat_axis, groups).map_err(wrap)?
        }
        Op::ShardSlice { axis, groups } | Op::ShardPad { axis, groups } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            let me = c.replica_id();
            let (pos, n) = groups
                .iter()
                .find_map(|g| g.iter().position(|&r| r == me).map(|k| (k, g.len())))
                .ok_or_else(|| Error::Communication {
                    at: at.to_string(),
                    problem: format!("replica {me} is in none of the groups"),
                })?;
            let x = first();
            if matches!(op, Op::ShardSlice { .. }) {
                block(&x, *axis, pos, n, spec)?
            } else {
                place(&x, *axis, pos, spec)?
            }
        }
        Op::CollectivePermute { pairs } => {
            let c = env.collectives.ok_or_else(|| missing("collectives"))?;
            c.collective_permute(first(), pairs).map_err(wrap)?
        }
        Op::Send { channel, peer } => {
            let c = env.channels.ok_or_else(|| missing("channels"))?;
            c.send(*channel, *peer, first()).map_err(wrap)?;
            token()?
        }
        Op::Recv { channel, peer, .. } => {
            let c = env.channels.ok_or_else(|| missing("channels"))?;
            c.recv(*channel, *peer, spec).map_err(wrap)?
        }
        Op::Emit { consumer } => {
            let h = env.host.ok_or_else(|| missing("a host sink"))?;
            let values: Vec<Tensor> = args.collect();
            h.emit(*consumer, &values).map_err(wrap)?;
            token()?
        }
        other => unreachable!("{} does not communicate", other.name()),
    };
    if out.spec() != *spec {
        return Err(Error::Communication {
            at: at.to_string(),
            problem: format!("the peer returned {}, the instruction makes {spec}", out.spec()),
        });
    }
    Ok(out)
}

/// Block `pos` of `n` along `axis` of `x` (of result spec `spec`).
fn block(x: &Tensor, axis: usize, pos: usize, n: usize, spec: &TensorSpec) -> Result<Tensor> {
    let part = x.shape()[axis] / n.max(1);
    let range = Slice::from(pos * part..(pos + 1) * part);
    let out = meshwork_types::map_tensor!(x, a => a.slice_axis(Axis(axis), range).to_owned());
    debug_assert_eq!(out.shape(), spec.shape.dims(), "inference sized the block");
    Ok(out.into_standard_layout())
}

/// `x` placed at block `pos` along `axis` of zeros of spec `spec`.
fn place(x: &Tensor, axis: usize, pos: usize, spec: &TensorSpec) -> Result<Tensor> {
    fn put<T: Element>(x: &ArrayD<T>, out: &mut Tensor, axis: usize, pos: usize) {
        let part = x.shape()[axis];
        let out = T::unwrap_mut(out).expect("zeros of the operand's dtype");
        out.slice_axis_mut(Axis(axis), Slice::from(pos * part..(pos + 1) * part)).assign(x);
    }
    let mut out = Tensor::zeros(spec.dtype, spec.shape.dims())?;
    meshwork_types::each_tensor!(x, a => put(a, &mut out, axis, pos));
    Ok(out)
}
