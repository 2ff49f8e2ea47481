//! The one safetensors reader: a file's header read alone (within [`MAX_HEADER`] bytes)
//! and checked before any data is, then any box of a tensor read by its bytes alone.
//!
//! The header is held to the `safetensors` crate's validation (its [`Metadata`]: every
//! tensor's bytes `dtype × shape`, the tensors' ranges contiguous from the data's start
//! and not overlapping), to the file's size (the data end exactly where the file
//! does), and to unique names — JSON lets a key repeat and serde keeps the last, so a
//! second entry under one name would silently win; here it is refused, by name. Every
//! refusal is one line naming the file and, where there is one, the tensor.
//!
//! [`Metadata`]: safetensors::tensor::Metadata

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub use safetensors::Dtype;
use serde::de::{IgnoredAny, MapAccess, Visitor};

use crate::{Error, Result};

/// The most bytes a header may take (the `safetensors` crate's own bound).
pub const MAX_HEADER: u64 = 100_000_000;

/// One tensor as the header lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name in the file.
    pub name: String,
    /// Its element type as stored.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The file offset of its first byte.
    pub start: u64,
    /// Its bytes in the file.
    pub bytes: u64,
}

/// A safetensors file's header, checked: its tensors in the order of their data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Every tensor, ordered by where its data start.
    pub entries: Vec<Entry>,
    /// The `__metadata__` strings, if any.
    pub metadata: Option<HashMap<String, String>>,
    /// Where the data start in the file (8 bytes of length, then the header).
    pub data_start: u64,
    by_name: HashMap<String, usize>,
}

impl Header {
    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }
}

/// The bytes an element of `dtype` takes, `None` for those under a byte (`F4`).
pub fn element_bytes(dtype: Dtype) -> Option<usize> {
    let bits = dtype.bitsize();
    bits.is_multiple_of(8).then_some(bits / 8)
}

/// A header's top-level entries in file order, raw, with a repeated key refused.
struct Unique(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Unique {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Unique;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Unique, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        let _: IgnoredAny = map.next_value()?;
                        return Err(serde::de::Error::custom(format!(
                            "tensor {key} is listed twice (the last would silently win)"
                        )));
                    }
                    out.push((key, map.next_value()?));
                }
                Ok(Unique(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Checks the header text `json` of a file of `file_len` bytes whose header took
/// `n` bytes; the problem in words (naming the tensor where there is one).
pub fn parse_header(json: &[u8], n: u64, file_len: u64) -> std::result::Result<Header, String> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let Unique(raw) = <Unique as serde::Deserialize>::deserialize(&mut de)
        .map_err(|e| format!("its header: {e}"))?;
    de.end().map_err(|e| format!("its header: {e}"))?;
    let data_start = 8 + n;
    // The tensors in data order, each checked by name first, so a refusal names it.
    let mut listed = Vec::with_capacity(raw.len());
    let mut metadata = None;
    for (name, value) in raw {
        if name == "__metadata__" {
            metadata = Some(
                serde_json::from_value::<HashMap<String, String>>(value)
                    .map_err(|e| format!("its __metadata__: {e}"))?,
            );
            continue;
        }
        let info: safetensors::tensor::TensorInfo =
            serde_json::from_value(value).map_err(|e| format!("tensor {name}: {e}"))?;
        listed.push((name, info));
    }
    listed.sort_by_key(|(_, info)| info.data_offsets);
    let mut at = 0usize;
    let mut before: Option<&str> = None;
    for (name, info) in &listed {
        let (b, e) = info.data_offsets;
        let count = info.shape.iter().try_fold(1usize, |c, &d| c.checked_mul(d));
        let want = count.and_then(|c| element_bytes(info.dtype).and_then(|s| c.checked_mul(s)));
        if b != at {
            let problem = match before {
                Some(other) if b < at => format!("overlaps tensor {other}'s (..{at})"),
                _ if b < at => "overlaps another tensor's".to_string(),
                _ => format!("leaves a gap after byte {at}"),
            };
            return Err(format!("tensor {name}: its bytes {b}..{e} {problem}"));
        }
        before = Some(name);
        if e < b || Some(e - b) != want {
            return Err(format!(
                "tensor {name}: bytes {b}..{e} do not hold {:?} of {:?}",
                info.shape, info.dtype
            ));
        }
        at = e;
    }
    // The crate's own validation too, so nothing it refuses passes here.
    serde_json::from_slice::<safetensors::tensor::Metadata>(json)
        .map_err(|e| format!("its header: {e}"))?;
    let end = data_start.checked_add(at as u64);
    if end != Some(file_len) {
        return Err(format!(
            "its tensors end at byte {}, the file has {file_len}: cut short or padded",
            end.map_or("past 2^64".into(), |e| e.to_string())
        ));
    }
    let entries: Vec<Entry> = listed
        .into_iter()
        .map(|(name, info)| Entry {
            name,
            dtype: info.dtype,
            shape: info.shape,
            start: data_start + info.data_offsets.0 as u64,
            bytes: (info.data_offsets.1 - info.data_offsets.0) as u64,
        })
        .collect();
    let by_name = entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
    Ok(Header { entries, metadata, data_start, by_name })
}

/// A header of `n` bytes in a file of `len`: within [`MAX_HEADER`] and the file.
fn check_header_len(n: u64, len: u64) -> std::result::Result<(), String> {
    if n > MAX_HEADER || n > len.saturating_sub(8) {
        return Err(format!("not a safetensors file: a header of {n} bytes in a file of {len}"));
    }
    Ok(())
}

/// The header of a whole file held in `bytes`, or the problem in words.
pub fn parse(bytes: &[u8]) -> std::result::Result<Header, String> {
    let Some(head) = bytes.get(..8) else {
        return Err("not a safetensors file: no header length".into());
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    let len = bytes.len() as u64;
    check_header_len(n, len)?;
    parse_header(&bytes[8..8 + n as usize], n, len)
}

/// Reads and checks the header of the open file `file` of `len` bytes, or the
/// problem in words.
pub fn read_header(file: &File, len: u64) -> std::result::Result<Header, String> {
    let mut head = [0u8; 8];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| format!("not a safetensors file: no header length ({e})"))?;
    let n = u64::from_le_bytes(head);
    check_header_len(n, len)?;
    let mut json = vec![0u8; n as usize];
    file.read_exact_at(&mut json, 8).map_err(|e| format!("header cut short ({e})"))?;
    parse_header(&json, n, len)
}

/// Opens the regular file `path` (never waiting on a FIFO) and reads its header;
/// `what` names it in an error.
pub fn open(what: &str, path: &Path) -> Result<(File, Header)> {
    let (file, len) = crate::files::open_regular(what, path)?;
    let header = read_header(&file, len)
        .map_err(|p| Error::new(format!("{what}: {}: {p}", path.display())))?;
    Ok((file, header))
}

/// [`read_box_of`], its error naming the file as `what` names it.
pub fn read_box(
    what: &str,
    path: &Path,
    file: &File,
    entry: &Entry,
    ranges: &[Range<usize>],
) -> Result<Vec<u8>> {
    read_box_of(file, entry, ranges)
        .map_err(|p| Error::new(format!("{what}: {}: {p}", path.display())))
}

/// The bytes of box `ranges` (`[start, stop)` per dim) of tensor `entry` of `file`,
/// row-major: only the box's bytes are read, one run per row of the dims it does not
/// span whole. The box must lie inside the tensor; its bytes are reserved, not
/// assumed, so a box too big for memory is an error.
pub fn read_box_of(
    file: &File,
    entry: &Entry,
    ranges: &[Range<usize>],
) -> std::result::Result<Vec<u8>, String> {
    let name = &entry.name;
    let bad = |p: String| format!("tensor {name}: {p}");
    let shape = &entry.shape;
    if ranges.len() != shape.len()
        || ranges.iter().zip(shape).any(|(r, &d)| r.start > r.end || r.end > d)
    {
        return Err(bad(format!("no box {ranges:?} in {shape:?}")));
    }
    let size = element_bytes(entry.dtype)
        .ok_or_else(|| bad(format!("{:?} packs elements below a byte", entry.dtype)))?;
    let dims: Vec<usize> = ranges.iter().map(|r| r.end - r.start).collect();
    // Inside a tensor whose bytes the header check bounded: no product overflows.
    let count: usize = dims.iter().product();
    let mut out = Vec::new();
    out.try_reserve_exact(count * size)
        .map_err(|_| bad(format!("no memory for the {count} values of box {ranges:?}")))?;
    if count == 0 {
        return Ok(out);
    }
    // Trailing dims taken whole join one run, with the range of the dim before them.
    let rank = shape.len();
    let mut inner = rank;
    let mut run = 1;
    while inner > 0 && ranges[inner - 1] == (0..shape[inner - 1]) {
        run *= shape[inner - 1];
        inner -= 1;
    }
    if inner > 0 {
        run *= dims[inner - 1];
    }
    let strides: Vec<usize> = (0..rank).map(|d| shape[d + 1..].iter().product()).collect();
    let outer = inner.saturating_sub(1);
    let mut index: Vec<usize> = ranges[..outer].iter().map(|r| r.start).collect();
    let mut chunk = vec![0u8; run * size];
    loop {
        let mut flat: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
        if inner > 0 {
            flat += ranges[inner - 1].start * strides[inner - 1];
        }
        file.read_exact_at(&mut chunk, entry.start + (flat * size) as u64)
            .map_err(|e| bad(format!("cannot read its data: {e}")))?;
        out.extend_from_slice(&chunk);
        // The next outer index, the last dim fastest; done when every dim wrapped.
        let mut d = outer;
        let done = loop {
            if d == 0 {
                break true;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < ranges[d].end {
                break false;
            }
            index[d] = ranges[d].start;
        };
        if done {
            return Ok(out);
        }
    }
}

#[cfg(test)]
mod tests;
