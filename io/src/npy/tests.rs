//! What NumPy writes reads back; what it does not is refused, naming the flag.

use super::*;

/// `read` with the flag `data-x`, its error as text.
fn read_text(path: &Path, limit: u64) -> std::result::Result<ArrayD<f64>, String> {
    read("--data-x", path, limit).map_err(|e| e.to_string())
}

#[test]
fn reads_what_numpy_writes_and_refuses_the_rest() {
    let a = ndarray::Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f64 * 0.5);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.npy");
    write_f64(&path, &a).unwrap();
    assert_eq!(read_text(&path, 1 << 30).unwrap(), a.clone().into_dyn());
    // Over the byte limit: refused before reading the data.
    let e = read_text(&path, 47).unwrap_err();
    assert!(e.starts_with("--data-x: ") && e.contains("limit"), "{e}");
    // 48 data bytes fit under 60, but not with the 48 bytes of f64 they become.
    assert!(read_text(&path, 60).unwrap_err().contains("limit"));
    assert!(read_text(&path, 96).is_ok());
    let good = std::fs::read(&path).unwrap();
    // Cut short, or with bytes beyond what the header declares.
    std::fs::write(&path, &good[..good.len() - 1]).unwrap();
    assert!(read_text(&path, 1 << 30).unwrap_err().contains("data bytes"));
    std::fs::write(&path, [&good[..], &[0u8; 8]].concat()).unwrap();
    assert!(read_text(&path, 1 << 30).unwrap_err().contains("data bytes"));
    // A header that claims a huge shape: refused without allocating it.
    let huge = String::from_utf8_lossy(&good).replace("(3, 2)", "(300000000000, 2)");
    let mut bytes = good[..10].to_vec();
    bytes.extend(huge.as_bytes()[10..].iter().take(good.len() - 10 - 48 + 6));
    std::fs::write(&path, &bytes).unwrap();
    let e = read_text(&path, 1 << 30).unwrap_err();
    assert!(e.contains("limit") || e.contains("header"), "{e}");
    // A version-1 header of length 0 (then bytes): an error, not a panic.
    std::fs::write(&path, b"\x93NUMPY\x01\x00\x00\x00abcdefgh").unwrap();
    assert!(read_text(&path, 1 << 30).is_err());
    // Not NumPy at all, an endless device, a directory.
    std::fs::write(&path, b"not numpy at all").unwrap();
    assert!(read_text(&path, 1 << 30).unwrap_err().contains("magic"));
    let e = read_text(Path::new("/dev/zero"), 1 << 30).unwrap_err();
    assert!(e.contains("a device, not a regular file"), "{e}");
    assert!(read_text(dir.path(), 1 << 30).unwrap_err().contains("directory"));
}

/// Every dtype NumPy writes little-endian reads as its values in f64.
#[test]
fn every_integer_and_float_dtype_reads_as_f64() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.npy");
    let cases: [(&str, Vec<u8>); 5] = [
        ("<f4", [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect()),
        ("<i4", [7i32, -3].iter().flat_map(|v| v.to_le_bytes()).collect()),
        ("<i8", [7i64, -3].iter().flat_map(|v| v.to_le_bytes()).collect()),
        ("|u1", vec![7, 250]),
        ("<u2", [7u16, 65535].iter().flat_map(|v| v.to_le_bytes()).collect()),
    ];
    let want = [[1.5, -2.0], [7.0, -3.0], [7.0, -3.0], [7.0, 250.0], [7.0, 65535.0]];
    for ((descr, data), want) in cases.into_iter().zip(want) {
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (2,), }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((header.len() as u16).to_le_bytes());
        bytes.extend(header.as_bytes());
        bytes.extend(data);
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(read_text(&path, 1 << 20).unwrap().into_raw_vec_and_offset().0, want, "{descr}");
    }
}

proptest::proptest! {
    /// What [`encode`] writes, [`read`] reads back: any shape of 0 to 4 dims (empty
    /// ones too), f64 and i32 alike; and [`read_rows`] reads the rows it is asked for.
    #[test]
    fn what_is_written_reads_back(
        shape in proptest::collection::vec(0usize..4, 0..5),
        seed in 0u64..1000,
    ) {
        let count: usize = shape.iter().product();
        let values: Vec<f64> = (0..count).map(|i| (i as f64 + seed as f64) * 0.25 - 3.0).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.npy");
        std::fs::write(&path, encode(&shape, &values).unwrap()).unwrap();
        let a = read("--x", &path, 1 << 20).unwrap();
        proptest::prop_assert_eq!(a.shape(), &shape[..]);
        proptest::prop_assert_eq!(a.iter().copied().collect::<Vec<f64>>(), values.clone());
        let ints: Vec<i32> = (0..count as i32).map(|i| i - 7).collect();
        std::fs::write(&path, encode(&shape, &ints).unwrap()).unwrap();
        let b = read("--x", &path, 1 << 20).unwrap();
        proptest::prop_assert!(b.iter().zip(&ints).all(|(x, &i)| *x == f64::from(i)));
        proptest::prop_assert!(encode(&shape, &values[..count.saturating_sub(1)]).is_none() || count == 0);
        if let Some(&n) = shape.first() {
            let every_other = |s: &[usize]| Ok((0..s[0]).map(|r| r % 2 == 0).collect());
            let (got_shape, rows, got) = read_rows("--x", &path, 1 << 20, &every_other).unwrap();
            proptest::prop_assert_eq!(&got_shape, &shape);
            let per = count.checked_div(n).unwrap_or(0);
            let want: Vec<f64> = rows
                .iter()
                .flat_map(|&r| ints[r * per..(r + 1) * per].iter().map(|&i| f64::from(i)))
                .collect();
            proptest::prop_assert_eq!(rows, (0..n).step_by(2).collect::<Vec<_>>());
            proptest::prop_assert_eq!(got, want);
        }
    }
}

/// A header too long for version 1's two length bytes (a shape of very many dims) is
/// written as version 2, and reads back; the same bytes read from memory alike.
#[test]
fn a_long_header_is_written_as_version_2() {
    let shape = vec![1usize; 25_000];
    let bytes = encode(&shape, &[2.5f64]).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x02\x00");
    let header_len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    assert!(header_len > 65_535 && (12 + header_len).is_multiple_of(64));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.npy");
    std::fs::write(&path, &bytes).unwrap();
    let a = read("--x", &path, 1 << 20).unwrap();
    assert_eq!((a.ndim(), a.iter().copied().collect::<Vec<_>>()), (25_000, vec![2.5]));
    assert_eq!(from_bytes("--x", &bytes, 1 << 20).unwrap(), a);
    assert!(from_bytes("--x", &bytes[..bytes.len() - 1], 1 << 20).is_err());
}
