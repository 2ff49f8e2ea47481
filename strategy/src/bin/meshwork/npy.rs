//! Reading NumPy `.npy` files (format versions 1–3, little-endian or single-byte
//! numbers, C order) into f64 arrays.

use ndarray::{ArrayD, IxDyn};

/// A `.npy` file's shape and values as f64, or what is wrong with it.
pub(crate) fn read(path: &str) -> Result<ArrayD<f64>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    parse(&bytes).map_err(|e| format!("{path} is not a readable .npy file: {e}"))
}

fn parse(bytes: &[u8]) -> Result<ArrayD<f64>, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("no NumPy magic".into());
    }
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => {
            (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12)
        }
        v => return Err(format!("unsupported format version {v}")),
    };
    let header = bytes.get(start..start + len).ok_or("header cut short")?;
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
    let inner = &inner[..inner.find(')').ok_or("bad shape")?];
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("bad shape {shape_text}")))
        .collect::<Result<_, _>>()?;
    let data = &bytes[start + len..];
    let n: usize = shape.iter().product();
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
    ArrayD::from_shape_vec(IxDyn(&shape), values).map_err(|e| e.to_string())
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
        let path = std::env::temp_dir().join(format!("meshwork-npy-{}.npy", std::process::id()));
        write_f64(path.to_str().unwrap(), &a).unwrap();
        assert_eq!(read(path.to_str().unwrap()).unwrap(), a.into_dyn());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.pop();
        assert!(parse(&bytes).unwrap_err().contains("data bytes"));
        assert!(parse(b"not numpy at all").unwrap_err().contains("magic"));
        std::fs::remove_file(path).unwrap();
    }
}
