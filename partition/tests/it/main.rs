//! The partitioner's passes through their public API, with nothing run: what they
//! refuse and what they count. (Runs of partitioned and placed programs against one
//! device, over the JAX oracle's programs, are the strategy crate's tests.)

use meshwork_partition::placed::work;
use meshwork_partition::{Error, partition};
use meshwork_program::{Builder, Value};
use meshwork_sharding::Mesh;
use meshwork_sharding::spmd::Layout;
use meshwork_types::DType;

/// What the partitioner cannot do is a typed error that says what and where: an
/// indivisible dim (naming the value and dim, also for a value inside the program), a
/// layout of the wrong rank or another mesh, a pending parameter or result, a program
/// that already communicates.
#[test]
fn what_cannot_be_partitioned_is_a_typed_error() {
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)]).unwrap();
    let layout = |spec: &str, rank| Layout::from_spec(&mesh, &spec.parse().unwrap(), rank).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[5,4]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[4,6]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let z = b.name(z, "z").unwrap();
    let r = b.reshape(z, &[3, 10]).unwrap();
    let program = b.finish(&[r]).unwrap();

    let err = partition(&program, &mesh, &[Some(layout("P('data')", 2)), None], &[None]);
    let err = err.unwrap_err();
    assert!(
        matches!(&err, Error::Indivisible { value, dim: 0, size: 5, tiles: 2 } if value == "x"),
        "{err}"
    );
    // z [5, 6] tiled on dim 1 by w's columns is fine; asking the result [3, 10] for
    // rows over data is not.
    let err = partition(
        &program,
        &mesh,
        &[None, Some(layout("P(None, 'model')", 2))],
        &[Some(layout("P('data')", 2))],
    )
    .unwrap_err();
    assert!(matches!(&err, Error::Indivisible { dim: 0, size: 3, tiles: 2, .. }), "{err}");
    let err = partition(&program, &mesh, &[Some(layout("P()", 3)), None], &[None]).unwrap_err();
    assert!(err.to_string().contains("a rank-3 layout for a rank-2 value"), "{err}");
    let other = Mesh::iota(&[("a", 2), ("b", 2), ("c", 2)]).unwrap();
    let far = Layout::from_spec(&other, &"P('c')".parse().unwrap(), 2).unwrap();
    let err = partition(&program, &mesh, &[Some(far), None], &[None]).unwrap_err();
    assert!(err.to_string().contains("another mesh"), "{err}");
    let pending = Layout::new(&mesh, vec![vec![], vec![]], vec![1]).unwrap();
    let err = partition(&program, &mesh, &[Some(pending.clone()), None], &[None]).unwrap_err();
    assert!(err.to_string().contains("x (layout): a parameter cannot be a pending sum"), "{err}");
    let err = partition(&program, &mesh, &[None, None], &[Some(pending)]).unwrap_err();
    assert!(err.to_string().contains("a result cannot be a pending sum"), "{err}");
    let err = partition(&program, &mesh, &[None], &[None]).unwrap_err();
    assert!(err.to_string().contains("1 input and 1 output layouts"), "{err}");

    let mut b = Builder::new();
    let x = b.param("x", "f64[4]".parse().unwrap()).unwrap();
    let s = b.all_reduce(x, meshwork_types::ReduceOp::Sum, &[vec![0, 1]]).unwrap();
    let communicating = b.finish(&[s]).unwrap();
    let err = partition(&communicating, &mesh, &[None], &[None]).unwrap_err();
    assert!(err.to_string().contains("already communicates"), "{err}");
}

/// Work is counted from the program: 2 FLOPs per multiply-add of a contraction, one
/// element per element of cheap kernels, transcendentals apart.
#[test]
fn an_instructions_work_is_counted_from_its_shapes() {
    let mut b = Builder::new();
    let x = b.param("x", "f32[2,4,3]".parse().unwrap()).unwrap();
    let w = b.param("w", "f32[2,3,5]".parse().unwrap()).unwrap();
    let y = b.dot_general(x, w, &[2], &[1], &[0], &[0]).unwrap();
    let t = b.tanh(y).unwrap();
    let s = b.reduce_sum(t, &[1], false).unwrap();
    let d = b.convert(s, DType::F64).unwrap();
    let n = b.neg(d).unwrap();
    let p = b.finish(&[n]).unwrap();
    let of = |v: Value| work(&p, p.instr(v).unwrap());
    // Brute force: one multiply-add per (batch, row, column, contracted index).
    let mut madds = 0;
    for _ in 0..2 {
        for _ in 0..4 {
            for _ in 0..5 {
                for _ in 0..3 {
                    madds += 1;
                }
            }
        }
    }
    assert_eq!(of(y).matmul_flops, 2.0 * madds as f64);
    assert_eq!((of(t).transcendentals, of(t).elements), (40.0, 0.0));
    assert_eq!(of(s).elements, 40.0, "a reduction reads its operand");
    assert!(!of(d).wide && of(n).wide, "f64 work runs at f64 rates");
    assert!(of(y).elements == 0.0 && of(y).transcendentals == 0.0);
}

/// A layout constraint on a named value (JAX's `with_sharding_constraint`) is where
/// data moves: a weight split over `data`, read through an identity constrained whole,
/// is all-gathered there before the batch-split matmul reads it, and its gradient
/// path has nothing else to move; without the constraint the partitioner is free to
/// move the activations instead. A spec naming neither a parameter nor a named value
/// is refused.
#[test]
fn a_constrained_value_is_where_the_partitioner_gathers() {
    use meshwork_partition::spmd::{PartitionOptions, Shardings, partition_with};
    let mesh = Mesh::iota(&[("data", 2)]).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,16]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[16,4]".parse().unwrap()).unwrap();
    let whole = b.identity(w).unwrap();
    let whole = b.name(whole, "w.whole").unwrap();
    let z = b.matmul(x, whole).unwrap();
    let program = b.finish(&[z]).unwrap();
    let shardings = Shardings::new(mesh.clone())
        .with("x", "P('data')")
        .unwrap()
        .with("w", "P('data')")
        .unwrap()
        .with("w.whole", "P()")
        .unwrap();
    let inputs = shardings.layouts(&program).unwrap();
    let constraints = shardings.constraints(&program).unwrap();
    assert_eq!(constraints.len(), 1);
    assert_eq!(constraints[0].0, program.value_named("w.whole").unwrap().index());
    let options = PartitionOptions { constraints, ..PartitionOptions::default() };
    let part = partition_with(&program, &mesh, &inputs, &[None], &options).unwrap();
    let moved: Vec<(&str, &str)> =
        part.collectives().iter().map(|c| (c.op, c.value.as_str())).collect();
    assert_eq!(moved, [("all_gather", "w.whole")], "{}", part.program());
    // Unconstrained, the weight stays split and the matmul's contraction is what
    // the partitioner reconciles: no gather of the weight alone.
    let free = Shardings::new(mesh.clone()).with("x", "P('data')").unwrap().with("w", "P('data')");
    let inputs = free.unwrap().layouts(&program).unwrap();
    let part = partition_with(&program, &mesh, &inputs, &[None], &PartitionOptions::default());
    let part = part.unwrap();
    let moved: Vec<(&str, &str)> =
        part.collectives().iter().map(|c| (c.op, c.value.as_str())).collect();
    assert!(moved.iter().all(|&(op, _)| op != "all_gather"), "{}", part.program());

    let bad = Shardings::new(mesh.clone()).with("nowhere", "P()").unwrap();
    let err = bad.layouts(&program).unwrap_err();
    assert!(err.to_string().contains("no parameter or named value"), "{err}");
    let options = PartitionOptions {
        constraints: vec![(0, Layout::from_spec(&mesh, &"P()".parse().unwrap(), 2).unwrap())],
        ..PartitionOptions::default()
    };
    let inputs = [None, None];
    let err = partition_with(&program, &mesh, &inputs, &[None], &options).unwrap_err();
    assert!(err.to_string().contains("names an instruction"), "{err}");
}
