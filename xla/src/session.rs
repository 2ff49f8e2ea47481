//! A client with a cache of compiled programs: what runs a meshwork [`Program`] on a
//! plugin's device, one call at a time (the conformance runner and the tools), and
//! what the strategy's XLA back end builds on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use meshwork_program::Program;
use meshwork_types::Tensor;

use crate::lower::{LowerOptions, Lowered, lower};
use crate::{Arg, Client, CompileOptions, Error, Executable, NamedValueOf, Plugin, Result};

/// A program compiled by XLA, with what its lowering says about its outputs.
#[derive(Debug)]
pub struct Compiled {
    /// The loaded executable.
    pub executable: Executable,
    /// The lowered module (text, output specs, emits).
    pub lowered: Lowered,
}

/// A client and the programs compiled on it, each compiled once per text.
#[derive(Debug)]
pub struct Session {
    client: Client,
    cache: Mutex<HashMap<String, Arc<Compiled>>>,
    compiles: AtomicUsize,
}

impl Session {
    /// A session on a new client of `plugin`. `cpu_devices` asks a CPU plugin for that
    /// many devices (`cpu_device_count`); a plugin that refuses the option as an
    /// invalid argument (a GPU plugin) is asked again without it.
    pub fn new(plugin: &Plugin, cpu_devices: usize) -> Result<Session> {
        let option = [("cpu_device_count", NamedValueOf::Int(cpu_devices as i64))];
        let client = match plugin.client(&option) {
            Ok(c) => c,
            Err(Error::Plugin { code: crate::Code::InvalidArgument, .. }) => plugin.client(&[])?,
            Err(e) => return Err(e),
        };
        Ok(Session::with_client(client))
    }

    /// A session on `client`.
    pub fn with_client(client: Client) -> Session {
        Session { client, cache: Mutex::new(HashMap::new()), compiles: AtomicUsize::new(0) }
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// How many programs XLA compiled for this session (cache misses).
    pub fn compiles(&self) -> usize {
        self.compiles.load(Ordering::Relaxed)
    }

    /// `program` lowered with `options` and compiled (replica `r` on XLA's default
    /// device `r`), from the cache when the same module was compiled before.
    pub fn compile(&self, program: &Program, options: &LowerOptions) -> Result<Arc<Compiled>> {
        self.compile_on(program, options, &[])
    }

    /// [`compile`](Self::compile) with replica `r` on the device whose id is
    /// `devices[r]` (one per replica; empty for XLA's default assignment). With
    /// `options.partitions` above 1, the module is XLA's to partition
    /// (`use_spmd_partitioning`), partition `p` of replica `r` on `devices[r·P + p]`.
    pub fn compile_on(
        &self,
        program: &Program,
        options: &LowerOptions,
        devices: &[i64],
    ) -> Result<Arc<Compiled>> {
        self.compile_with(program, options, devices, false)
    }

    /// `program` (one device: no replicas, partitions or collectives) compiled once
    /// to run on any device of the client ([`Executable::execute_on`]), from the
    /// cache when it was compiled so before.
    ///
    /// [`Executable::execute_on`]: crate::Executable::execute_on
    pub fn compile_portable(&self, program: &Program) -> Result<Arc<Compiled>> {
        self.compile_with(program, &LowerOptions::default(), &[], true)
    }

    fn compile_with(
        &self,
        program: &Program,
        options: &LowerOptions,
        devices: &[i64],
        portable: bool,
    ) -> Result<Arc<Compiled>> {
        let lowered = lower(program, options)?;
        let replicas = options.replicas.max(1);
        let partitions = options.partitions.max(1);
        if !devices.is_empty() && devices.len() != replicas * partitions {
            return Err(Error::Arguments(format!(
                "{} devices assigned to {replicas} replicas of {partitions} partitions",
                devices.len()
            )));
        }
        let mut key = lowered.text.clone();
        key.push_str(&format!("// devices {devices:?}{}", if portable { " portable" } else { "" }));
        if let Some(c) = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(Arc::clone(c));
        }
        let compile = CompileOptions {
            replicas,
            partitions,
            spmd_partitioning: partitions > 1,
            devices: devices.to_vec(),
            portable,
            ..CompileOptions::default()
        };
        let executable = self
            .client
            .compile("mlir", lowered.text.as_bytes(), &compile.encode())
            .map_err(|e| e.during("compile"))?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let compiled = Arc::new(Compiled { executable, lowered });
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, Arc::clone(&compiled));
        Ok(compiled)
    }

    /// Runs `program` on device 0 with host `inputs` and returns its outputs (results,
    /// then what it emits) on the host.
    pub fn run(&self, program: &Program, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let compiled = self.compile(program, &LowerOptions::default())?;
        let device = self.client.device(0)?;
        let buffers =
            inputs.iter().map(|t| self.client.put(t, device)).collect::<Result<Vec<_>>>()?;
        let outs =
            compiled.executable.execute(vec![buffers.iter().map(Arg::Borrowed).collect()])?;
        outs.into_iter().next().unwrap_or_default().iter().map(crate::Buffer::to_host).collect()
    }
}
