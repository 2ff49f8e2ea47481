//! SPMD partitioning (GSPMD): a program for one device, some of its parameters
//! annotated with partition specs over a mesh, rewritten into the program every device
//! of the mesh runs, with the collectives its layouts need.
//!
//! The sharding crate owns the semantics (layouts, propagation, the transitions
//! between layouts); this module maps each program op onto one of its op rules
//! (its private `rules` module) and rewrites programs ([`partition`]).

mod partition;
mod rules;

pub use partition::{Collective, PartitionOptions, Partitioned, partition, partition_with};

use meshwork_program::Program;
use meshwork_sharding::spmd::Layout;
use meshwork_sharding::{DimSpec, Mesh, PartitionSpec};

use crate::{Error, Result};

/// A mesh and the partition specs of some of a program's parameters (by name); the
/// others are left to propagation.
#[derive(Debug, Clone)]
pub struct Shardings {
    mesh: Mesh,
    specs: Vec<(String, PartitionSpec)>,
}

impl Shardings {
    /// No parameter annotated yet.
    pub fn new(mesh: Mesh) -> Shardings {
        Shardings { mesh, specs: Vec::new() }
    }

    /// Parameter `param` laid out by `spec` (`"P('data', None)"`).
    pub fn with(self, param: &str, spec: &str) -> Result<Shardings> {
        Ok(self.with_spec(param, spec.parse()?))
    }

    /// Parameter `param` laid out by `spec`.
    pub fn with_spec(mut self, param: &str, spec: PartitionSpec) -> Shardings {
        self.specs.retain(|(n, _)| n != param);
        self.specs.push((param.to_string(), spec));
        self
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The spec given for `param`, if any.
    pub fn spec(&self, param: &str) -> Option<&PartitionSpec> {
        self.specs.iter().find(|(n, _)| n == param).map(|(_, s)| s)
    }

    /// Each parameter's layout (`None` where not given); a spec naming neither a
    /// parameter of `program` nor a named instruction ([`constraints`](Self::constraints))
    /// is an error.
    pub fn layouts(&self, program: &Program) -> Result<Vec<Option<Layout>>> {
        for (name, _) in &self.specs {
            if !program.params().iter().any(|p| &p.name == name)
                && program.value_named(name).is_none()
            {
                return Err(Error::Partition {
                    value: name.clone(),
                    op: "shardings",
                    problem: "the program has no parameter or named value of this name".into(),
                });
            }
        }
        program
            .params()
            .iter()
            .map(|p| {
                self.spec(&p.name)
                    .map(|s| Ok(Layout::from_spec(&self.mesh, s, p.spec.shape.rank())?))
                    .transpose()
            })
            .collect()
    }
}

impl Shardings {
    /// The layouts given for named instructions of `program` (JAX's
    /// `with_sharding_constraint`): (value, layout) pairs the partitioner holds those
    /// values in, moving data into and out of them as their neighbours need — an
    /// identity of a weight split over `data`, constrained to whole, is where the
    /// weight is all-gathered before use (and its gradient reduce-scattered back).
    pub fn constraints(&self, program: &Program) -> Result<Vec<(usize, Layout)>> {
        let np = program.params().len();
        let mut out = Vec::new();
        for (name, spec) in &self.specs {
            if program.params().iter().any(|p| &p.name == name) {
                continue;
            }
            if let Some(v) = program.value_named(name).filter(|v| v.index() >= np) {
                let rank = program.spec(v).expect("a value of the program").shape.rank();
                out.push((v.index(), Layout::from_spec(&self.mesh, spec, rank)?));
            }
        }
        Ok(out)
    }
}

/// The Megatron-style tensor-parallel spec over mesh axis `model` of a parameter of
/// the program crate's `nn` layers, by name: attention's `wq`, `wk`, `wv` and the MLP's
/// `w1` split by columns (and `b1` with them), attention's `wo` and the MLP's `w2` by
/// rows; everything else (embeddings, layer norms, `b2`, `unembed`) replicated. With
/// it, a decoder block's forward pass needs exactly two all-reduces over `model` (after
/// `wo` and after `w2`) and its backward pass two (the input gradients of the
/// column-split layers).
///
/// GPT-2's Hugging Face names split the same way: `attn.c_attn` and `mlp.c_fc` (weight
/// and bias) by columns, `attn.c_proj.weight` and `mlp.c_proj.weight` by rows. (The
/// fused `c_attn` holds q, k and v side by side, so its column halves do not hold
/// whole heads: the partitioner moves what each device's heads need.)
pub fn megatron_spec(name: &str, rank: usize) -> PartitionSpec {
    let model = || DimSpec::Axes(vec!["model".to_string()]);
    let columns =
        ["attn.wq", "attn.wk", "attn.wv", "mlp.w1", "attn.c_attn.weight", "mlp.c_fc.weight"];
    let rows = ["attn.wo", "mlp.w2", "attn.c_proj.weight", "mlp.c_proj.weight"];
    let split_biases = ["mlp.b1", "attn.c_attn.bias", "mlp.c_fc.bias"];
    if rank == 2 && columns.iter().any(|c| name.ends_with(c)) {
        PartitionSpec::new(vec![DimSpec::Replicated, model()])
    } else if (rank == 2 && rows.iter().any(|r| name.ends_with(r)))
        || (rank == 1 && split_biases.iter().any(|b| name.ends_with(b)))
    {
        PartitionSpec::new(vec![model()])
    } else {
        PartitionSpec::replicated()
    }
}
