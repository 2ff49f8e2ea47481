//! The trait programs stream data out through; `strategy` connects it to the outfeed.

use crate::Tensor;
use crate::runtime::ReplicaError;

/// Where [`ReplicaContext::emit`](crate::ReplicaContext::emit) sends a replica's
/// tensors: a consumer id picks the stream, as in the outfeed's registry.
///
/// Implementations must be safe to call from every device thread at once; calls from
/// one replica arrive in the order it made them.
pub trait OutfeedSink: Send + Sync {
    /// Takes `tensors` emitted by `replica` for `consumer_id`.
    fn emit(
        &self,
        replica: usize,
        consumer_id: u32,
        tensors: &[Tensor],
    ) -> Result<(), ReplicaError>;
}
