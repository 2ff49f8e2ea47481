//! The cost of a placed program's instructions: work counted from the program (matmul
//! FLOPs, elements, transcendental elements, bytes), times kernel rates per device type,
//! and transfers over a link — the placer's [`CostModel`](meshwork_placer::CostModel)
//! for [`place_program`](super::place_program) with a cost. The rates and the link are
//! the caller's to give: measured on the machine (the strategy crate times its
//! interpreter and its devices), or fixed.

use std::collections::HashMap;

use meshwork_placer::{CostModel, Device, Graph, NodeId};
use meshwork_program::{Binary, Instr, Op, Program, Unary};
use meshwork_types::{DType, TensorSpec};

use super::ProgramGraph;

/// Bytes of a dense tensor of `spec` (saturating).
pub fn spec_bytes(spec: &TensorSpec) -> u64 {
    spec.byte_size().map_or(u64::MAX, |b| b as u64)
}

/// What one instruction does, counted from its op and operand shapes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Work {
    /// Multiply-add FLOPs of contractions (`dot_general`, convolutions): 2 per
    /// multiply-add.
    pub matmul_flops: f64,
    /// Elements produced or read by cheap elementwise, data-movement and reduction
    /// kernels.
    pub elements: f64,
    /// Elements through a transcendental function (`exp`, `tanh`, `log`, `pow`, GELU,
    /// …; softmax counts one per element).
    pub transcendentals: f64,
    /// Whether the work is double precision (64-bit elements), which runs at the
    /// device's f64 rates.
    pub wide: bool,
}

impl Work {
    /// No work at all.
    pub fn is_empty(&self) -> bool {
        self.matmul_flops == 0.0 && self.elements == 0.0 && self.transcendentals == 0.0
    }
}

/// The work of `instr`, an instruction of `program`.
pub fn work(program: &Program, instr: &Instr) -> Work {
    let elems = |spec: &TensorSpec| spec.shape.num_elements() as f64;
    let arg = |k: usize| program.spec(instr.args[k]).map(|s| (elems(s), s.shape.dims().to_vec()));
    let out = elems(&instr.spec);
    let wide = matches!(
        instr.args.first().and_then(|a| program.spec(*a)).map_or(instr.spec.dtype, |s| s.dtype),
        DType::F64 | DType::I64 | DType::U64
    );
    let mut w = Work { wide, ..Work::default() };
    match &instr.op {
        Op::Unary(u) => match u {
            Unary::Neg
            | Unary::Abs
            | Unary::Square
            | Unary::Relu
            | Unary::StopGradient
            | Unary::Barrier => {
                w.elements = out;
            }
            _ => w.transcendentals = out,
        },
        Op::Binary(Binary::Pow) => w.transcendentals = out,
        Op::DotGeneral { lhs_contract, .. } => {
            let contract: f64 =
                arg(0).map_or(1.0, |(_, d)| lhs_contract.iter().map(|&a| d[a] as f64).product());
            w.matmul_flops = 2.0 * out * contract;
        }
        Op::Conv2d { .. } => {
            // Per output element, a multiply-add over the filter's window and inputs.
            let per = arg(1).map_or(0.0, |(n, d)| n / d[3].max(1) as f64);
            w.matmul_flops = 2.0 * out * per;
        }
        Op::Conv2dBackpropInput { .. } => {
            let (g, per) = (
                arg(0).map_or(0.0, |(n, _)| n),
                arg(1).map_or(0.0, |(n, d)| n / d[3].max(1) as f64),
            );
            w.matmul_flops = 2.0 * g * per;
        }
        Op::Conv2dBackpropFilter { filter, .. } => {
            let g = arg(1).map_or(0.0, |(n, _)| n);
            let per = filter.iter().product::<usize>() as f64 / filter[3].max(1) as f64;
            w.matmul_flops = 2.0 * g * per;
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } => {
            w.transcendentals = out;
            w.elements = 3.0 * out;
        }
        Op::Attention(_) | Op::AttentionGrad { .. } => {
            // Two products over [B,H,Tq,Tk] scores, softmax over them. Its gradient is
            // three ops (of q, k, v) that run as one: the scores again and four
            // products, a third of those five each.
            let (q, qd) = arg(0).unwrap_or_default();
            let tk = arg(1).map_or(1, |(_, d)| d.get(2).copied().unwrap_or(1)) as f64;
            let d = qd.get(3).copied().unwrap_or(1).max(1) as f64;
            let scores = q / d * tk;
            let products = if matches!(instr.op, Op::Attention(_)) { 2.0 } else { 5.0 / 3.0 };
            w.matmul_flops = 2.0 * products * scores * d;
            w.transcendentals = scores;
            w.elements = 3.0 * scores;
        }
        Op::CrossEntropy | Op::CrossEntropyGrad => {
            // As its definition runs (XLA inlines it): a log-softmax over the logits
            // and a pass with the one-hot row; the gradient an exponential of the
            // log-softmax again and two passes more.
            let logits = arg(0).map_or(0.0, |(n, _)| n);
            let forward = matches!(instr.op, Op::CrossEntropy);
            w.transcendentals = if forward { logits } else { 2.0 * logits };
            w.elements = if forward { 4.0 * logits } else { 6.0 * logits };
        }
        Op::Reduce { .. } | Op::ScatterAdd { .. } | Op::Argmax { .. } => {
            w.elements = arg(0).map_or(out, |(n, _)| n).max(out);
        }
        Op::Send { .. } | Op::Recv { .. } | Op::Emit { .. } => {}
        _ => w.elements = out,
    }
    w
}

/// How fast a device type runs each kind of work, for one precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Matmul FLOPs per second.
    pub matmul_flops: f64,
    /// Cheap elements per second.
    pub elements: f64,
    /// Transcendental elements per second.
    pub transcendentals: f64,
    /// Seconds every instruction costs on top (dispatch).
    pub overhead: f64,
}

impl Rates {
    /// Seconds `work` takes at these rates.
    pub fn seconds(&self, work: &Work) -> f64 {
        self.overhead
            + work.matmul_flops / self.matmul_flops
            + work.elements / self.elements
            + work.transcendentals / self.transcendentals
    }
}

/// A device type's rates in single (32-bit and narrower) and double precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceRates {
    /// Rates of 32-bit and narrower work.
    pub single: Rates,
    /// Rates of 64-bit work.
    pub double: Rates,
}

impl DeviceRates {
    /// The rates `work` runs at.
    pub fn of(&self, work: &Work) -> &Rates {
        if work.wide { &self.double } else { &self.single }
    }
}

/// The cost model of placed programs: kernel rates per device type, one link between
/// any two devices, a memory cap per device.
///
/// Memory is counted as TensorFlow's cost-aware placers (Baechi's m-ETF) count it: a
/// variable's and a fed parameter's bytes, and every value an instruction computes, as
/// if all were live at once — an upper bound on what a device holds during a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramCost {
    /// Rates per device type (`CPU`, `TPU`, …); types not listed run at `default_rates`.
    pub rates: HashMap<String, DeviceRates>,
    /// Rates of unlisted device types.
    pub default_rates: DeviceRates,
    /// Bytes per second between two devices.
    pub bandwidth: f64,
    /// Seconds per transfer between two devices.
    pub latency: f64,
    /// Memory per device (by full name); unlisted devices have `default_capacity`.
    pub capacity: HashMap<String, u64>,
    /// Memory of unlisted devices.
    pub default_capacity: u64,
}

impl ProgramCost {
    /// One set of rates for every device type, a link, no memory cap.
    pub fn uniform(rates: DeviceRates, bandwidth: f64, latency: f64) -> ProgramCost {
        ProgramCost {
            rates: HashMap::new(),
            default_rates: rates,
            bandwidth,
            latency,
            capacity: HashMap::new(),
            default_capacity: u64::MAX,
        }
    }

    /// Every device capped at `bytes`.
    pub fn with_capacity(mut self, bytes: u64) -> ProgramCost {
        self.default_capacity = bytes;
        self
    }

    /// The rates of `device_type`.
    pub fn rates(&self, device_type: &str) -> &DeviceRates {
        self.rates.get(device_type).unwrap_or(&self.default_rates)
    }

    /// The estimated seconds `program`'s instructions take run one after another on
    /// one device of `device_type` (no transfers).
    pub fn serial_seconds(&self, program: &Program, device_type: &str) -> f64 {
        let rates = self.rates(device_type);
        program
            .instrs()
            .iter()
            .map(|i| {
                let w = work(program, i);
                rates.of(&w).seconds(&w)
            })
            .sum()
    }
}

/// A node's work, the bytes it keeps on its device and sends along each out-edge.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct NodeWork {
    pub(crate) work: Work,
    pub(crate) memory: u64,
    pub(crate) output: u64,
}

/// A [`ProgramCost`] over one program's placer graph.
pub(crate) struct NodeCosts<'a> {
    pub(crate) cost: &'a ProgramCost,
    pub(crate) graph: &'a ProgramGraph,
}

impl CostModel for NodeCosts<'_> {
    fn compute(&self, _: &Graph, node: NodeId, device: &Device) -> f64 {
        let w = &self.graph.works[node.index()].work;
        if w.is_empty() {
            return 0.0; // parameters, variables and their reads and assignments
        }
        self.cost.rates(device.device_type()).of(w).seconds(w)
    }

    fn memory(&self, _: &Graph, node: NodeId) -> u64 {
        self.graph.works[node.index()].memory
    }

    fn output_bytes(&self, _: &Graph, node: NodeId) -> u64 {
        self.graph.works[node.index()].output
    }

    fn transfer(&self, bytes: u64, from: &Device, to: &Device) -> f64 {
        if from.name() == to.name() {
            0.0
        } else {
            self.cost.latency + bytes as f64 / self.cost.bandwidth
        }
    }

    fn capacity(&self, device: &Device) -> u64 {
        self.cost.capacity.get(device.name()).copied().unwrap_or(self.cost.default_capacity)
    }
}
