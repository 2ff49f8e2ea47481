//! Scans every f32 and prints the largest error, in units in the last place, of the
//! fast interpreter's vectorizable `tanh` and `exp` ([`tanh_f32`], [`exp_f32`])
//! against the correctly rounded results (the library's f64 functions, rounded): the
//! bounds their docs state (tanh 8 ulp everywhere; exp 1 ulp wherever its result is a
//! normal number). About a minute.
//!
//! `cargo run --release -p meshwork-program --example float_scan`

#![allow(clippy::print_stdout, missing_docs)]

use meshwork_program::fast::{exp_f32, tanh_f32};

fn ulps(a: f32, b: f32) -> u64 {
    (i64::from(a.to_bits() as i32) - i64::from(b.to_bits() as i32)).unsigned_abs()
}

fn main() {
    let (mut tanh_worst, mut exp_worst) = ((0u64, 0f32), (0u64, 0f32));
    let mut nan_kept = true;
    for bits in 0..=u32::MAX {
        let x = f32::from_bits(bits);
        if x.is_nan() {
            nan_kept &= tanh_f32(x).is_nan() && exp_f32(x).is_nan();
            continue;
        }
        let t = tanh_f32(x);
        let want = f64::from(x).tanh() as f32;
        let u = if t == want { 0 } else { ulps(t, want) };
        if u > tanh_worst.0 {
            tanh_worst = (u, x);
        }
        let want = f64::from(x).exp() as f32;
        if want.is_normal() {
            let e = exp_f32(x);
            let u = if e == want { 0 } else { ulps(e, want) };
            if u > exp_worst.0 {
                exp_worst = (u, x);
            }
        }
    }
    println!("tanh: at most {} ulp (at x = {:e})", tanh_worst.0, tanh_worst.1);
    println!(
        "exp: at most {} ulp where the result is normal (at x = {:e})",
        exp_worst.0, exp_worst.1
    );
    println!("NaN stays NaN: {nan_kept}");
}
