//! SPMD partitioning support: value layouts in mesh-axis form, XLA's sharding
//! propagation over op rules, and the collectives that move a value between layouts.
//!
//! The crate owns the op description ([`OpRule`]), so it needs no program types: a
//! caller (meshwork's partitioner in the strategy crate) describes each op of its
//! program by a rule, propagates annotations with [`propagate`], and inserts what
//! [`transition`] returns wherever a value's layout differs from what a use needs.
//!
//! ```
//! use meshwork_sharding::Mesh;
//! use meshwork_sharding::spmd::{Graph, Layout, Node, OpRule, Step, propagate, transition};
//!
//! // y = x @ w: the batch over `data`, w's columns over `model`.
//! let mesh = Mesh::iota(&[("data", 2), ("model", 2)])?;
//! let rule = OpRule::einsum("bi,ik->bk", &[&[8, 4], &[4, 6]])?;
//! let graph = Graph {
//!     shapes: vec![vec![8, 4], vec![4, 6], vec![8, 6]],
//!     zeros: vec![],
//!     nodes: vec![Node { rule, operands: vec![0, 1], result: 2 }],
//! };
//! let x = Layout::new(&mesh, vec![vec![0], vec![]], vec![])?;
//! let w = Layout::new(&mesh, vec![vec![], vec![1]], vec![])?;
//! let p = propagate(&mesh, &graph, &[Some(x), Some(w), None])?;
//! assert_eq!(p.layouts[2].display(&mesh).to_string(), "P('data', 'model')");
//!
//! // Gathering y's columns is one all-gather over `model`.
//! let t = transition(&mesh, &[8, 6], 4, &p.layouts[2], &Layout::new(&mesh, vec![vec![0], vec![]], vec![])?)?;
//! assert_eq!(t.steps(), [Step::AllGather { dim: 1, axes: vec![1] }]);
//! # Ok::<(), meshwork_sharding::Error>(())
//! ```

mod layout;
mod propagate;
mod rule;
#[cfg(test)]
mod tests;
mod transition;

pub use layout::{Layout, axis_groups};
pub use propagate::{Graph, Node, Operand, Propagation, node_layouts, propagate};
pub use rule::{FactorKind, Linear, OpRule};
pub use transition::{Step, Transition, greedy, transition, transition_hlo};
