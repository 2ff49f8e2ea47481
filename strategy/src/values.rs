//! Values that live on every replica.

use meshwork_executor::Tensor;

/// One value per replica, in replica order (`tf.distribute`'s `PerReplica`).
#[derive(Debug, Clone, PartialEq)]
pub struct PerReplica<T>(Vec<T>);

impl<T> PerReplica<T> {
    /// Wraps one value per replica.
    pub fn new(values: Vec<T>) -> PerReplica<T> {
        PerReplica(values)
    }

    /// The values in replica order (`experimental_local_results`).
    pub fn values(&self) -> &[T] {
        &self.0
    }

    /// Unwraps the values.
    pub fn into_values(self) -> Vec<T> {
        self.0
    }

    /// Replica `r`'s value.
    pub fn get(&self, r: usize) -> Option<&T> {
        self.0.get(r)
    }

    /// Number of replicas.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Applies `f` to every replica's value.
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> PerReplica<U> {
        PerReplica(self.0.into_iter().map(f).collect())
    }
}

/// An argument to [`Strategy::run`](crate::Strategy::run): one tensor every replica
/// sees, or one tensor per replica.
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// The same tensor on every replica.
    Shared(Tensor),
    /// Replica `r` sees the `r`-th tensor.
    PerReplica(PerReplica<Tensor>),
}

impl Arg {
    pub(crate) fn for_replica(&self, r: usize) -> &Tensor {
        match self {
            Arg::Shared(t) => t,
            Arg::PerReplica(p) => &p.0[r],
        }
    }
}
