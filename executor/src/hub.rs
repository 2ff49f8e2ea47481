//! The rendezvous: replicas of a group meet, each leaves with every member's tensor.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::direct::Lent;
use crate::sync::{Condvar, Mutex, MutexGuard};
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
        Arc::new(Round { tensors, lent, working })
    }

    /// The tensors.
    pub(crate) fn into_tensors(self) -> Vec<Arc<Tensor>> {
        self.tensors
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
    left: Mutex<usize>,
    zero: Condvar,
}

impl Countdown {
    fn new(n: usize) -> Countdown {
        Countdown { left: Mutex::new(n), zero: Condvar::new() }
    }

    /// One member's work is done.
    pub(crate) fn done(&self) {
        let mut left = lock(&self.left);
        *left -= 1;
        if *left == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits until every member's work is done.
    pub(crate) fn wait(&self) {
        let mut left = lock(&self.left);
        while *left > 0 {
            left = self.zero.wait(left).unwrap_or_else(|e| e.into_inner());
        }
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
        }
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
                let groups = groups
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
                let set = Arc::new(GroupSet { groups, place });
                if let Some(f) = *lock(&self.failed) {
                    set.poison(f);
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
            let result = check(&self.global(&group.members), &offers).and_then(|()| {
                let lent = offers.iter().map(|o| o.lent).collect();
                let tensors = finish(offers.into_iter().map(|o| o.tensor).collect())?;
                Ok(Round::lending(tensors, lent))
            });
            st.done = Some((round, result));
            st.unread = group.members.len();
            st.round += 1;
            st.count = 0;
            group.arrived.notify_all();
        } else {
            let deadline = Instant::now() + self.timeout;
            while st.round == round {
                if let Some(e) = &st.aborted {
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

    /// Marks `replica` as failed: every peer waiting (now or later) gets an error.
    pub(crate) fn poison(&self, replica: usize) {
        let mut failed = lock(&self.failed);
        if failed.is_none() {
            *failed = Some(replica);
        }
        drop(failed);
        for set in lock(&self.sets).values() {
            set.poison(replica);
        }
    }
}

impl GroupSet {
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
