//! meshwork's sharding: XLA/JAX tile-assignment shardings and the data movement they
//! imply.
//!
//! Meshes, partition specs and `NamedSharding` lowered to XLA's `HloSharding` exactly as
//! JAX lowers them; XLA's text form parsed and printed byte for byte; index maps per
//! device; `ndarray` tensors split into shards, assembled back, and resharded with a
//! plan that moves the fewest bytes; the variable-reshard state machine.
//!
//! With the `serde` feature, meshes, partition specs, named and bound shardings and
//! `HloSharding` (as its XLA text) serialise; deserialising validates.
//!
//! [`spmd`] has what a partitioner needs without knowing its program types: layouts
//! in mesh-axis form, XLA's sharding propagation over op rules, and the collectives
//! that move a value between layouts. It is **not** a compiler: it does not rewrite
//! programs (the strategy crate's partitioner does), and it does not run collectives
//! (that is `meshwork-executor`).
//!
//! ```
//! use meshwork_sharding::{Mesh, Mode, NamedSharding};
//!
//! let mesh = Mesh::iota(&[("a", 2), ("b", 4)])?;
//! let named = NamedSharding::new(mesh, "P('a', 'b')".parse()?)?;
//! let sharding = named.to_sharding(2)?;
//! assert_eq!(sharding.hlo().to_string(), "{devices=[2,4]<=[8]}");
//! assert_eq!(sharding.shard_shape(&[8, 8], Mode::Strict)?, [4, 2]);
//! let map = sharding.index_map(&[8, 8], Mode::Strict)?;
//! assert_eq!(map[5].ranges, [4..8, 2..4]);
//! # Ok::<(), meshwork_sharding::Error>(())
//! ```

mod data;
mod error;
mod hlo;
mod logical;
mod mesh;
mod named;
mod par;
mod parse;
mod reshard;
#[cfg(feature = "serde")]
mod serde_impls;
mod sharding;
mod show;
mod spec;
pub mod spmd;
#[cfg(any(test, feature = "proptest"))]
pub mod testing;
#[cfg(test)]
mod tests;
mod tile;
mod variable;

pub use data::{Shard, assemble, assemble_into, shard, shard_into};
pub use error::{Error, Result};
pub use hlo::{HloSharding, SubgroupType, Tiled};
pub use logical::{
    assign_to_logical_device, replicate_to_logical_devices, split_to_logical_devices,
};
pub use mesh::{AxisType, Mesh};
pub use named::NamedSharding;
pub use reshard::{ReshardPlan, Transfer};
pub use sharding::{Mode, ShardIndex, Sharding};
pub use show::{describe, describe_reshard, visualize};
pub use spec::{DimSpec, PartitionSpec};
pub use tile::{Iota, MAX_TILES, TileAssignment};
pub use variable::{ReshardableVariable, VariableFormat};
