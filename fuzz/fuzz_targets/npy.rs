//! Any bytes as a `.npy` file: read whole or by rows within a limit, or refused in
//! words; what reads has as many values as its shape says. Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_io::npy;

fuzz_target!(|data: &[u8]| {
    let dir = meshwork_fuzz::scratch("npy");
    let path = dir.join("x.npy");
    std::fs::write(&path, data).unwrap();
    if let Ok(a) = npy::read("--data-x", &path, 1 << 20) {
        assert_eq!(a.len(), a.shape().iter().product::<usize>());
    }
    let every_other = |s: &[usize]| Ok((0..s[0].min(1 << 16)).map(|r| r % 2 == 0).collect());
    if let Ok((shape, rows, values)) = npy::read_rows("--data-x", &path, 1 << 20, &every_other) {
        let per: usize = shape[1..].iter().product();
        assert_eq!(values.len(), rows.len() * per);
    }
});
