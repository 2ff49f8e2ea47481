//! The devices a graph can be placed on, with TF's ordering rules.

use std::collections::HashMap;
use std::fmt;

use crate::{DeviceName, Error, Result};

/// The device type that supports every kernel (TF's `COMPOSITE` device: a resource
/// spread over several physical devices).
pub const COMPOSITE: &str = "COMPOSITE";

/// A physical device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    name: String,
    parsed: DeviceName,
    is_local: bool,
}

impl Device {
    /// The full name (`/job:localhost/replica:0/task:0/device:CPU:0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The parsed name.
    pub fn parsed(&self) -> &DeviceName {
        &self.parsed
    }

    /// The device type.
    pub fn device_type(&self) -> &str {
        self.parsed.device_type.as_deref().expect("device names are fully specified")
    }

    /// Whether the device is in this process (preferred on ties).
    pub fn is_local(&self) -> bool {
        self.is_local
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// The devices available to the placer, with device-type priorities (TF's
/// `DeviceFactory` registration priorities: higher is preferred) and an optional default
/// local device, which wins ties.
#[derive(Debug, Clone, Default)]
pub struct DeviceSet {
    devices: Vec<Device>,
    type_priority: HashMap<String, i32>,
    default_local: Option<usize>,
}

/// Device-type priorities TF registers by default: `GPU` 210, `CPU` 60, `XLA_CPU` and
/// `XLA_GPU` 50. Other types rank −1 unless set with [`DeviceSet::with_type_priority`].
pub const DEFAULT_TYPE_PRIORITIES: [(&str, i32); 4] =
    [("GPU", 210), ("CPU", 60), ("XLA_CPU", 50), ("XLA_GPU", 50)];

impl DeviceSet {
    /// A set of devices from their full names, all local, with
    /// [`DEFAULT_TYPE_PRIORITIES`]. Names must be fully specified and distinct.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Result<DeviceSet> {
        let mut set = DeviceSet {
            devices: Vec::with_capacity(names.len()),
            type_priority: DEFAULT_TYPE_PRIORITIES
                .iter()
                .map(|(t, p)| ((*t).to_owned(), *p))
                .collect(),
            default_local: None,
        };
        for name in names {
            set.add(name.as_ref(), true)?;
        }
        Ok(set)
    }

    /// Adds a device (`is_local`: whether it lives in this process).
    pub fn add(&mut self, name: &str, is_local: bool) -> Result<&mut DeviceSet> {
        let parsed = DeviceName::parse(name)?;
        if !parsed.is_fully_specified() {
            return Err(Error::PartialDeviceName { name: name.to_owned() });
        }
        let canonical = parsed.to_string();
        if self.devices.iter().any(|d| d.name == canonical) {
            return Err(Error::DuplicateDevice { name: canonical });
        }
        self.devices.push(Device { name: canonical, parsed, is_local });
        Ok(self)
    }

    /// Sets the priority of a device type.
    pub fn with_type_priority(mut self, device_type: &str, priority: i32) -> DeviceSet {
        self.type_priority.insert(device_type.to_owned(), priority);
        self
    }

    /// Makes `name` the default local device: it comes first among candidates, and its
    /// address space is the local one (TF's `default_local_device`).
    pub fn with_default_local_device(mut self, name: &str) -> Result<DeviceSet> {
        let index =
            self.find(name).ok_or_else(|| Error::UnknownDevice { name: name.to_owned() })?;
        self.default_local = Some(index);
        Ok(self)
    }

    /// The devices, in the order given.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The default local device, if set.
    pub fn default_local_device(&self) -> Option<&Device> {
        self.default_local.map(|i| &self.devices[i])
    }

    pub(crate) fn default_local_index(&self) -> Option<usize> {
        self.default_local
    }

    /// The index of the device with this name (any spelling TF accepts).
    pub fn find(&self, name: &str) -> Option<usize> {
        let canonical = DeviceName::parse(name).ok()?.to_string();
        self.devices.iter().position(|d| d.name == canonical)
    }

    /// A device type's priority (−1 when unregistered).
    pub fn type_priority(&self, device_type: &str) -> i32 {
        self.type_priority.get(device_type).copied().unwrap_or(-1)
    }

    /// The distinct device types, highest priority first, then by name
    /// (`DeviceSet::PrioritizedDeviceTypeList`).
    pub fn prioritized_types(&self) -> Vec<String> {
        let mut types: Vec<String> = Vec::new();
        for d in &self.devices {
            if !types.iter().any(|t| t == d.device_type()) {
                types.push(d.device_type().to_owned());
            }
        }
        types.sort_by(|a, b| {
            self.type_priority(b).cmp(&self.type_priority(a)).then_with(|| a.cmp(b))
        });
        types
    }
}
