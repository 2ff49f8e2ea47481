//! The shardings of `tf.distribute.TPUStrategy`'s model-parallel helpers, with the
//! seed's checks in the seed's order and wording.

use crate::hlo::HloSharding;
use crate::tile::TileAssignment;
use crate::{Error, Result};

/// `experimental_split_to_logical_devices`: tile a tensor of `shape` into
/// `partition_dims[i]` pieces along dim `i` over `num_logical_devices` devices
/// (`{devices=[dims]<=[N]}`).
///
/// Checks, in the seed's order: one split per dim ([`Error::SplitRank`]), every dim
/// divisible by its split ([`Error::SplitIndivisible`]), the splits multiplying to the
/// number of logical devices ([`Error::SplitCount`]).
pub fn split_to_logical_devices(
    shape: &[usize],
    partition_dims: &[usize],
    num_logical_devices: usize,
) -> Result<HloSharding> {
    if partition_dims.len() != shape.len() {
        return Err(Error::SplitRank { partition_dims: partition_dims.len(), rank: shape.len() });
    }
    for (dim, (&size, &split)) in shape.iter().zip(partition_dims).enumerate() {
        if split == 0 || !size.is_multiple_of(split) {
            return Err(Error::SplitIndivisible { dim, size, split });
        }
    }
    let splits = partition_dims.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s));
    if splits != Some(num_logical_devices) {
        return Err(Error::SplitCount {
            logical_devices: num_logical_devices,
            splits: splits.unwrap_or(usize::MAX),
        });
    }
    if shape.is_empty() {
        // A scalar cannot be split; on one logical device it is simply replicated.
        return Ok(HloSharding::Replicated);
    }
    Ok(HloSharding::tile(TileAssignment::identity(partition_dims.to_vec())?))
}

/// `experimental_replicate_to_logical_devices`: every logical device holds the tensor.
pub fn replicate_to_logical_devices() -> HloSharding {
    HloSharding::Replicated
}

/// `experimental_assign_to_logical_device`: logical device `id` alone holds the tensor
/// (`{maximal device=id}`); `id` must be below `num_logical_devices`.
pub fn assign_to_logical_device(id: usize, num_logical_devices: usize) -> Result<HloSharding> {
    if id >= num_logical_devices {
        return Err(Error::LogicalDeviceOutOfRange { id, logical_devices: num_logical_devices });
    }
    Ok(HloSharding::Maximal { device: id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_checks_in_the_seeds_order_and_words() {
        // Rank first, even when the other checks would fail too.
        let err = split_to_logical_devices(&[10, 3], &[4], 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Length of `partition_dimensions` (1) must be equal to the rank of `x` (2)."
        );
        // Divisibility before the count.
        let err = split_to_logical_devices(&[10, 4], &[4, 1], 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Tensor shape at dimension 0 (10) must be divisible by corresponding value specified by `partition_dimensions` (4)."
        );
        let err = split_to_logical_devices(&[8, 6], &[1, 3], 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Number of logical devices (4) does not match the number of partition splits specified (3)."
        );
        assert_eq!(
            split_to_logical_devices(&[8, 6], &[2, 2], 4).unwrap().to_string(),
            "{devices=[2,2]<=[4]}"
        );
        assert_eq!(split_to_logical_devices(&[], &[], 1).unwrap(), HloSharding::Replicated);
    }

    #[test]
    fn replicate_and_assign() {
        assert_eq!(replicate_to_logical_devices().to_string(), "{replicated}");
        assert_eq!(assign_to_logical_device(3, 4).unwrap().to_string(), "{maximal device=3}");
        assert_eq!(
            assign_to_logical_device(4, 4).unwrap_err().to_string(),
            "`logical_core_id` to assign must be lower then total number of logical devices per replica. \
             Received logical device id 4 but there are only total of 4 logical devices in replica."
        );
    }
}
