//! The consumer registry: which consumer id carries which tensors.

use std::collections::BTreeMap;

use meshwork_types::TensorSpec;
use serde::{Deserialize, Serialize};

use crate::{Error, Result, frame::SHUTDOWN};

/// A registered consumer: a name and the payload spec (a tuple of tensors).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Consumer {
    /// A name for logs and metrics.
    pub name: String,
    /// The tensors of every payload, in order.
    pub specs: Vec<TensorSpec>,
}

impl Consumer {
    /// Bytes of a payload with this spec.
    pub fn payload_len(&self) -> Result<usize> {
        self.specs.iter().try_fold(0usize, |acc, s| {
            let bytes = s.byte_size()?;
            acc.checked_add(bytes).ok_or_else(|| {
                Error::Types(meshwork_types::Error::ByteSizeOverflow {
                    shape: s.shape.clone(),
                    dtype: s.dtype,
                })
            })
        })
    }
}

/// Consumer ids and their payload specs, shared by sender and receiver (serde).
///
/// Id 0 is reserved for the shutdown marker; registering an id again is fine with the
/// same spec and an error with another (as in the seed).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Registry {
    consumers: BTreeMap<u32, Consumer>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Registers consumer `id`.
    pub fn register(
        &mut self,
        id: u32,
        name: &str,
        specs: Vec<TensorSpec>,
    ) -> Result<&mut Registry> {
        if id == SHUTDOWN {
            return Err(Error::ReservedConsumerId);
        }
        if let Some(previous) = self.consumers.get(&id) {
            if previous.specs != specs {
                return Err(Error::ConflictingSpec {
                    consumer: id,
                    previous: previous.specs.clone(),
                    new: specs,
                });
            }
            return Ok(self);
        }
        let consumer = Consumer { name: name.to_owned(), specs };
        consumer.payload_len()?;
        self.consumers.insert(id, consumer);
        Ok(self)
    }

    /// The consumer with this id.
    pub fn get(&self, id: u32) -> Option<&Consumer> {
        self.consumers.get(&id)
    }

    /// All consumers by id.
    pub fn consumers(&self) -> impl Iterator<Item = (u32, &Consumer)> {
        self.consumers.iter().map(|(&id, c)| (id, c))
    }
}
