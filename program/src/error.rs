//! The program crate's error type.

use meshwork_types::{DType, TensorSpec};

/// Everything that can go wrong building or checking a program.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value was invalid (a shape whose element count overflows).
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// An instruction whose operands or attributes its op cannot take.
    #[error("{op}({}) at {at}: {problem}", specs(operands))]
    Type {
        /// The op.
        op: &'static str,
        /// Where: the instruction's value (`%7`) and name, if any.
        at: String,
        /// The operands' specs.
        operands: Vec<TensorSpec>,
        /// What does not fit.
        problem: String,
    },
    /// A dtype programs do not compute in (they use f32, f64, i32, i64 and bool).
    #[error("{at}: dtype {dtype} is not one of f32, f64, i32, i64, bool")]
    UnsupportedDType {
        /// Where.
        at: String,
        /// The dtype.
        dtype: DType,
    },
    /// A value used before it is defined, or not defined in this program at all.
    #[error("{at} uses %{value}, which is not defined before it")]
    UndefinedValue {
        /// The instruction (or `return`) using it.
        at: String,
        /// The value's number.
        value: u32,
    },
    /// Two parameters or named values with one name.
    #[error("the name {name:?} is given twice")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A tensor whose element count is not its shape's.
    #[error("{elements} elements for shape {shape:?}")]
    TensorSize {
        /// The shape.
        shape: Vec<usize>,
        /// The elements given.
        elements: usize,
    },
    /// Inputs that do not match the program's parameters.
    #[error("{actual} inputs for {expected} parameters: {problem}")]
    Inputs {
        /// Parameters.
        expected: usize,
        /// Inputs given.
        actual: usize,
        /// What does not match.
        problem: String,
    },
    /// An instruction that cannot compute its result on these values (an index out of
    /// range, an integer division by zero, an op that needs other devices).
    #[error("{at}: {problem}")]
    Runtime {
        /// The instruction.
        at: String,
        /// What went wrong.
        problem: String,
    },
    /// A collective, channel or host consumer failed for an instruction (the peer's
    /// or the implementation's message).
    #[error("{at}: {problem}")]
    Communication {
        /// The instruction.
        at: String,
        /// What the implementation reported.
        problem: String,
    },
    /// Program text that does not read: the line, its text and what is wrong.
    #[error("line {line}: {problem}: {text:?}")]
    Parse {
        /// The line (from 1).
        line: usize,
        /// The line's text.
        text: String,
        /// What is wrong.
        problem: String,
    },
    /// A gradient asked for where there is none: of an integer or bool value, of a
    /// value that is not a parameter, or of a loss that is not a float scalar.
    #[error("no gradient for %{value}: {problem}")]
    NoGradient {
        /// The value.
        value: u32,
        /// Why.
        problem: String,
    },
    /// An op that autodiff cannot transpose yet.
    #[error("%{value}: autodiff has no transpose rule for {op} yet")]
    NoTransposeRule {
        /// The op.
        op: &'static str,
        /// The instruction's value.
        value: u32,
    },
    /// A program with no results.
    #[error("a program must return at least one value")]
    NoResults,
    /// A device request that cannot be recorded: a device spec (`/device:CPU:1`,
    /// `CPU:1`) is ASCII without spaces, quotes, commas or braces, so it prints and
    /// reads back in the text form.
    #[error("the device {device:?} cannot be requested: {problem}")]
    BadDevice {
        /// The request.
        device: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A parameter or instruction name the text form could not read back.
    #[error("the name {name:?} cannot be used: {problem}")]
    BadName {
        /// The name (within its scopes).
        name: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A [`Graph`](crate::Graph) used from inside its own [`Graph::with`](crate::Graph::with)
    /// closure, while its builder is lent out.
    #[error("{op}: the graph's builder is in use by an enclosing `Graph::with`")]
    GraphBusy {
        /// What was attempted.
        op: &'static str,
    },
}

fn specs(operands: &[TensorSpec]) -> String {
    operands.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `Result` with the program crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
