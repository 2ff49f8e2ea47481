//! Wire format v1 and its codec.
//!
//! Every frame is a 20-byte little-endian header followed by the payload:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `271828` (the seed's first header word) |
//! | 4 | 4 | consumer id (the seed's second word; 0 = shutdown marker) |
//! | 8 | 2 | format version (1) |
//! | 10 | 2 | flags (0; reserved) |
//! | 12 | 4 | payload length in bytes |
//! | 16 | 4 | CRC32C of the payload |
//! | 20 | len | payload: the consumer's tensors, in spec order, each its elements in row-major order, little-endian (`bool` one byte) |
//!
//! The length comes before the payload, so a reader can skip a frame it cannot deliver
//! (unknown consumer, bad checksum) and stay in sync; it is checked against a cap
//! before anything is allocated.
//!
//! Frames that never leave the process (an in-process channel, which moves the payload
//! by pointer) carry CRC 0 and are not verified; a stream or file always carries the
//! checksum, and recording a channel to a file fills it in.

use std::io::{self, Read};

use crate::{Error, Result};

/// The seed's magic header word.
pub const MAGIC: u32 = 271_828;
/// The wire-format version this crate writes and reads.
pub const VERSION: u16 = 1;
/// Header bytes before the payload.
pub const HEADER_LEN: usize = 20;
/// The consumer id reserved for the shutdown marker.
pub const SHUTDOWN: u32 = 0;

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// The consumer id (0: shutdown).
    pub consumer: u32,
    /// Payload bytes.
    pub len: u32,
    /// CRC32C of the payload.
    pub crc: u32,
}

impl Header {
    /// The header of a frame carrying `payload` for `consumer`.
    pub fn for_payload(consumer: u32, payload: &[u8]) -> Result<Header> {
        Ok(Header { crc: crc32c::crc32c(payload), ..Header::unchecked(consumer, payload)? })
    }

    /// The header of a frame carrying `payload` for `consumer` through an in-process
    /// channel: no checksum (`crc` 0), since the payload moves by pointer and is never
    /// copied or written to a medium.
    pub fn unchecked(consumer: u32, payload: &[u8]) -> Result<Header> {
        let len = u32::try_from(payload.len()).map_err(|_| Error::FrameTooLong {
            stream: 0,
            consumer,
            len: payload.len() as u64,
            cap: u32::MAX as u64,
        })?;
        Ok(Header { consumer, len, crc: 0 })
    }

    /// The shutdown marker's header.
    pub fn shutdown() -> Header {
        Header { consumer: SHUTDOWN, len: 0, crc: crc32c::crc32c(&[]) }
    }

    /// The 20 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&self.consumer.to_le_bytes());
        out[8..10].copy_from_slice(&VERSION.to_le_bytes());
        out[10..12].copy_from_slice(&0u16.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..20].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    /// Reads a header from its 20 bytes (`stream` names the source in errors).
    pub fn decode(bytes: &[u8; HEADER_LEN], stream: usize) -> Result<Header> {
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let magic = word(0);
        if magic != MAGIC {
            return Err(Error::BadMagic { stream, magic });
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != VERSION {
            return Err(Error::UnsupportedVersion { stream, version });
        }
        Ok(Header { consumer: word(4), len: word(12), crc: word(16) })
    }
}

/// A frame as read from a stream: header and payload (checksum not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    /// The header.
    pub header: Header,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

impl RawFrame {
    /// Checks the payload against the header's CRC32C.
    pub fn verify(&self, stream: usize) -> Result<()> {
        let actual = crc32c::crc32c(&self.payload);
        if actual == self.header.crc {
            Ok(())
        } else {
            Err(Error::Checksum {
                stream,
                consumer: self.header.consumer,
                expected: self.header.crc,
                actual,
            })
        }
    }
}

/// Reads one frame from a byte stream: `Ok(None)` at a clean end (between frames), an
/// error for a bad header, a frame over `max_payload` (before allocating) or a stream
/// that ends mid-frame. After a checksum error the reader is still in sync.
pub fn read_frame(
    reader: &mut dyn Read,
    stream: usize,
    max_payload: u32,
) -> Result<Option<RawFrame>> {
    let mut header = [0u8; HEADER_LEN];
    let got = read_full(reader, &mut header, stream)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(Error::Truncated { stream, got, needed: HEADER_LEN });
    }
    let header = Header::decode(&header, stream)?;
    if header.len > max_payload {
        return Err(Error::FrameTooLong {
            stream,
            consumer: header.consumer,
            len: header.len as u64,
            cap: max_payload as u64,
        });
    }
    let mut payload = vec![0u8; header.len as usize];
    let got = read_full(reader, &mut payload, stream)?;
    if got < payload.len() {
        return Err(Error::Truncated {
            stream,
            got: HEADER_LEN + got,
            needed: HEADER_LEN + payload.len(),
        });
    }
    Ok(Some(RawFrame { header, payload }))
}

/// Fills `buf` unless the stream ends first; returns the bytes read.
fn read_full(reader: &mut dyn Read, buf: &mut [u8], stream: usize) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(Error::Io { stream, error }),
        }
    }
    Ok(got)
}
