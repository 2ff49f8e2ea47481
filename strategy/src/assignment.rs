//! Which device runs which replica's logical device: TPUStrategy's `DeviceAssignment`
//! over a mesh of devices grouped into hosts.

use meshwork_types::DeviceId;

use crate::{Error, Result};

/// A mesh of devices (row-major ids `0..product(shape)`), `devices_per_host`
/// consecutive ids to a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    shape: Vec<usize>,
    devices_per_host: usize,
}

impl Topology {
    /// A topology of `shape` whose hosts hold `devices_per_host` consecutive devices.
    pub fn new(shape: Vec<usize>, devices_per_host: usize) -> Result<Topology> {
        let devices = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        match devices {
            Some(n) if n > 0 && devices_per_host > 0 && n.is_multiple_of(devices_per_host) => {
                Ok(Topology { shape, devices_per_host })
            }
            _ => Err(Error::Topology { shape, devices_per_host }),
        }
    }

    /// The mesh shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Devices in the mesh.
    pub fn num_devices(&self) -> usize {
        self.shape.iter().product()
    }

    /// Devices on each host.
    pub fn devices_per_host(&self) -> usize {
        self.devices_per_host
    }
}

/// Devices indexed `[replica][logical device]`, as TPUStrategy's `_tpu_devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAssignment {
    /// Row-major `[replicas][logical]`.
    devices: Vec<DeviceId>,
    logical: usize,
    devices_per_host: usize,
    num_devices: usize,
}

impl DeviceAssignment {
    /// One logical device per replica: replica `r` on device `r`, all on one host.
    pub fn default_for(replicas: usize) -> Result<DeviceAssignment> {
        let topology = Topology::new(vec![replicas], replicas.max(1))?;
        DeviceAssignment::build(&topology, &[1], None)
    }

    /// TPU's `DeviceAssignment.build`: each replica takes a block of
    /// `computation_shape` devices of the topology (its logical devices, row-major in
    /// the block); replicas take the blocks in row-major order. `num_replicas`
    /// defaults to every block.
    pub fn build(
        topology: &Topology,
        computation_shape: &[usize],
        num_replicas: Option<usize>,
    ) -> Result<DeviceAssignment> {
        let mesh = topology.shape();
        let bad = |problem: String| Error::Assignment {
            topology: mesh.to_vec(),
            computation_shape: computation_shape.to_vec(),
            problem,
        };
        if computation_shape.len() != mesh.len() {
            return Err(bad(format!(
                "the computation shape has rank {}, the topology rank {}",
                computation_shape.len(),
                mesh.len()
            )));
        }
        if let Some(d) = (0..mesh.len())
            .find(|&d| computation_shape[d] == 0 || !mesh[d].is_multiple_of(computation_shape[d]))
        {
            return Err(bad(format!(
                "dim {d}: the topology's {} devices do not divide into blocks of {}",
                mesh[d], computation_shape[d]
            )));
        }
        let grid: Vec<usize> = mesh.iter().zip(computation_shape).map(|(m, c)| m / c).collect();
        let blocks: usize = grid.iter().product();
        let replicas = num_replicas.unwrap_or(blocks);
        if replicas == 0 || replicas > blocks {
            return Err(bad(format!(
                "{replicas} replicas asked for, but the topology holds {blocks} blocks"
            )));
        }
        let logical: usize = computation_shape.iter().product();
        let mut devices = Vec::with_capacity(replicas * logical);
        for r in 0..replicas {
            let block = unravel(r, &grid);
            for l in 0..logical {
                let within = unravel(l, computation_shape);
                let coord: Vec<usize> =
                    (0..mesh.len()).map(|d| block[d] * computation_shape[d] + within[d]).collect();
                devices.push(DeviceId(ravel(&coord, mesh) as u32));
            }
        }
        Ok(DeviceAssignment {
            devices,
            logical,
            devices_per_host: topology.devices_per_host(),
            num_devices: topology.num_devices(),
        })
    }

    /// Replicas (`num_replicas_in_sync`).
    pub fn num_replicas(&self) -> usize {
        self.devices.len() / self.logical
    }

    /// Logical devices (cores) per replica.
    pub fn num_logical_devices(&self) -> usize {
        self.logical
    }

    /// Devices in the topology.
    pub fn num_devices(&self) -> usize {
        self.num_devices
    }

    /// The device of `(replica, logical)`.
    pub fn device(&self, replica: usize, logical: usize) -> DeviceId {
        self.devices[replica * self.logical + logical]
    }

    /// The host of a replica: that of its logical device 0.
    pub fn host(&self, replica: usize) -> usize {
        self.device(replica, 0).0 as usize / self.devices_per_host
    }

    /// Hosts holding replicas.
    pub fn num_hosts(&self) -> usize {
        let mut hosts: Vec<usize> = (0..self.num_replicas()).map(|r| self.host(r)).collect();
        hosts.dedup();
        hosts.sort_unstable();
        hosts.dedup();
        hosts.len()
    }

    /// The replicas whose logical device 0 is on each host, hosts in id order.
    pub fn replicas_by_host(&self) -> Vec<(usize, Vec<usize>)> {
        let mut by: Vec<(usize, Vec<usize>)> = Vec::new();
        for r in 0..self.num_replicas() {
            let h = self.host(r);
            match by.iter_mut().find(|(host, _)| *host == h) {
                Some((_, rs)) => rs.push(r),
                None => by.push((h, vec![r])),
            }
        }
        by.sort_by_key(|(h, _)| *h);
        by
    }

    /// TPUStrategy's `num_replicas_per_host`: `min(replicas, devices per host /
    /// logical devices per replica)`.
    pub fn replicas_per_host(&self) -> usize {
        self.num_replicas().min(self.devices_per_host / self.logical)
    }
}

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        out[d] = i % shape[d];
        i /= shape[d];
    }
    out
}

fn ravel(coord: &[usize], shape: &[usize]) -> usize {
    coord.iter().zip(shape).fold(0, |acc, (c, s)| acc * s + c)
}
