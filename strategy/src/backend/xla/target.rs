//! XLA for GPUs that are not here: every program the strategy compiles is lowered as
//! the XLA back end lowers it and compiled for a [`Target`] through the CUDA plugin
//! without a device ([`TargetSession`]); what XLA says of each (its memory per
//! device, its optimized HLO) is kept for reports. Its executables plan and check a
//! step; they do not run it.

use std::sync::{Arc, Mutex, PoisonError};

use meshwork_partition::placed::Part;
use meshwork_partition::spmd::Partitioned;
use meshwork_types::{Tensor, TensorSpec};
use meshwork_xla::Plugin;
use meshwork_xla::target::{Target, TargetCompiled, TargetSession};

use super::super::{Backend, Partitioner, PlacedExecutable, SpmdExecutable, Traffic};
use crate::{Error, Result, Strategy};

/// XLA compiling for a GPU target without its devices: position `r` of a mesh is the
/// target's device `r`.
#[derive(Debug, Clone)]
pub struct XlaTarget {
    /// Before the session: the executables go before their topology.
    compiled: Arc<Mutex<Vec<Arc<TargetCompiled>>>>,
    session: Arc<TargetSession>,
    partitioner: Partitioner,
}

impl XlaTarget {
    /// A back end compiling for `target` with `plugin` (the CUDA plugin).
    pub fn new(plugin: &Plugin, target: Target) -> Result<XlaTarget> {
        Ok(XlaTarget {
            compiled: Arc::default(),
            session: Arc::new(TargetSession::new(plugin, target)?),
            partitioner: Partitioner::Meshwork,
        })
    }

    /// This back end with SPMD programs split by `partitioner`.
    pub fn with_partitioner(self, partitioner: Partitioner) -> XlaTarget {
        XlaTarget { partitioner, ..self }
    }

    /// The session: the target and its topology.
    pub fn session(&self) -> &TargetSession {
        &self.session
    }

    /// Every program compiled through this back end, in the order asked (a program
    /// asked twice is listed twice, compiled once).
    pub fn compiled(&self) -> Vec<Arc<TargetCompiled>> {
        self.compiled.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn not_here(&self) -> Error {
        Error::Compiled {
            problem: format!(
                "compiled for {} without its devices: a --target compile plans and checks a step, it does not run it",
                self.session.target().name()
            ),
        }
    }
}

impl Backend for XlaTarget {
    fn name(&self) -> &'static str {
        "xla"
    }

    fn describe(&self) -> String {
        format!("XLA for {} (compiled without its devices)", self.session.target().name())
    }

    fn partitioner(&self) -> Partitioner {
        self.partitioner
    }

    fn cudnn(&self) -> bool {
        self.session.target().cudnn_attention()
    }

    fn compiles(&self) -> u64 {
        self.session.compiles() as u64
    }

    fn compile_spmd(
        &self,
        part: &Partitioned,
        placement: &[usize],
        _resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        let n = placement.len();
        let (program, mut options, _) = super::lowering(self.partitioner, part, n, carry)?;
        options.cudnn_attention = self.cudnn();
        let compiled = self.session.compile(program, &options)?;
        let lowered = &compiled.lowered;
        if !lowered.sends.is_empty() || !lowered.recvs.is_empty() {
            return Err(Error::Compiled {
                problem: "an SPMD program that sends or receives: on XLA, transfers between \
                          devices run in placed programs"
                    .into(),
            });
        }
        self.compiled.lock().unwrap_or_else(PoisonError::into_inner).push(compiled);
        Ok(Box::new(Unrunnable { positions: n, why: self.not_here().to_string() }))
    }

    fn compile_placed(
        &self,
        _parts: &[Part],
        _placement: &[usize],
        _devices: usize,
    ) -> Result<Box<dyn PlacedExecutable>> {
        Err(Error::Compiled {
            problem: format!(
                "--target {} compiles a mesh's step; a pipeline's stages are placed programs, not compiled for a target yet",
                self.session.target().name()
            ),
        })
    }
}

/// A program compiled for devices that are not here: it holds nothing and runs
/// nothing, and says why.
struct Unrunnable {
    positions: usize,
    why: String,
}

impl Unrunnable {
    fn refuse<T>(&self) -> Result<T> {
        Err(Error::Compiled { problem: self.why.clone() })
    }
}

impl SpmdExecutable for Unrunnable {
    fn positions(&self) -> usize {
        self.positions
    }
    fn buffer(&self, _r: usize, _spec: &TensorSpec) -> Result<Tensor> {
        self.refuse()
    }
    fn put(&self, _r: usize, _param: usize, _part: Tensor) -> Result<()> {
        self.refuse()
    }
    fn put_all(&self, _parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        self.refuse()
    }
    fn fetch(&self, _r: usize, _param: usize) -> Result<Option<Tensor>> {
        self.refuse()
    }
    fn is_set(&self, _r: usize, _param: usize) -> bool {
        false
    }
    fn held_bytes(&self, _r: usize, _param: usize) -> Result<Option<u64>> {
        Ok(None)
    }
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
    fn run(
        &self,
        _strategy: &Strategy,
        _feeds: Vec<Vec<Vec<Tensor>>>,
        _tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        self.refuse()
    }
    fn commit(&self, _keep: bool) {}
}
