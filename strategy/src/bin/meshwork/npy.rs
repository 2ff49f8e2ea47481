//! Reading NumPy `.npy` files (format versions 1–3, little-endian or single-byte
//! numbers, C order) into f64 arrays.

use ndarray::{ArrayD, IxDyn};

/// A `.npy` file's shape and values as f64, or what is wrong with it. Reads only the
/// bytes the header declares, refuses a header that declares more than the file holds
/// (where its size is known) or more than `limit` bytes of data, so a huge or endless
/// input (`/dev/zero`) cannot exhaust memory.
pub(crate) fn read(path: &str, limit: u64) -> Result<ArrayD<f64>, String> {
    use std::io::Read;
    let cannot = |e: std::io::Error| format!("cannot read {path}: {e}");
    let mut file = std::fs::File::open(path).map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    if meta.is_dir() {
        return Err(format!("{path} is a directory, not a .npy file"));
    }
    let size = meta.is_file().then_some(meta.len());
    let bad = |e: String| format!("{path} is not a readable .npy file: {e}");
    // Magic, version and header length (2 bytes in version 1, 4 in versions 2 and 3).
    let mut head = [0u8; 12];
    let got = read_up_to(&mut file, &mut head[..10]).map_err(cannot)?;
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
    // Headers are a short dict padded to 64 bytes; a megabyte is far beyond any.
    if len > 1 << 20 || size.is_some_and(|s| (start + len) as u64 > s) {
        return Err(bad(format!("its header claims {len} bytes, more than the file holds")));
    }
    let mut bytes = head[..start].to_vec();
    bytes.resize(start + len, 0);
    file.read_exact(&mut bytes[start..]).map_err(|e| bad(format!("header cut short ({e})")))?;
    let header = parse_header(&bytes[start..start + len]).map_err(bad)?;
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
    if let Some(s) = size {
        let have = s - (start + len) as u64;
        if have != want as u64 {
            return Err(bad(format!(
                "the header declares {want} data bytes (shape {:?} of {}), the file holds {have}",
                header.shape, header.descr
            )));
        }
    }
    let mut data = vec![0u8; want];
    file.read_exact(&mut data)
        .map_err(|e| bad(format!("{want} data bytes declared, fewer present ({e})")))?;
    decode(&header, &data).map_err(bad)
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_up_to(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
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

/// Writes a 2-D f64 array as `.npy` (used by tests and tools).
#[allow(dead_code)]
pub(crate) fn write_f64(path: &str, a: &ndarray::Array2<f64>) -> std::io::Result<()> {
    let shape = format!("({}, {})", a.nrows(), a.ncols());
    let mut header = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    for x in a.iter() {
        out.extend(x.to_le_bytes());
    }
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_numpy_writes_and_refuses_the_rest() {
        let a = ndarray::Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f64 * 0.5);
        let dir = std::env::temp_dir();
        let path = dir.join(format!("meshwork-npy-{}.npy", std::process::id()));
        let p = path.to_str().unwrap();
        write_f64(p, &a).unwrap();
        assert_eq!(read(p, 1 << 30).unwrap(), a.clone().into_dyn());
        // Over the byte limit: refused before reading the data.
        assert!(read(p, 47).unwrap_err().contains("limit"), "{}", read(p, 47).unwrap_err());
        // 48 data bytes fit under 60, but not with the 48 bytes of f64 they become.
        assert!(read(p, 60).unwrap_err().contains("limit"));
        assert!(read(p, 96).is_ok());
        let good = std::fs::read(&path).unwrap();
        // Cut short, or with bytes beyond what the header declares.
        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        assert!(read(p, 1 << 30).unwrap_err().contains("data bytes"));
        std::fs::write(&path, [&good[..], &[0u8; 8]].concat()).unwrap();
        assert!(read(p, 1 << 30).unwrap_err().contains("data bytes"));
        // A header that claims a huge shape: refused without allocating it.
        let huge = String::from_utf8_lossy(&good).replace("(3, 2)", "(300000000000, 2)");
        let mut bytes = good[..10].to_vec();
        bytes.extend(huge.as_bytes()[10..].iter().take(good.len() - 10 - 48 + 6));
        std::fs::write(&path, &bytes).unwrap();
        let e = read(p, 1 << 30).unwrap_err();
        assert!(e.contains("limit") || e.contains("header"), "{e}");
        // A version-1 header of length 0 (then bytes): an error, not a panic.
        std::fs::write(&path, b"\x93NUMPY\x01\x00\x00\x00abcdefgh").unwrap();
        assert!(read(p, 1 << 30).is_err());
        // Not NumPy at all, an endless device, a directory.
        std::fs::write(&path, b"not numpy at all").unwrap();
        assert!(read(p, 1 << 30).unwrap_err().contains("magic"));
        assert!(read("/dev/zero", 1 << 30).unwrap_err().contains("magic"));
        assert!(read(dir.to_str().unwrap(), 1 << 30).unwrap_err().contains("directory"));
        std::fs::remove_file(path).unwrap();
    }

    proptest::proptest! {
        /// Any bytes — random, or a valid file's cut, padded or mutated — read as an
        /// array or an error, never a panic or an allocation beyond the limit.
        #[test]
        fn prop_any_bytes_read_as_an_array_or_an_error(
            cut in 0usize..200,
            flips in proptest::collection::vec((0usize..200, proptest::prelude::any::<u8>()), 0..6),
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
        ) {
            let a = ndarray::Array2::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64);
            let dir = std::env::temp_dir();
            let path = dir.join(format!("meshwork-npy-prop-{}.npy", std::process::id()));
            let p = path.to_str().unwrap();
            write_f64(p, &a).unwrap();
            let mut bytes = std::fs::read(&path).unwrap();
            bytes.truncate(cut.max(1).min(bytes.len()));
            for (at, v) in flips {
                if let Some(b) = bytes.get_mut(at) {
                    *b = v;
                }
            }
            bytes.extend(tail);
            std::fs::write(&path, &bytes).unwrap();
            let _ = read(p, 1 << 20);
            std::fs::remove_file(&path).unwrap();
        }
    }
}
