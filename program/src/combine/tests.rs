//! The combiner against the uncombined program: same results bit for bit under
//! collectives whose answer depends on the reduction and the replica groups, fewer
//! launches, never a combination of dependent all-reduces, and a program that reads
//! back through the builder.

use std::sync::Mutex;

use meshwork_types::ReduceOp;
use proptest::prelude::*;

use crate::{Builder, Env, Op, Program, Tensor, Value, fast, reference};

/// Collectives whose all-reduce is elementwise but tells reductions and replica groups
/// apart (a merge across them changes the numbers), and which records each launch's
/// element count.
#[derive(Default)]
struct Marked {
    launches: Mutex<Vec<usize>>,
}

impl crate::Collectives for Marked {
    fn replica_id(&self) -> usize {
        0
    }
    fn all_reduce(&self, x: Tensor, op: ReduceOp, groups: &[Vec<usize>]) -> crate::Result<Tensor> {
        self.launches.lock().unwrap().push(x.len());
        let shift = groups.len() as f64 + if op == ReduceOp::Sum { 0.0 } else { 0.25 };
        let d = x.shape().to_vec();
        Ok(Tensor::f64(&d, x.to_f64().iter().map(|v| 2.0 * v + shift).collect())?)
    }
    fn all_gather(&self, x: Tensor, _: usize, _: &[Vec<usize>]) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn reduce_scatter(
        &self,
        x: Tensor,
        _: ReduceOp,
        _: usize,
        _: &[Vec<usize>],
    ) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn all_to_all(&self, x: Tensor, _: usize, _: usize, _: &[Vec<usize>]) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn collective_permute(&self, x: Tensor, _: &[(usize, usize)]) -> crate::Result<Tensor> {
        Ok(x)
    }
}

fn all_reduces(p: &Program) -> usize {
    p.instrs().iter().filter(|i| matches!(i.op, Op::AllReduce { .. })).count()
}

/// Runs `p` with both interpreters under [`Marked`]; the results (bits) and the
/// launches' sizes.
fn run(p: &Program, feed: &[Tensor]) -> (Vec<Vec<u64>>, Vec<usize>) {
    let m = Marked::default();
    let env = Env::local().with_collectives(&m);
    let out = reference::evaluate_with(p, feed, &env).unwrap();
    let fast = fast::Executable::compile(p, fast::Options::default()).run(feed, &env).unwrap();
    let bits = |t: &Tensor| t.to_f64().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(out.iter().map(bits).collect::<Vec<_>>(), fast.iter().map(bits).collect::<Vec<_>>());
    let launches = m.launches.lock().unwrap();
    // Each run launched the same collectives.
    let half = launches.len() / 2;
    assert_eq!(launches[..half], launches[half..]);
    (out.iter().map(bits).collect(), launches[..half].to_vec())
}

/// A program of `steps`: each either an elementwise op of two earlier values, or an
/// all-reduce of an earlier value over one of two group sets with one of two
/// reductions; every value of rank 1 or 2 (a sum of a rank-2 value makes rank 1).
fn random_program(steps: &[(u8, usize, usize)]) -> (Program, Vec<Tensor>) {
    let mut b = Builder::new();
    let mut vals: Vec<Value> = vec![
        b.param("a", "f64[2,3]".parse().unwrap()).unwrap(),
        b.param("b", "f64[3]".parse().unwrap()).unwrap(),
    ];
    for &(kind, i, j) in steps {
        let x = vals[i % vals.len()];
        let y = vals[j % vals.len()];
        let v = match kind % 6 {
            0 => b.add(x, y).unwrap(),
            1 => b.mul(x, y).unwrap(),
            2 => b.all_reduce(x, ReduceOp::Sum, &[vec![0, 1]]).unwrap(),
            3 => b.all_reduce(x, ReduceOp::Sum, &[vec![0], vec![1]]).unwrap(),
            4 => b.all_reduce(x, ReduceOp::Max, &[vec![0, 1]]).unwrap(),
            _ => {
                let r = b.spec(x).unwrap().shape.rank();
                if r == 2 { b.reduce_sum(x, &[0], false).unwrap() } else { b.tanh(x).unwrap() }
            }
        };
        vals.push(v);
    }
    // Every value is a result, so nothing is dead.
    let p = b.finish(&vals[2..]).unwrap();
    let feed = vec![
        Tensor::f64(&[2, 3], vec![0.5, -1.0, 0.25, 2.0, -0.75, 1.5]).unwrap(),
        Tensor::f64(&[3], vec![0.125, -0.5, 1.0]).unwrap(),
    ];
    (p, feed)
}

proptest! {
    /// Combining keeps every result bit for bit (the collectives tell reductions and
    /// groups apart), never launches more all-reduces, and makes a program that reads
    /// back; a cap of 0 bytes combines nothing.
    #[test]
    fn prop_combined_programs_equal_the_uncombined(
        steps in prop::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 1..24),
    ) {
        let (p, feed) = random_program(&steps);
        let (want, launches) = run(&p, &feed);
        let c = p.combine_all_reduces(usize::MAX);
        let text = c.to_string();
        prop_assert_eq!(text.parse::<Program>().unwrap().to_string(), text.clone());
        let (got, combined) = run(&c, &feed);
        prop_assert_eq!(got, want);
        prop_assert!(combined.len() <= launches.len());
        prop_assert_eq!(combined.iter().sum::<usize>(), launches.iter().sum::<usize>());
        prop_assert_eq!(all_reduces(&c), combined.len());
        prop_assert_eq!(p.combine_all_reduces(0), p.clone());
    }
}

/// Independent all-reduces of one key become one launch, in order; one that reads
/// another's result is never in its combination; other keys stay apart; a byte cap
/// starts a new combination.
#[test]
fn independent_all_reduces_of_one_key_launch_once() {
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,2]".parse().unwrap()).unwrap();
    let y = b.param("y", "f64[3]".parse().unwrap()).unwrap();
    let g = [vec![0, 1]];
    let gx = b.all_reduce(x, ReduceOp::Sum, &g).unwrap();
    let gy = b.all_reduce(y, ReduceOp::Sum, &g).unwrap();
    // Reads gx: may not join gx's combination.
    let t = b.tanh(gx).unwrap();
    let gt = b.all_reduce(t, ReduceOp::Sum, &g).unwrap();
    // Another reduction: apart.
    let m = b.all_reduce(y, ReduceOp::Max, &g).unwrap();
    let s = b.reduce_sum(x, &[0, 1], false).unwrap();
    let gs = b.all_reduce(s, ReduceOp::Sum, &g).unwrap();
    let p = b.finish(&[gx, gy, gt, m, gs]).unwrap();
    let feed = [
        Tensor::f64(&[4, 2], (0..8).map(|k| k as f64 * 0.5 - 1.0).collect()).unwrap(),
        Tensor::f64(&[3], vec![1.0, -2.0, 0.5]).unwrap(),
    ];
    let (want, before) = run(&p, &feed);
    assert_eq!(before, vec![8, 3, 8, 3, 1]);
    let c = p.combine_all_reduces(usize::MAX);
    let (got, after) = run(&c, &feed);
    assert_eq!(got, want);
    // gx and gy in one launch (8 + 3); gt, which reads gx, opens the next, which gs
    // joins (8 + 1); the max alone.
    let mut sorted = after.clone();
    sorted.sort();
    assert_eq!(sorted, vec![3, 9, 11], "{c}");
    // The trace names each all-reduce's launch.
    let (c, trace) = p.combine_all_reduces_traced(usize::MAX);
    let launch = |v: Value| {
        let np = c.params().len();
        let instr = &c.instrs()[trace[v.index()].index() - np];
        assert!(matches!(instr.op, Op::AllReduce { .. }), "{c}");
        (trace[v.index()], instr.spec.shape.num_elements())
    };
    assert_eq!(launch(gx), launch(gy));
    assert_eq!(launch(gx).1, 11);
    assert_eq!(launch(gt), launch(gs));
    assert_ne!(launch(gt), launch(gx));
    assert_eq!(launch(m).1, 3);
    // An 80-byte cap (10 f64s): gy does not fit beside gx, nor gt beside gy; gs does
    // beside gt.
    let capped = p.combine_all_reduces(80);
    let (got, after) = run(&capped, &feed);
    assert_eq!(got, want);
    let mut sorted = after.clone();
    sorted.sort();
    assert_eq!(sorted, vec![3, 3, 8, 9], "{capped}");
    // Names stay on the members' results.
    let mut b = Builder::new();
    let x = b.param("x", "f64[2]".parse().unwrap()).unwrap();
    let a = b.all_reduce(x, ReduceOp::Sum, &g).unwrap();
    let a = b.name(a, "ga").unwrap();
    let c2 = b.all_reduce(x, ReduceOp::Sum, &g).unwrap();
    let p = b.finish(&[a, c2]).unwrap();
    let c = p.combine_all_reduces(usize::MAX);
    assert_eq!(all_reduces(&c), 1);
    assert!(c.value_named("ga").is_some(), "{c}");
}

/// Two keys whose all-reduces read each other's crosswise (a sum of a max's result
/// after a sum, a max of that first sum's result): combining both pairs would make
/// each combination wait for the other; the second pair stays apart.
#[test]
fn crosswise_dependencies_never_make_a_cycle() {
    let mut b = Builder::new();
    let x = b.param("x", "f64[2]".parse().unwrap()).unwrap();
    let g = [vec![0, 1]];
    let g1 = b.all_reduce(x, ReduceOp::Sum, &g).unwrap();
    let h1 = b.all_reduce(x, ReduceOp::Max, &g).unwrap();
    let t = b.tanh(h1).unwrap();
    let g2 = b.all_reduce(t, ReduceOp::Sum, &g).unwrap();
    let u = b.tanh(g1).unwrap();
    let h2 = b.all_reduce(u, ReduceOp::Max, &g).unwrap();
    let p = b.finish(&[g1, h1, g2, h2]).unwrap();
    let feed = [Tensor::f64(&[2], vec![0.5, -0.25]).unwrap()];
    let (want, _) = run(&p, &feed);
    let c = p.combine_all_reduces(usize::MAX);
    let (got, after) = run(&c, &feed);
    assert_eq!(got, want);
    assert_eq!(after.len(), 3, "{c}");
}
