//! Typed tensors as they travel in payloads: the host tensors (`meshwork_types::Tensor`)
//! as little-endian bytes, end to end.

use meshwork_types::{Tensor, TensorSpec};

use crate::{Error, Result};

/// Encodes `tensors` as the payload of `consumer`, checking them against `specs`.
pub fn encode_payload(
    consumer: u32,
    specs: &[TensorSpec],
    tensors: &[Tensor],
    out: &mut Vec<u8>,
) -> Result<()> {
    if tensors.len() != specs.len() {
        return Err(Error::TensorMismatch {
            consumer,
            index: tensors.len().min(specs.len()),
            actual: format!("{} tensors", tensors.len()),
            expected: format!("{} tensors", specs.len()),
        });
    }
    for (index, (t, spec)) in tensors.iter().zip(specs).enumerate() {
        let actual = t.spec();
        if &actual != spec {
            return Err(Error::TensorMismatch {
                consumer,
                index,
                actual: actual.to_string(),
                expected: spec.to_string(),
            });
        }
    }
    out.clear();
    for t in tensors {
        t.write_le_bytes(out);
    }
    Ok(())
}

/// Decodes a payload of `specs` (its length already checked).
pub fn decode_payload(specs: &[TensorSpec], payload: &[u8]) -> Vec<Tensor> {
    let mut at = 0;
    specs
        .iter()
        .map(|spec| {
            let len = spec.byte_size().expect("registered specs have a byte size");
            let t = Tensor::from_le_bytes(spec.dtype, spec.shape.dims(), &payload[at..at + len])
                .expect("the payload's length was checked against the specs");
            at += len;
            t
        })
        .collect()
}
