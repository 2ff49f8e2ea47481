//! An SPMD program on the interpreter: one executable per mesh position, each on its
//! device's thread, resident parts held beside it.

use std::sync::{Arc, Mutex};

use meshwork_program::fast::{Executable, Input, Options};
use meshwork_program::{Env, Op, Program};
use meshwork_types::{Tensor, TensorSpec};

use super::{FirstReplicaHost, MeshCollectives, lock, run_replicas};
use crate::backend::SpmdExecutable;
use crate::{Error, Result, Strategy};

/// One position's share: its interpreter, the resident parts it keeps, and what a run
/// feeds, stages and returns.
struct Device {
    exe: Executable,
    resident: Vec<Option<Tensor>>,
    /// Each step's feeds (a run may take several steps).
    feed: Vec<Vec<Tensor>>,
    /// The last step's carried results, `(parameter, value)`, until committed.
    staged: Vec<(usize, Tensor)>,
    /// Each step's results that are not carried.
    out: Vec<Vec<Tensor>>,
}

/// The mesh's devices running one program.
pub(super) struct Devices {
    devices: Arc<Vec<Mutex<Device>>>,
    placement: Vec<usize>,
    /// The mesh position of its first device (its executor replica id): 0 in one
    /// process, this process's first position across processes.
    first: usize,
    carry: Vec<(usize, usize)>,
    results: usize,
    /// Whether the program communicates (with one device it does not).
    communicates: bool,
    /// Whether it streams anything to the host (`emit`).
    emits: bool,
    /// What its runs moved.
    traffic: Arc<crate::backend::TrafficCounter>,
}

/// The message of a panic payload.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

impl Devices {
    /// Positions `first..first + placement.len()` of the program's mesh, position
    /// `first + i` on the strategy's device `placement[i]`.
    pub(super) fn compile(
        program: &Program,
        first: usize,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Devices {
        let options = Options::for_devices(placement.len());
        let np = program.params().len();
        let devices = placement
            .iter()
            .map(|_| {
                Mutex::new(Device {
                    exe: Executable::compile(program, options),
                    resident: vec![None; np],
                    feed: Vec::new(),
                    staged: Vec::new(),
                    out: Vec::new(),
                })
            })
            .collect();
        debug_assert_eq!(resident.len(), np);
        Devices {
            devices: Arc::new(devices),
            placement: placement.to_vec(),
            first,
            carry: carry.to_vec(),
            results: program.results().len(),
            communicates: program
                .instrs()
                .iter()
                .any(|i| i.op.communicates() && !matches!(i.op, Op::Emit { .. })),
            emits: program.instrs().iter().any(|i| matches!(i.op, Op::Emit { .. })),
            traffic: Arc::default(),
        }
    }
}

impl SpmdExecutable for Devices {
    fn positions(&self) -> usize {
        self.devices.len()
    }

    fn buffer(&self, r: usize, spec: &TensorSpec) -> Result<Tensor> {
        Ok(lock(&self.devices[r]).exe.buffer(spec)?)
    }

    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()> {
        let mut d = lock(&self.devices[r]);
        if let Some(old) = d.resident[param].replace(part) {
            d.exe.recycle(vec![old]);
        }
        Ok(())
    }

    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>> {
        Ok(lock(&self.devices[r]).resident[param].clone())
    }

    fn is_set(&self, r: usize, param: usize) -> bool {
        lock(&self.devices[r]).resident[param].is_some()
    }

    fn held_bytes(&self, r: usize, param: usize) -> Result<Option<u64>> {
        Ok(lock(&self.devices[r]).resident[param].as_ref().map(|t| t.byte_size() as u64))
    }

    fn traffic(&self) -> crate::backend::Traffic {
        self.traffic.get()
    }

    fn run(
        &self,
        strategy: &Strategy,
        feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        let steps = feeds.first().map_or(0, Vec::len);
        self.traffic.fed(crate::backend::bytes_of(feeds.iter().flatten().flatten()));
        for (d, feed) in self.devices.iter().zip(feeds) {
            lock(d).feed = feed;
        }
        let devices = self.devices.clone();
        let first = self.first;
        let carry = self.carry.clone();
        let traffic = self.traffic.clone();
        let (communicates, nres) = (self.communicates, self.results);
        // One device's share of the steps, given what each may talk to (`envs[i]`,
        // step `i`'s).
        let device_step = move |d: &mut Device, envs: &[Env<'_>]| -> meshwork_program::Result<()> {
            let steps = std::mem::take(&mut d.feed);
            let mut outs = Vec::with_capacity(steps.len());
            // The carried results so far, by parameter: the next step's inputs.
            let mut staged: Vec<Option<Tensor>> = vec![None; d.resident.len()];
            for (i, step_feed) in steps.into_iter().enumerate() {
                let mut feed = step_feed.into_iter();
                // Resident parts are read in place (or the previous step's carried
                // results taken), feeds taken.
                let mut now = std::mem::replace(&mut staged, vec![None; d.resident.len()]);
                let inputs = d
                    .resident
                    .iter()
                    .zip(now.iter_mut())
                    .map(|(slot, carried)| match (carried.take(), slot) {
                        (Some(t), _) => Ok(Input::Owned(t)),
                        (None, Some(t)) => Ok(Input::Borrowed(t)),
                        (None, None) => feed.next().map(Input::Owned).ok_or_else(|| {
                            meshwork_program::Error::Communication {
                                at: "step".into(),
                                problem: "a feed is missing (a partitioner bug)".into(),
                            }
                        }),
                    })
                    .collect::<meshwork_program::Result<Vec<_>>>()?;
                let out = d.exe.run_inputs(inputs, &envs[i])?;
                let mut out: Vec<Option<Tensor>> = out.into_iter().map(Some).collect();
                for &(r, p) in carry.iter() {
                    staged[p] = out[r].take();
                }
                outs.push((0..nres).filter_map(|r| out[r].take()).collect());
            }
            d.staged = staged.into_iter().enumerate().filter_map(|(p, t)| Some((p, t?))).collect();
            d.out = outs;
            Ok(())
        };
        let run = if self.devices.len() == 1 && !communicates && !self.emits {
            // Nothing to meet or stream: the one device's work runs here, without
            // the hand-over to its thread and back. A panic in a kernel is this
            // step's error, as on the devices' threads.
            let mut d = lock(&devices[0]);
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                device_step(&mut d, &vec![Env::local(); steps])
            })) {
                Ok(done) => done.map_err(Error::from),
                Err(panic) => Err(Error::Compiled {
                    problem: format!("the step panicked: {}", panic_text(&*panic)),
                }),
            }
        } else {
            run_replicas(
                strategy.runtime(),
                &self.placement,
                Arc::new(move |ctx| {
                    let mut d = lock(&devices[ctx.replica_id() - first]);
                    let coll = MeshCollectives::counted(ctx, &traffic);
                    let hosts: Vec<FirstReplicaHost<'_>> = (0..d.feed.len())
                        .map(|i| FirstReplicaHost {
                            ctx,
                            step: tag + i as u64,
                            counter: Some(&traffic),
                        })
                        .collect();
                    // A program that does not communicate (one device) runs without
                    // collectives, which lets it run on the kernels' pool.
                    let envs: Vec<Env<'_>> = hosts
                        .iter()
                        .map(|host| {
                            if communicates {
                                Env::local().with_collectives(&coll).with_host(host)
                            } else {
                                Env::local().with_host(host)
                            }
                        })
                        .collect();
                    device_step(&mut d, &envs).map_err(|e| coll.failure(e))
                }),
            )
        };
        if let Err(e) = run {
            self.commit(false);
            return Err(e);
        }
        let out: Vec<Vec<Vec<Tensor>>> =
            self.devices.iter().map(|d| std::mem::take(&mut lock(d).out)).collect();
        self.traffic.returned(crate::backend::bytes_of(out.iter().flatten().flatten()));
        self.traffic.stepped(steps as u64);
        Ok(out)
    }

    fn commit(&self, keep: bool) {
        for d in self.devices.iter() {
            let mut d = lock(d);
            let d = &mut *d;
            let staged = std::mem::take(&mut d.staged);
            if keep {
                for (p, t) in staged {
                    if let Some(old) = d.resident[p].replace(t) {
                        d.exe.recycle(vec![old]);
                    }
                }
            } else {
                d.exe.recycle(staged.into_iter().map(|(_, t)| t).collect());
                d.out.clear();
                d.feed.clear();
            }
        }
    }
}
