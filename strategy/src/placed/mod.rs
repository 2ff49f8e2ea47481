//! Placed programs: TensorFlow's placer assigns a program's instructions to devices,
//! and the program runs split across them.
//!
//! A program's device requests ([`Builder::device`](meshwork_program::Builder::device),
//! [`colocate_with`](meshwork_program::Builder::colocate_with)) become a placer
//! [`Graph`](meshwork_placer::Graph): a fed parameter is a `Placeholder`; a parameter the program updates
//! (carried) is a resource variable — a `VarHandleOp`, the `ReadVariableOp` its
//! readers read, and an `AssignVariableOp` per update, requested where the update's
//! instruction is, so TensorFlow's resource-edge rule puts reads and updates with the
//! variable; each instruction is a node of op type `op:dtype` whose kernels the
//! program crate's [`Catalogue`](meshwork_program::Catalogue) lists. [`meshwork_placer::place`] decides (soft
//! placement, colocation groups, TF's errors), then the program is split into one
//! program per device with a `send`/`recv` pair for every value that crosses devices
//! (one transfer per value and destination device, as TensorFlow's partitioner
//! deduplicates), and the pieces run concurrently on the executor's devices as a
//! dataflow: each device's part is cut into segments by the last transfer they wait
//! for, and a device runs the first segment (in program order) whose inputs are
//! there, taking transfers
//! as they arrive — no barrier between layers, no instruction held up behind a
//! transfer it does not need — and a failure on any
//! device ends the run on all of them with that device's error.
//!
//! Variables stay on their devices across steps: a step moves only its feeds in,
//! the values that cross devices between them, and its results out.
//!
//! A `recv` waits at most the executor runtime's timeout (60 s by default; a longer
//! one through [`Strategy::with_runtime`] and
//! [`Runtime::with_timeout`](meshwork_executor::Runtime::with_timeout)), then the
//! step fails with the executor's `Timeout` everywhere — a pipeline whose first stage
//! waits out a long backward needs the longer one.

use std::fmt;
use std::sync::{Mutex, PoisonError};

pub use meshwork_partition::placed::{PlaceOptions, PlacedProgram, ProgramCost, Transfer};
use meshwork_partition::placed::{Sink, Source, place_program};
use meshwork_placer::{CostPlacement, DeviceSet, Explanation};
use meshwork_program::{Program, Tensor, Value};

use crate::backend::PlacedExecutable;
use crate::{Error, Result, Strategy};

mod measure;

/// A program placed on a strategy's devices and split into one program per device.
/// Variables (the carried parameters) stay on their devices between steps.
pub struct Placed<'s> {
    strategy: &'s Strategy,
    /// What the placer decided, and each device's part.
    plan: PlacedProgram,
    /// The parts on the strategy's back end, with the variables.
    exe: Box<dyn PlacedExecutable>,
    /// Per parameter: the (part, slot) of its resident value if it is a variable.
    slot: Vec<Option<(usize, usize)>>,
    /// Per result of the program, whether a step returns it (it is not carried).
    returned: Vec<bool>,
    /// Held while a step runs: one step of a placed program at a time.
    busy: Mutex<()>,
}

impl fmt::Debug for Placed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Placed")
            .field("devices", &self.plan.devices().devices().len())
            .field("parts", &self.plan.parts().len())
            .field("transfers", &self.plan.transfers().len())
            .finish()
    }
}

impl Strategy {
    /// Places `program` on this strategy's devices by TensorFlow's rules and splits it
    /// into one program per device. `carry` pairs (result index, parameter index):
    /// after each step, that result becomes that parameter's value — those
    /// parameters are resource variables, resident on their device (set them with
    /// [`Placed::set`] before the first step); the other parameters are fed.
    pub fn place(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
    ) -> Result<Placed<'_>> {
        self.place_by(program, carry, options, None)
    }

    /// [`place`](Self::place), then devices chosen by cost: TensorFlow's rules decide
    /// which devices each colocation group may use (requests, kernels, resource
    /// edges), and [`meshwork_placer::place_with_cost`] chooses among them by an
    /// estimated schedule under `cost`'s memory caps — so a program without device
    /// scopes spreads over the devices where that is estimated faster, or where one
    /// device's memory would not hold it. The estimate, and TensorFlow's default
    /// placement's under the same model, are [`Placed::estimate`].
    pub fn place_with_cost(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
        cost: &ProgramCost,
    ) -> Result<Placed<'_>> {
        self.place_by(program, carry, options, Some(cost))
    }

    fn place_by(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
        cost: Option<&ProgramCost>,
    ) -> Result<Placed<'_>> {
        if self.is_multi_process() {
            return Err(placed_error(
                String::new(),
                "placed programs run on the devices of one process",
            ));
        }
        let runtime_devices = self.runtime().devices();
        let plan = place_program(program, carry, options, runtime_devices, cost)?;
        let np = program.params().len();
        let mut slot = vec![None; np];
        for (r, part) in plan.parts().iter().enumerate() {
            let mut held = 0;
            for s in &part.sources {
                if let Source::Variable(k) = *s {
                    slot[k] = Some((r, held));
                    held += 1;
                }
            }
        }
        let placement: Vec<usize> = plan.parts().iter().map(|p| p.device).collect();
        // A carried result stays on its device as the variable's next value; only the
        // others come back from a step.
        let carried: Vec<bool> =
            (0..program.results().len()).map(|k| carry.iter().any(|&(r, _)| r == k)).collect();
        let mut parts = plan.parts().to_vec();
        for part in &mut parts {
            for sink in &mut part.sinks {
                if matches!(*sink, Sink::Result(k) if carried[k]) {
                    *sink = Sink::Token;
                }
            }
        }
        let returned = carried.iter().map(|&c| !c).collect();
        let exe = self.backend().compile_placed(&parts, &placement, runtime_devices)?;
        Ok(Placed { strategy: self, plan, exe, slot, returned, busy: Mutex::new(()) })
    }
}

impl Placed<'_> {
    /// What the placer decided and each device's part: device names, placement,
    /// transfers, the cost estimate, explanations.
    pub fn plan(&self) -> &PlacedProgram {
        &self.plan
    }

    /// The device names, in the order device indices count them.
    pub fn devices(&self) -> &DeviceSet {
        self.plan.devices()
    }

    /// The device index value `v` is placed on.
    pub fn device_index(&self, v: Value) -> Option<usize> {
        self.plan.device_index(v)
    }

    /// The name of the device value `v` is placed on.
    pub fn device(&self, v: Value) -> Option<&str> {
        self.plan.device(v)
    }

    /// Every transfer a step makes (one per value and reading device).
    pub fn transfers(&self) -> &[Transfer] {
        self.plan.transfers()
    }

    /// Bytes a step moves between devices.
    pub fn transfer_bytes(&self) -> u64 {
        self.plan.transfer_bytes()
    }

    /// Each device's program, with the device index it runs on.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &Program)> {
        self.plan.parts().iter().map(|p| (p.device, &p.program))
    }

    /// The cost model's estimate, when [`Strategy::place_with_cost`] placed the
    /// program ([`PlacedProgram::estimate`]).
    pub fn estimate(&self) -> Option<&CostPlacement> {
        self.plan.estimate()
    }

    /// Why TensorFlow's rules put the node of value `v` where they did
    /// ([`PlacedProgram::explain`]).
    pub fn explain(&self, v: Value) -> Result<Explanation> {
        Ok(self.plan.explain(v)?)
    }

    /// The placed graph in Graphviz's DOT language, one cluster per device.
    pub fn to_dot(&self) -> String {
        self.plan.to_dot()
    }

    /// The names of the variables (carried parameters).
    pub fn variables(&self) -> Vec<&str> {
        self.plan
            .program()
            .params()
            .iter()
            .zip(&self.slot)
            .filter(|(_, s)| s.is_some())
            .map(|(p, _)| p.name.as_str())
            .collect()
    }

    /// Variable `name`'s parameter index and (part, slot).
    fn variable(&self, name: &str) -> Result<(usize, usize, usize)> {
        self.plan
            .program()
            .params()
            .iter()
            .position(|p| p.name == name)
            .and_then(|k| self.slot[k].map(|(r, j)| (k, r, j)))
            .ok_or_else(|| placed_error(name.to_string(), "not a variable of the placed program"))
    }

    /// Sets variable `name` (kept on its device).
    pub fn set(&self, name: &str, value: Tensor) -> Result<()> {
        let (k, r, j) = self.variable(name)?;
        let spec = &self.plan.program().params()[k].spec;
        if value.spec() != *spec {
            return Err(placed_error(
                name.to_string(),
                format!("set to {}, the variable is {spec}", value.spec()),
            ));
        }
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        self.exe.put(r, j, value)
    }

    /// The device (index into [`devices`](Self::devices)) holding variable `name` and
    /// the bytes it takes there, as its back end reports them.
    pub fn held_bytes(&self, name: &str) -> Result<(usize, u64)> {
        let (_, r, j) = self.variable(name)?;
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = self
            .exe
            .held_bytes(r, j)?
            .ok_or_else(|| placed_error(name.to_string(), "has no value yet"))?;
        Ok((self.plan.parts()[r].device, bytes))
    }

    /// What its steps moved so far, as its back end counted it.
    pub fn traffic(&self) -> crate::backend::Traffic {
        self.exe.traffic()
    }

    /// Variable `name`'s current value.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        let (_, r, j) = self.variable(name)?;
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        self.exe.fetch(r, j)?.ok_or_else(|| placed_error(name.to_string(), "has no value yet"))
    }

    /// Runs one step: `feeds` are the fed parameters in order; returns the program's
    /// results that are not carried, in order (as a compiled SPMD step does). Carried
    /// results become the variables' values, on their devices, only if every device
    /// finished the step; a step that fails anywhere leaves them as they were.
    pub fn step(&self, feeds: &[Tensor]) -> Result<Vec<Tensor>> {
        if feeds.len() != self.plan.feeds().len() {
            return Err(placed_error(
                String::new(),
                format!("{} feeds for {} fed parameters", feeds.len(), self.plan.feeds().len()),
            ));
        }
        for (t, &k) in feeds.iter().zip(self.plan.feeds()) {
            let p = &self.plan.program().params()[k];
            if t.spec() != p.spec {
                return Err(placed_error(
                    p.name.clone(),
                    format!("fed {}, the parameter is {}", t.spec(), p.spec),
                ));
            }
        }
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, p) in self.plan.program().params().iter().enumerate() {
            if let Some((r, j)) = self.slot[k]
                && !self.exe.is_set(r, j)
            {
                return Err(placed_error(
                    p.name.clone(),
                    "has no value yet: set it before the first step",
                ));
            }
        }
        // Each device's feeds, moved to it; its variables are read in place there.
        let feeds_of: Vec<Vec<Tensor>> = self
            .plan
            .parts()
            .iter()
            .map(|part| {
                part.sources
                    .iter()
                    .filter_map(|s| match *s {
                        Source::Feed(f) => Some(feeds[f].clone()),
                        Source::Variable(_) => None,
                    })
                    .collect()
            })
            .collect();
        let outs = self.exe.run(self.strategy, feeds_of)?;
        // Every device finished (its updates kept on the devices): the results out.
        let mut results: Vec<Option<Tensor>> = vec![None; self.plan.program().results().len()];
        for (part, out) in self.plan.parts().iter().zip(outs) {
            // The results the back end returns: those not carried, as compiled.
            let sinks = part.sinks.iter().filter_map(|s| match *s {
                Sink::Result(k) if self.returned[k] => Some(k),
                Sink::Result(_) | Sink::Update(_) | Sink::Token => None,
            });
            for (k, t) in sinks.zip(out) {
                results[k] = Some(t);
            }
        }
        results
            .into_iter()
            .zip(&self.returned)
            .filter(|(_, r)| **r)
            .map(|(t, _)| {
                t.ok_or_else(|| placed_error(String::new(), "a result no device returned"))
            })
            .collect()
    }
}

/// The placed-program error about `value`.
fn placed_error(value: impl Into<String>, problem: impl Into<String>) -> Error {
    meshwork_partition::Error::Placed { value: value.into(), problem: problem.into() }.into()
}

impl fmt::Display for Placed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.plan.fmt(f)
    }
}
