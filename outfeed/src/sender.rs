//! The device side: encodes tensors into frames and hands them to a sink.

use crate::Tensor;
use crate::frame::Header;
use crate::tensor::encode_payload;
use crate::{Error, Registry, Result, Sink};

/// Sends frames for registered consumers through a [`Sink`]. Payload buffers come back
/// from stream sinks and are reused, so steady-state sends do not allocate.
pub struct Sender<S: Sink> {
    registry: Registry,
    sink: S,
    pool: Vec<Vec<u8>>,
    /// The consumer sent to last and its payload length, so a stream of one consumer's
    /// frames looks neither up again.
    last: Option<(u32, usize)>,
}

impl<S: Sink> Sender<S> {
    /// A sender for `registry`'s consumers.
    pub fn new(registry: Registry, sink: S) -> Sender<S> {
        Sender { registry, sink, pool: Vec::new(), last: None }
    }

    /// Sends `tensors` to `consumer`, checked against its spec.
    pub fn send(&mut self, consumer: u32, tensors: &[Tensor]) -> Result<()> {
        let spec = &self
            .registry
            .get(consumer)
            .ok_or(Error::UnknownConsumer { stream: 0, consumer })?
            .specs;
        let mut buf = self.pool.pop().unwrap_or_default();
        encode_payload(consumer, spec, tensors, &mut buf)?;
        self.send_raw(consumer, buf)
    }

    /// Sends an already-encoded payload to `consumer` (its length is checked).
    pub fn send_bytes(&mut self, consumer: u32, payload: Vec<u8>) -> Result<()> {
        let expected = match self.last {
            Some((id, len)) if id == consumer => len,
            _ => {
                let len = self
                    .registry
                    .get(consumer)
                    .ok_or(Error::UnknownConsumer { stream: 0, consumer })?
                    .payload_len()?;
                self.last = Some((consumer, len));
                len
            }
        };
        if payload.len() != expected {
            return Err(Error::PayloadMismatch {
                stream: 0,
                consumer,
                len: payload.len(),
                expected,
            });
        }
        self.send_raw(consumer, payload)
    }

    fn send_raw(&mut self, consumer: u32, payload: Vec<u8>) -> Result<()> {
        let header = if self.sink.checksummed() {
            Header::for_payload(consumer, &payload)?
        } else {
            Header::unchecked(consumer, &payload)?
        };
        if let Some(mut back) = self.sink.send(header, payload)? {
            back.clear();
            if self.pool.len() < 8 {
                self.pool.push(back);
            }
        }
        Ok(())
    }

    /// Sends the shutdown marker: the receiver's listener for this device finishes after
    /// delivering everything sent before it.
    pub fn shutdown(&mut self) -> Result<()> {
        self.sink.send(Header::shutdown(), Vec::new()).map(|_| ())
    }

    /// The sink back.
    pub fn into_sink(self) -> S {
        self.sink
    }
}
