//! Building programs from Rust: every instruction is checked and its result's spec
//! inferred as it is added, so a mistake is a typed error at the line that made it.

use std::collections::{HashMap, HashSet};

use meshwork_types::{DType, ReduceOp, Shape, TensorSpec};

use crate::infer::{infer, supported};
use crate::op::{Binary, Compare, Op, Padding, Reduction, Unary};
use crate::program::{Instr, Param, Program, Value};
use crate::{Error, Result};

/// Builds a [`Program`]. Parameters first or interleaved with instructions; values are
/// handles ([`Value`]) into the program being built.
///
/// ```
/// use meshwork_program::Builder;
///
/// let mut b = Builder::new();
/// let x = b.param("x", "f32[8,4]".parse()?)?;
/// let y = b.scope("layer", |b| {
///     let w = b.param("w", "f32[4,16]".parse()?)?;
///     let h = b.matmul(x, w)?;
///     b.relu(h)
/// })?;
/// let p = b.finish(&[y])?;
/// assert_eq!(p.spec(y).unwrap().to_string(), "f32[8,16]");
/// assert_eq!(p.params()[1].name, "layer.w");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Default)]
pub struct Builder {
    params: Vec<Param>,
    /// Instructions with their result's value number (parameters may come between).
    instrs: Vec<(Value, Instr)>,
    specs: Vec<TensorSpec>,
    scope: Vec<String>,
    names: HashSet<String>,
    /// The device request of the enclosing `device` scopes (empty for none).
    device: String,
    /// The values of the enclosing `colocate_with` scopes.
    colocation: Vec<Value>,
    /// The value of each parameter.
    param_values: Vec<Value>,
    /// Inside [`reuse_params`](Builder::reuse_params).
    reuse: bool,
    /// Reused parameters' reads on other devices: (parameter, device) → its copy.
    reads: HashMap<(Value, String), Value>,
    /// Each [`scope`](Builder::scope) closed so far: its full name and the range of
    /// instruction indices added inside it.
    spans: Vec<(String, std::ops::Range<usize>)>,
    /// The dtype products compute in inside [`matmuls_in`](Builder::matmuls_in).
    matmul_dtype: Option<DType>,
}

impl Builder {
    /// An empty builder.
    pub fn new() -> Builder {
        Builder::default()
    }

    /// A builder holding `program`'s parameters and instructions (names included), to
    /// add to: `Value(k)` of the program is `Value(k)` here. What a training step adds
    /// to a gradient program, and second-order autodiff to a first-order one.
    pub fn from_program(program: &Program) -> Result<Builder> {
        let mut b = Builder::new();
        for p in program.params() {
            b.param(&p.name, p.spec.clone())?;
            if let Some(last) = b.params.last_mut() {
                last.device.clone_from(&p.device);
            }
        }
        for instr in program.instrs() {
            b.push(instr.op.clone(), &instr.args)?;
            let full = instr.name.as_ref().map(|n| b.claim(n.clone())).transpose()?;
            if let Some((_, last)) = b.instrs.last_mut() {
                last.name = full;
                last.device.clone_from(&instr.device);
                last.colocate.clone_from(&instr.colocate);
            }
        }
        Ok(b)
    }

    fn at(&self, op: &str) -> String {
        format!("%{} ({op})", self.specs.len())
    }

    fn scoped(&self, name: &str) -> String {
        if self.scope.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.scope.join("."))
        }
    }

    fn claim(&mut self, name: String) -> Result<String> {
        // Names print quoted (escaped) on one line of the text form, and must read back.
        let problem = if name.is_empty() {
            Some("a name is not empty")
        } else if name.trim() != name {
            Some("a name neither starts nor ends with whitespace")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(Error::BadName { name, problem });
        }
        if !self.names.insert(name.clone()) {
            return Err(Error::DuplicateName { name });
        }
        Ok(name)
    }

    /// Instructions added so far: the index the next one will have in the finished
    /// program (whose instructions keep their order), so that `start..instr_count()`
    /// around a block names its instructions ([`grad_remat`](crate::grad_remat)'s
    /// regions).
    pub fn instr_count(&self) -> usize {
        self.instrs.len()
    }

    /// The spec of `v`.
    pub fn spec(&self, v: Value) -> Result<&TensorSpec> {
        self.specs
            .get(v.index())
            .ok_or(Error::UndefinedValue { at: "the builder".into(), value: v.0 })
    }

    /// A parameter named `name` (within the current scopes) of `spec`. Inside
    /// [`reuse_params`](Self::reuse_params), an existing parameter of that name is
    /// returned instead (read on the current device).
    pub fn param(&mut self, name: &str, spec: TensorSpec) -> Result<Value> {
        if self.reuse
            && let Some(v) = self.reused(&self.scoped(name), &spec)?
        {
            return Ok(v);
        }
        let name = self.claim(self.scoped(name))?;
        if !supported(spec.dtype) {
            return Err(Error::UnsupportedDType {
                at: format!("param {name:?}"),
                dtype: spec.dtype,
            });
        }
        if let Err(problem) = crate::infer::strides_fit(spec.shape.dims()) {
            return Err(Error::Type {
                op: "param",
                at: format!("param {name:?}"),
                operands: vec![spec],
                problem,
            });
        }
        let v = Value(self.specs.len() as u32);
        self.specs.push(spec.clone());
        self.params.push(Param { name, spec, device: self.device.clone() });
        self.param_values.push(v);
        Ok(v)
    }

    /// Runs `f` with parameters shared, as TensorFlow's
    /// `variable_scope(reuse=AUTO_REUSE)`: a parameter `f` declares under a name the
    /// program already has is that parameter (its spec must match), so a model applied
    /// to several micro-batches, or by several replicas, has one set of weights. A
    /// parameter reused under a device request other than its own is read there once
    /// — a copy on that device ([`identity`](Self::identity)) that every later reuse
    /// on the device shares, as `variable_scope`'s `caching_device` reads a variable
    /// once per tower — so its readers on that device and their gradients (summed
    /// there first) cross devices once per step.
    ///
    /// ```
    /// use meshwork_program::Builder;
    ///
    /// let mut b = Builder::new();
    /// let x = b.param("x", "f32[3]".parse()?)?;
    /// let (y, z) = b.reuse_params(|b| {
    ///     let w = b.param("w", "f32[3]".parse()?)?;
    ///     let y = b.mul(x, w)?;
    ///     let w2 = b.device("CPU:1", |b| b.param("w", "f32[3]".parse()?))?;
    ///     Ok((y, b.device("CPU:1", |b| b.mul(y, w2))?))
    /// })?;
    /// let p = b.finish(&[y, z])?;
    /// assert_eq!(p.params().len(), 2, "one w, read on CPU:1 through a copy");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reuse_params<T>(&mut self, f: impl FnOnce(&mut Builder) -> Result<T>) -> Result<T> {
        let outer = std::mem::replace(&mut self.reuse, true);
        let out = f(self);
        self.reuse = outer;
        out
    }

    /// The existing parameter `name` (full name) if there is one, read on the current
    /// device request.
    fn reused(&mut self, name: &str, spec: &TensorSpec) -> Result<Option<Value>> {
        let Some(k) = self.params.iter().position(|p| p.name == name) else { return Ok(None) };
        let v = self.param_values[k];
        if self.params[k].spec != *spec {
            return Err(Error::Type {
                op: "param",
                at: format!("param {name:?}"),
                operands: vec![self.params[k].spec.clone(), spec.clone()],
                problem: "reused with a different spec".into(),
            });
        }
        if self.device.is_empty() || self.device == self.params[k].device {
            return Ok(Some(v));
        }
        let key = (v, self.device.clone());
        if let Some(&copy) = self.reads.get(&key) {
            return Ok(Some(copy));
        }
        let copy = self.identity(v)?;
        self.reads.insert(key, copy);
        Ok(Some(copy))
    }

    /// Runs `f` with what it makes — instructions and parameters — requested on
    /// `device` (TensorFlow's `tf.device`): a device spec such as `/device:CPU:1`,
    /// `/job:worker/task:1` or the local form `CPU:1`. Scopes nest as TensorFlow's do:
    /// the inner spec's fields (job, replica, task, device) replace the outer's and
    /// the others are kept; `""` clears the request. The placer resolves requests
    /// (see `meshwork-strategy`'s placed programs); interpreters ignore them.
    ///
    /// ```
    /// use meshwork_program::Builder;
    ///
    /// let mut b = Builder::new();
    /// let x = b.param("x", "f32[4]".parse()?)?;
    /// let y = b.device("/job:localhost/device:CPU:0", |b| b.device("CPU:1", |b| b.neg(x)))?;
    /// let p = b.finish(&[y])?;
    /// assert_eq!(p.instr(y).unwrap().device, "/job:localhost/device:CPU:1");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn device<T>(
        &mut self,
        device: &str,
        f: impl FnOnce(&mut Builder) -> Result<T>,
    ) -> Result<T> {
        let inner =
            if device.is_empty() { String::new() } else { merge_device(&self.device, device)? };
        let outer = std::mem::replace(&mut self.device, inner);
        let out = f(self);
        self.device = outer;
        out
    }

    /// Runs `f` with every instruction it makes colocated with `v` (TensorFlow's
    /// `colocate_with`): placed on the device `v` is placed on. As in TensorFlow, the
    /// enclosing device scopes give way to `v`'s own request inside (a `device` scope
    /// opened within still applies), and nested scopes colocate with every value of
    /// the stack.
    pub fn colocate_with<T>(
        &mut self,
        v: Value,
        f: impl FnOnce(&mut Builder) -> Result<T>,
    ) -> Result<T> {
        let device = self.device_of(v)?.to_string();
        let outer = std::mem::replace(&mut self.device, device);
        self.colocation.push(v);
        let out = f(self);
        self.colocation.pop();
        self.device = outer;
        out
    }

    /// Requests that the instruction or parameter defining `v` runs on `device`
    /// (replacing any request it had; `""` clears it).
    pub fn set_device(&mut self, v: Value, device: &str) -> Result<Value> {
        let device = if device.is_empty() { String::new() } else { merge_device("", device)? };
        if let Some(instr) = self.instr_mut(v) {
            instr.device = device;
            return Ok(v);
        }
        match self.param_index(v) {
            Some(k) => {
                self.params[k].device = device;
                Ok(v)
            }
            None => Err(Error::UndefinedValue { at: "set_device".into(), value: v.0 }),
        }
    }

    /// Colocates the instruction defining `v` with the earlier value `with`.
    pub fn colocate(&mut self, v: Value, with: Value) -> Result<Value> {
        self.spec(with)?;
        if with >= v {
            return Err(Error::UndefinedValue {
                at: format!("colocating %{} with", v.0),
                value: with.0,
            });
        }
        match self.instr_mut(v) {
            Some(instr) => {
                if !instr.colocate.contains(&with) {
                    instr.colocate.push(with);
                }
                Ok(v)
            }
            None => {
                Err(Error::UndefinedValue { at: "colocate (an instruction)".into(), value: v.0 })
            }
        }
    }

    /// The device request of the instruction or parameter defining `v`.
    pub fn device_of(&self, v: Value) -> Result<&str> {
        if let Ok(i) = self.instr_position(v) {
            return Ok(&self.instrs[i].1.device);
        }
        self.param_index(v)
            .map(|k| self.params[k].device.as_str())
            .ok_or(Error::UndefinedValue { at: "device_of".into(), value: v.0 })
    }

    /// The index among the parameters of the parameter `v`, if it is one.
    fn param_index(&self, v: Value) -> Option<usize> {
        match self.instr_position(v) {
            _ if v.index() >= self.specs.len() => None,
            Ok(_) => None,
            // Parameters are the values no instruction defines, in order.
            Err(before) => Some(v.index() - before),
        }
    }

    /// Where the instruction defining `v` is among the instructions (which are in
    /// value order), or how many instructions come before `v`.
    fn instr_position(&self, v: Value) -> std::result::Result<usize, usize> {
        self.instrs.binary_search_by_key(&v, |(w, _)| *w)
    }

    fn instr_mut(&mut self, v: Value) -> Option<&mut Instr> {
        let i = self.instr_position(v).ok()?;
        Some(&mut self.instrs[i].1)
    }

    /// Replaces the request (device and colocation stack) what is added next gets,
    /// returning the one it replaces: for autodiff and optimizers, which place what
    /// they add beside what it derives from.
    pub(crate) fn swap_request(
        &mut self,
        device: String,
        colocation: Vec<Value>,
    ) -> (String, Vec<Value>) {
        (
            std::mem::replace(&mut self.device, device),
            std::mem::replace(&mut self.colocation, colocation),
        )
    }

    /// Runs `f` with `name` appended to the scope: parameters and named values made
    /// inside get `name.` in front (`layers.0.attn.wq`).
    pub fn scope<T>(&mut self, name: &str, f: impl FnOnce(&mut Builder) -> Result<T>) -> Result<T> {
        self.enter(name);
        let full = self.scope.join(".");
        let start = self.instrs.len();
        let out = f(self);
        self.spans.push((full, start..self.instrs.len()));
        self.leave();
        out
    }

    /// The current scope's full name (`transformer.h.3.attn`; empty at the top).
    pub fn scope_name(&self) -> String {
        self.scope.join(".")
    }

    /// Every [`scope`](Self::scope) closed so far, in the order they closed: its full
    /// name (`transformer.h.3`) and the range of instruction indices added inside it,
    /// which the finished program keeps. A model's blocks, found by name, are the
    /// regions [`grad_remat`](crate::grad_remat) recomputes.
    pub fn scope_spans(&self) -> &[(String, std::ops::Range<usize>)] {
        &self.spans
    }

    /// Opens scope `name` (closed by [`leave`](Self::leave)); for [`Graph`](crate::Graph).
    pub(crate) fn enter(&mut self, name: &str) {
        self.scope.push(name.to_string());
    }

    /// Closes the innermost scope.
    pub(crate) fn leave(&mut self) {
        self.scope.pop();
    }

    /// Adds a copy of `instr` (an instruction of another program) over `args`: its
    /// op, its device request and its colocations (`colocate`: its `colocate` values,
    /// mapped as its operands were), named `name` when given. What programs made from
    /// programs (autodiff, gradient accumulation, rewrites) add instruction by
    /// instruction.
    pub fn push_copy(
        &mut self,
        instr: &Instr,
        args: &[Value],
        colocate: &[Value],
        name: Option<&str>,
    ) -> Result<Value> {
        let v = self.push(instr.op.clone(), args)?;
        if let Some(name) = name {
            self.name(v, name)?;
        }
        self.set_device(v, &instr.device)?;
        for &c in colocate {
            self.colocate(v, c)?;
        }
        Ok(v)
    }

    /// Names the instruction that defines `v` (within the current scopes).
    pub fn name(&mut self, v: Value, name: &str) -> Result<Value> {
        let full = self.claim(self.scoped(name))?;
        match self.instr_mut(v) {
            Some(instr) => {
                instr.name = Some(full);
                Ok(v)
            }
            None => Err(Error::UndefinedValue { at: format!("naming {name:?}"), value: v.0 }),
        }
    }

    /// Adds `op` over `args`, checking them and inferring the result's spec.
    pub fn push(&mut self, op: Op, args: &[Value]) -> Result<Value> {
        let name = op.name();
        let mut specs = Vec::with_capacity(args.len());
        for a in args {
            let s = self
                .specs
                .get(a.index())
                .ok_or_else(|| Error::UndefinedValue { at: self.at(name), value: a.0 })?;
            specs.push(s);
        }
        let spec = infer(&op, &specs).map_err(|problem| Error::Type {
            op: name,
            at: self.at(name),
            operands: specs.iter().map(|s| (*s).clone()).collect(),
            problem,
        })?;
        // The one check of a result's dtype (a parameter's is in `param`): every
        // value of a program is of a dtype both interpreters compute in.
        if !supported(spec.dtype) {
            return Err(Error::UnsupportedDType { at: self.at(name), dtype: spec.dtype });
        }
        let v = Value(self.specs.len() as u32);
        self.specs.push(spec.clone());
        let mut colocate = self.colocation.clone();
        colocate.dedup();
        self.instrs.push((
            v,
            Instr {
                op,
                args: args.to_vec(),
                spec,
                name: None,
                device: self.device.clone(),
                colocate,
            },
        ));
        Ok(v)
    }

    /// `axis` of `v`, counted from the end when negative.
    fn axis(&self, op: &'static str, v: Value, axis: isize) -> Result<usize> {
        let rank = self.spec(v)?.shape.rank();
        let k = if axis < 0 { axis.checked_add(rank as isize) } else { Some(axis) };
        k.and_then(|k| usize::try_from(k).ok()).filter(|&k| k < rank).ok_or_else(|| Error::Type {
            op,
            at: self.at(op),
            operands: vec![self.specs[v.index()].clone()],
            problem: format!("axis {axis} is out of range for rank {rank}"),
        })
    }

    /// Returns the program with `results`. Parameters keep their order; instructions
    /// their order of addition (a valid evaluation order: each uses only earlier values).
    pub fn finish(self, results: &[Value]) -> Result<Program> {
        if results.is_empty() {
            return Err(Error::NoResults);
        }
        let params = self.params.len();
        // Renumber: parameters first, then instructions in order.
        let mut map = vec![Value(0); self.specs.len()];
        let mut next_param = 0u32;
        let mut next_instr = params as u32;
        let defined: HashSet<Value> = self.instrs.iter().map(|(v, _)| *v).collect();
        for (k, slot) in map.iter_mut().enumerate() {
            if defined.contains(&Value(k as u32)) {
                *slot = Value(next_instr);
                next_instr += 1;
            } else {
                *slot = Value(next_param);
                next_param += 1;
            }
        }
        let instrs = self
            .instrs
            .into_iter()
            .map(|(_, mut i)| {
                i.args.iter_mut().for_each(|a| *a = map[a.index()]);
                i.colocate.iter_mut().for_each(|a| *a = map[a.index()]);
                i
            })
            .collect();
        let mut out = Vec::with_capacity(results.len());
        for r in results {
            out.push(
                *map.get(r.index())
                    .ok_or(Error::UndefinedValue { at: "return".into(), value: r.0 })?,
            );
        }
        Ok(Program { params: self.params, instrs, results: out })
    }

    /// A rank-0 constant.
    pub fn constant(&mut self, value: f64, dtype: DType) -> Result<Value> {
        self.push(Op::Constant { value, dtype }, &[])
    }

    /// A float tensor given whole (a table the program closes over, such as rotary
    /// positions' cosines).
    pub fn literal(&mut self, value: meshwork_types::Tensor) -> Result<Value> {
        self.push(Op::Literal { value: std::sync::Arc::new(value) }, &[])
    }

    /// `0, 1, …` along `axis` of a new `dtype` tensor of `shape`.
    pub fn iota(&mut self, dtype: DType, shape: &[usize], axis: usize) -> Result<Value> {
        self.push(Op::Iota { dtype, shape: shape.to_vec(), axis }, &[])
    }

    /// Elementwise conversion.
    pub fn convert(&mut self, x: Value, dtype: DType) -> Result<Value> {
        self.push(Op::Convert { dtype }, &[x])
    }

    /// A copy of `x` (TensorFlow's `tf.identity`; a conversion to its own dtype): under
    /// a device scope, `x` read on that device.
    pub fn identity(&mut self, x: Value) -> Result<Value> {
        let dtype = self.spec(x)?.dtype;
        self.convert(x, dtype)
    }

    /// `select(pred, on_true, on_false)`.
    pub fn select(&mut self, pred: Value, on_true: Value, on_false: Value) -> Result<Value> {
        self.push(Op::Select, &[pred, on_true, on_false])
    }

    /// Uniform floats in `[0, 1)` as `jax.random.uniform` draws them (float32): the
    /// [`Op::ThreefryUniform`] of keys `k1`, `k2` and counters `x`, `i32` of one shape.
    pub fn threefry_uniform(&mut self, k1: Value, k2: Value, x: Value) -> Result<Value> {
        self.push(Op::ThreefryUniform, &[k1, k2, x])
    }

    /// Runs `f` with every product it builds ([`dot_general`](Self::dot_general),
    /// [`matmul`](Self::matmul)) computed in `dtype`, as `torch.autocast` runs matmuls
    /// in bf16 or f16: float operands of another dtype are converted to `dtype`, the
    /// product is taken in it, and the result converted back to the left operand's
    /// dtype, so everything else computes as before. Autodiff then takes the products'
    /// transposes in `dtype` too, and each weight's gradient comes back in the weight's
    /// dtype through the conversions. `None` turns it off inside `f`.
    pub fn matmuls_in<T>(
        &mut self,
        dtype: Option<DType>,
        f: impl FnOnce(&mut Builder) -> Result<T>,
    ) -> Result<T> {
        if let Some(d) = dtype
            && !(d.is_float() && supported(d))
        {
            return Err(Error::UnsupportedDType { at: "matmuls_in".into(), dtype: d });
        }
        let outer = std::mem::replace(&mut self.matmul_dtype, dtype);
        let out = f(self);
        self.matmul_dtype = outer;
        out
    }

    /// The dtype products compute in inside [`matmuls_in`](Self::matmuls_in), if set.
    pub fn matmul_dtype(&self) -> Option<DType> {
        self.matmul_dtype
    }

    /// [`Op::Attention`] of heads `q [B,H,Tq,D]`, `k [B,H,Tk,D]`, `v [B,H,Tk,Dv]`. Inside
    /// [`matmuls_in`](Self::matmuls_in) the heads are converted to its dtype first and
    /// the result back, as a product's operands are.
    pub fn attention(
        &mut self,
        q: Value,
        k: Value,
        v: Value,
        spec: crate::op::AttentionSpec,
    ) -> Result<Value> {
        let dtype = self.spec(q)?.dtype;
        match self.matmul_dtype {
            Some(c) if dtype.is_float() && dtype != c => {
                let qc = self.convert(q, c)?;
                let kc = self.convert(k, c)?;
                let vc = self.convert(v, c)?;
                let out = self.push(Op::Attention(spec), &[qc, kc, vc])?;
                self.convert(out, dtype)
            }
            _ => self.push(Op::Attention(spec), &[q, k, v]),
        }
    }

    /// XLA's `dot_general`.
    pub fn dot_general(
        &mut self,
        lhs: Value,
        rhs: Value,
        lhs_contract: &[usize],
        rhs_contract: &[usize],
        lhs_batch: &[usize],
        rhs_batch: &[usize],
    ) -> Result<Value> {
        let op = Op::DotGeneral {
            lhs_contract: lhs_contract.to_vec(),
            rhs_contract: rhs_contract.to_vec(),
            lhs_batch: lhs_batch.to_vec(),
            rhs_batch: rhs_batch.to_vec(),
        };
        let (l, r) = (self.spec(lhs)?.dtype, self.spec(rhs)?.dtype);
        match self.matmul_dtype {
            Some(c) if l.is_float() && r.is_float() && (l != c || r != c) => {
                let lc = if l == c { lhs } else { self.convert(lhs, c)? };
                let rc = if r == c { rhs } else { self.convert(rhs, c)? };
                let product = self.push(op, &[lc, rc])?;
                if l == c { Ok(product) } else { self.convert(product, l) }
            }
            _ => self.push(op, &[lhs, rhs]),
        }
    }

    /// `lhs @ rhs`: the last dim of `lhs` with the first of `rhs` (rank ≥ 1 each; for
    /// batched products use [`dot_general`](Self::dot_general)).
    pub fn matmul(&mut self, lhs: Value, rhs: Value) -> Result<Value> {
        let last = self.spec(lhs)?.shape.rank().saturating_sub(1);
        self.dot_general(lhs, rhs, &[last], &[0], &[], &[])
    }

    fn reduce(
        &mut self,
        kind: Reduction,
        x: Value,
        axes: &[isize],
        keepdims: bool,
    ) -> Result<Value> {
        let name = Op::Reduce { kind, axes: Vec::new(), keepdims }.name();
        let mut norm = axes.iter().map(|&a| self.axis(name, x, a)).collect::<Result<Vec<_>>>()?;
        norm.sort_unstable();
        self.push(Op::Reduce { kind, axes: norm, keepdims }, &[x])
    }

    /// The sum over `axes` (negative counts from the end).
    pub fn reduce_sum(&mut self, x: Value, axes: &[isize], keepdims: bool) -> Result<Value> {
        self.reduce(Reduction::Sum, x, axes, keepdims)
    }

    /// The maximum over `axes`.
    pub fn reduce_max(&mut self, x: Value, axes: &[isize], keepdims: bool) -> Result<Value> {
        self.reduce(Reduction::Max, x, axes, keepdims)
    }

    /// The mean over `axes`.
    pub fn reduce_mean(&mut self, x: Value, axes: &[isize], keepdims: bool) -> Result<Value> {
        self.reduce(Reduction::Mean, x, axes, keepdims)
    }

    /// The same elements in `shape`.
    pub fn reshape(&mut self, x: Value, shape: &[usize]) -> Result<Value> {
        self.push(Op::Reshape { shape: shape.to_vec() }, &[x])
    }

    /// Output dim `i` is input dim `perm[i]`.
    pub fn transpose(&mut self, x: Value, perm: &[usize]) -> Result<Value> {
        self.push(Op::Transpose { perm: perm.to_vec() }, &[x])
    }

    /// NumPy broadcasting to `shape`.
    pub fn broadcast_to(&mut self, x: Value, shape: &[usize]) -> Result<Value> {
        self.push(Op::BroadcastTo { shape: shape.to_vec() }, &[x])
    }

    /// `lax.slice`.
    pub fn slice(
        &mut self,
        x: Value,
        start: &[usize],
        stop: &[usize],
        step: &[usize],
    ) -> Result<Value> {
        let op = Op::Slice { start: start.to_vec(), stop: stop.to_vec(), step: step.to_vec() };
        self.push(op, &[x])
    }

    /// Concatenation along `axis` (negative counts from the end).
    pub fn concat(&mut self, xs: &[Value], axis: isize) -> Result<Value> {
        let first = *xs.first().ok_or_else(|| Error::Type {
            op: "concat",
            at: self.at("concat"),
            operands: Vec::new(),
            problem: "takes at least one operand".into(),
        })?;
        let axis = self.axis("concat", first, axis)?;
        self.push(Op::Concat { axis }, xs)
    }

    /// `jnp.take(table, indices, axis)`.
    pub fn take(&mut self, table: Value, indices: Value, axis: isize) -> Result<Value> {
        let axis = self.axis("take", table, axis)?;
        self.push(Op::Take { axis }, &[table, indices])
    }

    /// One-hot rows of `depth` in `dtype` for integer `indices`.
    pub fn one_hot(&mut self, indices: Value, depth: usize, dtype: DType) -> Result<Value> {
        self.push(Op::OneHot { depth, dtype }, &[indices])
    }

    /// Softmax along `axis`.
    pub fn softmax(&mut self, x: Value, axis: isize) -> Result<Value> {
        let axis = self.axis("softmax", x, axis)?;
        self.push(Op::Softmax { axis }, &[x])
    }

    /// Log-softmax along `axis`.
    pub fn log_softmax(&mut self, x: Value, axis: isize) -> Result<Value> {
        let axis = self.axis("log_softmax", x, axis)?;
        self.push(Op::LogSoftmax { axis }, &[x])
    }

    /// [`Op::CrossEntropy`]: the softmax cross-entropy of each row of float `logits`
    /// `[..., C]` against integer `labels` `[...]`, `logsumexp − logits[label]` (0 for
    /// a label outside `0..C`).
    pub fn cross_entropy(&mut self, logits: Value, labels: Value) -> Result<Value> {
        self.push(Op::CrossEntropy, &[logits, labels])
    }

    /// Index of the first maximum along `axis`.
    pub fn argmax(&mut self, x: Value, axis: isize) -> Result<Value> {
        let axis = self.axis("argmax", x, axis)?;
        self.push(Op::Argmax { axis }, &[x])
    }

    /// 2-D convolution of NHWC `x` with HWIO `w`.
    pub fn conv2d(
        &mut self,
        x: Value,
        w: Value,
        strides: [usize; 2],
        padding: Padding,
    ) -> Result<Value> {
        self.push(Op::Conv2d { strides, padding }, &[x, w])
    }

    /// All-reduce across each of `groups`.
    pub fn all_reduce(&mut self, x: Value, op: ReduceOp, groups: &[Vec<usize>]) -> Result<Value> {
        self.push(Op::AllReduce { op, groups: groups.to_vec() }, &[x])
    }

    /// All-gather along `axis` within each of `groups`.
    pub fn all_gather(&mut self, x: Value, axis: usize, groups: &[Vec<usize>]) -> Result<Value> {
        self.push(Op::AllGather { axis, groups: groups.to_vec() }, &[x])
    }

    /// Reduce-scatter along `axis` within each of `groups`.
    pub fn reduce_scatter(
        &mut self,
        x: Value,
        op: ReduceOp,
        axis: usize,
        groups: &[Vec<usize>],
    ) -> Result<Value> {
        self.push(Op::ReduceScatter { op, axis, groups: groups.to_vec() }, &[x])
    }

    /// All-to-all within each of `groups`.
    pub fn all_to_all(
        &mut self,
        x: Value,
        split_axis: usize,
        concat_axis: usize,
        groups: &[Vec<usize>],
    ) -> Result<Value> {
        self.push(Op::AllToAll { split_axis, concat_axis, groups: groups.to_vec() }, &[x])
    }

    /// [`Op::ShardSlice`]: this replica's block of `axis` among its group.
    pub fn shard_slice(&mut self, x: Value, axis: usize, groups: &[Vec<usize>]) -> Result<Value> {
        self.push(Op::ShardSlice { axis, groups: groups.to_vec() }, &[x])
    }

    /// [`Op::ShardPad`]: `x` at this replica's block of `axis`, zeros elsewhere.
    pub fn shard_pad(&mut self, x: Value, axis: usize, groups: &[Vec<usize>]) -> Result<Value> {
        self.push(Op::ShardPad { axis, groups: groups.to_vec() }, &[x])
    }

    /// Collective permute along `(source, target)` pairs.
    pub fn collective_permute(&mut self, x: Value, pairs: &[(usize, usize)]) -> Result<Value> {
        self.push(Op::CollectivePermute { pairs: pairs.to_vec() }, &[x])
    }

    /// Sends `x` to device `peer` on `channel`; returns the send's token.
    pub fn send(&mut self, x: Value, channel: u32, peer: usize) -> Result<Value> {
        self.push(Op::Send { channel, peer }, &[x])
    }

    /// Receives a `spec` tensor from device `peer` on `channel`.
    pub fn recv(&mut self, spec: &TensorSpec, channel: u32, peer: usize) -> Result<Value> {
        let op = Op::Recv { channel, peer, dtype: spec.dtype, shape: spec.shape.dims().to_vec() };
        self.push(op, &[])
    }

    /// Streams `xs` to the host's consumer `consumer`; returns the emit's token.
    pub fn emit(&mut self, xs: &[Value], consumer: u32) -> Result<Value> {
        self.push(Op::Emit { consumer }, xs)
    }

    /// A rank-0 constant of `like`'s dtype.
    pub fn scalar_like(&mut self, like: Value, value: f64) -> Result<Value> {
        let dtype = self.spec(like)?.dtype;
        self.constant(value, dtype)
    }

    /// The shape of `v`.
    pub fn shape(&self, v: Value) -> Result<Shape> {
        Ok(self.spec(v)?.shape.clone())
    }
}

macro_rules! unary {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Builder {$(
            $(#[$doc])*
            pub fn $name(&mut self, x: Value) -> Result<Value> {
                self.push(Op::Unary(Unary::$op), &[x])
            }
        )*}
    };
}

unary! {
    /// `-x`.
    neg => Neg;
    /// `e^x`.
    exp => Exp;
    /// Natural logarithm.
    log => Log;
    /// Hyperbolic tangent.
    tanh => Tanh;
    /// The sigmoid.
    logistic => Logistic;
    /// Square root.
    sqrt => Sqrt;
    /// `1 / sqrt(x)`.
    rsqrt => Rsqrt;
    /// `|x|`.
    abs => Abs;
    /// `x * x`.
    square => Square;
    /// `max(x, 0)`.
    relu => Relu;
    /// GELU (tanh approximation).
    gelu => Gelu;
    /// Sine.
    sin => Sin;
    /// Cosine.
    cos => Cos;
    /// The identity with a zero gradient.
    stop_gradient => StopGradient;
    /// The identity a compiler may not merge or move work across.
    optimization_barrier => Barrier;
}

macro_rules! binary {
    ($($(#[$doc:meta])* $name:ident => $kind:ident::$op:ident;)*) => {
        impl Builder {$(
            $(#[$doc])*
            pub fn $name(&mut self, a: Value, b: Value) -> Result<Value> {
                self.push(Op::$kind($kind::$op), &[a, b])
            }
        )*}
    };
}

binary! {
    /// `a + b` (broadcasting).
    add => Binary::Add;
    /// `a - b`.
    sub => Binary::Sub;
    /// `a * b`.
    mul => Binary::Mul;
    /// `a / b`.
    div => Binary::Div;
    /// The larger of `a` and `b`.
    max => Binary::Max;
    /// The smaller.
    min => Binary::Min;
    /// `a ^ b`.
    pow => Binary::Pow;
    /// `a < b`.
    lt => Compare::Lt;
    /// `a <= b`.
    le => Compare::Le;
    /// `a > b`.
    gt => Compare::Gt;
    /// `a >= b`.
    ge => Compare::Ge;
    /// `a == b`.
    eq => Compare::Eq;
    /// `a != b`.
    ne => Compare::Ne;
}

/// `inner` merged over `outer` as TensorFlow nests device scopes: each of the job,
/// replica, task and device fields of `inner` replaces the outer one; a local form
/// (`CPU:1`) is `/device:CPU:1`. Checks that the result can print in the text form.
pub(crate) fn merge_device(outer: &str, inner: &str) -> Result<String> {
    let bad = |problem| Err(Error::BadDevice { device: inner.to_string(), problem });
    if inner.is_empty() {
        return bad("a device request is not empty");
    }
    if !inner.bytes().all(|c| c.is_ascii_graphic() && !b"\",{}@".contains(&c)) {
        return bad("a device spec is ASCII without spaces, quotes, commas, braces or `@`");
    }
    let inner = if inner.starts_with('/') { inner.to_string() } else { format!("/device:{inner}") };
    // The field a component sets: `job:`, `replica:`, `task:`, or the device
    // (`device:TYPE:ID` and the legacy `cpu:0`).
    let key = |c: &str| match c.split(':').next() {
        Some(k @ ("job" | "replica" | "task")) => k.to_string(),
        _ => "device".to_string(),
    };
    let mut fields: Vec<(String, String)> = Vec::new();
    for part in [outer, inner.as_str()] {
        for c in part.split('/').filter(|c| !c.is_empty()) {
            let k = key(c);
            match fields.iter_mut().find(|(f, _)| *f == k) {
                Some(slot) => slot.1 = c.to_string(),
                None => fields.push((k, c.to_string())),
            }
        }
    }
    let order = ["job", "replica", "task", "device"];
    fields.sort_by_key(|(k, _)| order.iter().position(|o| o == k));
    Ok(fields.iter().map(|(_, c)| format!("/{c}")).collect())
}
