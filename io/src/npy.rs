//! NumPy's `.npy`: files of format versions 1–3 (little-endian or single-byte numbers,
//! C order, any number of dims) read into f64 arrays within a byte limit, whole or by
//! rows; and arrays written as NumPy writes them.

use std::io::Read;
use std::path::Path;

use ndarray::{ArrayD, IxDyn};

use crate::files::open_regular;
use crate::{Error, Result};

/// A `.npy` file's shape and values as f64, or what is wrong with it, naming it `what`.
/// Reads only the bytes the header declares, and refuses a header of more than 1 MiB,
/// one that declares more than the file holds, or more than `limit` bytes of data
/// (counting the f64 values they become) — before allocating them. Only a regular
/// file is read (a FIFO or device is refused without waiting on it).
pub fn read(what: &str, path: &Path, limit: u64) -> Result<ArrayD<f64>> {
    read_within(what, path, limit).map_err(|e| match e {
        Problem::Usage(e) => e,
        Problem::Text(t) => Error::new(format!("{what}: {t}")),
    })
}

/// What went wrong: the opener's own error, or words about the file.
enum Problem {
    Usage(Error),
    Text(String),
}

impl From<String> for Problem {
    fn from(t: String) -> Problem {
        Problem::Text(t)
    }
}

/// Which rows of a file of a shape to read, or why its shape will not do.
pub type Wanted<'a> = dyn Fn(&[usize]) -> std::result::Result<Vec<bool>, String> + 'a;

/// The rows of a `.npy` file of at least one dim that `wanted(shape)` marks (or a
/// refusal in its words), each read alone at its offset, nothing else of the data:
/// its shape, the rows read in order, and their values as f64 (each row's elements in
/// turn). The header is checked as [`read`] checks it; `limit` bounds what the rows
/// read take.
pub fn read_rows(
    what: &str,
    path: &Path,
    limit: u64,
    wanted: &Wanted<'_>,
) -> Result<(Vec<usize>, Vec<usize>, Vec<f64>)> {
    use std::os::unix::fs::FileExt;
    let fail = |t: String| Error::new(format!("{what}: {t}"));
    let shown = path.display().to_string();
    let (mut file, size) = open_regular(what, path)?;
    let (header, start) = read_header(&mut file, size, &shown).map_err(fail)?;
    let Some(&n) = header.shape.first() else {
        return Err(fail(format!("{shown} holds a scalar, not rows")));
    };
    let bad = |e: String| fail(format!("{shown} is not a readable .npy file: {e}"));
    let want = header.count.checked_mul(header.size).ok_or_else(|| bad("too large".into()))?;
    if size - start as u64 != want as u64 {
        return Err(bad(format!(
            "the header declares {want} data bytes (shape {:?} of {}), the file holds {}",
            header.shape,
            header.descr,
            size - start as u64
        )));
    }
    let marks = wanted(&header.shape).map_err(fail)?;
    let per = header.count.checked_div(n).unwrap_or(0);
    let rows: Vec<usize> = (0..n).filter(|&r| marks.get(r).copied().unwrap_or(false)).collect();
    let bytes = rows.len().saturating_mul(per).saturating_mul(header.size + 8);
    if bytes as u64 > limit {
        return Err(bad(format!(
            "its {} rows read here need more than the {limit}-byte limit (--max-memory)",
            rows.len()
        )));
    }
    let row_bytes = per * header.size;
    let mut values = Vec::with_capacity(rows.len() * per);
    let mut buf = vec![0u8; row_bytes];
    let row_header =
        Header { descr: header.descr.clone(), shape: vec![per], count: per, size: header.size };
    for &r in &rows {
        file.read_exact_at(&mut buf, (start + r * row_bytes) as u64)
            .map_err(|e| bad(format!("row {r} cut short ({e})")))?;
        values.extend(decode(&row_header, &buf).map_err(bad)?.iter());
    }
    Ok((header.shape, rows, values))
}

/// A `.npy` file's header, read from `file` (of `size` bytes), and where its data
/// start.
fn read_header(
    file: &mut impl Read,
    size: u64,
    shown: &str,
) -> std::result::Result<(Header, usize), String> {
    let cannot = |e: std::io::Error| format!("cannot read {shown}: {e}");
    let bad = |e: String| format!("{shown} is not a readable .npy file: {e}");
    let mut head = [0u8; 12];
    let got = read_up_to(file, &mut head[..10]).map_err(cannot)?;
    if got < 10 || &head[..6] != b"\x93NUMPY" {
        return Err(bad("no NumPy magic".into()));
    }
    let (len, start) = match head[6] {
        1 => (u16::from_le_bytes([head[8], head[9]]) as usize, 10),
        2 | 3 => {
            file.read_exact(&mut head[10..12])
                .map_err(|e| bad(format!("header cut short ({e})")))?;
            (u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize, 12)
        }
        v => return Err(bad(format!("unsupported format version {v}"))),
    };
    if len > MAX_HEADER || (start + len) as u64 > size {
        return Err(bad(format!("its header claims {len} bytes, more than the file holds")));
    }
    let mut bytes = vec![0u8; len];
    file.read_exact(&mut bytes).map_err(|e| bad(format!("header cut short ({e})")))?;
    Ok((parse_header(&bytes).map_err(bad)?, start + len))
}

fn read_within(what: &str, path: &Path, limit: u64) -> std::result::Result<ArrayD<f64>, Problem> {
    let shown = path.display().to_string();
    let (mut file, size) = open_regular(what, path).map_err(Problem::Usage)?;
    Ok(read_array(&mut file, size, &shown, limit)?)
}

/// The array in `bytes`, a whole `.npy` file held in memory, checked as [`read`]
/// checks a file (`what` names it in an error).
pub fn from_bytes(what: &str, bytes: &[u8], limit: u64) -> Result<ArrayD<f64>> {
    let mut cursor = std::io::Cursor::new(bytes);
    read_array(&mut cursor, bytes.len() as u64, "the array", limit)
        .map_err(|t| Error::new(format!("{what}: {t}")))
}

/// The array of an input of `size` bytes read from its start: its header (as
/// [`read_header`] reads it), then its data, the data's bytes and the f64 values they
/// become checked against `limit` before either is allocated.
fn read_array(
    input: &mut impl Read,
    size: u64,
    shown: &str,
    limit: u64,
) -> std::result::Result<ArrayD<f64>, String> {
    let (header, start) = read_header(input, size, shown)?;
    let bad = |e: String| format!("{shown} is not a readable .npy file: {e}");
    // The raw bytes and the f64 values they become are held at once.
    let fits = |b: &usize| {
        header
            .count
            .checked_mul(8)
            .and_then(|d| d.checked_add(*b))
            .is_some_and(|t| t as u64 <= limit)
    };
    let want = header.count.checked_mul(header.size).filter(fits).ok_or_else(|| {
        bad(format!(
            "its shape {:?} of {} needs more than the {limit}-byte limit (--max-memory) to read",
            header.shape, header.descr
        ))
    })?;
    let have = size - start as u64;
    if have != want as u64 {
        return Err(bad(format!(
            "the header declares {want} data bytes (shape {:?} of {}), the file holds {have}",
            header.shape, header.descr
        )));
    }
    let mut data = vec![0u8; want];
    input
        .read_exact(&mut data)
        .map_err(|e| bad(format!("{want} data bytes declared, fewer present ({e})")))?;
    decode(&header, &data).map_err(bad)
}

/// The largest header read: headers are a short dict padded to 64 bytes.
pub const MAX_HEADER: usize = 1 << 20;

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// What a header says.
struct Header {
    descr: String,
    shape: Vec<usize>,
    count: usize,
    size: usize,
}

fn parse_header(header: &[u8]) -> Result<Header, String> {
    let header = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let descr = value(header, "descr").ok_or("no descr in the header")?;
    let quote =
        descr.chars().next().filter(|c| *c == '\'' || *c == '"').ok_or("descr is not a string")?;
    let descr = &descr[1..];
    let descr = &descr[..descr.find(quote).ok_or("descr is not a string")?];
    if value(header, "fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err("Fortran order is not supported; save with C order".into());
    }
    let shape_text = value(header, "shape").ok_or("no shape in the header")?;
    let inner = shape_text.trim_start_matches('(');
    let close = inner.find(')').ok_or("the header's shape has no closing parenthesis")?;
    let inner = &inner[..close];
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("bad shape ({inner})")))
        .collect::<Result<_, _>>()?;
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape ({inner}) has more elements than memory can address"))?;
    let size = match descr {
        "<f8" | "<i8" | "<u8" => 8,
        "<f4" | "<i4" | "<u4" => 4,
        "<i2" | "<u2" => 2,
        "|i1" | "|u1" | "|b1" => 1,
        other => {
            return Err(format!(
                "unsupported dtype {other:?} (want little-endian floats or integers)"
            ));
        }
    };
    Ok(Header { descr: descr.to_string(), shape, count, size })
}

fn decode(header: &Header, data: &[u8]) -> Result<ArrayD<f64>, String> {
    let (shape, descr) = (&header.shape, header.descr.as_str());
    let n = header.count;
    macro_rules! read {
        ($t:ty) => {{
            let size = std::mem::size_of::<$t>();
            if data.len() != n * size {
                return Err(format!("{} data bytes for shape {shape:?} of {descr}", data.len()));
            }
            data.chunks_exact(size)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("size")) as f64)
                .collect::<Vec<f64>>()
        }};
    }
    let values = match descr {
        "<f8" => read!(f64),
        "<f4" => read!(f32),
        "<i8" => read!(i64),
        "<i4" => read!(i32),
        "<i2" => read!(i16),
        "|i1" => read!(i8),
        "|u1" | "|b1" => read!(u8),
        "<u2" => read!(u16),
        "<u4" => read!(u32),
        "<u8" => read!(u64),
        other => {
            return Err(format!(
                "unsupported dtype {other:?} (want little-endian floats or integers)"
            ));
        }
    };
    ArrayD::from_shape_vec(IxDyn(shape), values).map_err(|e| e.to_string())
}

/// The text after `'key':` in a header dict, up to the end.
fn value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(&format!("'{key}'"))?;
    let rest = &header[at + key.len() + 2..];
    Some(rest.trim_start().strip_prefix(':')?.trim_start())
}

/// The magic, version and header of a `.npy` file of a C-order array of
/// `descr` (`<f8`, `<i4`) and `shape` (any number of dims), padded as NumPy pads it.
/// Tests use it to build damaged files.
pub fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [d] => format!("({d},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    // Version 1 holds a header of up to 65535 bytes; a longer one (a shape of very
    // many dims) is version 2's, whose length takes 4 bytes (and pads to 64 with them).
    match u16::try_from(header.len()) {
        Ok(n) => {
            let mut out = b"\x93NUMPY\x01\x00".to_vec();
            out.extend(n.to_le_bytes());
            out.extend(header.as_bytes());
            out
        }
        Err(_) => {
            header.pop();
            while !(12 + header.len() + 1).is_multiple_of(64) {
                header.push(' ');
            }
            header.push('\n');
            let mut out = b"\x93NUMPY\x02\x00".to_vec();
            out.extend((header.len() as u32).to_le_bytes());
            out.extend(header.as_bytes());
            out
        }
    }
}

/// A number `.npy` holds: its `descr` and little-endian bytes.
pub trait Element: Copy {
    /// NumPy's `descr` of it (`<f8`).
    const DESCR: &'static str;
    /// Appends its little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
}

macro_rules! element {
    ($t:ty, $d:literal) => {
        impl Element for $t {
            const DESCR: &'static str = $d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend(self.to_le_bytes());
            }
        }
    };
}
element!(f64, "<f8");
element!(f32, "<f4");
element!(i64, "<i8");
element!(i32, "<i4");

/// The bytes of a `.npy` file of `values` (row-major) of `shape`; `None` when the
/// count of values is not the shape's.
pub fn encode<T: Element>(shape: &[usize], values: &[T]) -> Option<Vec<u8>> {
    let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    if count != values.len() {
        return None;
    }
    let mut out = header(T::DESCR, shape);
    out.reserve(count * size_of::<T>());
    for &x in values {
        x.put(&mut out);
    }
    Some(out)
}

/// Writes an f64 array of any number of dims as `.npy` (whole or not at all).
pub fn write_f64<D: ndarray::Dimension>(
    path: &Path,
    a: &ndarray::Array<f64, D>,
) -> std::io::Result<()> {
    let values: Vec<f64> = a.iter().copied().collect();
    let bytes = encode(a.shape(), &values).expect("an array's values fill its shape");
    crate::files::write_atomic(path, &bytes)
}

#[cfg(test)]
mod tests;
