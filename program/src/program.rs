//! A program: typed parameters, instructions in SSA form in evaluation order, results.

use std::fmt;

use meshwork_types::TensorSpec;

use crate::op::{Attributes, Op};

/// A value of a program: parameter `k` is `Value(k)`, and instruction `i` defines
/// `Value(params + i)`. Printed `%k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub u32);

impl Value {
    /// Its index among the program's values.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// A parameter: the name it is fed and saved under (a checkpoint tensor name for a
/// model's weights) and its spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    /// The hierarchical name (`layers.0.attn.wq`).
    pub name: String,
    /// Its dtype and shape.
    pub spec: TensorSpec,
    /// The device it is requested on (a TensorFlow device spec such as
    /// `/device:CPU:1`; empty for none), from a [`Builder::device`](crate::Builder::device)
    /// scope or [`Builder::set_device`](crate::Builder::set_device).
    pub device: String,
}

/// One instruction: an op over earlier values, defining one new value.
#[derive(Debug, Clone, PartialEq)]
pub struct Instr {
    /// The op and its attributes.
    pub op: Op,
    /// The operands, all defined before this instruction.
    pub args: Vec<Value>,
    /// The result's dtype and shape (inferred when the instruction was added).
    pub spec: TensorSpec,
    /// A hierarchical name (from the builder's scopes), if one was given.
    pub name: Option<String>,
    /// The device it is requested on (empty for none), as for [`Param::device`].
    pub device: String,
    /// Earlier values it must be placed with (TensorFlow's `colocate_with`, the
    /// `loc:@` list of a node), from [`Builder::colocate_with`](crate::Builder::colocate_with).
    pub colocate: Vec<Value>,
}

impl Instr {
    /// `op` over `args` with result `spec`, unnamed and with no device request.
    pub fn new(op: Op, args: Vec<Value>, spec: TensorSpec) -> Instr {
        Instr { op, args, spec, name: None, device: String::new(), colocate: Vec::new() }
    }
}

/// A tensor program. Built by a [`Builder`](crate::Builder), which checks every
/// instruction's operands and infers its result's spec, so a `Program` is always well
/// typed and in a valid evaluation order.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    pub(crate) params: Vec<Param>,
    pub(crate) instrs: Vec<Instr>,
    pub(crate) results: Vec<Value>,
}

impl Program {
    /// The parameters, in order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The instructions, in evaluation order.
    pub fn instrs(&self) -> &[Instr] {
        &self.instrs
    }

    /// The values the program returns.
    pub fn results(&self) -> &[Value] {
        &self.results
    }

    /// How many values the program defines (parameters and instructions).
    pub fn num_values(&self) -> usize {
        self.params.len() + self.instrs.len()
    }

    /// The spec of `v`, if the program defines it.
    pub fn spec(&self, v: Value) -> Option<&TensorSpec> {
        let k = v.index();
        match k.checked_sub(self.params.len()) {
            None => self.params.get(k).map(|p| &p.spec),
            Some(i) => self.instrs.get(i).map(|i| &i.spec),
        }
    }

    /// The instruction defining `v` (`None` for a parameter).
    pub fn instr(&self, v: Value) -> Option<&Instr> {
        v.index().checked_sub(self.params.len()).and_then(|i| self.instrs.get(i))
    }

    /// The program without its dead code: instructions whose values reach no result
    /// are dropped, except those that communicate (collectives, `send`/`recv`, `emit`:
    /// their peers and the host count on them) and what they read. Parameters stay, so
    /// the program is called as before; values are renumbered in order.
    pub fn without_dead_code(&self) -> Program {
        let np = self.params.len();
        let mut live = vec![false; self.num_values()];
        for r in &self.results {
            live[r.index()] = true;
        }
        for (i, instr) in self.instrs.iter().enumerate().rev() {
            if instr.op.communicates() {
                live[np + i] = true;
            }
            if live[np + i] {
                for a in &instr.args {
                    live[a.index()] = true;
                }
            }
        }
        let mut map: Vec<Value> = (0..np as u32).map(Value).collect();
        let mut instrs = Vec::new();
        for (i, instr) in self.instrs.iter().enumerate() {
            // A dead value maps to nothing anyone reads; keep the slot for indexing.
            map.push(Value((np + instrs.len()) as u32));
            if live[np + i] {
                let mut kept = instr.clone();
                kept.args.iter_mut().for_each(|a| *a = map[a.index()]);
                // A colocation with a dropped value constrains nothing any more.
                kept.colocate.retain(|c| live[c.index()]);
                kept.colocate.iter_mut().for_each(|c| *c = map[c.index()]);
                instrs.push(kept);
            }
        }
        let results = self.results.iter().map(|r| map[r.index()]).collect();
        Program { params: self.params.clone(), instrs, results }
    }

    /// The value whose name (a parameter's or a named instruction's) is `name`.
    pub fn value_named(&self, name: &str) -> Option<Value> {
        let param = self.params.iter().position(|p| p.name == name);
        let instr = || {
            self.instrs
                .iter()
                .position(|i| i.name.as_deref() == Some(name))
                .map(|i| i + self.params.len())
        };
        param.or_else(instr).map(|k| Value(k as u32))
    }
}

/// The text form: one line per parameter, one per instruction, then `return`:
///
/// ```text
/// param %0 "x": f64[2,3]
/// %2 = f64[2,4] dot_general(%0, %1), lhs_contract={1}, rhs_contract={0}, lhs_batch={}, rhs_batch={}
/// %3 = f64[2,4] relu(%2) "h"
/// return %3
/// ```
///
/// Device requests follow an instruction's attributes (before its name), and a
/// parameter's spec: `@device="/device:CPU:1"`, `@colocate={%3,%5}`.
impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, p) in self.params.iter().enumerate() {
            write!(f, "param %{k} {:?}: {}", p.name, p.spec)?;
            if !p.device.is_empty() {
                write!(f, " @device=\"{}\"", p.device)?;
            }
            writeln!(f)?;
        }
        for (i, instr) in self.instrs.iter().enumerate() {
            let v = Value((self.params.len() + i) as u32);
            write!(f, "{v} = {} {}(", instr.spec, instr.op.name())?;
            for (k, a) in instr.args.iter().enumerate() {
                if k > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{a}")?;
            }
            write!(f, "){}", Attributes(&instr.op))?;
            if !instr.device.is_empty() {
                write!(f, " @device=\"{}\"", instr.device)?;
            }
            if !instr.colocate.is_empty() {
                f.write_str(" @colocate={")?;
                for (k, c) in instr.colocate.iter().enumerate() {
                    if k > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{c}")?;
                }
                f.write_str("}")?;
            }
            if let Some(name) = &instr.name {
                write!(f, " {name:?}")?;
            }
            writeln!(f)?;
        }
        f.write_str("return")?;
        for (k, r) in self.results.iter().enumerate() {
            f.write_str(if k == 0 { " " } else { ", " })?;
            write!(f, "{r}")?;
        }
        writeln!(f)
    }
}
