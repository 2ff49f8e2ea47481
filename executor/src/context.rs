//! What a program sees on one replica: its id and the collectives.

use std::sync::Arc;

use meshwork_types::{DeviceId, ReduceOp};
use ndarray::ArrayD;

use crate::direct;
use crate::hub::{Gathered, Hub, Offer, ReplicaGroups, Round};
use crate::net::{Net, Plan, Straight};
use crate::pool::Pool;
use crate::sink::OutfeedSink;
use crate::tensor::TensorOps;
use crate::{Error, Result};
use meshwork_types::Tensor;

/// One replica's view of a run: who it is, and the collectives over its peers.
///
/// Every collective is a rendezvous: all replicas of the group must call the same
/// collective with the same dtype, shape and arguments, or all of them get
/// [`Error::Mismatch`]. Results are deterministic: reductions fold in rank order (in a
/// multi-process run, each process's members of the group in rank order, then those
/// folds in process order), so every replica gets bit-identical values, run after run.
pub struct ReplicaContext {
    replica: usize,
    replicas: usize,
    /// This replica in its process's hub (equal to `replica` in a one-process run).
    local: usize,
    /// The device (thread) of this process's runtime the replica runs on.
    device: usize,
    hub: Arc<Hub>,
    all: ReplicaGroups,
    local_all: ReplicaGroups,
    sink: Option<Arc<dyn OutfeedSink>>,
    net: Option<Arc<Net>>,
    /// The buffer pool of this replica's device.
    pool: Arc<Pool>,
}

/// Refuses a tensor of a dtype collectives do not carry (f32, f64, i32 and i64 only),
/// before any replica waits for it.
fn carried(op: &'static str, t: &Tensor) -> Result<()> {
    if crate::tensor::carried(t.dtype()) {
        return Ok(());
    }
    Err(Error::UnsupportedDType { op, dtype: t.dtype() })
}

impl ReplicaContext {
    /// Local replica `local` of a run whose other processes (if any) `net` reaches.
    pub(crate) fn new(
        local: usize,
        device: usize,
        hub: Arc<Hub>,
        sink: Option<Arc<dyn OutfeedSink>>,
        net: Option<Arc<Net>>,
        pool: Arc<Pool>,
    ) -> ReplicaContext {
        let (replica, replicas) = match &net {
            Some(net) => (net.base() + local, net.replicas()),
            None => (local, hub.replicas()),
        };
        let local_all = ReplicaGroups::all(hub.replicas());
        let all = ReplicaGroups::all(replicas);
        ReplicaContext { replica, replicas, local, device, hub, all, local_all, sink, net, pool }
    }

    /// The device (of this process's runtime) this replica runs on: local device `r`
    /// for replica `r` under [`Runtime::run`](crate::Runtime::run), the placement's
    /// device under [`Runtime::run_on`](crate::Runtime::run_on).
    pub fn device(&self) -> DeviceId {
        DeviceId(self.device as u32)
    }

    /// Streams `tensors` to the run's [`OutfeedSink`] under `consumer_id`.
    pub fn emit(&self, consumer_id: u32, tensors: &[Tensor]) -> Result<()> {
        let outfeed = |message: String| Error::Outfeed { replica: self.replica, message };
        let sink =
            self.sink.as_ref().ok_or_else(|| outfeed("the runtime has no outfeed sink".into()))?;
        sink.emit(self.replica, consumer_id, tensors)
            .map_err(|e| outfeed(format!("consumer {consumer_id}: {e}")))
    }

    /// Gives `t`'s memory to this device's buffer pool, for the next plain collective
    /// on this device whose result has `t`'s dtype and element count (in this run or
    /// a later one) to write into instead of fresh pages. What a training loop does
    /// with last step's gathered parameters once it is done with them. The pool keeps
    /// at most its capacity (see [`Runtime::with_pool`](crate::Runtime::with_pool));
    /// what it does not keep is freed.
    pub fn recycle(&self, t: Tensor) {
        self.pool.put(t);
    }

    /// A tensor of `dtype` and `shape` for this replica to fill: a buffer this device's
    /// pool keeps, if it has one of that dtype and element count, otherwise zeros (see
    /// [`Runtime::buffer`](crate::Runtime::buffer)). A kept buffer's elements are stale:
    /// fill every one. A program that takes its gradient buffers here, and hands them to
    /// a consuming collective, gets them back next step instead of fresh pages.
    pub fn buffer(&self, dtype: meshwork_types::DType, shape: &[usize]) -> Result<Tensor> {
        crate::runtime::pooled_or_zeros(&self.pool, dtype, shape)
    }

    /// A buffer for a result of `dtype` and `shape` from this device's pool, if it
    /// holds one (its elements are stale: the caller overwrites every one).
    fn kept(&self, dtype: meshwork_types::DType, shape: &[usize]) -> Option<Tensor> {
        self.pool.take(dtype, shape)
    }

    /// A buffer of `dtype` and `shape` from local replica `x`'s device pool, or zeros.
    fn buffer_of(&self, x: usize, dtype: meshwork_types::DType, shape: &[usize]) -> Result<Tensor> {
        match self.hub.pools_of(std::iter::once(x)).first() {
            Some(pool) => crate::runtime::pooled_or_zeros(pool, dtype, shape),
            None => Tensor::zeroed(dtype, shape),
        }
    }

    /// Gives this process's replicas' inputs to a cross-process collective (`local`,
    /// in local rank order), consumed, back to their devices' pools (freed off this
    /// thread where not kept).
    fn give_back(&self, local: Vec<Arc<Tensor>>) {
        let pools = self.hub.pools_of(0..local.len());
        let mut garbage = Vec::new();
        for (t, pool) in local.into_iter().zip(&pools) {
            if let Some(t) = Arc::into_inner(t) {
                pool.put_consumed(t, &mut garbage);
            }
        }
        crate::pool::release(garbage);
    }

    /// This process's replicas' inputs folded in rank order (a mean as a sum), in their
    /// shape: with one local replica its own input (it owns it by now), otherwise a
    /// fold into a buffer of the first local device's pool, the inputs given back to
    /// their pools.
    fn local_partial(&self, local: Vec<Arc<Tensor>>, op: ReduceOp) -> Result<Tensor> {
        let fold = if op == ReduceOp::Mean { ReduceOp::Sum } else { op };
        match <[Arc<Tensor>; 1]>::try_from(local) {
            Ok([only]) => Ok(Arc::try_unwrap(only).unwrap_or_else(|shared| (*shared).clone())),
            Err(local) => {
                let (dtype, shape, len) =
                    (local[0].dtype(), local[0].shape().to_vec(), local[0].len());
                let mut partial = self.buffer_of(0, dtype, &shape)?;
                let at: Vec<(&Tensor, usize)> = local.iter().map(|t| (&**t, 0)).collect();
                Tensor::fold_at_into(&at, len, fold, &mut partial);
                drop(at);
                self.give_back(local);
                Ok(partial)
            }
        }
    }

    /// This replica is done with `round` (of `members`): the last of them to be done
    /// gives every member's input back to that member's device pool (in one process;
    /// across processes the round's tensors are copies, and are freed).
    fn done_with(&self, round: Gathered, members: &[usize]) {
        let pools = match self.net {
            Some(_) => Vec::new(),
            None => self.hub.pools_of(members.iter().copied()),
        };
        Round::reclaim(round, &pools);
    }

    /// This replica's id, `0..num_replicas()`.
    pub fn replica_id(&self) -> usize {
        self.replica
    }

    /// How many replicas run the program.
    pub fn num_replicas(&self) -> usize {
        self.replicas
    }

    /// Replica groups over this run's replicas (validated against its replica count).
    pub fn groups(&self, groups: Vec<Vec<usize>>) -> Result<ReplicaGroups> {
        ReplicaGroups::new(groups, self.num_replicas())
    }

    fn meet(
        &self,
        groups: &ReplicaGroups,
        op: &'static str,
        args: String,
        t: Tensor,
    ) -> Result<(Gathered, usize)> {
        self.meet_wanting(groups, op, args, t, None)
    }

    /// [`meet`](Self::meet), where across processes only the tensors some replica
    /// needs move: `wants(x, y)` says whether replica `x` needs replica `y`'s tensor
    /// (`None`: every member of its group's). A member whose tensor no replica of this
    /// process needs is an empty placeholder in the round.
    fn meet_wanting(
        &self,
        groups: &ReplicaGroups,
        op: &'static str,
        args: String,
        t: Tensor,
        wants: Option<&dyn Fn(usize, usize) -> bool>,
    ) -> Result<(Gathered, usize)> {
        let (members, rank) = self.place(groups)?;
        let signature = format!("{args} {}{:?}", t.dtype(), t.shape());
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let tensor = Arc::new(t.standard());
        let Some(net) = &self.net else {
            let parts =
                self.hub.exchange(groups, self.replica, Offer::new(op, signature, tensor))?;
            return Ok((parts, rank));
        };
        // Across processes: meet the local replicas, agree with the other processes,
        // move the tensors replicas of other processes need, then keep this group's.
        let signature = format!("{signature} in {:?}", groups.groups());
        let offer = Offer::new(op, signature.clone(), tensor);
        let mut group_of = vec![0; self.replicas];
        for (g, members) in groups.groups().iter().enumerate() {
            members.iter().for_each(|&m| group_of[m] = g);
        }
        let same_group = |x: usize, y: usize| group_of[x] == group_of[y];
        // Whose tensors a replica needs: named by `op` and its arguments where given.
        let custom = wants.is_some();
        let everyone = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            net.step(op, &signature, self.replica)?;
            if wants.is_none() && groups.groups().len() == 1 {
                // Every replica needs every tensor.
                return net.gather_all(&local);
            }
            let wants = wants.unwrap_or(&same_group);
            let key = format!("meet {op} {signature} {}", custom);
            let got = net.exchange(key, &local, 1, &shape, &|x, y, _| wants(x, y))?;
            let empty = Arc::new(Tensor::empty(dtype));
            Ok(got.into_iter().map(|t| t.unwrap_or_else(|| empty.clone())).collect())
        })?;
        Ok((Round::new(members.iter().map(|&m| everyone[m].clone()).collect()), rank))
    }

    /// Where `groups` put every replica of a multi-process run: each replica's group
    /// and rank in it, and for each group the replica that carries its partial on each
    /// process (its member there of the lowest rank), `None` where it has none.
    fn layout(&self, groups: &ReplicaGroups) -> GroupLayout {
        let d = self.hub.replicas();
        let processes = self.replicas / d;
        let mut group_of = vec![0; self.replicas];
        let mut rank_of = vec![0; self.replicas];
        let mut carriers = vec![vec![None; processes]; groups.groups().len()];
        for (g, members) in groups.groups().iter().enumerate() {
            for (k, &y) in members.iter().enumerate() {
                group_of[y] = g;
                rank_of[y] = k;
                carriers[g][y / d].get_or_insert(y);
            }
        }
        GroupLayout { group_of, rank_of, carriers }
    }

    /// A reduction within `groups` (not all replicas) in a multi-process run,
    /// hierarchical: each process folds its members of each group (in group rank
    /// order) into one partial, the processes exchange only the bytes of the partials
    /// that members elsewhere need — the whole partial for an all-reduce (`axis`
    /// `None`), member `k`'s piece along `axis` for a reduce-scatter — and each member
    /// folds its piece of its group's partials in process order (a mean divides that
    /// sum by the group size). Every member of a group gets the same bits. A
    /// reduce-scatter over groups of unequal sizes moves its members' whole tensors
    /// instead (each member folds its piece of them in the same order).
    #[allow(clippy::too_many_arguments)]
    fn grouped_reduce_across(
        &self,
        net: &Net,
        groups: &ReplicaGroups,
        name: &'static str,
        args: String,
        op: ReduceOp,
        axis: Option<usize>,
        t: Tensor,
    ) -> Result<Tensor> {
        let (members, rank) = self.place(groups)?;
        let m = members.len();
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let mut out_shape = shape.clone();
        if let Some(a) = axis {
            out_shape[a] /= m;
        }
        let fold = if op == ReduceOp::Mean { ReduceOp::Sum } else { op };
        let t = t.standard();
        // Piece-major, so member k's piece is one contiguous run.
        let flat = match axis {
            Some(a) if a != 0 => t.pieces_flat(a, m),
            _ => t,
        };
        let len = flat.len();
        let uniform = groups.groups().iter().all(|g| g.len() == m);
        if axis.is_some() && !uniform {
            // Every member's whole tensor; this member's piece of them folded in the
            // documented order: each process's members in rank order, then the
            // processes in order.
            let piece = len / m;
            let (parts, _) = self.meet(groups, name, args, flat)?;
            let d = self.hub.replicas();
            let mut processes: Vec<usize> = members.iter().map(|&y| y / d).collect();
            processes.sort_unstable();
            processes.dedup();
            let mut partials = Vec::with_capacity(processes.len());
            for &q in &processes {
                let here: Vec<(&Tensor, usize)> = members
                    .iter()
                    .zip(parts.iter())
                    .filter(|(y, _)| **y / d == q)
                    .map(|(_, t)| (&**t, rank * piece))
                    .collect();
                let mut partial = Tensor::zeroed(dtype, &[piece])?;
                Tensor::fold_at_into(&here, piece, fold, &mut partial);
                partials.push(partial);
            }
            let mut out = self.output(dtype, &out_shape)?;
            let at: Vec<(&Tensor, usize)> = partials.iter().map(|p| (p, 0)).collect();
            Tensor::fold_at_into(&at, piece, fold, &mut out);
            drop(at);
            self.done_with(parts, members);
            return Ok(if op == ReduceOp::Mean { out.mean_of(m) } else { out });
        }
        let d = self.hub.replicas();
        let layout = self.layout(groups);
        // An all-reduce whose groups each span the same number of processes, over a
        // tensor that splits evenly among them, goes as NCCL's: the processes of a group
        // reduce-scatter its partials (each folds one chunk), then all-gather the chunks.
        let spans: Vec<usize> =
            layout.carriers.iter().map(|c| c.iter().flatten().count()).collect();
        let k = spans[0];
        if axis.is_none() && k > 1 && spans.iter().all(|&s| s == k) && len.is_multiple_of(k) {
            let args = format!("{args} {shape:?}");
            let total =
                self.grouped_all_reduce_in_chunks(net, groups, &layout, name, &args, op, flat)?;
            return Ok(if op == ReduceOp::Mean { total.mean_of(m) } else { total }.reshaped(&shape));
        }
        let items = if axis.is_some() { m } else { 1 };
        let piece = len / items;
        let p = self.replica / d;
        let wants = |x: usize, y: usize, k: usize| {
            x / d != y / d
                && layout.group_of[x] == layout.group_of[y]
                && layout.carriers[layout.group_of[y]][y / d] == Some(y)
                && (items == 1 || k == layout.rank_of[x])
        };
        // What moves: the same on every process and for every local replica.
        let signature = format!("{args} {dtype}{shape:?} in {:?}", groups.groups());
        let plan = net.plan(format!("partials {name} {signature}"), len, items, &wants);
        let offsets = plan.offsets();
        let offer = Offer::new(name, signature.clone(), Arc::new(flat));
        let round = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            // Each group's partial here, carried by its member of the lowest rank; the
            // other members' tensors stay as they are (nobody asks for them). Made, with
            // the buffer the others' partials arrive in, before the processes agree on
            // the step: a buffer that cannot be had is then this process's failure,
            // which the agreement tells the others.
            let mut carried = local.clone();
            let mut partial_of: Vec<Option<Arc<Tensor>>> = vec![None; d];
            for g in groups.groups() {
                let here: Vec<usize> =
                    g.iter().filter(|&&y| y / d == p).map(|&y| y - p * d).collect();
                let Some(&first) = here.first() else { continue };
                let partial = if here.len() == 1 {
                    local[first].clone()
                } else {
                    let mut out = self.buffer_of(first, dtype, &[len])?;
                    let at: Vec<(&Tensor, usize)> = here.iter().map(|&j| (&*local[j], 0)).collect();
                    Tensor::fold_at_into(&at, len, fold, &mut out);
                    Arc::new(out)
                };
                carried[first] = partial.clone();
                here.iter().for_each(|&j| partial_of[j] = Some(partial.clone()));
            }
            let mut arrived = self.buffer_of(0, dtype, &[plan.recv_len()])?;
            net.step(name, &signature, self.replica)?;
            net.exchange_into(&plan, &carried, &mut arrived)?;
            drop(carried);
            self.give_back(local);
            // The round: each local replica's group partial, then what arrived.
            let empty = Arc::new(Tensor::empty(dtype));
            let mut round: Vec<Arc<Tensor>> =
                partial_of.into_iter().map(|t| t.unwrap_or_else(|| empty.clone())).collect();
            round.push(Arc::new(arrived));
            Ok(round)
        })?;
        // This member's piece of each process's partial, in process order.
        let g = layout.group_of[self.replica];
        let k = if items == 1 { 0 } else { rank };
        let parts: Vec<(&Tensor, usize)> = layout.carriers[g]
            .iter()
            .enumerate()
            .filter_map(|(q, carrier)| {
                let y = (*carrier)?;
                Some(if q == p {
                    (&*round[self.local], k * piece)
                } else {
                    (&*round[d], offsets[y * items + k].expect("a needed item arrived"))
                })
            })
            .collect();
        let mut out = self.output(dtype, &out_shape)?;
        Tensor::fold_at_into(&parts, piece, fold, &mut out);
        drop(parts);
        // Local replica `j`'s entry is its group's partial, made in (or, for a group of
        // one here, the input of) the group's carrier here; then the arrivals, pool 0's.
        let origin = |j: usize| match j < d {
            true => layout.carriers[layout.group_of[p * d + j]][p].map_or(j, |y| y - p * d),
            false => 0,
        };
        self.reclaim_local_from(round, &origin);
        Ok(if op == ReduceOp::Mean { out.mean_of(m) } else { out })
    }

    /// This replica is done with a cross-process `round` whose tensors are this
    /// process's buffers — one per local replica (its device's), then one of the first
    /// device's: the last replica done gives each back to its device's pool (what a
    /// pool does not keep is freed, see `pool::release`).
    fn reclaim_local(&self, round: Gathered) {
        let d = self.hub.replicas();
        self.reclaim_local_from(round, &|j| if j < d { j } else { 0 });
    }

    /// [`reclaim_local`](Self::reclaim_local) of a round whose tensor `j` came from
    /// local replica `origin(j)`'s device pool.
    fn reclaim_local_from(&self, round: Gathered, origin: &dyn Fn(usize) -> usize) {
        let Some(round) = Arc::into_inner(round) else { return };
        let pools = self.hub.pools_of(0..self.hub.replicas());
        let mut garbage = Vec::new();
        for (j, t) in round.into_tensors().into_iter().enumerate() {
            let Some(t) = Arc::into_inner(t) else { continue };
            match pools.get(origin(j)) {
                Some(pool) => pool.put_consumed(t, &mut garbage),
                None => garbage.push(t),
            }
        }
        crate::pool::release(garbage);
    }

    /// The grouped all-reduce across processes in two exchanges, when every group spans
    /// `K` processes and `flat` (this replica's input, 1-D) splits into `K` chunks: each
    /// process folds its members of each group into a partial (in group rank order);
    /// the `i`-th process of a group receives chunk `i` of the group's other partials
    /// and folds chunk `i` of the total (partials in process order — the order of the
    /// one-exchange form, bit for bit); then the processes of the group exchange their
    /// chunks. Each process receives `2(K-1)/K` of a tensor per group instead of
    /// `K-1` tensors, and folds a `K`-th of it. A mean is left as the sum (the caller
    /// divides). Returns this replica's group total.
    #[allow(clippy::too_many_arguments)]
    fn grouped_all_reduce_in_chunks(
        &self,
        net: &Net,
        groups: &ReplicaGroups,
        layout: &GroupLayout,
        name: &'static str,
        args: &str,
        op: ReduceOp,
        flat: Tensor,
    ) -> Result<Tensor> {
        let fold = if op == ReduceOp::Mean { ReduceOp::Sum } else { op };
        let (dtype, len) = (flat.dtype(), flat.len());
        let d = self.hub.replicas();
        let p = self.replica / d;
        // Each group's processes in order, and where each process stands among them.
        let spans: Vec<Vec<usize>> = layout
            .carriers
            .iter()
            .map(|c| c.iter().enumerate().filter(|(_, y)| y.is_some()).map(|(q, _)| q).collect())
            .collect();
        let k_chunks = spans[0].len();
        let chunk = len / k_chunks;
        let index = |g: usize, q: usize| spans[g].iter().position(|&s| s == q);
        let carrier = |y: usize| layout.carriers[layout.group_of[y]][y / d] == Some(y);
        let peers = |x: usize, y: usize| {
            x / d != y / d && layout.group_of[x] == layout.group_of[y] && carrier(x) && carrier(y)
        };
        // 1: the `i`-th process of a group gets chunk `i` of the others' partials;
        // 2: every process of it gets chunk `j` of the `j`-th process's fold.
        let scatter = |x: usize, y: usize, c: usize| {
            peers(x, y) && index(layout.group_of[x], x / d) == Some(c)
        };
        let gather = |x: usize, y: usize, c: usize| {
            peers(x, y) && index(layout.group_of[y], y / d) == Some(c)
        };
        let signature = format!("{args} {dtype}[{len}] in {:?} in chunks", groups.groups());
        let plan1 = net.plan(format!("scatter {name} {signature}"), len, k_chunks, &scatter);
        let plan2 = net.plan(format!("gather {name} {signature}"), len, k_chunks, &gather);
        let (at1, at2) = (plan1.offsets(), plan2.offsets());
        let offer = Offer::new(name, signature.clone(), Arc::new(flat));
        let round = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            // Every buffer before the agreement (see `grouped_reduce_across`): each
            // local group's partial and total, and the two receive buffers.
            let mut carried = local.clone();
            let mut totals: Vec<(usize, Tensor)> = Vec::new();
            for (g, members) in groups.groups().iter().enumerate() {
                let here: Vec<usize> =
                    members.iter().filter(|&&y| y / d == p).map(|&y| y - p * d).collect();
                let Some(&first) = here.first() else { continue };
                if here.len() > 1 {
                    let mut partial = self.buffer_of(first, dtype, &[len])?;
                    let at: Vec<(&Tensor, usize)> = here.iter().map(|&j| (&*local[j], 0)).collect();
                    Tensor::fold_at_into(&at, len, fold, &mut partial);
                    carried[first] = Arc::new(partial);
                }
                totals.push((g, self.buffer_of(first, dtype, &[len])?));
            }
            let mut arrived1 = self.buffer_of(0, dtype, &[plan1.recv_len()])?;
            let mut arrived2 = self.buffer_of(0, dtype, &[plan2.recv_len()])?;
            net.step(name, &signature, self.replica)?;
            net.exchange_into(&plan1, &carried, &mut arrived1)?;
            // This process's chunk of each local group's total, partials in process order.
            for (g, total) in &mut totals {
                let i = index(*g, p).expect("a group with members here");
                let parts: Vec<(&Tensor, usize)> = spans[*g]
                    .iter()
                    .map(|&q| {
                        let y = layout.carriers[*g][q].expect("a carrier on each of its processes");
                        match q == p {
                            true => (&*carried[y - p * d], i * chunk),
                            false => (&arrived1, at1[y * k_chunks + i].expect("a chunk arrived")),
                        }
                    })
                    .collect();
                Tensor::fold_at_into_at(&parts, chunk, fold, total, i * chunk);
            }
            // The partials and inputs are done with: back to their pools (the inputs
            // first, so none is still held by the partials' list; a partial to the pool
            // of the carrier it was made in).
            let partials: Vec<(usize, Tensor)> = std::mem::take(&mut carried)
                .into_iter()
                .enumerate()
                .filter(|(j, t)| !Arc::ptr_eq(t, &local[*j]))
                .filter_map(|(j, t)| Arc::into_inner(t).map(|t| (j, t)))
                .collect();
            self.give_back(local);
            let pools = self.hub.pools_of(0..d);
            let mut garbage = Vec::new();
            for (j, t) in partials {
                match pools.get(j) {
                    Some(pool) => pool.put_consumed(t, &mut garbage),
                    None => garbage.push(t),
                }
            }
            crate::pool::release(garbage);
            // The totals, carried for the gather by the same members (nothing is sent
            // of the others' placeholders).
            let empty = Arc::new(Tensor::empty(dtype));
            let mut gathered = vec![empty; d];
            let mut carrier_of = vec![0; d];
            for (g, total) in totals {
                let here: Vec<usize> = groups.groups()[g]
                    .iter()
                    .filter(|&&y| y / d == p)
                    .map(|&y| y - p * d)
                    .collect();
                here.iter().for_each(|&j| carrier_of[j] = here[0]);
                gathered[here[0]] = Arc::new(total);
            }
            net.exchange_into(&plan2, &gathered, &mut arrived2)?;
            // Each total's other chunks, from the processes that folded them.
            let mut gathered: Vec<Option<Tensor>> = gathered
                .into_iter()
                .enumerate()
                .map(|(j, t)| if carrier_of[j] == j { Arc::into_inner(t) } else { None })
                .collect();
            for (j, slot) in gathered.iter_mut().enumerate() {
                let Some(total) = slot else { continue };
                let g = layout.group_of[p * d + j];
                for (c, &q) in spans[g].iter().enumerate().filter(|&(_, &q)| q != p) {
                    let y = layout.carriers[g][q].expect("a carrier on each of its processes");
                    let at = at2[y * k_chunks + c].expect("a chunk arrived");
                    total.copy_run(c * chunk, &arrived2, at..at + chunk);
                }
            }
            let totals: Vec<Arc<Tensor>> = gathered
                .into_iter()
                .map(|t| Arc::new(t.unwrap_or_else(|| Tensor::empty(dtype))))
                .collect();
            // The round: each local replica's group total (at its group's carrier).
            // The receive buffers back to the first device's pool, where they came from.
            let mut garbage = vec![arrived1, arrived2];
            if let Some(pool) = self.hub.pools_of(std::iter::once(0)).first() {
                let mut unkept = Vec::new();
                garbage.drain(..).for_each(|t| pool.put_consumed(t, &mut unkept));
                garbage = unkept;
            }
            crate::pool::release(garbage);
            Ok((0..d).map(|j| totals[carrier_of[j]].clone()).collect())
        })?;
        // Tensor `j` of the round is a total from the pool of its group's carrier here.
        let origin = |j: usize| {
            let carrier = layout.carriers[layout.group_of[p * d + j]][p];
            carrier.map_or(j, |y| y - p * d)
        };
        self.own_copy_of(round, self.local, &[len], &origin)
    }

    /// All-gather in a multi-process run other than over all replicas along axis 0:
    /// each process receives, into a pooled buffer taken before the agreement, only the
    /// tensors of other processes' members of its replicas' groups, and each member
    /// assembles its result from those and its own process's inputs.
    fn grouped_all_gather_across(
        &self,
        net: &Net,
        groups: &ReplicaGroups,
        axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let (members, _) = self.place(groups)?;
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let t = t.standard();
        let len = t.len();
        let d = self.hub.replicas();
        let layout = self.layout(groups);
        let wants = |x: usize, y: usize, _: usize| {
            x / d != y / d && layout.group_of[x] == layout.group_of[y]
        };
        let signature = format!("axis={axis} {dtype}{shape:?} in {:?}", groups.groups());
        let plan = net.plan(format!("grouped {OP} {signature}"), len, 1, &wants);
        if axis == 0
            && let Some(ranges) = plan.straight(&|y, _| layout.rank_of[y] * len)
        {
            // One device per process: the others' tensors arrive in place in the result.
            let mut want = shape.clone();
            want[0] *= members.len();
            let mut out = self.output(dtype, &want)?;
            out.copy_run(layout.rank_of[self.replica] * len, &t, 0..len);
            return self.exchange_straight(net, OP, signature, t, out, &ranges);
        }
        let round = self.exchange_planned(net, &plan, OP, signature, t)?;
        let parts = self.planned_items(&round, members, &plan.offsets(), 1, 0, len);
        let out = self.concat_parts(&parts, &shape, axis);
        drop(parts);
        self.reclaim_local(round);
        out
    }

    /// Offers `flat` to the local replicas' round; once for them all, takes a pooled
    /// buffer for what `plan` brings — before the processes agree on the step, so a
    /// buffer that cannot be had is this process's failure, which the agreement tells
    /// the others — agrees, and moves the items. The round holds the local replicas'
    /// tensors, then that buffer.
    fn exchange_planned(
        &self,
        net: &Net,
        plan: &Plan,
        op: &'static str,
        signature: String,
        flat: Tensor,
    ) -> Result<Gathered> {
        let dtype = flat.dtype();
        let offer = Offer::new(op, signature.clone(), Arc::new(flat));
        self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            let mut arrived = self.buffer_of(0, dtype, &[plan.recv_len()])?;
            net.step(op, &signature, self.replica)?;
            net.exchange_into(plan, &local, &mut arrived)?;
            let mut round = local;
            round.push(Arc::new(arrived));
            Ok(round)
        })
    }

    /// With one device per process: agrees on the step and moves `ranges` from `flat`
    /// (this replica's input) straight into `out` (its result, its own part already
    /// there), with no receive buffer and no copy after.
    fn exchange_straight(
        &self,
        net: &Net,
        op: &'static str,
        signature: String,
        flat: Tensor,
        mut out: Tensor,
        ranges: &Straight,
    ) -> Result<Tensor> {
        let offer = Offer::new(op, signature.clone(), Arc::new(flat));
        let round = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            net.step(op, &signature, self.replica)?;
            net.exchange_straight(&local[0], &mut out, ranges)?;
            Ok(local)
        })?;
        self.reclaim_local(round);
        Ok(out)
    }

    /// Item `k` (of `items`, `item` elements each) of each of `members`' tensors, in
    /// rank order, as (tensor, offset) in a round of
    /// [`exchange_planned`](Self::exchange_planned): this process's members' in their
    /// inputs, the others' where they arrived (`offsets`, the plan's).
    fn planned_items<'r>(
        &self,
        round: &'r Round,
        members: &[usize],
        offsets: &[Option<usize>],
        items: usize,
        k: usize,
        item: usize,
    ) -> Vec<(&'r Tensor, usize)> {
        let d = self.hub.replicas();
        let p = self.replica / d;
        members
            .iter()
            .map(|&y| match y / d == p {
                true => (&*round[y - p * d], k * item),
                false => (&*round[d], offsets[y * items + k].expect("a needed item arrived")),
            })
            .collect()
    }

    /// `parts` — (tensor, offset) of as many elements as `shape` holds, each a tensor of
    /// `shape` in row-major order — concatenated in order along `axis`, into a buffer
    /// from the pool.
    fn concat_parts(
        &self,
        parts: &[(&Tensor, usize)],
        shape: &[usize],
        axis: usize,
    ) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        let mut want = shape.to_vec();
        want[axis] *= parts.len();
        let dtype = parts.first().map_or(meshwork_types::DType::F32, |(t, _)| t.dtype());
        let mut out = self.output(dtype, &want)?;
        if axis == 0 {
            // Parts end to end along axis 0 are the result's row-major order.
            for (i, &(src, at)) in parts.iter().enumerate() {
                out.copy_run(i * len, src, at..at + len);
            }
        } else {
            Tensor::concat_runs_into(parts, shape, axis, &mut out);
        }
        Ok(out)
    }

    /// All-to-all within `groups` (not all replicas) in a multi-process run: member `k`
    /// receives only piece `k` of each member's tensor from other processes (groups of
    /// unequal sizes move whole tensors instead).
    fn grouped_all_to_all_across(
        &self,
        net: &Net,
        groups: &ReplicaGroups,
        split_axis: usize,
        concat_axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "all_to_all";
        let (members, rank) = self.place(groups)?;
        let m = members.len();
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let mut piece_shape = shape.clone();
        piece_shape[split_axis] /= m;
        let t = t.standard();
        let flat = if split_axis == 0 { t } else { t.pieces_flat(split_axis, m) };
        let piece = flat.len() / m;
        let args = format!("split={split_axis} concat={concat_axis}");
        let uniform = groups.groups().iter().all(|g| g.len() == m);
        if !uniform {
            let (parts, _) = self.meet(groups, OP, args, flat)?;
            let at: Vec<(&Tensor, usize)> = parts.iter().map(|t| (&**t, rank * piece)).collect();
            let out = self.concat_parts(&at, &piece_shape, concat_axis);
            drop(at);
            self.done_with(parts, members);
            return out;
        }
        let d = self.hub.replicas();
        let layout = self.layout(groups);
        let wants = |x: usize, y: usize, k: usize| {
            x / d != y / d && layout.group_of[x] == layout.group_of[y] && k == layout.rank_of[x]
        };
        let signature = format!("{args} {dtype}{shape:?} in {:?}", groups.groups());
        let plan = net.plan(format!("grouped {OP} {signature}"), flat.len(), m, &wants);
        if concat_axis == 0
            && let Some(ranges) = plan.straight(&|y, _| layout.rank_of[y] * piece)
        {
            // One device per process: the others' pieces arrive in place in the result.
            let mut want = piece_shape.clone();
            want[0] *= m;
            let mut out = self.output(dtype, &want)?;
            let own = rank * piece..(rank + 1) * piece;
            out.copy_run(own.start, &flat, own);
            return self.exchange_straight(net, OP, signature, flat, out, &ranges);
        }
        let round = self.exchange_planned(net, &plan, OP, signature, flat)?;
        let parts = self.planned_items(&round, members, &plan.offsets(), m, rank, piece);
        let out = self.concat_parts(&parts, &piece_shape, concat_axis);
        drop(parts);
        self.reclaim_local(round);
        out
    }

    /// The one result of `round`, which every local replica gets, as this replica's own
    /// tensor in `shape`: moved out by the last replica to read it, a copy into a
    /// buffer of this replica's pool for the others. The tensor came from the first
    /// local device's pool.
    fn own_copy(&self, round: Gathered, shape: &[usize]) -> Result<Tensor> {
        self.own_copy_of(round, 0, shape, &|_| 0)
    }

    /// [`own_copy`](Self::own_copy) of the round's tensor `j`, where the round's tensor
    /// `i` came from local replica `origin(i)`'s device pool. A replica that finds the
    /// round shared copies; whichever replica lets go of the round last gives its
    /// tensors back to their pools — except, if it found the round unshared, the one
    /// it takes, for which it gives a buffer of its own pool of that kind (if it has
    /// one) to that tensor's pool. The copies come from the copiers' own pools, so in a
    /// loop whose results go back to their devices' pools every pool gets back what it
    /// gave, whichever replicas copy and whichever reads last, and none drains into
    /// fresh pages while another fills up.
    fn own_copy_of(
        &self,
        round: Gathered,
        j: usize,
        shape: &[usize],
        origin: &dyn Fn(usize) -> usize,
    ) -> Result<Tensor> {
        // The round's tensors (but `keep`) back to the pools they came from.
        let give_back = |tensors: Vec<Arc<Tensor>>, keep: Option<usize>| {
            let pools = self.hub.pools_of(0..self.hub.replicas());
            let mut mine = None;
            let mut garbage = Vec::new();
            for (i, t) in tensors.into_iter().enumerate() {
                if Some(i) == keep {
                    mine = Some(t);
                } else if let Some(t) = Arc::into_inner(t) {
                    match pools.get(origin(i)) {
                        Some(pool) => pool.put_consumed(t, &mut garbage),
                        None => garbage.push(t),
                    }
                }
            }
            crate::pool::release(garbage);
            (mine, pools)
        };
        match Arc::try_unwrap(round) {
            Ok(round) => {
                let (mine, pools) = give_back(round.into_tensors(), Some(j));
                let t = mine.expect("the round has this replica's tensor");
                match Arc::try_unwrap(t) {
                    Ok(t) => {
                        let from = origin(j);
                        if from != self.local
                            && let Some(pool) = pools.get(from)
                            && let Some(spare) = self.pool.take_spare(t.dtype(), t.len())
                        {
                            pool.put(spare);
                        }
                        Ok(t.reshaped(shape))
                    }
                    Err(shared) => {
                        let mut out = self.output(shared.dtype(), shape)?;
                        out.read_flat(0, &shared);
                        Ok(out)
                    }
                }
            }
            Err(shared) => {
                let mut out = self.output(shared[j].dtype(), shape)?;
                out.read_flat(0, &shared[j]);
                // The others may have let go while this one copied.
                if let Some(round) = Arc::into_inner(shared) {
                    give_back(round.into_tensors(), None);
                }
                Ok(out)
            }
        }
    }

    /// A buffer for a result of `dtype` and `shape`: a kept one, or zeros.
    fn output(&self, dtype: meshwork_types::DType, shape: &[usize]) -> Result<Tensor> {
        match self.kept(dtype, shape) {
            Some(out) => Ok(out),
            None => Tensor::zeroed(dtype, shape),
        }
    }

    /// The members of this replica's group among `groups` and its rank there.
    fn place<'g>(&self, groups: &'g ReplicaGroups) -> Result<(&'g [usize], usize)> {
        let bad = || Error::BadGroups { groups: groups.groups().to_vec(), replicas: self.replicas };
        if groups.groups().iter().map(Vec::len).sum::<usize>() != self.replicas {
            return Err(bad());
        }
        groups.place(self.replica).ok_or_else(bad)
    }

    fn bad(&self, op: &'static str, problem: String) -> Error {
        Error::BadArgument { op, replica: self.replica, problem }
    }

    fn check_axis(&self, op: &'static str, t: &Tensor, axis: usize) -> Result<()> {
        if axis >= t.shape().len() {
            return Err(
                self.bad(op, format!("axis {axis} is past the rank of shape {:?}", t.shape()))
            );
        }
        Ok(())
    }

    /// Element-wise reduction over all replicas; every replica gets the result.
    pub fn all_reduce(&self, op: ReduceOp, t: Tensor) -> Result<Tensor> {
        self.all_reduce_in(&self.all, op, t)
    }

    /// [`all_reduce`](Self::all_reduce) within each of `groups`.
    pub fn all_reduce_in(&self, groups: &ReplicaGroups, op: ReduceOp, t: Tensor) -> Result<Tensor> {
        self.all_reduce_signed(groups, op, t, "")
    }

    /// [`all_reduce_in`](Self::all_reduce_in) whose signature carries `extra` too.
    fn all_reduce_signed(
        &self,
        groups: &ReplicaGroups,
        op: ReduceOp,
        t: Tensor,
        extra: &str,
    ) -> Result<Tensor> {
        carried("all_reduce", &t)?;
        const OP: &str = "all_reduce";
        let shape = t.shape().to_vec();
        if let Some(net) = &self.net {
            return self.all_reduce_across(net, groups, op, t, extra);
        }
        // Every member lends its buffer; each rank folds one region of all of them
        // and writes the result into that region of each (see `direct`).
        let (members, rank) = self.place(groups)?;
        let mut t = t.standard();
        let dtype = t.dtype();
        let lent = direct::Lent::of(&mut t);
        let nothing = Arc::new(Tensor::I32(ArrayD::zeros(ndarray::IxDyn(&[0]))));
        let offer = Offer {
            op: OP,
            signature: format!("{op:?} {dtype}{shape:?}{extra}"),
            tensor: nothing,
            lent: Some(lent),
        };
        let round = self.hub.exchange(groups, self.replica, offer)?;
        direct::all_reduce(&round, rank, dtype, op).map_err(|k| Error::PeerFailed {
            failed: members[k],
            replica: self.replica,
            op: OP,
        })?;
        Ok(t)
    }

    /// All-reduces many tensors (a step's gradients) in few collectives: in reverse
    /// order (the order a backward pass produces gradients, as PyTorch's DDP buckets
    /// them), tensors are packed end to end into one flat bucket per dtype until the
    /// next would take it past `bucket_bytes`; each full bucket is all-reduced as one
    /// tensor and its results copied back into the tensors' own buffers. A tensor of
    /// `bucket_bytes` or more is all-reduced on its own, in place. Returns the results
    /// in the order given, bit for bit what [`all_reduce_in`](Self::all_reduce_in) of
    /// each tensor gives (reductions are element-wise, in rank order, wherever an
    /// element sits in a bucket). Every member must pass tensors of the same dtypes
    /// and shapes in the same order, or all get [`Error::Mismatch`]. Bucket buffers
    /// come from and go back to the device's pool.
    pub fn all_reduce_fused(
        &self,
        groups: &ReplicaGroups,
        op: ReduceOp,
        tensors: Vec<Tensor>,
        bucket_bytes: usize,
    ) -> Result<Vec<Tensor>> {
        for t in &tensors {
            carried("all_reduce", t)?;
        }
        let mut tensors: Vec<Tensor> = tensors.into_iter().map(Tensor::standard).collect();
        // Open buckets by dtype: the tensors in them (indices) and their bytes.
        let mut open: Vec<(meshwork_types::DType, Vec<usize>, usize)> = Vec::new();
        for i in (0..tensors.len()).rev() {
            let (dtype, size) = (tensors[i].dtype(), crate::pool::bytes(&tensors[i]));
            if size >= bucket_bytes {
                let t = std::mem::replace(&mut tensors[i], Tensor::empty(dtype));
                tensors[i] = self.all_reduce_signed(groups, op, t, " alone")?;
                continue;
            }
            let k = match open.iter().position(|(d, _, _)| *d == dtype) {
                Some(k) => k,
                None => {
                    open.push((dtype, Vec::new(), 0));
                    open.len() - 1
                }
            };
            if open[k].2 + size > bucket_bytes {
                let (_, members, _) = std::mem::replace(&mut open[k], (dtype, Vec::new(), 0));
                self.reduce_bucket(groups, op, &mut tensors, &members)?;
            }
            open[k].1.push(i);
            open[k].2 += size;
        }
        // What is left open, in the order the buckets were opened.
        for (_, members, _) in open {
            self.reduce_bucket(groups, op, &mut tensors, &members)?;
        }
        Ok(tensors)
    }

    /// All-reduces `tensors[members]` (one dtype, standard layout) as one flat bucket
    /// and writes the results back into them.
    fn reduce_bucket(
        &self,
        groups: &ReplicaGroups,
        op: ReduceOp,
        tensors: &mut [Tensor],
        members: &[usize],
    ) -> Result<()> {
        use std::hash::{Hash, Hasher};
        if members.is_empty() {
            return Ok(());
        }
        let len: usize = members.iter().map(|&i| tensors[i].len()).sum();
        let dtype = tensors[members[0]].dtype();
        let mut layout = rustc_hash::FxHasher::default();
        for &i in members {
            tensors[i].shape().hash(&mut layout);
        }
        let mut bucket = self.output(dtype, &[len])?;
        let mut at = 0;
        for &i in members {
            bucket.write_flat(at, &tensors[i]);
            at += tensors[i].len();
        }
        let extra = format!(" fused {} tensors {:016x}", members.len(), layout.finish());
        let bucket = self.all_reduce_signed(groups, op, bucket, &extra)?;
        let mut at = 0;
        for &i in members {
            let n = tensors[i].len();
            tensors[i].read_flat(at, &bucket);
            at += n;
        }
        self.pool.put(bucket);
        Ok(())
    }

    /// All-reduce in a multi-process run. Over all replicas it is hierarchical: the
    /// local replicas are folded in rank order, the processes' folds are reduced
    /// across processes (each process folds one chunk of all of them, in process
    /// order), and every local replica gets a copy. Other groups are hierarchical too
    /// (see `grouped_reduce_across`): each process's members of a group, then the
    /// processes, in order.
    fn all_reduce_across(
        &self,
        net: &Net,
        groups: &ReplicaGroups,
        op: ReduceOp,
        t: Tensor,
        extra: &str,
    ) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let shape = t.shape().to_vec();
        if *groups != self.all {
            return self.grouped_reduce_across(
                net,
                groups,
                OP,
                format!("{op:?}{extra}"),
                op,
                None,
                t,
            );
        }
        self.place(groups)?;
        let signature = format!("{op:?} {}{:?}{extra} in all", t.dtype(), t.shape());
        let offer = Offer::new(OP, signature.clone(), Arc::new(t.standard()));
        let total = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
            // The local fold first: a buffer it cannot have is this process's failure,
            // told to the others by the agreement.
            let mut total = self.local_partial(local, op)?;
            net.step(OP, &signature, self.replica)?;
            net.reduce(&mut total, op)?;
            if op == ReduceOp::Mean {
                total = total.mean_of(self.replicas);
            }
            Ok(vec![Arc::new(total)])
        })?;
        // The last local replica to read the result owns it outright: no copy for it.
        self.own_copy(total, &shape)
    }

    /// Concatenates every replica's tensor along `axis`, in replica order.
    pub fn all_gather(&self, axis: usize, t: Tensor) -> Result<Tensor> {
        self.all_gather_in(&self.all, axis, t)
    }

    /// Whether the members of this replica's group in `groups` hold bit-identical
    /// tensors: `None` if every member's tensor has the first member's bits (so
    /// `-0.0` differs from `0.0` and a NaN equals only its own bits), otherwise the
    /// rank of the first member whose tensor differs. Every member gets the same
    /// verdict. In one process nothing is copied: the member that completes the
    /// rendezvous compares the offered tensors in place, and once this returns the
    /// caller's `Arc` is its only reference again (`Arc::try_unwrap` gives the tensor
    /// back).
    pub fn first_difference_in(
        &self,
        groups: &ReplicaGroups,
        t: Arc<Tensor>,
    ) -> Result<Option<usize>> {
        const OP: &str = "first_difference";
        fn verdict(parts: &[Arc<Tensor>]) -> Option<usize> {
            parts.iter().skip(1).position(|p| !p.same_bits(&parts[0])).map(|k| k + 1)
        }
        if self.net.is_some() {
            let t = Arc::try_unwrap(t).unwrap_or_else(|shared| (*shared).clone());
            let (parts, _) = self.meet(groups, OP, String::new(), t)?;
            return Ok(verdict(&parts));
        }
        self.place(groups)?;
        let signature = format!("{}{:?}", t.dtype(), t.shape());
        let offer = Offer::new(OP, signature, t);
        let round = self.hub.exchange_then(groups, self.replica, offer, |parts| {
            let v = verdict(&parts).map_or(-1, |k| k as i64);
            Ok(vec![Arc::new(Tensor::I64(ndarray::arr1(&[v]).into_dyn()))])
        })?;
        match &*round[0] {
            Tensor::I64(a) => Ok(a.iter().next().and_then(|&k| usize::try_from(k).ok())),
            _ => unreachable!("the verdict is an i64"),
        }
    }

    /// [`all_gather`](Self::all_gather) within each of `groups`, in group rank order.
    pub fn all_gather_in(&self, groups: &ReplicaGroups, axis: usize, t: Tensor) -> Result<Tensor> {
        carried("all_gather", &t)?;
        self.check_axis("all_gather", &t, axis)?;
        let members = self.place(groups)?.0;
        let mut want = t.shape().to_vec();
        want[axis] *= members.len();
        if let Some(net) = &self.net
            && *groups == self.all
            && axis == 0
        {
            // Replicas end to end along axis 0 are the result's row-major order.
            let signature = format!("axis=0 {}{:?} in all", t.dtype(), t.shape());
            let offer = Offer::new("all_gather", signature.clone(), Arc::new(t.standard()));
            let all = self.hub.exchange_then(&self.local_all, self.local, offer, |local| {
                // From the first device's pool, where `own_copy` says it came from.
                let out = self.buffer_of(0, local[0].dtype(), &want)?;
                net.step("all_gather", &signature, self.replica)?;
                let out = net.all_gather_flat(&local, out)?;
                self.give_back(local);
                Ok(vec![Arc::new(out)])
            })?;
            return self.own_copy(all, &want);
        }
        if let Some(net) = &self.net {
            return self.grouped_all_gather_across(net, groups, axis, t);
        }
        let (parts, _) = self.meet(groups, "all_gather", format!("axis={axis}"), t)?;
        let mut out = self.output(parts[0].dtype(), &want)?;
        Tensor::concat_into(&parts, axis, &mut out);
        self.done_with(parts, members);
        Ok(out)
    }

    /// [`all_gather_in`](Self::all_gather_in) into `out`, a tensor of the result's dtype
    /// and shape (for example the previous step's result), which it returns filled. A
    /// large result then costs no fresh memory (for an 8 × 64 MiB all-gather, fresh
    /// pages are most of the time). Replicas may mix this with `all_gather_in`.
    ///
    /// Across processes it moves what `all_gather_in` moves (only the tensors other
    /// processes' members need): `out` goes to this device's pool first and the result
    /// is written into a pooled buffer of its size — `out` itself or another the pools
    /// keep (with several devices per process, a result all of them share comes from
    /// the first device's pool) — wherever the pool keeps buffers of its size (see
    /// [`Runtime::with_pool`](crate::Runtime::with_pool)); with pooling off, or a result
    /// outside the pool's limits, `out` is freed and the result is fresh memory.
    pub fn all_gather_into(
        &self,
        groups: &ReplicaGroups,
        axis: usize,
        t: Tensor,
        out: Tensor,
    ) -> Result<Tensor> {
        carried("all_gather", &t)?;
        const OP: &str = "all_gather";
        self.check_axis(OP, &t, axis)?;
        let members = self.place(groups)?.0;
        let mut want = t.shape().to_vec();
        want[axis] *= members.len();
        self.check_out(OP, &t, &want, &out)?;
        if self.net.is_some() {
            self.recycle(out);
            return self.all_gather_in(groups, axis, t);
        }
        let (parts, _) = self.meet(groups, OP, format!("axis={axis}"), t)?;
        let mut out = out;
        Tensor::concat_into(&parts, axis, &mut out);
        self.done_with(parts, members);
        Ok(out)
    }

    fn check_out(&self, op: &'static str, t: &Tensor, want: &[usize], out: &Tensor) -> Result<()> {
        if out.dtype() != t.dtype() || out.shape() != want {
            return Err(self.bad(
                op,
                format!(
                    "the output buffer is {}{:?}, the result is {}{want:?}",
                    out.dtype(),
                    out.shape(),
                    t.dtype()
                ),
            ));
        }
        Ok(())
    }

    /// Reduces over all replicas, then gives replica `k` the `k`-th of equal pieces
    /// along `axis` (whose length must divide by the group size).
    pub fn reduce_scatter(&self, op: ReduceOp, axis: usize, t: Tensor) -> Result<Tensor> {
        self.reduce_scatter_in(&self.all, op, axis, t)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) within each of `groups`.
    pub fn reduce_scatter_in(
        &self,
        groups: &ReplicaGroups,
        op: ReduceOp,
        axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        carried("reduce_scatter", &t)?;
        const OP: &str = "reduce_scatter";
        self.check_axis(OP, &t, axis)?;
        let (members, _) = self.place(groups)?;
        if !t.shape()[axis].is_multiple_of(members.len()) {
            return Err(self.bad(
                OP,
                format!(
                    "axis {axis} of shape {:?} does not divide into {} pieces",
                    t.shape(),
                    members.len()
                ),
            ));
        }
        if let Some(net) = &self.net {
            if *groups == self.all {
                return self.reduce_scatter_across(net, op, axis, t);
            }
            let args = format!("{op:?} axis={axis}");
            return self.grouped_reduce_across(net, groups, OP, args, op, Some(axis), t);
        }
        // Every member lends its output buffer; the members fold the pieces chunk by
        // chunk straight from the inputs, whichever of them are running taking the next
        // chunk (see `direct`), so each input element is read once and each output
        // element written once.
        let (members, rank) = self.place(groups)?;
        let n = members.len();
        let dtype = t.dtype();
        let mut shape = t.shape().to_vec();
        shape[axis] /= n;
        let mut out = self.output(dtype, &shape)?;
        let offer = Offer {
            op: OP,
            signature: format!("{op:?} axis={axis} {dtype}{:?}", t.shape()),
            tensor: Arc::new(t.standard()),
            lent: Some(direct::Lent::of(&mut out)),
        };
        let round = self.hub.exchange(groups, self.replica, offer)?;
        let chunk = direct::SCATTER_CHUNK_BYTES / dtype.size_in_bytes();
        let shared = direct::reduce_scatter(&round, rank, op, axis, chunk);
        // The last replica done with the inputs gives them back to their devices'
        // pools (not its own work to free them: freeing 8 × 64 MiB takes tens of ms).
        self.done_with(round, members);
        shared.map_err(|k| Error::PeerFailed {
            failed: members[k],
            replica: self.replica,
            op: OP,
        })?;
        Ok(out)
    }

    /// Reduce-scatter over all replicas of a multi-process run, hierarchical: the
    /// local replicas are folded in rank order (the pieces laid end to end), process
    /// `p` folds chunk `p` of the processes' folds in process order — the pieces of its
    /// own replicas, the only bytes it receives — and each local replica takes its
    /// piece. The order is the all-reduce's: a piece equals that piece of
    /// [`all_reduce`](Self::all_reduce) bit for bit.
    fn reduce_scatter_across(
        &self,
        net: &Net,
        op: ReduceOp,
        axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let n = self.replicas;
        let mut piece = t.shape().to_vec();
        piece[axis] /= n;
        let signature = format!("{op:?} axis={axis} {}{:?} in all", t.dtype(), t.shape());
        let offer = Offer::new(OP, signature.clone(), Arc::new(t.standard()));
        let pieces = self.hub.exchange_owned(&self.local_all, self.local, offer, |local| {
            let partial = self.local_partial(local, op)?;
            let mut flat = if axis == 0 { partial } else { partial.pieces_flat(axis, n) };
            let dtype = flat.dtype();
            let d = self.hub.replicas();
            // Every buffer the step needs, before the processes agree on it: one that
            // cannot be had is then this process's failure, which the agreement tells
            // the others (after it, they would be waiting in the exchange).
            let mine = self.buffer_of(self.local, dtype, &[net.chunk(flat.len()).len()])?;
            let mut pieces = match d {
                1 => Vec::new(),
                _ => {
                    (0..d).map(|x| self.buffer_of(x, dtype, &piece)).collect::<Result<Vec<_>>>()?
                }
            };
            net.step(OP, &signature, self.replica)?;
            let mut mine = net.reduce_scatter(&mut flat, op, |_| Ok(mine))?;
            self.give_back(vec![Arc::new(flat)]);
            if op == ReduceOp::Mean {
                mine = mine.mean_of(n);
            }
            if d == 1 {
                return Ok(vec![mine.reshaped(&piece)]);
            }
            // Each local replica's piece into a buffer of its own device's pool.
            let len = mine.len() / d;
            for (x, out) in pieces.iter_mut().enumerate() {
                out.read_flat(x * len, &mine);
            }
            self.give_back(vec![Arc::new(mine)]);
            Ok(pieces)
        })?;
        Ok(pieces.take_own(self.local).expect("a piece for every local replica"))
    }

    /// All-to-all over all replicas of a multi-process run: each process receives only
    /// the pieces its own replicas need (piece `x` of every replica for replica `x`).
    fn all_to_all_across(
        &self,
        net: &Net,
        split_axis: usize,
        concat_axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "all_to_all";
        let n = self.replicas;
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let mut piece = shape.clone();
        piece[split_axis] /= n;
        let signature = format!("split={split_axis} concat={concat_axis} {dtype}{shape:?} in all");
        let t = t.standard();
        let t_len = t.len();
        let flat = if split_axis == 0 { t } else { t.pieces_flat(split_axis, n) };
        let offer = Offer::new(OP, signature.clone(), Arc::new(flat));
        let piece_len: usize = piece.iter().product();
        let len = t_len;
        let outs = self.hub.exchange_owned(&self.local_all, self.local, offer, |local| {
            let outs = (0..local.len())
                .map(|x| self.buffer_of(x, dtype, &[len]))
                .collect::<Result<Vec<_>>>()?;
            net.step(OP, &signature, self.replica)?;
            let outs = net.all_to_all_pieces(&local, piece_len, outs)?;
            self.give_back(local);
            Ok(outs)
        })?;
        let flat = outs.take_own(self.local).expect("a result for every local replica");
        if concat_axis == 0 {
            // Pieces end to end along axis 0 are the result's row-major order.
            let mut shape = piece;
            shape[0] *= n;
            return Ok(flat.reshaped(&shape));
        }
        // The pieces, read in place, end to end along the axis into a pooled buffer;
        // the pieces' buffer back to the pool.
        let mut shape = piece.clone();
        shape[concat_axis] *= n;
        let mut out = self.output(dtype, &shape)?;
        let runs: Vec<(&Tensor, usize)> = (0..n).map(|k| (&flat, k * piece_len)).collect();
        Tensor::concat_runs_into(&runs, &piece, concat_axis, &mut out);
        drop(runs);
        self.recycle(flat);
        Ok(out)
    }

    /// Splits the tensor into group-size pieces along `split_axis`, sends piece `k` to
    /// rank `k`, and concatenates what arrives along `concat_axis` in rank order.
    pub fn all_to_all(&self, split_axis: usize, concat_axis: usize, t: Tensor) -> Result<Tensor> {
        self.all_to_all_in(&self.all, split_axis, concat_axis, t)
    }

    /// [`all_to_all`](Self::all_to_all) within each of `groups`.
    pub fn all_to_all_in(
        &self,
        groups: &ReplicaGroups,
        split_axis: usize,
        concat_axis: usize,
        t: Tensor,
    ) -> Result<Tensor> {
        carried("all_to_all", &t)?;
        let want = self.check_all_to_all(groups, split_axis, concat_axis, &t)?;
        if let Some(net) = &self.net {
            if *groups == self.all {
                return self.all_to_all_across(net, split_axis, concat_axis, t);
            }
            return self.grouped_all_to_all_across(net, groups, split_axis, concat_axis, t);
        }
        let members = self.place(groups)?.0;
        let (parts, rank) =
            self.meet(groups, "all_to_all", format!("split={split_axis} concat={concat_axis}"), t)?;
        let mut out = self.output(parts[0].dtype(), &want)?;
        Tensor::concat_pieces_into(&parts, split_axis, rank, concat_axis, &mut out);
        self.done_with(parts, members);
        Ok(out)
    }

    /// [`all_to_all_in`](Self::all_to_all_in) into `out`, a tensor of the result's
    /// dtype and shape, which it returns filled (see [`all_gather_into`](Self::all_gather_into),
    /// also for what it does across processes).
    pub fn all_to_all_into(
        &self,
        groups: &ReplicaGroups,
        split_axis: usize,
        concat_axis: usize,
        t: Tensor,
        out: Tensor,
    ) -> Result<Tensor> {
        carried("all_to_all", &t)?;
        let want = self.check_all_to_all(groups, split_axis, concat_axis, &t)?;
        self.check_out("all_to_all", &t, &want, &out)?;
        if self.net.is_some() {
            self.recycle(out);
            return self.all_to_all_in(groups, split_axis, concat_axis, t);
        }
        let (parts, rank) =
            self.meet(groups, "all_to_all", format!("split={split_axis} concat={concat_axis}"), t)?;
        let mut out = out;
        Tensor::concat_pieces_into(&parts, split_axis, rank, concat_axis, &mut out);
        self.done_with(parts, self.place(groups)?.0);
        Ok(out)
    }

    /// Checks an all-to-all's axes and split; returns the result's shape.
    fn check_all_to_all(
        &self,
        groups: &ReplicaGroups,
        split_axis: usize,
        concat_axis: usize,
        t: &Tensor,
    ) -> Result<Vec<usize>> {
        const OP: &str = "all_to_all";
        self.check_axis(OP, t, split_axis)?;
        self.check_axis(OP, t, concat_axis)?;
        let n = self.place(groups)?.0.len();
        if !t.shape()[split_axis].is_multiple_of(n) {
            return Err(self.bad(
                OP,
                format!(
                    "axis {split_axis} of shape {:?} does not divide into {n} pieces",
                    t.shape()
                ),
            ));
        }
        let mut want = t.shape().to_vec();
        want[split_axis] /= n;
        want[concat_axis] *= n;
        Ok(want)
    }

    /// Every replica gets the tensor of replica `root`.
    pub fn broadcast(&self, root: usize, t: Tensor) -> Result<Tensor> {
        carried("broadcast", &t)?;
        if root >= self.num_replicas() {
            return Err(self.bad(
                "broadcast",
                format!("root {root} is not one of {} replicas", self.num_replicas()),
            ));
        }
        let wants = |_: usize, y: usize| y == root;
        let (parts, _) =
            self.meet_wanting(&self.all, "broadcast", format!("root={root}"), t, Some(&wants))?;
        let out = self.copy_of(&parts[root])?;
        self.done_with(parts, &self.all.groups()[0]);
        Ok(out)
    }

    /// Sends the tensor along `(source, target)` pairs of replicas; a replica that is
    /// no pair's target gets zeros of its own tensor's shape. Sources and targets must
    /// each be distinct.
    pub fn collective_permute(&self, pairs: &[(usize, usize)], t: Tensor) -> Result<Tensor> {
        carried("collective_permute", &t)?;
        const OP: &str = "collective_permute";
        let n = self.num_replicas();
        let (mut src, mut dst) = (vec![false; n], vec![false; n]);
        for &(s, d) in pairs {
            if s >= n
                || d >= n
                || std::mem::replace(&mut src[s], true)
                || std::mem::replace(&mut dst[d], true)
            {
                return Err(self.bad(
                    OP,
                    format!("pairs {pairs:?} need distinct sources and targets among {n} replicas"),
                ));
            }
        }
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let wants = |x: usize, y: usize| pairs.contains(&(y, x));
        let (parts, _) = self.meet_wanting(&self.all, OP, format!("{pairs:?}"), t, Some(&wants))?;
        let out = match pairs.iter().find(|&&(_, d)| d == self.replica) {
            Some(&(s, _)) => self.copy_of(&parts[s])?,
            None => Tensor::zeroed(dtype, &shape)?,
        };
        self.done_with(parts, &self.all.groups()[0]);
        Ok(out)
    }

    /// A copy of `t` (standard layout), in a kept buffer if the pool has one.
    fn copy_of(&self, t: &Tensor) -> Result<Tensor> {
        let mut out = self.output(t.dtype(), t.shape())?;
        out.write_flat(0, t);
        Ok(out)
    }

    /// Sends `t` to replica `to` under `tag` (TensorFlow's `_Send`): it waits there
    /// until `to` receives it with the same tag; sending never blocks. A tag is used
    /// once between receipts (sending it again to the same replica before it was
    /// received is an [`Error::BadArgument`]). Within one process only.
    pub fn send(&self, to: usize, tag: u64, t: Tensor) -> Result<()> {
        carried("send", &t)?;
        let local = self.local_peer("send", to)?;
        self.hub.send(self.local, local, tag, t)
    }

    /// Receives what replica `from` sends this replica under `tag` (TensorFlow's
    /// `_Recv`), waiting for it. If any replica of the run fails meanwhile, returns
    /// [`Error::PeerFailed`] at once; if `from`'s run ends without sending it,
    /// [`Error::NotSent`]; after the runtime's timeout, [`Error::Timeout`].
    pub fn recv(&self, from: usize, tag: u64) -> Result<Tensor> {
        let local = self.local_peer("recv", from)?;
        self.hub.recv(local, self.local, tag)
    }

    /// Receives one of `wanted` (sender, tag): the first in `wanted`'s order among
    /// those already sent, or else the first to arrive — its index in `wanted` and the
    /// tensor. What a device with several pending `_Recv`s needs to go on with
    /// whichever is satisfied. Fails as [`recv`](Self::recv) does (any sender's run
    /// ending without sending its tag is [`Error::NotSent`]); `wanted` empty, or naming
    /// this replica or one outside the process, is an [`Error::BadArgument`].
    pub fn recv_any(&self, wanted: &[(usize, u64)]) -> Result<(usize, Tensor)> {
        if wanted.is_empty() {
            return Err(self.bad("recv", "nothing to wait for".into()));
        }
        let wanted = self.local_peers("recv", wanted)?;
        let got = self.hub.recv_any(self.local, &wanted, true)?;
        Ok(got.expect("a blocking receive returns a transfer or an error"))
    }

    /// [`recv_any`](Self::recv_any) without waiting: `None` when none of `wanted` has
    /// arrived yet; an error when a replica has failed or a peer is not another
    /// replica of this process.
    pub fn try_recv_any(&self, wanted: &[(usize, u64)]) -> Result<Option<(usize, Tensor)>> {
        let wanted = self.local_peers("recv", wanted)?;
        self.hub.recv_any(self.local, &wanted, false)
    }

    fn local_peers(&self, op: &'static str, wanted: &[(usize, u64)]) -> Result<Vec<(usize, u64)>> {
        wanted.iter().map(|&(from, tag)| Ok((self.local_peer(op, from)?, tag))).collect()
    }

    /// `peer` as a member of this process's hub, for point-to-point transfers.
    fn local_peer(&self, op: &'static str, peer: usize) -> Result<usize> {
        if self.net.is_some() {
            return Err(self.bad(op, "point-to-point transfers run within one process".into()));
        }
        if peer >= self.replicas || peer == self.replica {
            return Err(self
                .bad(op, format!("peer {peer} is not another of the {} replicas", self.replicas)));
        }
        Ok(peer)
    }

    /// Waits until every replica reaches the barrier.
    pub fn barrier(&self) -> Result<()> {
        let empty = Tensor::I32(ArrayD::zeros(ndarray::IxDyn(&[0])));
        let nothing = |_: usize, _: usize| false;
        self.meet_wanting(&self.all, "barrier", String::new(), empty, Some(&nothing)).map(|_| ())
    }
}

/// Tensor `k` of a round's result: moved out by the last replica to read it, copied
/// by the others.
/// Where replica groups put the replicas of a multi-process run (see
/// [`ReplicaContext::layout`]).
struct GroupLayout {
    group_of: Vec<usize>,
    rank_of: Vec<usize>,
    /// For each group, its carrier on each process.
    carriers: Vec<Vec<Option<usize>>>,
}
