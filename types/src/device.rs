//! Device identifiers.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// A device's global id: an index into the flat list of devices a program runs on.
///
/// Its text form is the bare integer (`3`), as in XLA's tile assignments and JAX's
/// `device.id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub u32);

impl DeviceId {
    /// The id as an index into a slice of devices.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl From<u32> for DeviceId {
    fn from(id: u32) -> Self {
        DeviceId(id)
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for DeviceId {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        // `u32::from_str` accepts a leading `+`; a device id is written without one.
        if s.starts_with('+') {
            return Err(Error::InvalidDeviceId { input: s.to_owned() });
        }
        s.parse::<u32>().map(DeviceId).map_err(|_| Error::InvalidDeviceId { input: s.to_owned() })
    }
}
