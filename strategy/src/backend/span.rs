//! An SPMD executable whose mesh spreads over processes, as one process sees it: its
//! own positions run on a back end's executable ([`Backend::compile_spmd_local`]),
//! and what the façade needs of the others' — the results of a step, a resident
//! parameter's parts — is all-gathered through the strategy's executor (across
//! processes over its interconnect). The façade keeps its one view of a mesh: every
//! position's feeds, parts and results.
//!
//! Every process runs the same calls in the same order with the same global values
//! (the batch, the initial weights): each takes its positions' parts of what it is
//! given and drops the rest. A process's own positions are
//! `local.start..local.end`, run as its executor's replicas `0..`, whose replica ids
//! are those positions.
//!
//! [`Backend::compile_spmd_local`]: super::Backend::compile_spmd_local

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use meshwork_types::{Tensor, TensorSpec, map_tensor};
use ndarray::Axis;

use super::interpreter::{ReplicaError, boolean, numeric, run_replicas};
use super::{SpmdExecutable, Traffic};
use crate::{Error, Result, Strategy};

/// This process's positions of a mesh spread over processes.
pub(crate) struct Spanning {
    inner: Arc<dyn SpmdExecutable>,
    local: Range<usize>,
    positions: usize,
    /// This process's positions' devices (for the gathers' executor runs).
    placement: Vec<usize>,
    /// `set[r][k]`: whether position `r`'s part of parameter `k` was put (kept for
    /// the other processes' positions: their owners hold the parts).
    set: Mutex<Vec<Vec<bool>>>,
    /// Per result a step returns: whether every position holds the same whole value
    /// (a replicated layout), which this process then has without any gather.
    replicated: Vec<bool>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Spanning {
    /// `inner` runs positions `local` of `positions`, position `local.start + i` on
    /// the strategy's device `placement[i]`, with `params` parameters; a step returns
    /// results whose layouts are replicated where `replicated` says.
    pub(crate) fn new(
        inner: Box<dyn SpmdExecutable>,
        local: Range<usize>,
        positions: usize,
        placement: Vec<usize>,
        params: usize,
        replicated: Vec<bool>,
    ) -> Spanning {
        Spanning {
            inner: Arc::from(inner),
            local,
            positions,
            placement,
            set: Mutex::new(vec![vec![false; params]; positions]),
            replicated,
        }
    }

    fn remote(&self, r: usize) -> Error {
        let problem = if r < self.positions {
            format!("position {r} runs in another process (this one runs {:?})", self.local)
        } else {
            format!("position {r} of a mesh of {}", self.positions)
        };
        Error::Compiled { problem }
    }

    /// Every position's tensors, from each process's own: `take(i)` gives local
    /// position `i`'s, on its replica's thread (a failure there fails the run in every
    /// process), the same count and specs on every position. One executor run, one
    /// all-gather per tensor across the processes.
    fn gather(&self, strategy: &Strategy, take: Arc<Take>) -> Result<Vec<Vec<Tensor>>> {
        let n = self.positions;
        let first = self.local.start;
        let out: Arc<Mutex<Vec<Vec<Tensor>>>> = Arc::default();
        let o = out.clone();
        run_replicas(
            strategy.runtime(),
            &self.placement,
            Arc::new(move |ctx| {
                let i = ctx.replica_id() - first;
                let mine = take(i).map_err(|problem| {
                    ReplicaError::Program(meshwork_program::Error::Runtime {
                        at: format!("position {}", first + i),
                        problem,
                    })
                })?;
                let everyone = ctx.groups(vec![(0..n).collect()]).map_err(ReplicaError::Peer)?;
                let mut by_position: Vec<Vec<Tensor>> =
                    (0..n).map(|_| Vec::with_capacity(mine.len())).collect();
                for t in mine {
                    let (t, was_bool) = numeric(t);
                    let t = map_tensor!(t, a => a.insert_axis(Axis(0)));
                    let all = ctx.all_gather_in(&everyone, 0, t).map_err(ReplicaError::Peer)?;
                    for (q, list) in by_position.iter_mut().enumerate() {
                        let part = map_tensor!(&all, a => a.index_axis(Axis(0), q).to_owned());
                        list.push(if was_bool { boolean(part) } else { part });
                    }
                }
                if i == 0 {
                    *lock(&o) = by_position;
                }
                Ok(())
            }),
        )?;
        let all = std::mem::take(&mut *lock(&out));
        if all.len() != n {
            return Err(Error::Compiled {
                problem: "a gather across processes returned nothing".into(),
            });
        }
        Ok(all)
    }
}

/// A stand-in where a gather returned fewer parts than asked (which the façade's
/// assembly then refuses by shape).
fn copy_placeholder() -> Tensor {
    Tensor::F32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[0])))
}

/// What a gather takes from local position `i`, or why it cannot.
type Take = dyn Fn(usize) -> std::result::Result<Vec<Tensor>, String> + Send + Sync;

impl SpmdExecutable for Spanning {
    fn positions(&self) -> usize {
        self.positions
    }

    fn local(&self) -> Range<usize> {
        self.local.clone()
    }

    fn buffer(&self, r: usize, spec: &TensorSpec) -> Result<Tensor> {
        if self.local.contains(&r) {
            self.inner.buffer(r - self.local.start, spec)
        } else {
            // Filled with another process's part of a feed, then dropped.
            Ok(Tensor::zeros(spec.dtype, spec.shape.dims())?)
        }
    }

    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()> {
        self.put_all(vec![(r, param, part)])
    }

    fn put_all(&self, parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        let mut mine = Vec::with_capacity(parts.len());
        let mut theirs = Vec::new();
        for (r, param, part) in parts {
            if r >= self.positions {
                return Err(self.remote(r));
            }
            if self.local.contains(&r) {
                mine.push((r - self.local.start, param, part));
            } else {
                theirs.push((r, param));
            }
        }
        self.inner.put_all(mine)?;
        let mut set = lock(&self.set);
        for (r, param) in theirs {
            if let Some(s) = set[r].get_mut(param) {
                *s = true;
            }
        }
        Ok(())
    }

    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>> {
        if self.local.contains(&r) {
            self.inner.fetch(r - self.local.start, param)
        } else {
            Err(self.remote(r))
        }
    }

    fn fetch_every(&self, strategy: &Strategy, param: usize) -> Result<Vec<Option<Tensor>>> {
        let (inner, first) = (self.inner.clone(), self.local.start);
        let take = Arc::new(move |i: usize| match inner.fetch(i, param) {
            Ok(Some(part)) => Ok(vec![part]),
            Ok(None) => {
                Err(format!("position {} holds no part of resident parameter {param}", first + i))
            }
            Err(e) => Err(e.to_string()),
        });
        Ok(self.gather(strategy, take)?.into_iter().map(|mut l| l.pop()).collect())
    }

    fn fetch_to_first(
        &self,
        strategy: &Strategy,
        param: usize,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        let n = self.positions;
        let (inner, first) = (self.inner.clone(), self.local.start);
        let out: Arc<Mutex<Vec<Option<Tensor>>>> = Arc::default();
        let o = out.clone();
        run_replicas(
            strategy.runtime(),
            &self.placement,
            Arc::new(move |ctx| {
                let i = ctx.replica_id() - first;
                let mine = match inner.fetch(i, param) {
                    Ok(Some(part)) => part,
                    Ok(None) => {
                        return Err(ReplicaError::Program(meshwork_program::Error::Runtime {
                            at: format!("position {}", first + i),
                            problem: format!("holds no part of resident parameter {param}"),
                        }));
                    }
                    Err(e) => {
                        return Err(ReplicaError::Program(meshwork_program::Error::Runtime {
                            at: format!("position {}", first + i),
                            problem: e.to_string(),
                        }));
                    }
                };
                let (mine, was_bool) = numeric(mine);
                let back = |t: Tensor| if was_bool { boolean(t) } else { t };
                let mut parts = Vec::with_capacity(n);
                // Position q's part to position 0, one at a time: only those bytes move.
                for q in 1..n {
                    let got = ctx.collective_permute(&[(q, 0)], mine.clone());
                    let got = got.map_err(ReplicaError::Peer)?;
                    if ctx.replica_id() == 0 {
                        parts.push(Some(back(got)));
                    }
                }
                if ctx.replica_id() == 0 {
                    parts.insert(0, Some(back(mine)));
                    *lock(&o) = parts;
                }
                Ok(())
            }),
        )?;
        if !self.local.contains(&0) {
            return Ok(None);
        }
        let all = std::mem::take(&mut *lock(&out));
        if all.len() != n {
            return Err(Error::Compiled {
                problem: "a gather to position 0 returned nothing".into(),
            });
        }
        Ok(Some(all))
    }

    fn is_set(&self, r: usize, param: usize) -> bool {
        if self.local.contains(&r) {
            self.inner.is_set(r - self.local.start, param)
        } else {
            lock(&self.set).get(r).and_then(|s| s.get(param)).copied().unwrap_or(false)
        }
    }

    fn held_bytes(&self, r: usize, param: usize) -> Result<Option<u64>> {
        if self.local.contains(&r) {
            self.inner.held_bytes(r - self.local.start, param)
        } else {
            Err(self.remote(r))
        }
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }

    fn run(
        &self,
        strategy: &Strategy,
        mut feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        if feeds.len() != self.positions {
            return Err(Error::Compiled {
                problem: format!(
                    "feeds for {} positions of a mesh of {}",
                    feeds.len(),
                    self.positions
                ),
            });
        }
        let steps = feeds.first().map_or(0, Vec::len);
        let mine: Vec<Vec<Vec<Tensor>>> = feeds.drain(self.local.clone()).collect();
        drop(feeds);
        let out = self.inner.run(strategy, mine, tag)?;
        let per_step: Vec<usize> =
            out.first().map_or_else(|| vec![0; steps], |o| o.iter().map(Vec::len).collect());
        if per_step.iter().any(|&k| k != self.replicated.len()) {
            return Err(Error::Compiled {
                problem: format!(
                    "a step returned {per_step:?} results; the program has {} (a back-end bug)",
                    self.replicated.len()
                ),
            });
        }
        // A replicated result is the same on every position: this process's first
        // position's copy stands for the others', and nothing moves. The others'
        // parts of each step are gathered, flattened, and cut back into steps.
        let replicated = self.replicated.clone();
        let copies: Vec<Vec<Option<Tensor>>> = out
            .first()
            .map(|o| {
                o.iter()
                    .map(|results| {
                        results
                            .iter()
                            .zip(&replicated)
                            .map(|(t, &same)| same.then(|| t.clone()))
                            .collect()
                    })
                    .collect()
            })
            .unwrap_or_default();
        let sharded: Vec<Mutex<Vec<Tensor>>> = out
            .into_iter()
            .map(|o| {
                Mutex::new(
                    o.into_iter()
                        .flat_map(|results| {
                            results
                                .into_iter()
                                .zip(&replicated)
                                .filter(|(_, s)| !**s)
                                .map(|(t, _)| t)
                        })
                        .collect(),
                )
            })
            .collect();
        let gathered = if replicated.iter().all(|&s| s) {
            vec![Vec::new(); self.positions]
        } else {
            let take = Arc::new(move |i: usize| {
                sharded
                    .get(i)
                    .map(|l| std::mem::take(&mut *lock(l)))
                    .ok_or_else(|| format!("local position {i} has no results (a back-end bug)"))
            });
            self.gather(strategy, take)?
        };
        Ok(gathered
            .into_iter()
            .map(|flat| {
                let mut flat = flat.into_iter();
                copies
                    .iter()
                    .map(|step| {
                        step.iter()
                            .map(|copy| match copy {
                                Some(t) => t.clone(),
                                None => flat.next().unwrap_or_else(copy_placeholder),
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect())
    }

    fn commit(&self, keep: bool) {
        self.inner.commit(keep);
    }
}
