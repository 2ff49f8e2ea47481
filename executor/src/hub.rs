//! The rendezvous: replicas of a group meet, each leaves with every member's tensor.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::direct::Lent;
use crate::pool::Pool;
use crate::sync::{AtomicUsize, Condvar, Mutex, MutexGuard};
use crate::{Error, Result, Tensor};

/// Replica groups: every replica of a run in exactly one group, members in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaGroups {
    groups: Vec<Vec<usize>>,
}

impl ReplicaGroups {
    /// Validates that `groups` hold each of `0..replicas` exactly once.
    pub fn new(groups: Vec<Vec<usize>>, replicas: usize) -> Result<ReplicaGroups> {
        let mut seen = vec![false; replicas];
        let ok = groups.iter().all(|g| !g.is_empty())
            && groups
                .iter()
                .flatten()
                .all(|&r| r < replicas && !std::mem::replace(&mut seen[r], true))
            && seen.iter().all(|&s| s);
        if ok { Ok(ReplicaGroups { groups }) } else { Err(Error::BadGroups { groups, replicas }) }
    }

    /// One group of all `replicas`.
    pub fn all(replicas: usize) -> ReplicaGroups {
        ReplicaGroups { groups: vec![(0..replicas).collect()] }
    }

    /// The groups.
    pub fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }

    /// The members of `replica`'s group and its rank there (`None` for a replica in
    /// no group).
    pub fn place(&self, replica: usize) -> Option<(&[usize], usize)> {
        self.groups
            .iter()
            .find_map(|g| g.iter().position(|&r| r == replica).map(|rank| (&g[..], rank)))
    }
}

/// What a participant brings: its tensor and a signature the others must share.
pub(crate) struct Offer {
    pub(crate) op: &'static str,
    pub(crate) signature: String,
    pub(crate) tensor: Arc<Tensor>,
    /// A buffer lent to the other members for the round (see `direct`).
    pub(crate) lent: Option<Lent>,
}

impl Offer {
    /// An offer of `tensor` under `op` and `signature`, lending nothing.
    pub(crate) fn new(op: &'static str, signature: String, tensor: Arc<Tensor>) -> Offer {
        Offer { op, signature, tensor, lent: None }
    }
}

/// What every participant leaves with: all members' tensors in rank order, and a
/// countdown for members that go on working on each other's buffers after the round.
pub(crate) struct Round {
    tensors: Vec<Arc<Tensor>>,
    /// The buffers members lent, in rank order (empty if none did).
    pub(crate) lent: Vec<Option<Lent>>,
    /// Members still at work on the round's buffers (see [`Countdown`]).
    pub(crate) working: Countdown,
    /// The next unclaimed unit of work of a round whose members share its work (a
    /// reduce-scatter's chunks, see `direct`): claimed by `fetch_add`, so each unit
    /// goes to exactly one member.
    pub(crate) next: AtomicUsize,
    /// Results that belong to one member each, by member index, for it to take
    /// without a copy (see [`Hub::exchange_owned`]).
    owned: Vec<Mutex<Option<Tensor>>>,
}

/// A shared round result.
pub(crate) type Gathered = Arc<Round>;

impl Round {
    /// A round of `tensors`, one per member.
    pub(crate) fn new(tensors: Vec<Arc<Tensor>>) -> Gathered {
        Round::lending(tensors, Vec::new())
    }

    fn lending(tensors: Vec<Arc<Tensor>>, lent: Vec<Option<Lent>>) -> Gathered {
        let working = Countdown::new(tensors.len());
        let next = AtomicUsize::new(0);
        Arc::new(Round { tensors, lent, working, next, owned: Vec::new() })
    }

    /// A round of results that belong to one member each.
    fn owning(owned: Vec<Tensor>) -> Gathered {
        Arc::new(Round {
            tensors: Vec::new(),
            lent: Vec::new(),
            working: Countdown::new(0),
            next: AtomicUsize::new(0),
            owned: owned.into_iter().map(|t| Mutex::new(Some(t))).collect(),
        })
    }

    /// Member `k`'s own result of a round made by [`Hub::exchange_owned`], the first
    /// time it is asked for.
    pub(crate) fn take_own(&self, k: usize) -> Option<Tensor> {
        lock(self.owned.get(k)?).take()
    }

    /// The tensors.
    pub(crate) fn into_tensors(self) -> Vec<Arc<Tensor>> {
        self.tensors
    }

    /// Gives every member's tensor back to its device's pool, if `round` is the last
    /// reference to the round and the tensor's (when every member calls this once it
    /// is done with the round, exactly one of them does the giving back). `pools` are
    /// the members' pools in rank order (empty: the tensors are freed, off this
    /// thread when large: see `pool::release`).
    pub(crate) fn reclaim(round: Gathered, pools: &[Arc<Pool>]) {
        let Some(round) = Arc::into_inner(round) else { return };
        let tensors = round.into_tensors();
        if pools.len() != tensors.len() {
            crate::pool::release(tensors.into_iter().filter_map(Arc::into_inner).collect());
            return;
        }
        let mut garbage = Vec::new();
        for (t, pool) in tensors.into_iter().zip(pools) {
            if let Some(t) = Arc::into_inner(t) {
                pool.put_consumed(t, &mut garbage);
            }
        }
        crate::pool::release(garbage);
    }
}

impl std::ops::Deref for Round {
    type Target = [Arc<Tensor>];
    fn deref(&self) -> &[Arc<Tensor>] {
        &self.tensors
    }
}

/// Counts members down to zero. Unlike a rendezvous it cannot be poisoned and never
/// times out: it waits only for work that cannot block (each member's share of a
/// computation), and it must outlast a failing peer, whose buffer others may still be
/// touching.
pub(crate) struct Countdown {
    left: Mutex<Left>,
    zero: Condvar,
}

struct Left {
    members: usize,
    /// The first member whose work failed (unwound), if any.
    failed: Option<usize>,
}

impl Countdown {
    fn new(n: usize) -> Countdown {
        Countdown { left: Mutex::new(Left { members: n, failed: None }), zero: Condvar::new() }
    }

    /// One member's work is over: finished, or failed when `failed` names the member.
    pub(crate) fn done(&self, failed: Option<usize>) {
        let mut left = lock(&self.left);
        left.members -= 1;
        if left.failed.is_none() {
            left.failed = failed;
        }
        if left.members == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits until every member's work is over.
    pub(crate) fn wait(&self) {
        let mut left = lock(&self.left);
        while left.members > 0 {
            left = self.zero.wait(left).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The first member whose work failed, once every member is done.
    pub(crate) fn failed(&self) -> Option<usize> {
        lock(&self.left).failed
    }
}

struct Group {
    members: Vec<usize>,
    state: Mutex<GroupState>,
    arrived: Condvar,
}

struct GroupState {
    round: u64,
    offers: Vec<Option<Offer>>,
    count: usize,
    done: Option<(u64, Result<Gathered>)>,
    /// Members that have not yet read `done`; the last one moves it out, so a result
    /// that is not shared ends up owned by one member alone.
    unread: usize,
    aborted: Option<Error>,
}

struct GroupSet {
    /// The replica groups this set is for.
    key: ReplicaGroups,
    groups: Vec<Arc<Group>>,
    /// Per replica: (group, rank in it).
    place: Vec<(usize, usize)>,
}

/// The rendezvous of one run.
pub(crate) struct Hub {
    replicas: usize,
    /// What errors add to a member index to name a replica (the first replica of this
    /// process in a multi-process run).
    base: usize,
    timeout: Duration,
    sets: Mutex<HashMap<ReplicaGroups, Arc<GroupSet>>>,
    failed: Mutex<Option<usize>>,
    /// Per member: where it is blocked, or that its run has ended — what the
    /// rendezvous needs to see that members wait for each other in different groups
    /// (or for a member that will never come) and fail at once instead of timing out.
    waits: Mutex<Vec<Wait>>,
    /// Point-to-point transfers sent and not yet received, by (from, to, tag).
    mailbox: Mutex<HashMap<(usize, usize, u64), Tensor>>,
    /// Signalled when a transfer arrives, a member fails or a member's run ends.
    delivered: Condvar,
    /// Per member: its device's buffer pool (empty for a hub without devices).
    pools: Vec<Arc<Pool>>,
}

/// What a member is doing, as far as the rendezvous can tell.
#[derive(Clone)]
enum Wait {
    /// Running its program (or between collectives).
    Running,
    /// Blocked in group `group` of `set`, offering `op` with `signature`.
    Blocked { set: Arc<GroupSet>, group: usize, op: &'static str, signature: String },
    /// Its run is over: it will offer nothing more.
    Ended,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Hub {
    pub(crate) fn new(replicas: usize, timeout: Duration) -> Hub {
        Hub {
            replicas,
            base: 0,
            timeout,
            sets: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
            waits: Mutex::new(vec![Wait::Running; replicas]),
            mailbox: Mutex::new(HashMap::new()),
            delivered: Condvar::new(),
            pools: Vec::new(),
        }
    }

    /// A hub whose member `i` runs on a device with pool `pools[i]`.
    pub(crate) fn with_pools(mut self, pools: Vec<Arc<Pool>>) -> Hub {
        self.pools = pools;
        self
    }

    /// The pools of `members` (member indices), or none if this hub has no pools.
    pub(crate) fn pools_of(&self, members: impl Iterator<Item = usize>) -> Vec<Arc<Pool>> {
        if self.pools.is_empty() {
            return Vec::new();
        }
        members.map(|m| self.pools[m].clone()).collect()
    }

    /// Leaves `t` for member `to` under `tag` (never waits). A tag still waiting to be
    /// received from this member is refused.
    pub(crate) fn send(&self, from: usize, to: usize, tag: u64, t: Tensor) -> Result<()> {
        let mut mailbox = lock(&self.mailbox);
        if mailbox.contains_key(&(from, to, tag)) {
            return Err(Error::BadArgument {
                op: "send",
                replica: from + self.base,
                problem: format!(
                    "tag {tag} to replica {} is sent again before it was received",
                    to + self.base
                ),
            });
        }
        mailbox.insert((from, to, tag), t);
        drop(mailbox);
        self.delivered.notify_all();
        Ok(())
    }

    /// Waits for what member `from` sends member `to` under `tag`. Fails at once when
    /// any member has failed ([`Error::PeerFailed`]) or `from`'s run ended without
    /// sending it ([`Error::NotSent`]), and after the timeout ([`Error::Timeout`]).
    pub(crate) fn recv(&self, from: usize, to: usize, tag: u64) -> Result<Tensor> {
        let got = self.recv_any(to, &[(from, tag)], true)?;
        Ok(got.expect("a blocking receive returns a transfer or an error").1)
    }

    /// The first of `wanted` (sender, tag) that has arrived for member `to`, as its
    /// index in `wanted` and the transfer; with `block`, waiting for one (failing as
    /// [`recv`](Self::recv) does), otherwise `None` when none has arrived (failing only
    /// when a member has failed).
    pub(crate) fn recv_any(
        &self,
        to: usize,
        wanted: &[(usize, u64)],
        block: bool,
    ) -> Result<Option<(usize, Tensor)>> {
        let deadline = Instant::now() + self.timeout;
        let mut mailbox = lock(&self.mailbox);
        loop {
            for (i, &(from, tag)) in wanted.iter().enumerate() {
                if let Some(t) = mailbox.remove(&(from, to, tag)) {
                    return Ok(Some((i, t)));
                }
            }
            if let Some(failed) = *lock(&self.failed) {
                return Err(Error::PeerFailed {
                    failed: failed + self.base,
                    replica: to + self.base,
                    op: "recv",
                });
            }
            if !block || wanted.is_empty() {
                return Ok(None);
            }
            let waits = lock(&self.waits);
            if let Some(&(from, tag)) =
                wanted.iter().find(|(from, _)| matches!(waits[*from], Wait::Ended))
            {
                return Err(Error::NotSent { from: from + self.base, to: to + self.base, tag });
            }
            drop(waits);
            let now = Instant::now();
            if now >= deadline {
                let mut missing: Vec<usize> = wanted.iter().map(|(f, _)| f + self.base).collect();
                missing.sort_unstable();
                missing.dedup();
                let mut group = missing.clone();
                group.push(to + self.base);
                return Err(Error::Timeout { op: "recv", group, missing, timeout: self.timeout });
            }
            mailbox = self
                .delivered
                .wait_timeout(mailbox, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Wakes every member waiting in [`recv`](Self::recv) to look again.
    fn wake_receivers(&self) {
        // Taking the lock orders this after any receiver's check, so none misses it.
        drop(lock(&self.mailbox));
        self.delivered.notify_all();
    }

    /// A hub whose errors name member `i` as replica `base + i`.
    pub(crate) fn with_base(mut self, base: usize) -> Hub {
        self.base = base;
        self
    }

    fn global(&self, members: &[usize]) -> Vec<usize> {
        members.iter().map(|&m| m + self.base).collect()
    }

    pub(crate) fn replicas(&self) -> usize {
        self.replicas
    }

    fn set(&self, groups: &ReplicaGroups) -> Arc<GroupSet> {
        let mut sets = lock(&self.sets);
        if let Some(set) = sets.get(groups) {
            return set.clone();
        }
        sets.entry(groups.clone())
            .or_insert_with(|| {
                let mut place = vec![(0, 0); self.replicas];
                let members = groups
                    .groups()
                    .iter()
                    .enumerate()
                    .map(|(g, members)| {
                        for (rank, &r) in members.iter().enumerate() {
                            place[r] = (g, rank);
                        }
                        let state = GroupState {
                            round: 0,
                            offers: (0..members.len()).map(|_| None).collect(),
                            count: 0,
                            done: None,
                            unread: 0,
                            aborted: None,
                        };
                        Arc::new(Group {
                            members: members.clone(),
                            state: Mutex::new(state),
                            arrived: Condvar::new(),
                        })
                    })
                    .collect();
                let set = Arc::new(GroupSet { key: groups.clone(), groups: members, place });
                if let Some(f) = *lock(&self.failed) {
                    set.poison(f + self.base);
                }
                set
            })
            .clone()
    }

    /// Meets the other members of `replica`'s group: returns every member's tensor once
    /// all have arrived with the same op and signature. Fails if a peer failed, the
    /// signatures differ, or the timeout passes.
    pub(crate) fn exchange(
        &self,
        groups: &ReplicaGroups,
        replica: usize,
        offer: Offer,
    ) -> Result<Gathered> {
        self.exchange_then(groups, replica, offer, Ok)
    }

    /// [`exchange`](Self::exchange), but the member that completes the round turns the
    /// tensors into the round's result with `finish` (the other members' `finish` are
    /// dropped unused). `finish` runs under the group's lock, so peers see its result
    /// or its error, never a timeout while it runs.
    pub(crate) fn exchange_then(
        &self,
        groups: &ReplicaGroups,
        replica: usize,
        offer: Offer,
        finish: impl FnOnce(Vec<Arc<Tensor>>) -> Result<Vec<Arc<Tensor>>>,
    ) -> Result<Gathered> {
        self.rendezvous(groups, replica, offer, |offers| {
            let lent = offers.iter().map(|o| o.lent).collect();
            let tensors = finish(offers.into_iter().map(|o| o.tensor).collect())?;
            Ok(Round::lending(tensors, lent))
        })
    }

    /// [`exchange_then`](Self::exchange_then) whose `finish` makes one result per
    /// member, which each member takes for itself ([`Round::take_own`] with its member
    /// index) without a copy.
    pub(crate) fn exchange_owned(
        &self,
        groups: &ReplicaGroups,
        replica: usize,
        offer: Offer,
        finish: impl FnOnce(Vec<Arc<Tensor>>) -> Result<Vec<Tensor>>,
    ) -> Result<Gathered> {
        self.rendezvous(groups, replica, offer, |offers| {
            Ok(Round::owning(finish(offers.into_iter().map(|o| o.tensor).collect())?))
        })
    }

    /// The rendezvous: the member that completes the round checks the offers and
    /// makes the round with `build`.
    fn rendezvous(
        &self,
        groups: &ReplicaGroups,
        replica: usize,
        offer: Offer,
        build: impl FnOnce(Vec<Offer>) -> Result<Gathered>,
    ) -> Result<Gathered> {
        let set = self.set(groups);
        let (g, rank) = set.place[replica];
        let group = &set.groups[g];
        let op = offer.op;
        let mut st = lock(&group.state);
        if let Some(e) = &st.aborted {
            return Err(for_replica(e, replica + self.base, op));
        }
        let round = st.round;
        st.offers[rank] = Some(offer);
        st.count += 1;
        if st.count == group.members.len() {
            let offers: Vec<Offer> =
                st.offers.iter_mut().map(|o| o.take().expect("all arrived")).collect();
            let result = check(&self.global(&group.members), &offers).and_then(|()| build(offers));
            {
                let mut waits = lock(&self.waits);
                for &m in &group.members {
                    waits[m] = Wait::Running;
                }
            }
            st.done = Some((round, result));
            st.unread = group.members.len();
            st.round += 1;
            st.count = 0;
            group.arrived.notify_all();
        } else {
            let signature = st.offers[rank].as_ref().map_or("", |o| o.signature.as_str());
            if let Some(e) = self.block(&set, g, replica, op, signature) {
                // Waiting would never end: fail the round for every member now.
                st.aborted = Some(e.clone());
                group.arrived.notify_all();
                self.unblock(replica);
                return Err(e);
            }
            let deadline = Instant::now() + self.timeout;
            while st.round == round {
                if let Some(e) = &st.aborted {
                    self.unblock(replica);
                    return Err(for_replica(e, replica + self.base, op));
                }
                let now = Instant::now();
                if now >= deadline {
                    let missing = st
                        .offers
                        .iter()
                        .zip(&group.members)
                        .filter(|(o, _)| o.is_none())
                        .map(|(_, &m)| m + self.base)
                        .collect();
                    let e = Error::Timeout {
                        op,
                        group: self.global(&group.members),
                        missing,
                        timeout: self.timeout,
                    };
                    st.aborted = Some(e.clone());
                    group.arrived.notify_all();
                    self.unblock(replica);
                    return Err(e);
                }
                st = group
                    .arrived
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        // A round completes only with every member, and no member can start the next
        // one before all have read this one's result, so it is still there.
        st.unread -= 1;
        if st.unread == 0 {
            match st.done.take() {
                Some((r, result)) if r == round => result,
                _ => unreachable!("this round's result is kept until its last reader"),
            }
        } else {
            match &st.done {
                Some((r, result)) if *r == round => result.clone(),
                _ => unreachable!("this round's result is kept until its last reader"),
            }
        }
    }

    /// Records that `replica` (a member index) is about to wait in group `g` of `set`
    /// (its offer is in, the group's lock held), and returns the error to fail with
    /// instead if the wait could never end: a member it waits for has ended its run,
    /// or waits — directly or through others — for it in another set of groups (the
    /// replicas called one collective with different replica groups). Each member of a
    /// set's group is in that group alone, so a member blocked in another set is one
    /// that has not arrived here, and a chain of such waits that comes back is a
    /// deadlock.
    fn block(
        &self,
        set: &Arc<GroupSet>,
        g: usize,
        replica: usize,
        op: &'static str,
        signature: &str,
    ) -> Option<Error> {
        let group = &set.groups[g];
        let mut waits = lock(&self.waits);
        waits[replica] =
            Wait::Blocked { set: set.clone(), group: g, op, signature: signature.into() };
        // Depth-first over "waits for": from each blocked member to the members of its
        // group that are blocked in another set.
        let mut seen = vec![false; waits.len()];
        let mut stack: Vec<(usize, usize)> = Vec::new(); // (member, first hop from `replica`)
        for &m in &group.members {
            match &waits[m] {
                Wait::Ended => {
                    return Some(Error::Mismatch {
                        op,
                        group: self.global(&group.members),
                        first: replica + self.base,
                        expected: format!("{op} {signature} in groups {:?}", set.key.groups()),
                        replica: m + self.base,
                        actual: "the end of its run".into(),
                    });
                }
                Wait::Blocked { set: other, .. } if !Arc::ptr_eq(other, set) => {
                    stack.push((m, m));
                }
                _ => {}
            }
        }
        while let Some((x, hop)) = stack.pop() {
            if std::mem::replace(&mut seen[x], true) {
                continue;
            }
            let Wait::Blocked { set: xs, group: xg, .. } = &waits[x] else { continue };
            for &m in &xs.groups[*xg].members {
                if m == replica {
                    let Wait::Blocked { set: hs, op: hop_op, signature: hop_sig, .. } = &waits[hop]
                    else {
                        unreachable!("only blocked members are pushed")
                    };
                    return Some(Error::Mismatch {
                        op,
                        group: self.global(&group.members),
                        first: replica + self.base,
                        expected: format!("{op} {signature} in groups {:?}", set.key.groups()),
                        replica: hop + self.base,
                        actual: format!("{hop_op} {hop_sig} in groups {:?}", hs.key.groups()),
                    });
                }
                if let Wait::Blocked { set: ms, .. } = &waits[m]
                    && !Arc::ptr_eq(ms, xs)
                {
                    stack.push((m, hop));
                }
            }
        }
        None
    }

    /// `replica` no longer waits.
    fn unblock(&self, replica: usize) {
        let mut waits = lock(&self.waits);
        if matches!(waits[replica], Wait::Blocked { .. }) {
            waits[replica] = Wait::Running;
        }
    }

    /// Records that member `replica`'s run is over: it will offer nothing more, so
    /// every group waiting for it fails now (with `Mismatch`: the members did not make
    /// the same collectives) rather than at the timeout.
    pub(crate) fn end(&self, replica: usize) {
        let stuck: Vec<(Arc<GroupSet>, usize, usize, &'static str, String)> = {
            let mut waits = lock(&self.waits);
            waits[replica] = Wait::Ended;
            waits
                .iter()
                .enumerate()
                .filter_map(|(x, w)| match w {
                    Wait::Blocked { set, group, op, signature }
                        if set.groups[*group].members.contains(&replica) =>
                    {
                        Some((set.clone(), *group, x, *op, signature.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        self.wake_receivers();
        for (set, g, x, op, signature) in stuck {
            let group = &set.groups[g];
            let mut st = lock(&group.state);
            if st.aborted.is_none() && st.offers[set.place[replica].1].is_none() {
                st.aborted = Some(Error::Mismatch {
                    op,
                    group: self.global(&group.members),
                    first: x + self.base,
                    expected: format!("{op} {signature} in groups {:?}", set.key.groups()),
                    replica: replica + self.base,
                    actual: "the end of its run".into(),
                });
                group.arrived.notify_all();
            }
        }
    }

    /// Marks `replica` as failed: every peer waiting (now or later) gets an error.
    pub(crate) fn poison(&self, member: usize) {
        let mut failed = lock(&self.failed);
        if failed.is_none() {
            *failed = Some(member);
        }
        drop(failed);
        for set in lock(&self.sets).values() {
            set.poison(member + self.base);
        }
        self.wake_receivers();
    }
}

impl GroupSet {
    /// Fails every group's round: `replica` (an id across processes) failed.
    fn poison(&self, replica: usize) {
        for group in &self.groups {
            let mut st = lock(&group.state);
            if st.aborted.is_none() {
                st.aborted =
                    Some(Error::PeerFailed { failed: replica, replica: usize::MAX, op: "" });
            }
            group.arrived.notify_all();
        }
    }
}

/// The stored abort error as seen by `replica` in `op`.
fn for_replica(e: &Error, replica: usize, op: &'static str) -> Error {
    match e {
        Error::PeerFailed { failed, .. } => Error::PeerFailed { failed: *failed, replica, op },
        other => other.clone(),
    }
}

fn check(members: &[usize], offers: &[Offer]) -> Result<()> {
    let first = &offers[0];
    for (rank, o) in offers.iter().enumerate().skip(1) {
        if o.op != first.op || o.signature != first.signature {
            return Err(Error::Mismatch {
                op: first.op,
                group: members.to_vec(),
                first: members[0],
                expected: format!("{} {}", first.op, first.signature),
                replica: members[rank],
                actual: format!("{} {}", o.op, o.signature),
            });
        }
    }
    Ok(())
}

#[cfg(all(test, shuttle))]
mod model;

#[cfg(all(test, not(shuttle)))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use meshwork_types::Tensor;

    use super::{Hub, Offer};
    use crate::{Error, ReplicaGroups};

    /// The hub of a process whose replicas are numbered from 4 (members 0 and 1 are
    /// replicas 4 and 5): when member 0 fails, a collective and a receive waiting in
    /// member 1 both name replica 4 as the one that failed and 5 as the one that waited.
    #[test]
    fn a_failed_member_is_named_by_its_replica_id_everywhere() {
        let hub = Arc::new(Hub::new(2, Duration::from_secs(20)).with_base(4));
        let waiting = {
            let hub = hub.clone();
            std::thread::spawn(move || {
                let t = Arc::new(Tensor::i64(&[1], vec![5]).unwrap());
                hub.exchange(&ReplicaGroups::all(2), 1, Offer::new("all_gather", "x".into(), t))
                    .map(|_| ())
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        hub.poison(0);
        let collective = waiting.join().unwrap().unwrap_err();
        assert_eq!(collective, Error::PeerFailed { failed: 4, replica: 5, op: "all_gather" });
        let receive = hub.recv_any(1, &[(0, 7)], true).unwrap_err();
        assert_eq!(receive, Error::PeerFailed { failed: 4, replica: 5, op: "recv" });
        // A set of groups made after the failure fails the same way.
        let t = Arc::new(Tensor::i64(&[1], vec![5]).unwrap());
        let groups = ReplicaGroups::new(vec![vec![1, 0]], 2).unwrap();
        let later = hub.exchange(&groups, 1, Offer::new("all_reduce", "y".into(), t));
        assert_eq!(
            later.err(),
            Some(Error::PeerFailed { failed: 4, replica: 5, op: "all_reduce" })
        );
    }
}
