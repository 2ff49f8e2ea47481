//! Properties over random programs: a strategy builds random shape-compatible
//! compositions of 1–12 instructions (elementwise, broadcasting, `dot_general`,
//! reductions, layout ops, softmax, select, take), and
//!
//! - gradients equal central finite differences in f64;
//! - the fast interpreter equals the reference, for f32, f64, i32 and i64 programs;
//! - f32 is within 1e-3 of f64, relative to the output's largest magnitude;
//! - the text form prints, parses and prints the same;
//! - second-order autodiff of elementwise chains equals finite differences of the
//!   first-order gradient.

use meshwork_program::fast::{self, Executable, Options};
use meshwork_program::{Builder, Env, Program, Tensor, Value, grad, grad_remat, reference};
use meshwork_types::{DType, Shape, TensorSpec};
use proptest::prelude::*;

/// One step of a recipe: which op, which operands, an extra choice.
type Recipe = Vec<(u8, u8, u8, u8)>;

fn spec(dtype: DType, dims: &[usize]) -> TensorSpec {
    TensorSpec::new(dtype, Shape::new(dims).unwrap())
}

/// Builds a recipe's program: parameters `a [2,3]`, `b [3]`, `c [3,4]` of `dtype` and
/// integer `idx [4]` (values in 0..2), then one instruction per step on earlier values
/// (steps that do not fit the chosen operands pick a fallback that does). `smooth`
/// leaves out the ops with kinks, `differentiable` leaves out `stop_gradient` (whose
/// zero gradient finite differences do not see). Returns the program (results: the last value, and
/// for floats the sum of all its elements as a loss).
fn build(recipe: &Recipe, dtype: DType, smooth: bool, differentiable: bool) -> Program {
    let float = dtype.is_float();
    let mut b = Builder::new();
    let mut vals = vec![
        b.param("a", spec(dtype, &[2, 3])).unwrap(),
        b.param("b", spec(dtype, &[3])).unwrap(),
        b.param("c", spec(dtype, &[3, 4])).unwrap(),
    ];
    let idx = b.param("idx", spec(DType::I64, &[4])).unwrap();
    for &(kind, x, y, extra) in recipe {
        let v = vals[x as usize % vals.len()];
        let vd = b.spec(v).unwrap().shape.dims().to_vec();
        // Operands `w` that broadcast against `v`.
        let compatible: Vec<Value> = vals
            .iter()
            .copied()
            .filter(|&w| {
                let wd = b.spec(w).unwrap().shape.dims().to_vec();
                wd == vd || wd.is_empty() || (wd.len() == 1 && vd.last() == Some(&wd[0]))
            })
            .collect();
        let w = compatible[y as usize % compatible.len()];
        let rank = vd.len();
        let one = |b: &mut Builder| b.constant(1.0, dtype).unwrap();
        let out = match kind % 16 {
            0 if float => {
                let ops: &[fn(&mut Builder, Value) -> meshwork_program::Result<Value>] = if smooth {
                    &[
                        Builder::neg,
                        Builder::tanh,
                        Builder::logistic,
                        Builder::sin,
                        Builder::cos,
                        Builder::square,
                        Builder::gelu,
                    ]
                } else {
                    &[
                        Builder::neg,
                        Builder::tanh,
                        Builder::relu,
                        Builder::abs,
                        Builder::square,
                        Builder::gelu,
                        Builder::stop_gradient,
                    ]
                };
                let n = if differentiable && !smooth { ops.len() - 1 } else { ops.len() };
                ops[extra as usize % n](&mut b, v).unwrap()
            }
            0 => {
                let ops: &[fn(&mut Builder, Value) -> meshwork_program::Result<Value>] =
                    &[Builder::neg, Builder::abs, Builder::square, Builder::relu];
                ops[extra as usize % ops.len()](&mut b, v).unwrap()
            }
            1 => match extra % 3 {
                0 => b.add(v, w).unwrap(),
                1 => b.sub(v, w).unwrap(),
                _ => b.mul(v, w).unwrap(),
            },
            2 if float => {
                // Positive-domain ops on 1 + w².
                let sq = b.mul(w, w).unwrap();
                let o = one(&mut b);
                let pos = b.add(sq, o).unwrap();
                match extra % 4 {
                    0 => b.div(v, pos).unwrap(),
                    1 => b.log(pos).unwrap(),
                    2 => b.sqrt(pos).unwrap(),
                    _ => b.rsqrt(pos).unwrap(),
                }
            }
            3 if !smooth || float => {
                if extra % 2 == 0 {
                    b.max(v, w).unwrap()
                } else {
                    b.min(v, w).unwrap()
                }
            }
            4 if rank == 2 => {
                let rhs = vals.iter().copied().find(|&u| {
                    let ud = b.spec(u).unwrap().shape.dims().to_vec();
                    ud.len() == 2 && ud[0] == vd[1]
                });
                match rhs {
                    Some(r) if extra % 2 == 0 => b.matmul(v, r).unwrap(),
                    _ => b.dot_general(v, v, &[1], &[1], &[], &[]).unwrap(),
                }
            }
            4 if rank == 1 => b.dot_general(v, v, &[0], &[0], &[], &[]).unwrap(),
            5 if rank >= 1 => {
                let axis = (extra as usize % rank) as isize;
                let keep = extra & 8 != 0;
                match (extra / 16) % 3 {
                    0 => b.reduce_sum(v, &[axis], keep).unwrap(),
                    1 if float => b.reduce_mean(v, &[axis], keep).unwrap(),
                    _ => b.reduce_max(v, &[axis], keep).unwrap(),
                }
            }
            6 if rank >= 2 => {
                let perm: Vec<usize> = (0..rank).rev().collect();
                b.transpose(v, &perm).unwrap()
            }
            7 => {
                let n: usize = vd.iter().product();
                b.reshape(v, &[n]).unwrap()
            }
            8 if rank < 3 => {
                let mut to = vec![2];
                to.extend(&vd);
                b.broadcast_to(v, &to).unwrap()
            }
            9 if rank >= 1 && vd[0] >= 2 => {
                let start: Vec<usize> = (0..rank).map(|d| usize::from(d == 0)).collect();
                let step: Vec<usize> =
                    (0..rank).map(|d| if d == 0 { 1 + extra as usize % 2 } else { 1 }).collect();
                b.slice(v, &start, &vd, &step).unwrap()
            }
            10 if rank >= 1 => {
                let other = if b.spec(w).unwrap().shape.dims() == vd.as_slice() { w } else { v };
                b.concat(&[v, other], 0).unwrap()
            }
            11 if float && rank >= 1 => {
                if extra % 2 == 0 {
                    b.softmax(v, -1).unwrap()
                } else {
                    b.log_softmax(v, -1).unwrap()
                }
            }
            12 if !smooth => {
                let p = b.gt(v, w).unwrap();
                let wb = b.broadcast_to(w, &vd).unwrap();
                b.select(p, v, wb).unwrap()
            }
            13 if rank >= 1 && vd[0] >= 2 => b.take(v, idx, 0).unwrap(),
            14 if float => {
                // exp of a bounded value.
                let t = b.tanh(v).unwrap();
                b.exp(t).unwrap()
            }
            15 => {
                // Zeros around and between the elements (the gradient of a slice).
                let low: Vec<usize> = (0..rank).map(|d| (extra as usize >> d) % 2).collect();
                let high: Vec<usize> = (0..rank).map(|d| (extra as usize >> (d + 2)) % 2).collect();
                let interior: Vec<usize> =
                    (0..rank).map(|d| (extra as usize >> (d + 4)) % 2).collect();
                b.push(meshwork_program::Op::Pad { low, high, interior }, &[v]).unwrap()
            }
            _ => b.add(v, w).unwrap(),
        };
        vals.push(out);
    }
    let last = *vals.last().unwrap();
    let mut results = vec![last];
    if float {
        let rank = b.spec(last).unwrap().shape.rank();
        let axes: Vec<isize> = (0..rank as isize).collect();
        results.push(b.reduce_sum(last, &axes, false).unwrap());
    }
    b.finish(&results).unwrap()
}

/// Deterministic inputs for `program` from `seed`: floats in [-1.5, 1.5], integers in
/// -3..=3, indices in 0..2.
fn inputs(program: &Program, seed: u64) -> Vec<Tensor> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    program
        .params()
        .iter()
        .map(|p| {
            let dims = p.spec.shape.dims();
            let n = p.spec.shape.num_elements();
            match (p.name.as_str(), p.spec.dtype) {
                ("idx", _) => Tensor::i64(dims, (0..n).map(|_| (next() * 2.0) as i64).collect()),
                (_, DType::F64) => Tensor::f64(dims, (0..n).map(|_| next() * 3.0 - 1.5).collect()),
                (_, DType::F32) => {
                    Tensor::f32(dims, (0..n).map(|_| (next() * 3.0 - 1.5) as f32).collect())
                }
                (_, d @ (DType::BF16 | DType::F16)) => {
                    let v: Vec<f64> = (0..n).map(|_| next() * 3.0 - 1.5).collect();
                    Tensor::from_f64(d, dims, &v)
                }
                (_, DType::I32) => {
                    Tensor::i32(dims, (0..n).map(|_| (next() * 7.0) as i32 - 3).collect())
                }
                _ => Tensor::i64(dims, (0..n).map(|_| (next() * 7.0) as i64 - 3).collect()),
            }
            .unwrap()
        })
        .collect()
}

/// `p` with device requests and colocations: for each pick `(v, d, c)`, value `v`
/// is requested on one of a few device specs (`d`), and if it is an instruction it is
/// colocated with an earlier value (`c`).
fn with_requests(p: &Program, picks: &[(u8, u8, u8)]) -> Program {
    const DEVICES: [&str; 5] = ["/device:CPU:1", "CPU:0", "/job:w/task:1", "/cpu:2", ""];
    let mut b = Builder::from_program(p).unwrap();
    let n = p.num_values();
    for &(v, d, c) in picks {
        let v = Value(u32::from(v) % n as u32);
        b.set_device(v, DEVICES[usize::from(d) % DEVICES.len()]).unwrap();
        if v.index() >= p.params().len() {
            b.colocate(v, Value(u32::from(c) % v.0)).unwrap();
        }
    }
    b.finish(p.results()).unwrap()
}

fn recipe() -> impl Strategy<Value = Recipe> {
    proptest::collection::vec(any::<(u8, u8, u8, u8)>(), 1..=12)
}

/// `|a - b| <= tol (1 + max |b|)` elementwise over finite `b` (a tolerance relative to
/// the scale of the tensor's finite elements); an infinity or NaN in either must be the
/// same in both; integers and bools compare exactly.
fn close(a: &Tensor, b: &Tensor, tol: f64) -> Result<(), String> {
    if a.spec() != b.spec() {
        return Err(format!("{} vs {}", a.spec(), b.spec()));
    }
    let (x, y) = (a.to_f64(), b.to_f64());
    let scale = 1.0 + y.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
    for (k, (p, q)) in x.iter().zip(&y).enumerate() {
        let ok = if !a.spec().dtype.is_float() {
            p == q
        } else if p.is_finite() && q.is_finite() {
            (p - q).abs() <= tol * scale
        } else {
            p == q || (p.is_nan() && q.is_nan())
        };
        if !ok {
            return Err(format!("element {k}: {p} vs {q}"));
        }
    }
    Ok(())
}

/// Instructions no later instruction reads and no result returns (communicating ops
/// aside): what dead-code removal must leave none of.
fn unread(program: &Program) -> Vec<Value> {
    let np = program.params().len();
    (0..program.instrs().len())
        .map(|i| Value((np + i) as u32))
        .filter(|&v| {
            !program.results().contains(&v)
                && !program.instrs().iter().any(|j| j.args.contains(&v))
                && !program.instr(v).is_some_and(|i| i.op.communicates())
        })
        .collect()
}

fn loss_of(program: &Program, feed: &[Tensor]) -> f64 {
    let out = reference::evaluate(program, feed).unwrap();
    out[1].to_f64()[0]
}

proptest! {
    // 96 cases unless PROPTEST_CASES says otherwise (for longer hunts).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(96),
        ..ProptestConfig::default()
    })]

    /// Reverse-mode gradients of random f64 programs equal central differences.
    #[test]
    fn prop_gradients_equal_finite_differences(r in recipe(), seed in any::<u64>()) {
        let p = build(&r, DType::F64, false, true);
        let loss = p.results()[1];
        let wrt = [Value(0), Value(1), Value(2)];
        let g = grad(&p, loss, &wrt).unwrap();
        prop_assert!(unread(&g).is_empty(), "dead code {:?} in\n{}", unread(&g), g);
        let feed = inputs(&p, seed);
        let l0 = loss_of(&p, &feed);
        prop_assume!(l0.is_finite() && l0.abs() < 1e6);
        let grads = fast::evaluate(&g, &feed).unwrap();
        let h = 1e-5;
        for (k, _) in wrt.iter().enumerate() {
            let analytic = grads[1 + k].to_f64();
            for (i, &ga) in analytic.iter().enumerate() {
                let shifted = |d: f64| {
                    let mut f = feed.clone();
                    let mut x = f[k].to_f64();
                    x[i] += d;
                    f[k] = Tensor::f64(f[k].shape(), x).unwrap();
                    loss_of(&p, &f)
                };
                let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
                let tol = 1e-5 * (1.0 + ga.abs()) + 1e-10 * (1.0 + l0.abs()) / h;
                prop_assert!((fd - ga).abs() <= tol, "param {} [{}]: autodiff {} vs fd {}\n{}", k, i, ga, fd, g);
            }
        }
    }

    /// Rematerialization changes where values come from, never what they are: with
    /// random regions, `grad_remat`'s results equal `grad`'s exactly (the reference
    /// interpreter runs both), and its program keeps no dead code.
    #[test]
    fn prop_rematerialized_gradients_equal_plain_ones(
        r in recipe(),
        cuts in proptest::collection::vec(any::<u8>(), 0..6),
        seed in any::<u64>(),
    ) {
        let p = build(&r, DType::F64, false, false);
        let loss = p.results()[1];
        let wrt = [Value(0), Value(1), Value(2)];
        let n = p.instrs().len();
        // Consecutive regions between sorted cut points, every other one left out.
        let mut points: Vec<usize> = cuts.iter().map(|&c| c as usize % (n + 1)).collect();
        points.extend([0, n]);
        points.sort_unstable();
        points.dedup();
        let mut regions: Vec<std::ops::Range<usize>> = points
            .windows(2)
            .enumerate()
            .filter(|(k, _)| k % 2 == 0 || cuts.len() % 2 == 1)
            .map(|(_, w)| w[0]..w[1])
            .collect();
        // And a region nested in each long one.
        let inner: Vec<std::ops::Range<usize>> =
            regions.iter().filter(|r| r.len() >= 3).map(|r| r.start + 1..r.end - 1).collect();
        regions.extend(inner);
        let plain = grad(&p, loss, &wrt).unwrap();
        let remat = grad_remat(&p, loss, &wrt, &regions).unwrap();
        prop_assert!(unread(&remat).is_empty(), "dead code {:?} in\n{}", unread(&remat), remat);
        let feed = inputs(&p, seed);
        let want = reference::evaluate(&plain, &feed).unwrap();
        let got = reference::evaluate(&remat, &feed).unwrap();
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            let (a, b) = (a.to_f64(), b.to_f64());
            let same = a.iter().zip(&b).all(|(x, y)| x == y || (x.is_nan() && y.is_nan()));
            prop_assert!(same, "result {}: {:?} vs {:?}\n{}", k, a, b, remat);
        }
    }

    /// The fast interpreter (fused and unfused, one thread and two) equals the reference
    /// on random programs of every dtype.
    #[test]
    fn prop_the_fast_interpreter_equals_the_reference(
        r in recipe(),
        seed in any::<u64>(),
        dtype in prop::sample::select(vec![DType::F32, DType::F64, DType::I32, DType::I64]),
    ) {
        let p = build(&r, dtype, false, false);
        let feed = inputs(&p, seed);
        let want = reference::evaluate(&p, &feed);
        let tol = if dtype == DType::F32 { 1e-4 } else { 1e-10 };
        let streamed = Options { stream_bytes: 0, ..Options::default() };
        for options in [Options::default().threads(1), Options::default().threads(2), Options { fusion: false, ..Options::default() }, streamed, streamed.threads(1)] {
            let got = Executable::compile(&p, options).run(&feed, &Env::local());
            match (&got, &want) {
                (Ok(g), Ok(w)) => {
                    for (k, (a, b)) in g.iter().zip(w).enumerate() {
                        if let Err(e) = close(a, b, tol) {
                            prop_assert!(false, "{:?}: result {}: {}\n{}", options, k, e, p);
                        }
                    }
                }
                (Err(_), Err(_)) => {}
                _ => prop_assert!(false, "{:?}: fast {:?}, reference {:?}\n{}", options, got, want, p),
            }
        }
    }

    /// Half precision (bf16, f16) is computed in f32 and rounded as each value is
    /// stored: one random instruction (and the sum of its result) of either, by the
    /// fast interpreter (every option), is within one unit in the last place of the
    /// reference's (which computes in f64 and rounds), allowing for f32's own rounding
    /// of what it accumulates; bool and integer results are equal.
    #[test]
    fn prop_half_precision_is_computed_in_f32_and_rounded(
        r in recipe(),
        seed in any::<u64>(),
        dtype in prop::sample::select(vec![DType::BF16, DType::F16]),
    ) {
        let p = build(&r[..r.len().min(1)].to_vec(), dtype, false, false);
        let feed = inputs(&p, seed);
        let want = reference::evaluate(&p, &feed);
        let bits = if dtype == DType::BF16 { 8 } else { 11 };
        let streamed = Options { stream_bytes: 0, ..Options::default() };
        for options in [Options::default().threads(1), Options::default().threads(2), Options { fusion: false, ..Options::default() }, streamed] {
            let got = Executable::compile(&p, options).run(&feed, &Env::local());
            match (&got, &want) {
                (Ok(g), Ok(w)) => {
                    for (k, (a, b)) in g.iter().zip(w).enumerate() {
                        prop_assert_eq!(a.spec(), b.spec());
                        let (x, y) = (a.to_f64(), b.to_f64());
                        let scale = 1.0 + y.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
                        for (e, (u, v)) in x.iter().zip(&y).enumerate() {
                            let ok = if !(a.spec().dtype.is_float() && u.is_finite() && v.is_finite()) {
                                u == v || (u.is_nan() && v.is_nan())
                            } else {
                                let ulp = 2f64.powi(v.abs().max(u.abs()).max(1e-30).log2().floor() as i32 + 1 - bits);
                                (u - v).abs() <= ulp + 1e-5 * scale
                            };
                            prop_assert!(ok, "{:?}: result {} element {}: {} vs {}\n{}", options, k, e, u, v, p);
                        }
                    }
                }
                (Err(_), Err(_)) => {}
                _ => prop_assert!(false, "{:?}: fast {:?}, reference {:?}\n{}", options, got, want, p),
            }
        }
    }

    /// The same program in f32 stays within 1e-3 of f64 (relative to the output's
    /// largest magnitude) on inputs in [-1.5, 1.5].
    #[test]
    fn prop_f32_is_within_tolerance_of_f64(r in recipe(), seed in any::<u64>()) {
        let p64 = build(&r, DType::F64, true, true);
        let p32 = build(&r, DType::F32, true, true);
        let feed32 = inputs(&p32, seed);
        let feed64: Vec<Tensor> = feed32
            .iter()
            .map(|t| match t.spec().dtype {
                DType::F32 => Tensor::f64(t.shape(), t.to_f64()).unwrap(),
                _ => t.clone(),
            })
            .collect();
        let a = fast::evaluate(&p32, &feed32).unwrap();
        let b = fast::evaluate(&p64, &feed64).unwrap();
        let last = Tensor::f64(a[0].shape(), a[0].to_f64()).unwrap();
        prop_assume!(b[0].to_f64().iter().all(|x| x.is_finite() && x.abs() < 1e4));
        if let Err(e) = close(&last, &b[0], 1e-3) {
            prop_assert!(false, "{}\n{}", e, p64);
        }
    }

    /// Removing dead code leaves no unread instruction and the same results, bit for bit.
    #[test]
    fn prop_dead_code_removal_keeps_every_result(
        r in recipe(),
        seed in any::<u64>(),
        dtype in prop::sample::select(vec![DType::F64, DType::I64]),
    ) {
        let p = build(&r, dtype, false, false);
        let q = p.without_dead_code();
        prop_assert!(unread(&q).is_empty(), "dead code {:?} in\n{}", unread(&q), q);
        prop_assert_eq!(q.params(), p.params());
        prop_assert!(q.instrs().len() <= p.instrs().len());
        let feed = inputs(&p, seed);
        let (a, b) = (reference::evaluate(&p, &feed), reference::evaluate(&q, &feed));
        match (a, b) {
            (Ok(a), Ok(b)) => {
                let bits = |t: &Tensor| (t.spec(), t.to_f64().iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                prop_assert_eq!(a.iter().map(bits).collect::<Vec<_>>(), b.iter().map(bits).collect::<Vec<_>>());
            }
            // A removed instruction may have been the one that failed (a bad index).
            (Err(_), _) => {}
            (Ok(_), Err(e)) => prop_assert!(false, "{}\n{}", e, q),
        }
    }

    /// Random programs' text prints, parses back equal, and prints the same; so does
    /// their gradient program's.
    #[test]
    fn prop_random_programs_print_and_parse_back(
        r in recipe(),
        picks in proptest::collection::vec(any::<(u8, u8, u8)>(), 0..6),
    ) {
        let p = with_requests(&build(&r, DType::F64, false, false), &picks);
        let text = p.to_string();
        let back: Program = text.parse().unwrap();
        prop_assert_eq!(&back, &p);
        prop_assert_eq!(back.to_string(), text);
        let g = grad(&p, p.results()[1], &[Value(0), Value(2)]).unwrap();
        let gt = g.to_string();
        prop_assert_eq!(gt.parse::<Program>().unwrap().to_string(), gt);
    }

    /// Second order: the gradient of `sum(∂L/∂x)` (autodiff of the autodiff program)
    /// equals central differences of the first-order gradient, for elementwise chains.
    #[test]
    fn prop_second_order_equals_finite_differences(
        chain in proptest::collection::vec(0u8..8, 1..6),
        seed in any::<u64>(),
    ) {
        let mut b = Builder::new();
        let x = b.param("x", spec(DType::F64, &[4])).unwrap();
        let c = b.param("c", spec(DType::F64, &[4])).unwrap();
        let mut v = x;
        for op in chain {
            v = match op {
                0 => b.tanh(v),
                1 => b.sin(v),
                2 => b.logistic(v),
                3 => b.mul(v, c),
                4 => b.square(v),
                5 => b.gelu(v),
                6 => { let t = b.tanh(v).unwrap(); b.exp(t) }
                _ => b.mul(v, x),
            }
            .unwrap();
        }
        let loss = b.reduce_sum(v, &[0], false).unwrap();
        let p = b.finish(&[loss]).unwrap();
        let g1 = grad(&p, loss, &[x]).unwrap();
        let mut b2 = Builder::from_program(&g1).unwrap();
        let dx = g1.results()[1];
        let s = b2.reduce_sum(dx, &[0], false).unwrap();
        let p2 = b2.finish(&[s]).unwrap();
        let g2 = grad(&p2, s, &[x]).unwrap();
        let feed = inputs(&p, seed);
        let hv = fast::evaluate(&g2, &feed).unwrap()[1].to_f64();
        let sum_dx = |f: &[Tensor]| reference::evaluate(&g1, f).unwrap()[1].to_f64().iter().sum::<f64>();
        let h = 1e-5;
        for (i, &got) in hv.iter().enumerate() {
            let at = |d: f64| {
                let mut f = feed.clone();
                let mut xs = f[0].to_f64();
                xs[i] += d;
                f[0] = Tensor::f64(&[4], xs).unwrap();
                sum_dx(&f)
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            prop_assert!((fd - got).abs() <= 1e-5 * (1.0 + got.abs()), "[{}]: {} vs fd {}", i, got, fd);
        }
    }
}

/// Fusion really fuses: the MLP's gradient program runs its elementwise chains as
/// groups of several instructions (and gives the reference's results).
#[test]
fn elementwise_chains_fuse_into_groups() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F32, &[8, 4])).unwrap();
    let w = b.param("w", spec(DType::F32, &[4, 6])).unwrap();
    let bias = b.param("bias", spec(DType::F32, &[6])).unwrap();
    let z = b.matmul(x, w).unwrap();
    let z = b.add(z, bias).unwrap();
    let h = b.relu(z).unwrap();
    let t = b.tanh(h).unwrap();
    let loss = b.reduce_mean(t, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let g = grad(&p, loss, &[Value(1), Value(2)]).unwrap();
    let exe = Executable::compile(&g, Options::default());
    let groups = exe.fused_groups();
    assert!(groups.iter().any(|m| m.len() >= 3), "{groups:?}\n{g}");
    let feed = inputs(&p, 7);
    let (got, want) =
        (exe.run(&feed, &Env::local()).unwrap(), reference::evaluate(&g, &feed).unwrap());
    for (a, b) in got.iter().zip(&want) {
        close(a, b, 1e-5).unwrap();
    }
}

/// Chains that meet are merged: Adam's update (the `m` and `v` chains and the step
/// that reads both, three results) is one group, one pass over memory, and gives the
/// reference's results.
#[test]
fn chains_that_meet_fuse_into_one_group() {
    let mut b = Builder::new();
    let [p, g, m, v] =
        ["p", "g", "m", "v"].map(|n| b.param(n, spec(DType::F32, &[16, 8])).unwrap());
    let c = |b: &mut Builder, x: f64| b.constant(x, DType::F32).unwrap();
    let (b1, nb1, b2, nb2, eps, lr) = (
        c(&mut b, 0.9),
        c(&mut b, 0.1),
        c(&mut b, 0.999),
        c(&mut b, 0.001),
        c(&mut b, 1e-8),
        c(&mut b, 0.1),
    );
    let m0 = b.mul(b1, m).unwrap();
    let m1 = b.mul(nb1, g).unwrap();
    let m = b.add(m0, m1).unwrap();
    let g2 = b.mul(g, g).unwrap();
    let v0 = b.mul(b2, v).unwrap();
    let v1 = b.mul(nb2, g2).unwrap();
    let v = b.add(v0, v1).unwrap();
    // A bias correction computed from a scalar parameter: a group of its own shape,
    // open when the update reads it (a load, not a reason to split the update).
    let step = b.param("step", spec(DType::F32, &[])).unwrap();
    let one = c(&mut b, 1.0);
    let decayed = b.mul(b1, step).unwrap();
    let correction = b.sub(one, decayed).unwrap();
    let mhat = b.div(m, correction).unwrap();
    let root = b.sqrt(v).unwrap();
    let den = b.add(root, eps).unwrap();
    let u = b.div(mhat, den).unwrap();
    let d = b.mul(lr, u).unwrap();
    let new = b.sub(p, d).unwrap();
    let prog = b.finish(&[new, m, v]).unwrap();
    let exe = Executable::compile(&prog, Options::default());
    let groups = exe.fused_groups();
    // The update's 13 members in one group; the scalar's two in another.
    let shape = |v: &Value| prog.spec(*v).unwrap().shape.dims() == [16, 8];
    let update: Vec<_> = groups.iter().filter(|g| g.iter().any(shape)).collect();
    assert_eq!(update.len(), 1, "{groups:?}\n{prog}");
    assert_eq!(update[0].len(), 13, "{groups:?}\n{prog}");
    let feed = inputs(&prog, 3);
    let (got, want) =
        (exe.run(&feed, &Env::local()).unwrap(), reference::evaluate(&prog, &feed).unwrap());
    for (a, b) in got.iter().zip(&want) {
        close(a, b, 1e-5).unwrap();
    }
}

/// A profiled executable counts every step of every run by its kind (the op and its
/// shapes, or a fused group), and an unprofiled one keeps nothing.
#[test]
fn a_profile_counts_every_step_by_kind() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F32, &[8, 4])).unwrap();
    let w = b.param("w", spec(DType::F32, &[4, 6])).unwrap();
    let z = b.matmul(x, w).unwrap();
    let h = b.relu(z).unwrap();
    let t = b.tanh(h).unwrap();
    let p = b.finish(&[t]).unwrap();
    let feed = inputs(&p, 1);
    let plain = Executable::compile(&p, Options { profile: false, ..Options::default() });
    plain.run(&feed, &Env::local()).unwrap();
    assert_eq!(plain.profile(), None);
    let exe = Executable::compile(&p, Options { profile: true, ..Options::default() });
    for _ in 0..3 {
        exe.run(&feed, &Env::local()).unwrap();
    }
    let rows = exe.profile().unwrap();
    let kinds: Vec<&str> = rows.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(rows.len(), 2, "{kinds:?}");
    assert!(rows.iter().all(|r| r.count == 3 && r.seconds >= 0.0), "{rows:?}");
    assert!(kinds.contains(&"dot_general f32[8,6] <- [8, 4] [4, 6]"), "{kinds:?}");
    assert!(kinds.contains(&"fused [8, 6] 1 loads 1 outs: relu,tanh"), "{kinds:?}");
    // A product's operations: 3 runs of 8·6 results, each 4 multiply-adds (two
    // operations each); nothing else counts.
    let flops = |kind: &str| rows.iter().find(|r| r.kind.starts_with(kind)).unwrap().flops;
    assert_eq!(flops("dot_general"), 3.0 * 2.0 * 48.0 * 4.0);
    assert_eq!(flops("fused"), 0.0);
}

/// A batched product with two contracted dims counts `2 · result elements ·
/// contracted length` operations a run, the batch dims counted once (in the result).
#[test]
fn a_profile_counts_a_batched_products_operations() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F64, &[2, 3, 4, 5])).unwrap();
    let y = b.param("y", spec(DType::F64, &[2, 5, 4, 7])).unwrap();
    // Batch dim 0, contracting x's (2, 3) with y's (2, 1): result [2, 3, 7].
    let z = b.dot_general(x, y, &[2, 3], &[2, 1], &[0], &[0]).unwrap();
    let p = b.finish(&[z]).unwrap();
    assert_eq!(p.spec(z).unwrap().shape.dims(), &[2, 3, 7]);
    let exe = Executable::compile(&p, Options { profile: true, ..Options::default() });
    let feed = inputs(&p, 2);
    for _ in 0..2 {
        exe.run(&feed, &Env::local()).unwrap();
    }
    let rows = exe.profile().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    // One multiply-add per result element (2·3·7) and contracted pair (4·5), two
    // operations each, twice.
    let madds = (2 * 3 * 7) * (4 * 5);
    assert_eq!(rows[0].flops, 2.0 * 2.0 * madds as f64);
}

/// A causal mask (iotas and their comparison, which read no parameter) is computed
/// once when the program is compiled, not in every run, and the run's result is the
/// reference's.
#[test]
fn masks_that_read_no_parameter_are_computed_once() {
    let mut b = Builder::new();
    let s = b.param("s", spec(DType::F32, &[2, 5, 5])).unwrap();
    let qi = b.iota(DType::I32, &[5, 5], 0).unwrap();
    let ki = b.iota(DType::I32, &[5, 5], 1).unwrap();
    let mask = b.ge(qi, ki).unwrap();
    let masked = b.constant(-1e9, DType::F32).unwrap();
    let out = b.select(mask, s, masked).unwrap();
    let p = b.finish(&[out]).unwrap();
    let exe = Executable::compile(&p, Options { profile: true, ..Options::default() });
    let feed = inputs(&p, 5);
    let got = exe.run(&feed, &Env::local()).unwrap();
    close(&got[0], &reference::evaluate(&p, &feed).unwrap()[0], 1e-6).unwrap();
    let kinds: Vec<String> = exe.profile().unwrap().into_iter().map(|r| r.kind).collect();
    assert!(kinds.iter().all(|k| !k.starts_with("iota") && !k.starts_with("ge")), "{kinds:?}");
    assert!(kinds.iter().any(|k| k.starts_with("literal bool[5,5]")), "{kinds:?}");
}

/// Floats that read no parameter are not folded (the fast interpreter computes them
/// natively): a comparison of such floats stays in the run, and a fused group holding
/// them alongside members that read parameters still runs whole.
#[test]
fn floats_that_read_no_parameter_still_run_in_their_groups() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F32, &[4, 3])).unwrap();
    let c = b.constant(0.5, DType::F32).unwrap();
    let k = b.broadcast_to(c, &[4, 3]).unwrap();
    let y = b.add(x, k).unwrap();
    let z = b.mul(k, k).unwrap();
    let m = b.gt(z, k).unwrap();
    let p = b.finish(&[y, m]).unwrap();
    let feed = inputs(&p, 2);
    let want = reference::evaluate(&p, &feed).unwrap();
    for options in [Options::default(), Options { fusion: false, ..Options::default() }] {
        let got = Executable::compile(&p, options).run(&feed, &Env::local()).unwrap();
        for (a, b) in got.iter().zip(&want) {
            close(a, b, 1e-6).unwrap();
        }
    }
}

/// A scatter-add into a buffer that dies with it adds in place; into a parameter or a
/// value read again it copies first: all three give the reference's results, and the
/// value read again is left as it was.
#[test]
fn scatter_adds_into_dying_buffers_in_place() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F32, &[5, 3])).unwrap();
    let upd = b.param("upd", spec(DType::F32, &[4, 3])).unwrap();
    let idx = b.param("idx", spec(DType::I64, &[4])).unwrap();
    let zero = b.constant(0.0, DType::F32).unwrap();
    let zeros = b.broadcast_to(zero, &[5, 3]).unwrap();
    let dying = b.push(meshwork_program::Op::ScatterAdd { axis: 0 }, &[zeros, idx, upd]).unwrap();
    let from_param = b.push(meshwork_program::Op::ScatterAdd { axis: 0 }, &[x, idx, upd]).unwrap();
    let twice = b.mul(x, x).unwrap();
    let kept = b.push(meshwork_program::Op::ScatterAdd { axis: 0 }, &[twice, idx, upd]).unwrap();
    let after = b.add(twice, kept).unwrap();
    let p = b.finish(&[dying, from_param, after]).unwrap();
    let feed = inputs(&p, 9);
    let want = reference::evaluate(&p, &feed).unwrap();
    for options in [
        Options::default(),
        Options::default().threads(1),
        Options { fusion: false, ..Options::default() },
    ] {
        let got = Executable::compile(&p, options).run(&feed, &Env::local()).unwrap();
        for (a, b) in got.iter().zip(&want) {
            close(a, b, 1e-6).unwrap();
        }
    }
}

/// The comparison itself: an infinity or NaN in the reference neither widens the
/// tolerance of the other elements nor matches anything but itself.
#[test]
fn close_compares_non_finite_values_exactly_and_finite_ones_on_a_finite_scale() {
    let t = |v: Vec<f64>| Tensor::f64(&[v.len()], v).unwrap();
    // A finite element far off, beside an infinity both hold.
    assert!(close(&t(vec![0.0, f64::INFINITY]), &t(vec![5.0, f64::INFINITY]), 1e-9).is_err());
    assert!(close(&t(vec![1.0, f64::NAN]), &t(vec![1.0, f64::NAN]), 1e-9).is_ok());
    assert!(close(&t(vec![1.0, f64::INFINITY]), &t(vec![1.0, f64::NAN]), 1e-9).is_err());
    assert!(close(&t(vec![f64::NEG_INFINITY]), &t(vec![f64::INFINITY]), 1e-9).is_err());
    assert!(close(&t(vec![1e308]), &t(vec![f64::INFINITY]), 1e-9).is_err());
    assert!(close(&t(vec![f64::INFINITY]), &t(vec![1e308]), 1e-9).is_err());
    // Within tolerance of the finite elements' scale.
    assert!(
        close(&t(vec![100.0 + 1e-8, f64::INFINITY]), &t(vec![100.0, f64::INFINITY]), 1e-9).is_ok()
    );
    assert!(
        close(&t(vec![100.0 + 1e-5, f64::INFINITY]), &t(vec![100.0, f64::INFINITY]), 1e-9).is_err()
    );
}

/// Rematerialization holds one block's activations at a time: a chain of 8 blocks of
/// `tanh(x·W)` (a region each), differentiated with `grad_remat`, recomputes each
/// block's inner values in the backward pass, and the fast interpreter's plan of it
/// peaks lower than plain `grad`'s, with the same gradients.
#[test]
fn rematerialized_blocks_lower_the_peak_and_keep_the_gradients() {
    let mut b = Builder::new();
    let mut x = b.param("x", spec(DType::F64, &[64, 32])).unwrap();
    for i in 0..8 {
        x = b
            .scope(&format!("block{i}"), |b| {
                let w = b.param("w", spec(DType::F64, &[32, 32]))?;
                let h = b.matmul(x, w)?;
                let h = b.tanh(h)?;
                let s = b.logistic(h)?;
                let h = b.mul(h, s)?;
                b.add(x, h)
            })
            .unwrap();
    }
    // The blocks' scopes are the regions.
    let regions: Vec<std::ops::Range<usize>> =
        b.scope_spans().iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(b.scope_spans()[7].0, "block7");
    assert_eq!(regions[1], 5..10);
    assert_eq!(regions[7].end, b.instr_count());
    let loss = b.reduce_mean(x, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let wrt: Vec<Value> = (0..p.params().len()).map(|k| Value(k as u32)).skip(1).collect();
    let plain = grad(&p, loss, &wrt).unwrap();
    let remat = grad_remat(&p, loss, &wrt, &regions).unwrap();
    assert!(remat.instrs().len() > plain.instrs().len(), "nothing was recomputed:\n{remat}");
    let peak = |g: &Program| Executable::compile(g, Options::default()).peak_bytes();
    let (with, without) = (peak(&remat), peak(&plain));
    assert!(with * 10 < without * 8, "peak {with} with remat, {without} without");
    let feed = inputs(&p, 3);
    let got = Executable::compile(&remat, Options::default()).run(&feed, &Env::local()).unwrap();
    let want = reference::evaluate(&plain, &feed).unwrap();
    for (a, b) in got.iter().zip(&want) {
        close(a, b, 1e-12).unwrap();
    }
}

/// Regions outside the program, or overlapping, are refused.
#[test]
fn bad_rematerialization_regions_are_refused() {
    let mut b = Builder::new();
    let x = b.param("x", spec(DType::F64, &[3])).unwrap();
    let y = b.tanh(x).unwrap();
    let z = b.sin(y).unwrap();
    let loss = b.reduce_sum(z, &[0], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    // Past the program's 3 instructions; two that cross.
    let past = [0..2, 2..9];
    let crossing = [0..2, 1..3];
    for regions in [&past[..], &crossing[..]] {
        let e = grad_remat(&p, loss, &[Value(0)], regions).unwrap_err();
        assert!(e.to_string().contains("region"), "{e}");
    }
    // Nested ones are taken.
    assert!(grad_remat(&p, loss, &[Value(0)], &[0..3, 1..2]).is_ok());
}

/// `matmuls_in(bf16)`: a product of f32 values is taken in bf16 (its operands rounded
/// to bf16, the product rounded to bf16, then widened back to f32), as an independent
/// computation in Rust says; everything else stays f32; and the f32 weight's gradient
/// comes back in f32 through the conversions, within bf16's precision of plain f32's.
#[test]
fn products_in_bf16_round_their_operands_and_result_and_differentiate() {
    use meshwork_types::bf16;
    let build = |dtype: Option<DType>| {
        let mut b = Builder::new();
        let x = b.param("x", spec(DType::F32, &[4, 8])).unwrap();
        let w = b.param("w", spec(DType::F32, &[8, 3])).unwrap();
        let y = b.matmuls_in(dtype, |b| b.matmul(x, w)).unwrap();
        let t = b.tanh(y).unwrap();
        let loss = b.reduce_sum(t, &[0, 1], false).unwrap();
        let p = b.finish(&[y, loss]).unwrap();
        (p, loss)
    };
    let (p16, loss16) = build(Some(DType::BF16));
    let (p32, loss32) = build(None);
    let text = p16.to_string();
    assert!(text.contains("bf16[4,3] dot_general"), "{text}");
    assert_eq!(p16.spec(p16.results()[0]).unwrap().dtype, DType::F32);
    let feed = inputs(&p32, 11);
    let got = fast::evaluate(&p16, &feed).unwrap();
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let (x, w) = (feed[0].to_f64(), feed[1].to_f64());
    for i in 0..4 {
        for j in 0..3 {
            let dot: f32 =
                (0..8).map(|k| round(x[i * 8 + k] as f32) * round(w[k * 3 + j] as f32)).sum();
            assert_eq!(got[0].to_f64()[i * 3 + j], f64::from(round(dot)), "[{i},{j}]");
        }
    }
    let g16 = grad(&p16, loss16, &[Value(1)]).unwrap();
    let g32 = grad(&p32, loss32, &[Value(1)]).unwrap();
    assert!(g16.to_string().contains("bf16[8,3] dot_general"), "{g16}");
    let (a, b) = (fast::evaluate(&g16, &feed).unwrap(), fast::evaluate(&g32, &feed).unwrap());
    assert_eq!(a[1].spec(), b[1].spec());
    close(&a[1], &b[1], 3e-2).unwrap();
    assert!(close(&a[1], &b[1], 1e-6).is_err(), "the bf16 gradient is not f32's");
}
