//! The sharding crate's error type.

use meshwork_types::DeviceId;

/// Everything that can go wrong while building a sharding or moving shards.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),

    // ---- meshes -------------------------------------------------------------------
    /// The mesh has a different number of axis names than axis sizes.
    #[error("mesh has {names} axis names for {sizes} axis sizes")]
    MeshAxisCount {
        /// Number of axis names.
        names: usize,
        /// Number of axis sizes.
        sizes: usize,
    },
    /// Two mesh axes have the same name.
    #[error("mesh axis name `{name}` appears twice")]
    DuplicateMeshAxis {
        /// The repeated name.
        name: String,
    },
    /// A mesh axis has size 0.
    #[error("mesh axis `{name}` has size 0")]
    EmptyMeshAxis {
        /// The axis.
        name: String,
    },
    /// The product of the mesh shape differs from the number of devices.
    #[error("mesh shape {shape:?} holds {expected} devices but {actual} were given")]
    MeshDeviceCount {
        /// The mesh shape.
        shape: Vec<usize>,
        /// The product of the shape.
        expected: usize,
        /// The number of device ids given.
        actual: usize,
    },
    /// A mesh with more devices than a sharding can tile over.
    #[error("mesh shape {shape:?} has more than 2^20 devices")]
    MeshTooLarge {
        /// The mesh shape.
        shape: Vec<usize>,
    },
    /// A device appears twice in a mesh or device assignment.
    #[error("device {device} appears twice in the device list")]
    DuplicateDevice {
        /// The repeated device.
        device: DeviceId,
    },

    // ---- partition specs ------------------------------------------------------------
    /// A mesh axis is used twice in one partition spec.
    #[error("mesh axis `{axis}` is used more than once in the partition spec")]
    DuplicateSpecAxis {
        /// The repeated axis.
        axis: String,
    },
    /// A partition spec names an axis the mesh does not have.
    #[error(
        "partition spec uses axis `{axis}`, which the mesh does not have (axes: {mesh_axes:?})"
    )]
    UnknownSpecAxis {
        /// The unknown axis.
        axis: String,
        /// The mesh's axes.
        mesh_axes: Vec<String>,
    },
    /// `unreduced` or `reduced` names an axis whose type is not Explicit.
    #[error("axis `{axis}` is {axis_type} but unreduced/reduced axes must be Explicit")]
    UnreducedAxisType {
        /// The axis.
        axis: String,
        /// Its type.
        axis_type: crate::AxisType,
    },
    /// A partition spec shards a dimension the tensor does not have.
    #[error("partition spec entry {entry} shards over mesh axes but the tensor has rank {rank}")]
    SpecLongerThanRank {
        /// Index of the entry past the rank.
        entry: usize,
        /// The tensor's rank.
        rank: usize,
    },

    /// Data was placed with a partition spec longer than the array's rank (JAX's
    /// `check_compatible_aval`: a spec applies only to arrays of at least its length,
    /// even when the extra entries are `None`).
    #[error(
        "a partition spec of {entries} entries is only valid for arrays of rank at least {entries}, not rank {rank}"
    )]
    SpecTooLong {
        /// Entries in the spec.
        entries: usize,
        /// The array's rank.
        rank: usize,
    },
    /// Data was placed with an `UNCONSTRAINED` spec entry, which only a sharding
    /// constraint inside a compiled program may use (JAX's `device_put` refuses it).
    #[error("partition spec entry {entry} is UNCONSTRAINED: data cannot be placed with it")]
    UnconstrainedEntry {
        /// Index of the entry.
        entry: usize,
    },

    // ---- text ----------------------------------------------------------------------
    /// Text that does not parse.
    #[error("cannot parse `{input}` at byte {position}: expected {expected}")]
    Parse {
        /// The whole input.
        input: String,
        /// Byte offset of the problem.
        position: usize,
        /// What the parser expected there.
        expected: &'static str,
    },

    // ---- tile assignments ------------------------------------------------------------
    /// The tile dims and the device list (or iota reshape) disagree in size.
    #[error("tile assignment dims {dims:?} hold {expected} tiles but {actual} devices were given")]
    TileCount {
        /// The tile dims.
        dims: Vec<usize>,
        /// Their product.
        expected: usize,
        /// Devices (or iota elements) given.
        actual: usize,
    },
    /// Tile dims that are empty or contain 0, or whose product exceeds
    /// [`MAX_TILES`](crate::MAX_TILES).
    #[error("tile dims {dims:?} must be non-empty and positive, with at most 2^20 tiles in all")]
    BadTileDims {
        /// The dims.
        dims: Vec<usize>,
    },
    /// A tile-assignment list that is not a permutation of `0..n`.
    #[error("tile assignment {devices:?} is not a permutation of 0..{}", devices.len())]
    NotAPermutation {
        /// The list.
        devices: Vec<usize>,
    },
    /// A transpose permutation that is not a permutation of the dims.
    #[error("transpose {perm:?} is not a permutation of 0..{rank}")]
    BadTranspose {
        /// The permutation.
        perm: Vec<usize>,
        /// The rank it should permute.
        rank: usize,
    },
    /// More subgroup dims than tile dims.
    #[error("{subgroups} subgroup types for a tile assignment of rank {rank}")]
    TooManySubgroups {
        /// Number of subgroup types.
        subgroups: usize,
        /// Tile-assignment rank.
        rank: usize,
    },

    // ---- index maps -------------------------------------------------------------------
    /// The sharding tiles a different number of dims than the tensor has.
    #[error("sharding tiles {sharding_rank} dims but the tensor has rank {shape_rank}")]
    RankMismatch {
        /// Data dims tiled by the sharding.
        sharding_rank: usize,
        /// The tensor's rank.
        shape_rank: usize,
    },
    /// A dim does not divide evenly (strict mode).
    #[error(
        "dimension {dim} of size {size} cannot be split evenly into {shards} shards (use uneven mode for XLA's padded layout)"
    )]
    Indivisible {
        /// The dim.
        dim: usize,
        /// Its size.
        size: usize,
        /// Number of shards along it.
        shards: usize,
    },
    /// Index maps are not defined for an unreduced sharding (partial sums, not slices).
    #[error("an unreduced sharding holds partial values, not slices: it has no index map")]
    Unreduced,
    /// Index maps are not defined for a manual sharding.
    #[error("a manual sharding (or manual subgroup) has no index map")]
    Manual,
    /// A tuple sharding was used where one leaf is needed.
    #[error("a tuple sharding ({leaves} leaves) has no single index map: pick one leaf")]
    Tuple {
        /// Number of leaves.
        leaves: usize,
    },
    /// A tuple leaf index past the end.
    #[error("tuple sharding has {leaves} leaves, no leaf {index}")]
    NoSuchLeaf {
        /// The index asked for.
        index: usize,
        /// Number of leaves.
        leaves: usize,
    },
    /// The sharding's tile count differs from the device-assignment length.
    #[error(
        "the sharding tiles over {sharding_devices} devices but the device assignment has {assignment_devices}"
    )]
    DeviceCountMismatch {
        /// Devices the sharding names.
        sharding_devices: usize,
        /// Devices in the assignment.
        assignment_devices: usize,
    },
    /// A maximal sharding names a device past the device assignment.
    #[error(
        "maximal sharding names device {device} but the device assignment has {assignment_devices}"
    )]
    MaximalOutOfRange {
        /// The logical device.
        device: usize,
        /// Devices in the assignment.
        assignment_devices: usize,
    },

    // ---- logical devices (tf.distribute.TPUStrategy's wording) ------------------------
    /// `split_to_logical_devices`: one split per dim is needed.
    #[error(
        "Length of `partition_dimensions` ({partition_dims}) must be equal to the rank of `x` ({rank})."
    )]
    SplitRank {
        /// Number of partition dims given.
        partition_dims: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// `split_to_logical_devices`: a dim does not divide by its split.
    #[error(
        "Tensor shape at dimension {dim} ({size}) must be divisible by corresponding value specified by `partition_dimensions` ({split})."
    )]
    SplitIndivisible {
        /// The dim.
        dim: usize,
        /// Its size.
        size: usize,
        /// Its split.
        split: usize,
    },
    /// `split_to_logical_devices`: the splits must multiply to the logical devices.
    #[error(
        "Number of logical devices ({logical_devices}) does not match the number of partition splits specified ({splits})."
    )]
    SplitCount {
        /// Logical devices per replica.
        logical_devices: usize,
        /// Product of the splits.
        splits: usize,
    },
    /// `assign_to_logical_device`: the id must be below the logical-device count.
    #[error(
        "`logical_core_id` to assign must be lower then total number of logical devices per replica. Received logical device id {id} but there are only total of {logical_devices} logical devices in replica."
    )]
    LogicalDeviceOutOfRange {
        /// The id given.
        id: usize,
        /// Logical devices per replica.
        logical_devices: usize,
    },

    // ---- data ------------------------------------------------------------------------
    /// An array whose shape differs from the one the operation was given.
    #[error("array has shape {actual:?}, expected {expected:?}")]
    ArrayShape {
        /// The expected shape.
        expected: Vec<usize>,
        /// The array's shape.
        actual: Vec<usize>,
    },
    /// A different number of shards (or buffers) than the sharding has.
    #[error("{actual} shards given, the sharding has {expected}")]
    ShardCount {
        /// Shards the sharding has.
        expected: usize,
        /// Shards given.
        actual: usize,
    },
    /// A shard (or buffer) whose shape differs from its region's.
    #[error("shard for device {device} has shape {actual:?}, its region needs {expected:?}")]
    ShardShape {
        /// The device.
        device: DeviceId,
        /// The region's shape.
        expected: Vec<usize>,
        /// The shard's shape.
        actual: Vec<usize>,
    },
    /// The caller-provided output array of an assemble is not contiguous.
    #[error("the output array is not contiguous in row-major order")]
    OutputNotContiguous,
    /// A caller-provided buffer that is not contiguous in row-major order.
    #[error("buffer for device {device} is not contiguous in row-major order")]
    NotContiguous {
        /// The device.
        device: DeviceId,
    },

    // ---- SPMD: layouts, rules, propagation, transitions ----------------------------
    /// A layout names a mesh axis the mesh does not have.
    #[error("layout uses mesh axis {axis}, but the mesh has {axes} axes")]
    LayoutAxis {
        /// The axis index.
        axis: usize,
        /// The mesh's axis count.
        axes: usize,
    },
    /// A mesh position, or a dim of a layout, that is not there.
    #[error("{what} {index} is out of range ({count} of them)")]
    OutOfRange {
        /// What was asked for (`mesh position`, `dim`).
        what: &'static str,
        /// Its index.
        index: usize,
        /// How many there are.
        count: usize,
    },
    /// No layout over the mesh lowers to this sharding.
    #[error("sharding {sharding} is not a layout over mesh {mesh}")]
    NotOnMesh {
        /// The sharding (XLA text).
        sharding: String,
        /// The mesh.
        mesh: String,
    },
    /// An op rule that cannot describe an op.
    #[error("bad op rule: {problem}")]
    BadRule {
        /// What is wrong.
        problem: &'static str,
    },
    /// A propagation graph that is not well formed.
    #[error("bad propagation graph at node {node}: {problem}")]
    BadGraph {
        /// The node (`usize::MAX` for the graph as a whole).
        node: usize,
        /// What is wrong.
        problem: &'static str,
    },
    /// No sequence of collectives moves a value between these layouts.
    #[error("cannot move a value from {from} to {to}: {problem}")]
    Transition {
        /// The source layout.
        from: String,
        /// The target layout.
        to: String,
        /// Why not.
        problem: &'static str,
    },
}

/// `Result` with the sharding crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
