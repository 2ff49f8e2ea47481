//! The JAX oracle's programs (`program/testdata/cases.jsonl`) ready to partition: a
//! case's program, its `vjp`, its feeds, and a random mesh with random layouts of its
//! inputs; the checks against one device and JAX. Shared by the `it` binary and the
//! XLA binary (`tests/xla_oracle.rs`).

use meshwork_program::{Program, Tensor, Value, fast};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::sharding::spmd::Layout;
use serde_json::Value as Json;

#[path = "../../../program/tests/it/case.rs"]
pub(crate) mod case;

const MESHES: [&[(&str, usize)]; 10] = [
    &[("x", 1)],
    &[("x", 2)],
    &[("x", 4)],
    &[("x", 8)],
    &[("x", 3)],
    &[("x", 2), ("y", 2)],
    &[("x", 2), ("y", 4)],
    &[("x", 4), ("y", 2)],
    &[("x", 3), ("y", 2)],
    &[("x", 2), ("y", 2), ("z", 2)],
];

/// A small deterministic generator (a case's layouts depend on its index only).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        self.below(1 << 30) as f64 / (1u64 << 30) as f64
    }
}

/// A random layout of a value of `shape` over `mesh` whose tiles divide it: each axis
/// goes to a random dim (or none), in a random order; axes that would not divide are
/// left out.
pub(crate) fn random_layout(rng: &mut Rng, mesh: &Mesh, shape: &[usize]) -> Layout {
    let mut order: Vec<usize> = (0..mesh.shape().len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut dims = vec![Vec::new(); shape.len()];
    let mut tiles = vec![1usize; shape.len()];
    for a in order {
        // A dim it divides, three times in four.
        let fits: Vec<usize> = (0..shape.len())
            .filter(|&d| shape[d].is_multiple_of(tiles[d] * mesh.shape()[a]))
            .collect();
        if !fits.is_empty() && rng.below(4) > 0 {
            let d = fits[rng.below(fits.len())];
            tiles[d] *= mesh.shape()[a];
            dims[d].push(a);
        }
    }
    Layout::new(mesh, dims, Vec::new()).unwrap()
}

/// `got` equal to `want` in spec, and in values within `tol` (relative to 1 + |want|;
/// integers exactly).
pub(crate) fn close(got: &Tensor, want: &Tensor, tol: f64) -> Result<(), String> {
    if got.spec() != want.spec() {
        return Err(format!("{} vs {}", got.spec(), want.spec()));
    }
    let float = want.spec().dtype.is_float();
    for (k, (a, b)) in got.to_f64().iter().zip(want.to_f64()).enumerate() {
        let ok = if float { (a - b).abs() <= tol * (1.0 + b.abs()) } else { *a == b };
        if !ok {
            return Err(format!("element {k}: {a} vs {b}"));
        }
    }
    Ok(())
}

/// An oracle case ready to run: its program, its `vjp` program (outputs, then the
/// gradient of each f64 input), the feeds of the `vjp` program (inputs, then
/// cotangents) and the f64 inputs (index, name) gradients are taken of.
pub(crate) struct OracleCase {
    pub(crate) program: Program,
    pub(crate) back: Program,
    pub(crate) feed: Vec<Tensor>,
    wrt: Vec<(usize, String)>,
}

impl OracleCase {
    /// The case's vector-Jacobian program of `program` (the case's program, or it with
    /// device requests): outputs, then the gradients the case checks.
    pub(crate) fn vjp_of(&self, program: &Program) -> Result<Program, String> {
        let values: Vec<Value> = self.wrt.iter().map(|(k, _)| Value(*k as u32)).collect();
        meshwork_program::vjp(program, &values).map_err(|e| e.to_string())
    }

    pub(crate) fn new(case: &Json) -> Result<OracleCase, String> {
        let program = case::build(case).map_err(|e| e.to_string())?;
        let wrt: Vec<(usize, String)> = case["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .filter(|(_, i)| i["dtype"] == "f64")
            .map(|(k, i)| (k, i["name"].as_str().unwrap().to_string()))
            .collect();
        let values: Vec<Value> = wrt.iter().map(|(k, _)| Value(*k as u32)).collect();
        let back = meshwork_program::vjp(&program, &values).map_err(|e| e.to_string())?;
        let mut feed: Vec<Tensor> =
            case["inputs"].as_array().unwrap().iter().map(case::tensor).collect();
        feed.extend(
            case["cotangents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| !c.is_null())
                .map(case::tensor),
        );
        Ok(OracleCase { program, back, feed, wrt })
    }

    /// Checks `got` (the `vjp` program's results) against one device's run (relative
    /// 1e-12; `at` says where it ran) and against JAX's outputs and gradients (1e-9).
    pub(crate) fn check(
        &self,
        case: &Json,
        got: &[Tensor],
        at: &dyn Fn() -> String,
    ) -> Result<(), String> {
        let one = fast::evaluate(&self.back, &self.feed).map_err(|e| e.to_string())?;
        for (k, (g, w)) in got.iter().zip(&one).enumerate() {
            close(g, w, 1e-12).map_err(|e| format!("result {k} {}: {e}", at()))?;
        }
        let n = self.program.results().len();
        for (k, w) in case["expected"].as_array().unwrap().iter().enumerate() {
            close(&got[k], &case::tensor(w), 1e-9)
                .map_err(|e| format!("output {k} vs JAX: {e}"))?;
        }
        for (k, (_, name)) in self.wrt.iter().enumerate() {
            close(&got[n + k], &case::tensor(&case["grads"][name.as_str()]), 1e-9)
                .map_err(|e| format!("gradient of {name} vs JAX: {e}"))?;
        }
        Ok(())
    }
}

/// Case `index`'s random mesh (of 1 to 8 devices) and its inputs' random layouts that
/// divide them: of a few tries, the first on which some input is sharded.
pub(crate) fn random_mesh(index: usize, feed: &[Tensor]) -> (Mesh, Vec<Option<Layout>>) {
    let mut rng = Rng(index as u64 * 7919 + 17);
    let mut pick = None;
    for _ in 0..6 {
        let mesh = Mesh::iota(MESHES[rng.below(MESHES.len())]).unwrap();
        let layouts: Vec<Option<Layout>> =
            feed.iter().map(|t| Some(random_layout(&mut rng, &mesh, t.shape()))).collect();
        let sharded = layouts.iter().flatten().any(|l| !l.is_replicated());
        pick = Some((mesh, layouts));
        if sharded {
            break;
        }
    }
    pick.expect("six tries")
}
