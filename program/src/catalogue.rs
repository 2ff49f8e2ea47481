//! The kernel catalogue: which device types can run which ops at which dtypes — what
//! TensorFlow's kernel registry tells its placer. The strategy crate turns it into
//! the placer's `OpRegistry` for a program's instructions.

use meshwork_types::DType;

use crate::op::Op;
use crate::program::{Instr, Program};

/// The kernels of one device type: the op kinds (by [`Op::name`]) and dtypes it runs,
/// and their priority over other device types' kernels (higher first, as TF's kernel
/// priorities).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernels {
    device_type: String,
    ops: Option<Vec<String>>,
    dtypes: Option<Vec<DType>>,
    without: Vec<(String, DType)>,
    priority: i32,
}

impl Kernels {
    /// Kernels for every op at every dtype on `device_type` (`CPU`, `GPU`, …).
    pub fn new(device_type: &str) -> Kernels {
        Kernels {
            device_type: device_type.to_string(),
            ops: None,
            dtypes: None,
            without: Vec::new(),
            priority: 0,
        }
    }

    /// Only these op kinds (names as [`Op::name`] prints them).
    pub fn only_ops(mut self, ops: &[&str]) -> Kernels {
        self.ops = Some(ops.iter().map(|s| (*s).to_string()).collect());
        self
    }

    /// Only at these dtypes (a TPU-like device without `f64`, say).
    pub fn only_dtypes(mut self, dtypes: &[DType]) -> Kernels {
        self.dtypes = Some(dtypes.to_vec());
        self
    }

    /// No kernel for op kind `op` at `dtype`.
    pub fn without(mut self, op: &str, dtype: DType) -> Kernels {
        self.without.push((op.to_string(), dtype));
        self
    }

    /// With kernel priority `priority`.
    pub fn priority(mut self, priority: i32) -> Kernels {
        self.priority = priority;
        self
    }

    /// The device type.
    pub fn device_type(&self) -> &str {
        &self.device_type
    }

    /// Whether it runs op kind `op` at `dtype`.
    pub fn runs(&self, op: &str, dtype: DType) -> bool {
        self.ops.as_ref().is_none_or(|o| o.iter().any(|x| x == op))
            && self.dtypes.as_ref().is_none_or(|d| d.contains(&dtype))
            && !self.without.iter().any(|(o, d)| o == op && *d == dtype)
    }
}

/// Which device types run which instructions.
///
/// ```
/// use meshwork_program::{Builder, Catalogue, Kernels};
/// use meshwork_types::DType;
///
/// // A host CPU, and an accelerator without f64 kernels (as TPUs have none).
/// let catalogue = Catalogue::cpu().with(Kernels::new("TPU").only_dtypes(&[DType::F32, DType::I32]));
/// let mut b = Builder::new();
/// let x = b.param("x", "f64[4]".parse()?)?;
/// let y = b.neg(x)?;
/// let p = b.finish(&[y])?;
/// let neg = p.instr(y).unwrap();
/// let dtype = Catalogue::kernel_dtype(&p, neg);
/// assert_eq!(catalogue.kernels(&neg.op, dtype), vec![("CPU", 0)]);
/// assert_eq!(catalogue.kernels(&neg.op, DType::F32), vec![("CPU", 0), ("TPU", 0)]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalogue {
    kernels: Vec<Kernels>,
}

impl Catalogue {
    /// meshwork's devices: `CPU` runs every op at every dtype (both interpreters do).
    pub fn cpu() -> Catalogue {
        Catalogue { kernels: vec![Kernels::new("CPU")] }
    }

    /// With `kernels` added (replacing those of the same device type).
    pub fn with(mut self, kernels: Kernels) -> Catalogue {
        self.kernels.retain(|k| k.device_type != kernels.device_type);
        self.kernels.push(kernels);
        self
    }

    /// The device types it knows.
    pub fn device_types(&self) -> impl Iterator<Item = &str> {
        self.kernels.iter().map(|k| k.device_type.as_str())
    }

    /// The dtype that selects an instruction's kernel (TensorFlow's type attribute):
    /// the values' dtype for `select` (`T`, not the predicate's bool), the result's
    /// for ops that make a dtype (`one_hot`, `iota`, constants), the wider of source
    /// and destination for `convert` (`Cast` needs kernels for both), otherwise the
    /// first operand's.
    pub fn kernel_dtype(program: &Program, instr: &Instr) -> DType {
        let arg = |k: usize| instr.args.get(k).and_then(|a| program.spec(*a)).map(|s| s.dtype);
        match &instr.op {
            Op::Select => arg(1).unwrap_or(instr.spec.dtype),
            Op::OneHot { .. } | Op::Iota { .. } | Op::Constant { .. } | Op::Literal { .. } => {
                instr.spec.dtype
            }
            Op::Convert { dtype } => match arg(0) {
                Some(src) if src.size_in_bytes() > dtype.size_in_bytes() => src,
                _ => *dtype,
            },
            _ => arg(0).unwrap_or(instr.spec.dtype),
        }
    }

    /// The device types with a kernel for `op` at `dtype`, with their priorities.
    pub fn kernels(&self, op: &Op, dtype: DType) -> Vec<(&str, i32)> {
        self.kernels
            .iter()
            .filter(|k| k.runs(op.name(), dtype))
            .map(|k| (k.device_type.as_str(), k.priority))
            .collect()
    }
}
