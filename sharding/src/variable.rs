//! The variable-reshard state machine of TensorFlow's `TPUReshardVariables` op: a
//! variable remembers the format its data is in and moves between formats through the
//! unsharded default.

use ndarray::{ArrayD, ArrayViewD};

use crate::{Error, Mode, Result, Sharding, assemble, shard};

/// The layout a variable's data is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VariableFormat {
    /// Unsharded: one whole array (the seed's default key).
    Default,
    /// Sharded as `sharding`, named by `key`; two formats with the same key are the
    /// same format.
    Sharded {
        /// The format key.
        key: String,
        /// How the data is split.
        sharding: Sharding,
    },
}

impl VariableFormat {
    fn key(&self) -> Option<&str> {
        match self {
            VariableFormat::Default => None,
            VariableFormat::Sharded { key, .. } => Some(key),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Data<T> {
    Whole(ArrayD<T>),
    Shards(Vec<ArrayD<T>>),
}

/// A variable whose data can be moved between formats.
///
/// [`reshard`](Self::reshard) follows the seed: nothing to do when both formats are the
/// default or the keys are equal; otherwise unshard from the current (non-default)
/// format, shard into the new (non-default) one, and only then record the new format.
/// A failure at any step leaves the variable in its old format with its data intact.
#[derive(Debug, Clone, PartialEq)]
pub struct ReshardableVariable<T> {
    shape: Vec<usize>,
    mode: Mode,
    format: VariableFormat,
    data: Data<T>,
}

impl<T: Copy + Default + Send + Sync> ReshardableVariable<T> {
    /// A variable holding `value` in the default (unsharded) format; shards are laid out
    /// in `mode`.
    pub fn new(value: ArrayD<T>, mode: Mode) -> ReshardableVariable<T> {
        ReshardableVariable {
            shape: value.shape().to_vec(),
            mode,
            format: VariableFormat::Default,
            data: Data::Whole(value),
        }
    }

    /// A variable whose data is already laid out in `format`: `shards` in its
    /// sharding's index-map order, one per device (a compiled program's resident
    /// parts). The default format takes the whole value as its one shard. Copies of a
    /// replicated region are taken as given (nothing checks that they agree; reading
    /// the value assembles each region from its first holder). A shard
    /// count or shape other than the sharding's regions' in `mode` is refused
    /// ([`Error::ShardCount`], [`Error::ShardShape`]), as is an indivisible shape in
    /// strict mode.
    pub fn from_shards(
        shape: Vec<usize>,
        shards: Vec<ArrayD<T>>,
        format: VariableFormat,
        mode: Mode,
    ) -> Result<ReshardableVariable<T>> {
        let data = match &format {
            VariableFormat::Default => {
                let mut shards = shards;
                if shards.len() != 1 {
                    return Err(Error::ShardCount { expected: 1, actual: shards.len() });
                }
                let whole = shards.pop().expect("one shard");
                if whole.shape() != shape.as_slice() {
                    return Err(Error::ShardShape {
                        device: meshwork_types::DeviceId(0),
                        expected: shape,
                        actual: whole.shape().to_vec(),
                    });
                }
                Data::Whole(whole)
            }
            VariableFormat::Sharded { sharding, .. } => {
                let index = sharding.index_map(&shape, mode)?;
                crate::data::check_buffers(&index, shards.iter().map(|s| s.shape()))?;
                Data::Shards(shards)
            }
        };
        Ok(ReshardableVariable { shape, mode, format, data })
    }

    /// The value's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The current format.
    pub fn format(&self) -> &VariableFormat {
        &self.format
    }

    /// The shards, in the current sharding's index-map order (`None` when unsharded).
    pub fn shards(&self) -> Option<&[ArrayD<T>]> {
        match &self.data {
            Data::Shards(shards) => Some(shards),
            Data::Whole(_) => None,
        }
    }

    /// The whole value (assembled when sharded).
    pub fn value(&self) -> Result<ArrayD<T>> {
        match (&self.data, &self.format) {
            (Data::Whole(value), _) => Ok(value.clone()),
            (Data::Shards(shards), VariableFormat::Sharded { sharding, .. }) => {
                let views: Vec<ArrayViewD<'_, T>> = shards.iter().map(|s| s.view()).collect();
                assemble(&views, sharding, &self.shape, self.mode)
            }
            (Data::Shards(_), VariableFormat::Default) => {
                unreachable!("shards always have a sharding")
            }
        }
    }

    /// Moves the data into `new`. Returns whether anything changed.
    pub fn reshard(&mut self, new: VariableFormat) -> Result<bool> {
        let unchanged = match (self.format.key(), new.key()) {
            (None, None) => true,
            (Some(old), Some(new)) => old == new,
            _ => false,
        };
        if unchanged {
            return Ok(false);
        }
        // Unshard (to a temporary; the variable is untouched until the end).
        let whole = self.value()?;
        let data = match &new {
            VariableFormat::Default => Data::Whole(whole),
            VariableFormat::Sharded { sharding, .. } => {
                let shards = shard(&whole.view(), sharding, self.mode)?;
                Data::Shards(shards.into_iter().map(|s| s.data).collect())
            }
        };
        // Only now change the state.
        self.data = data;
        self.format = new;
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
