//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// How values from several replicas are combined into one.
///
/// Text form: `sum`, `mean`, `min`, `max`. Parsing ignores ASCII case, so TensorFlow's
/// `SUM` and `MEAN` read as expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (a sum divided by the number of contributions).
    Mean,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    /// Every reduce op.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max];

    /// The canonical name, as printed by `Display`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        ReduceOp::ALL
            .into_iter()
            .find(|op| op.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownReduceOp { name: s.to_owned() })
    }
}
