//! Model code with value handles and operators: a [`Graph`] is a [`Builder`] behind a
//! shared handle, and a [`Var`] is one of its values that knows its graph, so
//! instructions chain as methods and `+ - * /` work on them.
//!
//! Operators return [`Result<Var>`](crate::Result), as candle's tensors do: a shape or
//! dtype mismatch is the same typed error [`Builder`] gives, at the line that made it.
//! The `Result` of one operator is accepted as either operand beside a `Var`, so
//! `(x.matmul(w)? + b)?.relu()?` and `x * 2.0 + y` read as they would in JAX (two
//! `Result`s, or a `Result` and an `f64`, need a `?` on one side: Rust's orphan rule).

use std::cell::RefCell;
use std::fmt;
use std::ops::{Add, Div, Mul, Neg, Sub};

use meshwork_types::{DType, ReduceOp, TensorSpec};

use crate::builder::Builder;
use crate::op::Padding;
use crate::program::{Program, Value};
use crate::{Error, Result};

/// A program under construction that hands out [`Var`]s.
///
/// ```
/// use meshwork_program::{Builder, Graph, Result, Value};
///
/// // A layer written against the builder, as `meshwork-nn`'s are.
/// fn scaled_tanh(b: &mut Builder, x: Value) -> Result<Value> {
///     let s = b.param("scale", "f32[16]".parse()?)?;
///     let t = b.tanh(x)?;
///     b.mul(t, s)
/// }
///
/// let g = Graph::new();
/// let x = g.param("x", "f32[8,4]".parse()?)?;
/// let y = g.scope("layer", |g| {
///     let w = g.param("w", "f32[4,16]".parse()?)?;
///     let b = g.param("b", "f32[16]".parse()?)?;
///     (x.matmul(w)? + b)?.relu()
/// })?;
/// // Layers written against the builder take part too.
/// let y = g.scope("ln", |g| g.apply(|b| scaled_tanh(b, y.value())))?;
/// let loss = (y * y)?.reduce_mean(&[0, 1], false)?;
/// let p = g.finish(&[loss])?;
/// assert_eq!(p.params()[2].name, "layer.b");
/// assert_eq!(p.params()[3].name, "ln.scale");
/// assert!(p.to_string().contains("relu("));
/// // A mismatch is a typed error, not a panic.
/// assert!((x + y).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Default)]
pub struct Graph {
    b: RefCell<Builder>,
    /// Programs finished so far: a handle made before the last `finish` is refused.
    generation: std::cell::Cell<u64>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// A parameter named `name` (within the current scopes) of `spec`.
    pub fn param(&self, name: &str, spec: TensorSpec) -> Result<Var<'_>> {
        self.make("param", |b| b.param(name, spec))
    }

    /// A rank-0 constant.
    pub fn constant(&self, value: f64, dtype: DType) -> Result<Var<'_>> {
        self.make("constant", |b| b.constant(value, dtype))
    }

    /// `0, 1, …` along `axis` of a new `dtype` tensor of `shape`.
    pub fn iota(&self, dtype: DType, shape: &[usize], axis: usize) -> Result<Var<'_>> {
        self.make("iota", |b| b.iota(dtype, shape, axis))
    }

    /// Runs `f` with `name` appended to the scope (see [`Builder::scope`]).
    pub fn scope<'g, T>(&'g self, name: &str, f: impl FnOnce(&'g Graph) -> Result<T>) -> Result<T> {
        self.builder("scope")?.enter(name);
        let out = f(self);
        // The closure cannot hold the builder past its return: this borrow succeeds.
        if let Ok(mut b) = self.b.try_borrow_mut() {
            b.leave();
        }
        out
    }

    /// The handle of `v`, which must be a value of this graph.
    pub fn var(&self, v: Value) -> Result<Var<'_>> {
        self.builder("var")?.spec(v)?;
        Ok(Var { g: self, v, generation: self.generation.get() })
    }

    /// Runs `f` on the underlying builder: for anything written against [`Builder`].
    /// Handles of this graph cannot be used inside `f` (they answer
    /// [`Error::GraphBusy`]); use `f`'s builder.
    pub fn with<T>(&self, f: impl FnOnce(&mut Builder) -> Result<T>) -> Result<T> {
        f(&mut *self.builder("with")?)
    }

    /// Runs a layer written against [`Builder`] (as `meshwork-nn`'s are) and returns its
    /// result as a handle: `g.apply(|b| meshwork_nn::layer_norm(b, x.value(), 1e-5))`.
    pub fn apply(&self, f: impl FnOnce(&mut Builder) -> Result<Value>) -> Result<Var<'_>> {
        self.make("apply", f)
    }

    /// The program with `results` (see [`Builder::finish`]). The graph is empty
    /// afterwards: handles made before refer to nothing and are refused.
    pub fn finish(&self, results: &[Var<'_>]) -> Result<Program> {
        let values = results
            .iter()
            .map(|r| self.own(*r, "return").map(|r| r.v))
            .collect::<Result<Vec<_>>>()?;
        let program = std::mem::take(&mut *self.builder("finish")?).finish(&values);
        self.generation.set(self.generation.get() + 1);
        program
    }

    fn builder(&self, op: &'static str) -> Result<std::cell::RefMut<'_, Builder>> {
        self.b.try_borrow_mut().map_err(|_| Error::GraphBusy { op })
    }

    fn make(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Builder) -> Result<Value>,
    ) -> Result<Var<'_>> {
        let v = f(&mut *self.builder(op)?)?;
        Ok(Var { g: self, v, generation: self.generation.get() })
    }

    /// `v` if it is a handle of this graph.
    fn own<'g>(&'g self, v: Var<'_>, op: &'static str) -> Result<Var<'g>> {
        if !std::ptr::eq(self, v.g) {
            Err(Error::Type {
                op,
                at: "a graph".into(),
                operands: v.spec().into_iter().collect(),
                problem: "the operand is a value of another graph".into(),
            })
        } else if v.generation != self.generation.get() {
            Err(Error::UndefinedValue {
                at: format!("{op} (a handle from before `finish`)"),
                value: v.v.0,
            })
        } else {
            Ok(Var { g: self, v: v.v, generation: v.generation })
        }
    }
}

/// A value of a [`Graph`]: copyable, with the graph's ops as methods and `+ - * /` and
/// unary `-` as operators (`std::ops`) (NumPy broadcasting; an `f64` operand becomes a constant of
/// the other operand's dtype).
#[derive(Clone, Copy)]
pub struct Var<'g> {
    g: &'g Graph,
    v: Value,
    generation: u64,
}

impl fmt::Debug for Var<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.spec() {
            Ok(spec) => write!(f, "%{}: {spec}", self.v.0),
            Err(_) => write!(f, "%{} (undefined)", self.v.0),
        }
    }
}

impl<'g> Var<'g> {
    /// The value in the program being built.
    pub fn value(self) -> Value {
        self.v
    }

    /// Its graph.
    pub fn graph(self) -> &'g Graph {
        self.g
    }

    /// Its dtype and shape.
    pub fn spec(self) -> Result<TensorSpec> {
        if self.generation != self.g.generation.get() {
            return Err(Error::UndefinedValue {
                at: "spec (a handle from before `finish`)".into(),
                value: self.v.0,
            });
        }
        self.g.builder("spec")?.spec(self.v).cloned()
    }

    /// Its dims.
    pub fn dims(self) -> Result<Vec<usize>> {
        Ok(self.spec()?.shape.dims().to_vec())
    }

    fn then(self, f: impl FnOnce(&mut Builder, Value) -> Result<Value>) -> Result<Var<'g>> {
        let v = self.g.own(self, "var")?.v;
        self.g.make("var", |b| f(b, v))
    }

    fn with2(
        self,
        op: &'static str,
        other: Var<'_>,
        f: impl FnOnce(&mut Builder, Value, Value) -> Result<Value>,
    ) -> Result<Var<'g>> {
        let me = self.g.own(self, op)?;
        let other = self.g.own(other, op)?;
        let (a, c) = (me.v, other.v);
        self.g.make(op, |b| f(b, a, c))
    }

    /// Names the instruction that defines this value (within the current scopes).
    pub fn named(self, name: &str) -> Result<Var<'g>> {
        self.then(|b, v| b.name(v, name))
    }

    /// `self @ rhs` (see [`Builder::matmul`]).
    pub fn matmul(self, rhs: Var<'_>) -> Result<Var<'g>> {
        self.with2("dot_general", rhs, |b, x, y| b.matmul(x, y))
    }

    /// XLA's `dot_general` (see [`Builder::dot_general`]).
    pub fn dot_general(
        self,
        rhs: Var<'_>,
        lhs_contract: &[usize],
        rhs_contract: &[usize],
        lhs_batch: &[usize],
        rhs_batch: &[usize],
    ) -> Result<Var<'g>> {
        self.with2("dot_general", rhs, |b, x, y| {
            b.dot_general(x, y, lhs_contract, rhs_contract, lhs_batch, rhs_batch)
        })
    }

    /// `select(self, on_true, on_false)` for a bool `self`.
    pub fn select(self, on_true: Var<'_>, on_false: Var<'_>) -> Result<Var<'g>> {
        let p = self.g.own(self, "select")?.v;
        let t = self.g.own(on_true, "select")?;
        let f = self.g.own(on_false, "select")?;
        self.g.make("select", |b| b.select(p, t.v, f.v))
    }

    /// The sum over `axes` (negative counts from the end).
    pub fn reduce_sum(self, axes: &[isize], keepdims: bool) -> Result<Var<'g>> {
        self.then(|b, v| b.reduce_sum(v, axes, keepdims))
    }

    /// The maximum over `axes`.
    pub fn reduce_max(self, axes: &[isize], keepdims: bool) -> Result<Var<'g>> {
        self.then(|b, v| b.reduce_max(v, axes, keepdims))
    }

    /// The mean over `axes`.
    pub fn reduce_mean(self, axes: &[isize], keepdims: bool) -> Result<Var<'g>> {
        self.then(|b, v| b.reduce_mean(v, axes, keepdims))
    }

    /// The same elements in `shape`.
    pub fn reshape(self, shape: &[usize]) -> Result<Var<'g>> {
        self.then(|b, v| b.reshape(v, shape))
    }

    /// Output dim `i` is input dim `perm[i]`.
    pub fn transpose(self, perm: &[usize]) -> Result<Var<'g>> {
        self.then(|b, v| b.transpose(v, perm))
    }

    /// NumPy broadcasting to `shape`.
    pub fn broadcast_to(self, shape: &[usize]) -> Result<Var<'g>> {
        self.then(|b, v| b.broadcast_to(v, shape))
    }

    /// `lax.slice`.
    pub fn slice(self, start: &[usize], stop: &[usize], step: &[usize]) -> Result<Var<'g>> {
        self.then(|b, v| b.slice(v, start, stop, step))
    }

    /// `jnp.take(self, indices, axis)`.
    pub fn take(self, indices: Var<'_>, axis: isize) -> Result<Var<'g>> {
        self.with2("take", indices, |b, t, i| b.take(t, i, axis))
    }

    /// One-hot rows of `depth` in `dtype` for integer `self`.
    pub fn one_hot(self, depth: usize, dtype: DType) -> Result<Var<'g>> {
        self.then(|b, v| b.one_hot(v, depth, dtype))
    }

    /// Softmax along `axis`.
    pub fn softmax(self, axis: isize) -> Result<Var<'g>> {
        self.then(|b, v| b.softmax(v, axis))
    }

    /// Log-softmax along `axis`.
    pub fn log_softmax(self, axis: isize) -> Result<Var<'g>> {
        self.then(|b, v| b.log_softmax(v, axis))
    }

    /// Index of the first maximum along `axis`.
    pub fn argmax(self, axis: isize) -> Result<Var<'g>> {
        self.then(|b, v| b.argmax(v, axis))
    }

    /// Elementwise conversion.
    pub fn convert(self, dtype: DType) -> Result<Var<'g>> {
        self.then(|b, v| b.convert(v, dtype))
    }

    /// 2-D convolution of NHWC `self` with HWIO `w`.
    pub fn conv2d(self, w: Var<'_>, strides: [usize; 2], padding: Padding) -> Result<Var<'g>> {
        self.with2("conv2d", w, |b, x, w| b.conv2d(x, w, strides, padding))
    }

    /// All-reduce across each of `groups`.
    pub fn all_reduce(self, op: ReduceOp, groups: &[Vec<usize>]) -> Result<Var<'g>> {
        self.then(|b, v| b.all_reduce(v, op, groups))
    }

    /// Streams this value to the host's consumer `consumer`; returns the token.
    pub fn emit(self, consumer: u32) -> Result<Var<'g>> {
        self.then(|b, v| b.emit(&[v], consumer))
    }

    /// A rank-0 constant of this value's dtype.
    pub fn scalar(self, value: f64) -> Result<Var<'g>> {
        self.then(|b, v| b.scalar_like(v, value))
    }
}

macro_rules! var_unary {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        impl<'g> Var<'g> {$(
            $(#[$doc])*
            pub fn $name(self) -> Result<Var<'g>> {
                self.then(|b, v| b.$name(v))
            }
        )*}
    };
}

var_unary! {
    /// `e^self`.
    exp;
    /// Natural logarithm.
    log;
    /// Hyperbolic tangent.
    tanh;
    /// The sigmoid.
    logistic;
    /// Square root.
    sqrt;
    /// `1 / sqrt(self)`.
    rsqrt;
    /// `|self|`.
    abs;
    /// `self * self`.
    square;
    /// `max(self, 0)`.
    relu;
    /// GELU (tanh approximation).
    gelu;
    /// Sine.
    sin;
    /// Cosine.
    cos;
    /// The identity with a zero gradient.
    stop_gradient;
}

macro_rules! var_binary {
    ($($(#[$doc:meta])* $name:ident => $op:literal;)*) => {
        impl<'g> Var<'g> {$(
            $(#[$doc])*
            pub fn $name(self, other: Var<'_>) -> Result<Var<'g>> {
                self.with2($op, other, |b, x, y| b.$name(x, y))
            }
        )*}
    };
}

var_binary! {
    /// The larger of the two.
    max => "max";
    /// The smaller.
    min => "min";
    /// `self ^ other`.
    pow => "pow";
    /// `self < other`.
    lt => "lt";
    /// `self <= other`.
    le => "le";
    /// `self > other`.
    gt => "gt";
    /// `self >= other`.
    ge => "ge";
    /// `self == other`.
    eq => "eq";
    /// `self != other`.
    ne => "ne";
}

macro_rules! operator {
    ($($trait:ident $method:ident;)*) => {$(
        impl<'g> $trait<Var<'_>> for Var<'g> {
            type Output = Result<Var<'g>>;
            fn $method(self, rhs: Var<'_>) -> Result<Var<'g>> {
                self.with2(stringify!($method), rhs, |b, x, y| b.$method(x, y))
            }
        }

        impl<'g> $trait<Result<Var<'_>>> for Var<'g> {
            type Output = Result<Var<'g>>;
            fn $method(self, rhs: Result<Var<'_>>) -> Result<Var<'g>> {
                self.$method(rhs?)
            }
        }

        impl<'g> $trait<Var<'_>> for Result<Var<'g>> {
            type Output = Result<Var<'g>>;
            fn $method(self, rhs: Var<'_>) -> Result<Var<'g>> {
                self?.$method(rhs)
            }
        }

        impl<'g> $trait<f64> for Var<'g> {
            type Output = Result<Var<'g>>;
            fn $method(self, rhs: f64) -> Result<Var<'g>> {
                self.$method(self.scalar(rhs)?)
            }
        }

        impl<'g> $trait<Var<'g>> for f64 {
            type Output = Result<Var<'g>>;
            fn $method(self, rhs: Var<'g>) -> Result<Var<'g>> {
                rhs.scalar(self)?.$method(rhs)
            }
        }
    )*};
}

operator! {
    Add add;
    Sub sub;
    Mul mul;
    Div div;
}

impl<'g> Neg for Var<'g> {
    type Output = Result<Var<'g>>;
    fn neg(self) -> Result<Var<'g>> {
        self.then(|b, v| b.neg(v))
    }
}
