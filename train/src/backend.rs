//! The back end a run's settings choose, made in one place: meshwork's interpreter,
//! XLA on a PJRT client's devices, or XLA compiling for GPUs that are not here
//! (`--target`). The plugin is found and loaded here and nowhere else; the rest of
//! the trainer holds the result as `Arc<dyn Backend>`.

use std::path::Path;
use std::sync::Arc;

use meshwork_strategy::backend::{Backend, Xla, XlaTarget};
use meshwork_xla::target::Target;
use meshwork_xla::{Plugin, find};

use crate::config::BackendKind;
use crate::{Error, Result};

/// A run's back end: `None` for the interpreter (a strategy's own), else XLA's.
#[derive(Debug, Clone, Default)]
pub(crate) struct Chosen {
    /// What runs (or compiles) the steps; `None`: the interpreter.
    pub(crate) backend: Option<Arc<dyn Backend>>,
    /// The same back end when it compiles for a target, for its reports.
    pub(crate) target: Option<Arc<XlaTarget>>,
}

impl Chosen {
    /// A data-parallel strategy of `devices` devices on this back end: all in this
    /// process, or spread evenly over `processes` (process `p` running devices
    /// `p * local ..`, its runtime joined to theirs).
    pub(crate) fn strategy(
        &self,
        devices: usize,
        processes: Option<&crate::Processes>,
    ) -> Result<meshwork_strategy::Strategy> {
        use meshwork_strategy::executor::Runtime;
        use meshwork_strategy::{DeviceAssignment, Strategy, Topology};
        let strategy = match processes.filter(|p| p.count() > 1) {
            None => Strategy::data_parallel(devices).map_err(Error::failed)?,
            Some(p) => {
                let local = devices / p.count();
                let topology = Topology::new(vec![devices], local).map_err(Error::failed)?;
                let runtime =
                    Runtime::new(local).map_err(Error::failed)?.with_interconnect(p.link());
                Strategy::new(
                    DeviceAssignment::build(&topology, &[1], None).map_err(Error::failed)?,
                )
                .and_then(|s| s.with_runtime(runtime))
                .map_err(Error::failed)?
            }
        };
        Ok(match &self.backend {
            Some(b) => strategy.with_backend(Arc::clone(b)),
            None => strategy,
        })
    }
}

/// The plugin `--pjrt-plugin` (or `MESHWORK_PJRT_PLUGIN`) names, loaded: the one
/// place a plugin is loaded. Errors name `flag`.
pub(crate) fn plugin(given: Option<&Path>, flag: &str) -> Result<Plugin> {
    let path = find::plugin_path(given).map_err(|e| Error::flag(flag, e))?;
    find::load(&path).map_err(|e| Error::flag(flag, e))
}

/// The back end of `kind` for `devices` devices. What a device of XLA holds is XLA's
/// to say (`inspect --target` reads it from the compile; a run past a GPU's memory
/// fails with XLA's out-of-memory error): meshwork's host estimate is not a device's.
pub(crate) fn make(kind: &BackendKind, devices: usize) -> Result<Chosen> {
    match kind {
        BackendKind::Interpreter => Ok(Chosen::default()),
        BackendKind::Custom(b) => Ok(Chosen { backend: Some(Arc::clone(&b.0)), target: None }),
        BackendKind::Xla { plugin: given, partitioner } => {
            let flag = if given.is_some() { "pjrt-plugin" } else { "backend" };
            let loaded = plugin(given.as_deref(), flag)?;
            let xla = Xla::with_devices(&loaded, devices)
                .map_err(|e| no_gpu(&loaded, e, flag))?
                .with_partitioner(*partitioner);
            Ok(Chosen { backend: Some(Arc::new(xla)), target: None })
        }
        BackendKind::XlaTarget { plugin: given, partitioner, target, target_config } => {
            let mut t = Target::parse(target).map_err(|e| Error::usage(e.to_string()))?;
            if let Some(path) = target_config {
                let bytes = crate::files::read_input("--target-config", path, 1 << 20)?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    Error::usage(format!("--target-config {}: not UTF-8 text", path.display()))
                })?;
                t = t
                    .with_config(text, &format!("--target-config {}", path.display()))
                    .map_err(|e| Error::usage(e.to_string()))?;
            }
            if devices > t.devices() {
                return Err(Error::usage(format!(
                    "--target {}: the run needs {devices} devices; the target has {}",
                    t.name(),
                    t.devices()
                )));
            }
            let flag = if given.is_some() { "pjrt-plugin" } else { "target" };
            let loaded = plugin(given.as_deref(), flag)?;
            let xla = XlaTarget::new(&loaded, t)
                .map_err(|e| Error::flag(flag, e))?
                .with_partitioner(*partitioner);
            let xla = Arc::new(xla);
            Ok(Chosen { backend: Some(xla.clone()), target: Some(xla) })
        }
    }
}

/// A client the plugin could not make: where the plugin is a GPU plugin on a machine
/// without a GPU, one line saying so and what compiles without one.
fn no_gpu(plugin: &Plugin, e: meshwork_strategy::Error, flag: &str) -> Error {
    let text = e.to_string();
    let lower = text.to_lowercase();
    if lower.contains("no visible gpu")
        || lower.contains("cuda_error_no_device")
        || lower.contains("no cuda-capable device")
        || (lower.contains("cuda") && lower.contains("driver"))
    {
        return Error::flag(
            flag,
            format!(
                "{}: no GPU was found on this machine ({}); `meshwork inspect --target h100` compiles for GPUs without one",
                plugin.path().display(),
                text.lines().next().unwrap_or("")
            ),
        );
    }
    Error::flag(flag, e)
}
