//! Partition specs: for each tensor dim, which mesh axes shard it.

use std::fmt;
use std::str::FromStr;

use crate::parse::Cursor;
use crate::{Error, Result};

/// How one tensor dim is sharded.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DimSpec {
    /// Not sharded (`None`).
    Replicated,
    /// Sharded over these mesh axes, major first (`'a'` or `('a', 'b')`). Never empty:
    /// an empty tuple is [`DimSpec::Replicated`], as in JAX.
    Axes(Vec<String>),
    /// Left to the compiler (`P.UNCONSTRAINED`); lowers as not sharded, but data cannot
    /// be placed with it ([`NamedSharding::to_sharding`](crate::NamedSharding::to_sharding)
    /// refuses it, as JAX's `device_put` does).
    Unconstrained,
}

impl DimSpec {
    /// The mesh axes this dim is sharded over (none for replicated or unconstrained).
    pub fn axes(&self) -> &[String] {
        match self {
            DimSpec::Axes(axes) => axes,
            _ => &[],
        }
    }
}

/// JAX's `PartitionSpec`: one [`DimSpec`] per leading tensor dim (missing trailing
/// entries mean not sharded), plus the `unreduced` and `reduced` axis sets.
///
/// Text form: `P('data', ('x','y'), None, UNCONSTRAINED, unreduced={'z'})`. Parsing
/// also accepts `PartitionSpec(...)`, double quotes and `P.UNCONSTRAINED`; `('a',)`
/// reads as `'a'` and `()` as `None`, as in JAX.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PartitionSpec {
    dims: Vec<DimSpec>,
    unreduced: Vec<String>,
    reduced: Vec<String>,
}

impl PartitionSpec {
    /// A spec from per-dim entries (normalised: an empty axis list is `Replicated`).
    pub fn new(dims: Vec<DimSpec>) -> PartitionSpec {
        let dims = dims
            .into_iter()
            .map(|d| match d {
                DimSpec::Axes(axes) if axes.is_empty() => DimSpec::Replicated,
                other => other,
            })
            .collect();
        PartitionSpec { dims, unreduced: Vec::new(), reduced: Vec::new() }
    }

    /// The fully replicated spec `P()`.
    pub fn replicated() -> PartitionSpec {
        PartitionSpec::default()
    }

    /// This spec with the given `unreduced` axes.
    pub fn with_unreduced(mut self, axes: Vec<String>) -> PartitionSpec {
        self.unreduced = axes;
        self
    }

    /// This spec with the given `reduced` axes.
    pub fn with_reduced(mut self, axes: Vec<String>) -> PartitionSpec {
        self.reduced = axes;
        self
    }

    /// The per-dim entries.
    pub fn dims(&self) -> &[DimSpec] {
        &self.dims
    }

    /// Axes over which the value is an unreduced partial sum.
    pub fn unreduced(&self) -> &[String] {
        &self.unreduced
    }

    /// Axes over which the value has been reduced (replicated, explicitly).
    pub fn reduced(&self) -> &[String] {
        &self.reduced
    }
}

fn write_axis_set(f: &mut fmt::Formatter<'_>, key: &str, axes: &[String]) -> fmt::Result {
    write!(f, "{key}={{")?;
    for (i, a) in axes.iter().enumerate() {
        if i > 0 {
            f.write_str(",")?;
        }
        write!(f, "'{a}'")?;
    }
    f.write_str("}")
}

impl fmt::Display for PartitionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("P(")?;
        let mut first = true;
        let mut sep = |f: &mut fmt::Formatter<'_>| {
            let s = if first { "" } else { ", " };
            first = false;
            f.write_str(s)
        };
        for d in &self.dims {
            sep(f)?;
            match d {
                DimSpec::Replicated => f.write_str("None")?,
                DimSpec::Unconstrained => f.write_str("UNCONSTRAINED")?,
                DimSpec::Axes(axes) if axes.len() == 1 => write!(f, "'{}'", axes[0])?,
                DimSpec::Axes(axes) => {
                    f.write_str("(")?;
                    for (i, a) in axes.iter().enumerate() {
                        if i > 0 {
                            f.write_str(",")?;
                        }
                        write!(f, "'{a}'")?;
                    }
                    f.write_str(")")?;
                }
            }
        }
        if !self.unreduced.is_empty() {
            sep(f)?;
            write_axis_set(f, "unreduced", &self.unreduced)?;
        }
        if !self.reduced.is_empty() {
            sep(f)?;
            write_axis_set(f, "reduced", &self.reduced)?;
        }
        f.write_str(")")
    }
}

impl FromStr for PartitionSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<PartitionSpec> {
        let mut p = Cursor { input: s, pos: 0 };
        let spec = p.spec()?;
        p.skip_space();
        if p.pos != s.len() {
            return Err(p.error("end of input"));
        }
        Ok(spec)
    }
}

impl Cursor<'_> {
    fn spec(&mut self) -> Result<PartitionSpec> {
        if !(self.eat("PartitionSpec(") || self.eat("P(")) {
            return Err(self.error("`P(` or `PartitionSpec(`"));
        }
        let mut spec = PartitionSpec::default();
        if self.eat(")") {
            return Ok(spec);
        }
        loop {
            if self.eat("unreduced=") {
                spec.unreduced = self.axis_set()?;
            } else if self.eat("reduced=") {
                spec.reduced = self.axis_set()?;
            } else if !spec.unreduced.is_empty() || !spec.reduced.is_empty() {
                return Err(self.error("`unreduced=` or `reduced=` (dims come first)"));
            } else {
                let dim = self.dim()?;
                spec.dims.push(dim);
            }
            if self.eat(")") {
                return Ok(spec);
            }
            self.expect(",")?;
            if self.eat(")") {
                return Ok(spec);
            }
        }
    }

    fn dim(&mut self) -> Result<DimSpec> {
        if self.eat("None") {
            return Ok(DimSpec::Replicated);
        }
        if self.eat("P.UNCONSTRAINED") || self.eat("UNCONSTRAINED") {
            return Ok(DimSpec::Unconstrained);
        }
        if self.eat("(") {
            let mut axes = Vec::new();
            while !self.eat(")") {
                axes.push(self.name()?);
                if !self.eat(",") {
                    self.expect(")")?;
                    break;
                }
            }
            return Ok(if axes.is_empty() { DimSpec::Replicated } else { DimSpec::Axes(axes) });
        }
        Ok(DimSpec::Axes(vec![self.name()?]))
    }

    fn axis_set(&mut self) -> Result<Vec<String>> {
        self.expect("{")?;
        let mut axes = Vec::new();
        while !self.eat("}") {
            axes.push(self.name()?);
            if !self.eat(",") {
                self.expect("}")?;
                break;
            }
        }
        Ok(axes)
    }

    /// A quoted axis name: `'a'` or `"a"`.
    fn name(&mut self) -> Result<String> {
        self.skip_space();
        let rest = &self.input[self.pos..];
        let quote = match rest.chars().next() {
            Some(q @ ('\'' | '"')) => q,
            _ => return Err(self.error("a quoted axis name, `None`, `UNCONSTRAINED` or a tuple")),
        };
        let Some(len) = rest[1..].find(quote) else {
            self.pos += rest.len();
            return Err(self.error("a closing quote"));
        };
        let name = rest[1..1 + len].to_owned();
        if name.is_empty() {
            self.pos += 1;
            return Err(self.error("a non-empty axis name"));
        }
        self.pos += len + 2;
        Ok(name)
    }
}
