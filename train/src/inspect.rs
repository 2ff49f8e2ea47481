//! `meshwork inspect --model transformer`: the transformer's training step as each
//! device of a `data x model` mesh runs it, and what its collectives cost; with
//! `--backend xla`, the StableHLO module XLA compiles for it.

use std::collections::BTreeMap;

use meshwork_partition::spmd::{Shardings, megatron_spec};
use meshwork_program::Value;
use meshwork_sharding::Mesh;
use meshwork_strategy::Strategy;
use meshwork_types::DType;

use crate::config::{Config, ModelKind, OptimizerKind};
use crate::model::{Layout, Net};
use crate::plan::{MAX_DEVICES, heads_with_init, memory_error, transformer_from_flags};
use crate::{Error, Result, init};

/// The partitioned training step of the transformer `config` describes (its sizes,
/// `--init`, batch, optimizer, dtype, on `config.mesh`, default 1x2) as text: the
/// per-device program with its collectives, then a summary of them. A step estimated
/// to hold more than `config.max_memory` is refused before anything is built.
pub fn inspect(config: &Config) -> Result<String> {
    if config.model != ModelKind::Transformer {
        return Err(Error::usage("inspect needs --model transformer"));
    }
    let (data, m) = config.mesh.unwrap_or((1, 2));
    if data == 0 || m == 0 {
        return Err(Error::usage(format!(
            "--mesh {data}x{m}: a mesh needs at least one device along each axis"
        )));
    }
    let devices = data.checked_mul(m).filter(|&d| d <= MAX_DEVICES).ok_or_else(|| {
        Error::usage(format!("--mesh {data}x{m} has more than {MAX_DEVICES} devices"))
    })?;
    let batch = config.batch.unwrap_or(8);
    if batch == 0 || !batch.is_multiple_of(data) {
        return Err(Error::usage(format!("--batch {batch} does not split over {data} replicas")));
    }
    let optimizer = config.optimizer.unwrap_or(OptimizerKind::Adam).optimizer();
    let dtype = config.dtype.unwrap_or(DType::F32);
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(Error::usage(format!("--dtype {dtype} is not f32 or f64")));
    }
    let file = config.init.as_deref().map(|p| init::read_init(p, config.max_memory)).transpose()?;
    if file.is_some() && config.heads.is_none() {
        return Err(heads_with_init());
    }
    let model = transformer_from_flags(config, file.as_ref())?;
    if !model.heads.is_multiple_of(m) || !model.ffn.is_multiple_of(m) {
        return Err(Error::usage(format!(
            "--mesh {data}x{m}: the model axis must divide --heads {} and --ffn {}",
            model.heads, model.ffn
        )));
    }
    let net = Net::Transformer(model);
    let need = net.memory_estimate(batch, 1, dtype, devices, false);
    if need > config.max_memory as f64 {
        return Err(memory_error(need, config.max_memory));
    }
    let (program, loss) = net.loss_program(batch, dtype, Layout::Mesh { data, model: m })?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mesh = Mesh::iota(&[("data", data), ("model", m)]).map_err(Error::failed)?;
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')").map_err(Error::failed)?;
    for p in &program.params()[1..] {
        shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
    }
    let strategy = Strategy::data_parallel(devices).map_err(Error::failed)?;
    let step = strategy
        .compile_train_step(&program, loss, &weights, optimizer, &shardings)
        .map_err(Error::failed)?;
    let part = step.compiled().partitioned();
    if matches!(config.backend, crate::config::BackendKind::Xla { .. }) {
        // The module XLA compiles for each device, its state donated step to step.
        let carry = step.compiled().carry_pairs();
        let options = meshwork_strategy::xla::lower::LowerOptions {
            replicas: devices,
            donate: carry,
            ..Default::default()
        };
        let lowered = meshwork_strategy::xla::lower::lower(part.program(), &options)
            .map_err(Error::failed)?;
        return Ok(lowered.text);
    }
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for c in part.collectives() {
        *kinds.entry(format!("{} over {}", c.op, c.axes.join("+"))).or_default() += 1;
    }
    let mut out = format!("{part}\n");
    out += &format!(
        "# transformer L{} D{} H{} F{} V{} T{}, batch {batch}, {dtype}, {optimizer:?} on mesh {data}x{m}\n",
        model.layers, model.dim, model.heads, model.ffn, model.vocab, model.seq
    );
    out += &format!(
        "# a step runs {} collectives in {} launches ({}) and moves {:.3} MB between devices\n",
        part.collectives().len(),
        part.launches(),
        kinds.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", "),
        part.bytes_moved() as f64 / 1e6
    );
    Ok(out)
}
