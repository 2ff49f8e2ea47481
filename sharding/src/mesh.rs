//! Device meshes: named axes over a row-major grid of devices.

use std::fmt;

use meshwork_types::DeviceId;

use crate::{Error, Result};

/// How a mesh axis is used (JAX's `AxisType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AxisType {
    /// The compiler chooses (JAX's default).
    #[default]
    Auto,
    /// Sharding along this axis is part of the type; only such axes may be
    /// `unreduced` or `reduced`.
    Explicit,
    /// Manually partitioned (inside `shard_map`).
    Manual,
}

impl fmt::Display for AxisType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AxisType::Auto => "Auto",
            AxisType::Explicit => "Explicit",
            AxisType::Manual => "Manual",
        })
    }
}

/// A grid of devices with named axes, devices laid out row-major.
///
/// Unlike JAX, duplicate axis names, duplicate devices, zero-size axes and a device
/// count that differs from the product of the axis sizes are errors.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mesh {
    axis_names: Vec<String>,
    axis_sizes: Vec<usize>,
    axis_types: Vec<AxisType>,
    devices: Vec<DeviceId>,
}

impl Mesh {
    /// A mesh with `axes` (name, size), major first, over `devices` in row-major order;
    /// every axis [`AxisType::Auto`].
    pub fn new(axes: &[(&str, usize)], devices: Vec<DeviceId>) -> Result<Mesh> {
        let names = axes.iter().map(|(n, _)| (*n).to_owned()).collect();
        let sizes = axes.iter().map(|(_, s)| *s).collect();
        Mesh::with_types(names, sizes, vec![AxisType::Auto; axes.len()], devices)
    }

    /// A mesh over devices `0..n` in order.
    pub fn iota(axes: &[(&str, usize)]) -> Result<Mesh> {
        let shape: Vec<usize> = axes.iter().map(|(_, s)| *s).collect();
        let n = device_count(&shape)?;
        let ids = (0..n).map(|i| DeviceId(u32::try_from(i).expect("MAX_TILES fits in u32")));
        Mesh::new(axes, ids.collect())
    }

    /// The general constructor: names, sizes and types per axis.
    pub fn with_types(
        axis_names: Vec<String>,
        axis_sizes: Vec<usize>,
        axis_types: Vec<AxisType>,
        devices: Vec<DeviceId>,
    ) -> Result<Mesh> {
        if axis_names.len() != axis_sizes.len() || axis_types.len() != axis_sizes.len() {
            return Err(Error::MeshAxisCount { names: axis_names.len(), sizes: axis_sizes.len() });
        }
        for (i, name) in axis_names.iter().enumerate() {
            if axis_names[..i].contains(name) {
                return Err(Error::DuplicateMeshAxis { name: name.clone() });
            }
            if axis_sizes[i] == 0 {
                return Err(Error::EmptyMeshAxis { name: name.clone() });
            }
        }
        let expected = axis_sizes.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s));
        if expected != Some(devices.len()) {
            return Err(Error::MeshDeviceCount {
                shape: axis_sizes,
                expected: expected.unwrap_or(usize::MAX),
                actual: devices.len(),
            });
        }
        check_unique(&devices)?;
        Ok(Mesh { axis_names, axis_sizes, axis_types, devices })
    }

    /// Axis names, major first.
    pub fn axis_names(&self) -> &[String] {
        &self.axis_names
    }

    /// Axis sizes (the mesh shape), major first.
    pub fn shape(&self) -> &[usize] {
        &self.axis_sizes
    }

    /// Axis types.
    pub fn axis_types(&self) -> &[AxisType] {
        &self.axis_types
    }

    /// The devices, row-major over the shape.
    pub fn devices(&self) -> &[DeviceId] {
        &self.devices
    }

    /// Number of devices.
    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// Index of the axis called `name`.
    pub fn axis_index(&self, name: &str) -> Option<usize> {
        self.axis_names.iter().position(|n| n == name)
    }

    /// Size of the axis called `name`.
    pub fn axis_size(&self, name: &str) -> Option<usize> {
        self.axis_index(name).map(|i| self.axis_sizes[i])
    }
}

impl fmt::Display for Mesh {
    /// `Mesh('a': 2, 'b': 4)`, as JAX prints a mesh's shape.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Mesh(")?;
        for (i, (name, size)) in self.axis_names.iter().zip(&self.axis_sizes).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "'{name}': {size}")?;
        }
        f.write_str(")")
    }
}

/// The number of devices of a mesh shape: at most [`MAX_TILES`](crate::MAX_TILES), the
/// most devices a sharding can tile over.
fn device_count(shape: &[usize]) -> Result<usize> {
    let n = shape.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s));
    match n {
        Some(n) if n <= crate::MAX_TILES => Ok(n),
        _ => Err(Error::MeshTooLarge { shape: shape.to_vec() }),
    }
}

/// Errors on the first device that appears twice.
pub(crate) fn check_unique(devices: &[DeviceId]) -> Result<()> {
    let mut sorted = devices.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(Error::DuplicateDevice { device: w[0] }),
        None => Ok(()),
    }
}
