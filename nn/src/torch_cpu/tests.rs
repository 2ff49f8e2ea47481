//! Against PyTorch 2.15's own float32 kernels on the CPU (`testdata/torch_cpu`, made by
//! `gen_torch_cpu.py` there): every value bit for bit.

use super::*;
use meshwork_types::Tensor;

fn floats(name: &str) -> Vec<f32> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/torch_cpu").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The sizes `gen_torch_cpu.py` sums rows of.
const NS: [usize; 26] = [
    1, 7, 8, 9, 31, 32, 33, 63, 64, 96, 100, 128, 129, 511, 512, 576, 960, 1000, 1536, 2048, 2049,
    3072, 4096, 5120, 8192, 16384,
];

/// Row `r` of `n` values as the generator makes them.
fn row(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|k| (((r * 7919 + k * 104729) % 2000) as f64 / 250.0 - 4.0) as f32).collect()
}

/// `θ ** (arange(0, d, 2) / d)` for PyTorch's thetas and head dims, whole rows.
#[test]
fn pow_arange_is_pytorchs_bit_for_bit() {
    let t = floats("pow.bin");
    let mut at = 0;
    for theta in [1e4f32, 5e4, 1e5, 5e5, 1e6, 2e6, 8e6, 1.5e7] {
        for d in [8usize, 16, 32, 48, 64, 80, 96, 128, 160, 256] {
            let got = pow_arange(theta, d);
            for (i, g) in got.iter().enumerate() {
                let v = &t[3 * (at + i)..3 * (at + i) + 3];
                assert_eq!((v[0], v[1]), (theta, (2 * i) as f32 / d as f32));
                assert_eq!(g.to_bits(), v[2].to_bits(), "{theta}^(2·{i}/{d})");
            }
            at += got.len();
        }
    }
    assert_eq!(3 * at, t.len());
}

#[test]
fn row_sums_are_pytorchs_bit_for_bit() {
    let want = floats("sums.bin");
    assert_eq!(want.len(), 16 * NS.len());
    for (i, &n) in NS.iter().enumerate() {
        for r in 0..16 {
            assert_eq!(sum(&row(r, n)).to_bits(), want[16 * i + r].to_bits(), "row {r} of {n}");
        }
    }
}

/// The program [`sum_last`] writes adds in [`sum`]'s order on both interpreters, and
/// its gradient is a plain sum's (ones).
#[test]
fn the_ordered_sum_as_a_program_is_the_same_sum() {
    for n in [1, 3, 6, 8, 9, 33, 100, 576, 2049] {
        let mut b = Builder::new();
        let x = b.param("x", format!("f32[3,{n}]").parse().unwrap()).unwrap();
        let s = sum_last(&mut b, x).unwrap();
        let total = b.reduce_sum(s, &[0, 1], false).unwrap();
        let program = b.finish(&[s, total]).unwrap();
        let rows: Vec<f32> = (0..3).flat_map(|r| row(r, n)).collect();
        let input = Tensor::f32(&[3, n], rows.clone()).unwrap();
        let want: Vec<f32> = (0..3).map(|r| sum(&row(r, n))).collect();
        for out in [
            meshwork_program::fast::evaluate(&program, std::slice::from_ref(&input)).unwrap(),
            meshwork_program::reference::evaluate(&program, std::slice::from_ref(&input)).unwrap(),
        ] {
            let got: Vec<f32> = out[0].to_f64().iter().map(|&v| v as f32).collect();
            assert_eq!(got, want, "n {n}");
        }
        let g = meshwork_program::grad(&program, program.results()[1], &[Value(0)]).unwrap();
        let out = meshwork_program::fast::evaluate(&g, &[input]).unwrap();
        assert!(out.last().unwrap().to_f64().iter().all(|&v| v == 1.0), "n {n}");
    }
}
