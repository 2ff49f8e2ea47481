//! Tensors between their global form and their per-device layouts (split a feed,
//! assemble a result), the mesh's positions on the strategy's devices, and one run of
//! a partitioned program.

use meshwork_partition::spmd::Partitioned;
use meshwork_sharding::spmd::Layout;
use meshwork_sharding::{Mesh, Mode, assemble, shard};
use meshwork_types::{Element, Shape, Tensor, TensorSpec, each_tensor, with_element};
use ndarray::ArrayD;

use crate::{Error, Result, partition_error};

/// Splits global `t` into each mesh position's part under `layout` (never pending).
pub(crate) fn split(mesh: &Mesh, layout: &Layout, t: &Tensor) -> Result<Vec<Tensor>> {
    fn parts<T: Element>(a: &ArrayD<T>, s: &meshwork_sharding::Sharding) -> Result<Vec<Tensor>> {
        Ok(shard(&a.view(), s, Mode::Strict)?.into_iter().map(|p| T::wrap(p.data)).collect())
    }
    let sharding = layout.to_named(mesh)?.to_sharding(t.shape().len())?;
    each_tensor!(t, a => parts(a, &sharding))
}

/// How a fed parameter is split, worked out once: its layout as a sharding over the
/// mesh positions and each position's part's shape.
#[derive(Debug, Clone)]
pub(crate) struct FeedPlan {
    sharding: meshwork_sharding::Sharding,
    local: Vec<usize>,
}

impl FeedPlan {
    /// The plan for a value of global `shape` laid out by `layout` over `mesh`.
    pub(crate) fn new(mesh: &Mesh, layout: &Layout, shape: &[usize]) -> Result<FeedPlan> {
        let sharding = layout.to_named(mesh)?.to_sharding(shape.len())?;
        let local = layout.local_shape(mesh, shape)?;
        Ok(FeedPlan { sharding, local })
    }
}

/// [`split`] by `plan`, into buffers `take(position, spec)` hands out (a device's
/// pool: standard layout, of the part's spec), so a loop feeding the same shapes every
/// step writes into memory it already has.
pub(crate) fn split_with(
    plan: &FeedPlan,
    t: &Tensor,
    take: impl Fn(usize, &TensorSpec) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let local = TensorSpec::new(t.dtype(), Shape::new(&plan.local)?);
    let n = plan.sharding.device_assignment().len();
    let mut bufs: Vec<Tensor> = (0..n).map(|r| take(r, &local)).collect::<Result<_>>()?;
    fn fill<T: Element>(plan: &FeedPlan, global: &ArrayD<T>, bufs: &mut [Tensor]) -> Result<()> {
        let local = &plan.local;
        let mut outs = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            let (dtype, shape) = (b.dtype(), b.shape().to_vec());
            match T::unwrap_mut(b) {
                Some(o) if o.shape() == local.as_slice() => outs.push(o.view_mut()),
                _ => {
                    return Err(partition_error(
                        String::new(),
                        "split",
                        format!(
                            "a pooled buffer of {dtype}{shape:?} for a part of {}{local:?}",
                            T::DTYPE
                        ),
                    ));
                }
            }
        }
        // One part (one device, or every device a whole copy): a plain copy.
        if global.shape() == local.as_slice() {
            for o in &mut outs {
                o.assign(global);
            }
            return Ok(());
        }
        Ok(meshwork_sharding::shard_into(&global.view(), &plan.sharding, Mode::Strict, &mut outs)?)
    }
    each_tensor!(t, a => fill(plan, a, &mut bufs))?;
    Ok(bufs)
}

/// Assembles a global tensor of `shape` from each mesh position's part under `layout`
/// (never pending).
pub(crate) fn join(
    mesh: &Mesh,
    layout: &Layout,
    shape: &[usize],
    parts: &[Tensor],
) -> Result<Tensor> {
    if layout.is_replicated() || mesh.size() == 1 {
        return Ok(parts[0].clone());
    }
    let sharding = layout.to_named(mesh)?.to_sharding(shape.len())?;
    fn glue<T: Element>(
        parts: &[Tensor],
        sharding: &meshwork_sharding::Sharding,
        shape: &[usize],
    ) -> Result<Tensor> {
        let views = parts
            .iter()
            .map(|p| {
                p.as_array::<T>().map(|a| a.view()).ok_or(Error::DTypeMismatch {
                    what: "a value's parts",
                    expected: T::DTYPE,
                    actual: p.dtype(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(T::wrap(assemble(&views, sharding, shape, Mode::Strict)?))
    }
    with_element!(parts[0].dtype(), T => glue::<T>(parts, &sharding, shape))
}

impl crate::Strategy {
    /// The executor devices that run mesh positions `0..mesh.size()` (mesh position `r`
    /// on device `mesh.devices()[r]`) in this process: all of them, or, in a strategy
    /// spread over processes, this process's — which must be the consecutive
    /// positions whose devices it runs (process `p` of devices `d` running positions
    /// `p * d..`, every one of its devices used), as the executor numbers its
    /// replicas.
    pub(crate) fn mesh_placement(&self, mesh: &Mesh) -> Result<MeshRun> {
        let devices = self.runtime().devices();
        fn refuse<T>(problem: String) -> Result<T> {
            Err(partition_error(String::new(), "run", problem))
        }
        if self.is_multi_process() {
            let first = self.runtime().first_replica();
            let local = first..first + devices;
            let all = self.runtime().replicas();
            if mesh.size() != all {
                return refuse(format!(
                    "mesh {mesh} has {} positions; across processes a mesh uses every device of \
                     every process ({all})",
                    mesh.size()
                ));
            }
            // Every position is checked (not only this process's), so that every
            // process refuses the same meshes.
            let mut placement = Vec::with_capacity(devices);
            for (r, d) in mesh.devices().iter().enumerate() {
                let d = d.0 as usize;
                if d >= all || d / devices != r / devices {
                    return refuse(format!(
                        "mesh {mesh} puts position {r} on device {d}: across processes, process \
                         p (devices p * {devices}..) runs positions p * {devices}.."
                    ));
                }
                if local.contains(&r) {
                    placement.push(d - first);
                }
            }
            return Ok(MeshRun { local, placement });
        }
        let placement = mesh
            .devices()
            .iter()
            .map(|d| {
                let d = d.0 as usize;
                if d < devices {
                    Ok(d)
                } else {
                    refuse(format!("mesh {mesh} names device {d}; the strategy has {devices}"))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MeshRun { local: 0..mesh.size(), placement })
    }

    /// `part` compiled by the strategy's back end for its mesh's positions (this
    /// process's, and the others' through [`Spanning`](crate::backend::Spanning),
    /// when the strategy spreads over processes).
    pub(crate) fn compile_on_mesh(
        &self,
        part: &Partitioned,
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn crate::backend::SpmdExecutable>> {
        let n = part.mesh().size();
        let MeshRun { local, placement } = self.mesh_placement(part.mesh())?;
        if local.len() == n {
            return self.backend().compile_spmd(part, &placement, resident, carry);
        }
        let inner =
            self.backend().compile_spmd_local(part, local.clone(), &placement, resident, carry)?;
        // The results a step returns (those not carried), and which are replicated.
        let replicated = (0..part.outputs().len())
            .filter(|r| !carry.iter().any(|(c, _)| c == r))
            .map(|r| part.outputs()[r].is_replicated())
            .collect();
        Ok(Box::new(crate::backend::Spanning::new(
            inner,
            local,
            n,
            placement,
            resident.len(),
            replicated,
        )))
    }

    /// Runs a partitioned program once on the mesh's devices: `inputs` are the global
    /// parameters (split by their layouts), the results come back assembled. Each call
    /// moves every input in and every output out; [`compile`](crate::Strategy::compile)
    /// keeps state on the devices instead.
    pub fn run_partitioned(&self, p: &Partitioned, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let mesh = p.mesh();
        check_inputs(p.global(), inputs)?;
        let n = mesh.size();
        let mut per: Vec<Vec<Tensor>> = vec![Vec::with_capacity(inputs.len()); n];
        for (t, l) in inputs.iter().zip(p.inputs()) {
            for (r, part) in split(mesh, l, t)?.into_iter().enumerate() {
                per[r].push(part);
            }
        }
        let exe = self.compile_on_mesh(p, &vec![false; inputs.len()], &[])?;
        let per = per.into_iter().map(|feed| vec![feed]).collect();
        let mut outs: Vec<Vec<Tensor>> =
            exe.run(self, per, 0)?.into_iter().map(|mut o| o.remove(0)).collect();
        let global = p.global();
        let mut results = Vec::with_capacity(global.results().len());
        for (k, (v, l)) in global.results().iter().zip(p.outputs()).enumerate() {
            let parts: Vec<Tensor> =
                outs.iter_mut().map(|o| std::mem::replace(&mut o[k], placeholder())).collect();
            let shape = global.spec(*v).expect("a result").shape.dims().to_vec();
            results.push(join(mesh, l, &shape, &parts)?);
        }
        Ok(results)
    }
}

/// Where a mesh's positions run in this process: positions `local`, position
/// `local.start + i` on the executor's device `placement[i]` (every position, in one
/// process).
pub(crate) struct MeshRun {
    pub(crate) local: std::ops::Range<usize>,
    pub(crate) placement: Vec<usize>,
}

fn placeholder() -> Tensor {
    Tensor::bool(&[], vec![false]).expect("a scalar")
}

/// Checks that `inputs` are the program's parameters, by spec.
pub(crate) fn check_inputs(program: &meshwork_program::Program, inputs: &[Tensor]) -> Result<()> {
    if inputs.len() != program.params().len() {
        return Err(partition_error(
            String::new(),
            "run",
            format!("{} inputs for {} parameters", inputs.len(), program.params().len()),
        ));
    }
    for (t, p) in inputs.iter().zip(program.params()) {
        if t.spec() != p.spec {
            return Err(partition_error(
                p.name.clone(),
                "run",
                format!("fed {}, the parameter is {}", t.spec(), p.spec),
            ));
        }
    }
    Ok(())
}
