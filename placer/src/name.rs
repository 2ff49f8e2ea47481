//! Device names as TensorFlow reads and writes them (`DeviceNameUtils`):
//! `/job:J/replica:R/task:T/device:TYPE:ID`, partial, with `*`, in any order, and the
//! legacy `/cpu:N` / `/gpu:N` forms.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::{Error, Result};

/// A parsed, possibly partial, device name (TF's `DeviceNameUtils::ParsedName`). A
/// field that is `None` is unset, which is the same as `*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct DeviceName {
    /// The job (`/job:worker`).
    pub job: Option<Arc<str>>,
    /// The replica (`/replica:0`).
    pub replica: Option<u32>,
    /// The task (`/task:1`).
    pub task: Option<u32>,
    /// The device type (`/device:GPU:0` → `GPU`), case kept.
    pub device_type: Option<Arc<str>>,
    /// The device id (`/device:GPU:0` → `0`).
    pub id: Option<u32>,
}

/// Which field of a device name two names disagree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameField {
    /// `/job:`.
    Job,
    /// `/replica:`.
    Replica,
    /// `/task:`.
    Task,
    /// The device type.
    Type,
    /// The device id.
    Id,
}

impl NameField {
    /// TF's plural noun in merge errors (`jobs`, `replicas`, `tasks`, `types`, `ids`).
    pub fn plural(self) -> &'static str {
        match self {
            NameField::Job => "jobs",
            NameField::Replica => "replicas",
            NameField::Task => "tasks",
            NameField::Type => "types",
            NameField::Id => "ids",
        }
    }
}

impl fmt::Display for NameField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.plural())
    }
}

/// Two device names that cannot be merged: they set `field` to different values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MergeConflict {
    /// The field in conflict.
    pub field: NameField,
    /// The first name, as TF prints it.
    pub target: String,
    /// The second name.
    pub other: String,
}

impl fmt::Display for MergeConflict {
    /// TF's wording: `Cannot merge devices with incompatible types: 'A' and 'B'`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Cannot merge devices with incompatible {}: '{}' and '{}'",
            self.field, self.target, self.other
        )
    }
}

/// How [`DeviceName::merge`] treats a conflict in type or id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeMode {
    /// Every conflict is an error (`MergeDevNames`).
    Hard,
    /// A type conflict clears type and id, an id conflict clears the id
    /// (`MergeDevNames(allow_soft_placement=true)`).
    Soft,
    /// The other name's type and id win (`MergeOverrideDevNames`).
    Override,
}

impl DeviceName {
    /// A fully specified name.
    pub fn full(job: &str, replica: u32, task: u32, device_type: &str, id: u32) -> DeviceName {
        DeviceName {
            job: Some(job.into()),
            replica: Some(replica),
            task: Some(task),
            device_type: Some(device_type.into()),
            id: Some(id),
        }
    }

    /// TF's `ParseFullName`. `"/"` and `""` parse to the empty name.
    pub fn parse(input: &str) -> Result<DeviceName> {
        parse_full(input).ok_or_else(|| Error::MalformedDeviceName { input: input.to_owned() })
    }

    /// TF's `ParseLocalName`: `TYPE:ID` (or `TYPE:*`) with no leading slash.
    pub fn parse_local(input: &str) -> Result<DeviceName> {
        let malformed = || Error::MalformedDeviceName { input: input.to_owned() };
        let mut cursor = Cursor(input);
        let device_type = cursor.ident(b":").ok_or_else(malformed)?;
        if !cursor.take(":") {
            return Err(malformed());
        }
        let id = if cursor.take("*") { None } else { Some(cursor.number().ok_or_else(malformed)?) };
        if !cursor.0.is_empty() {
            return Err(malformed());
        }
        Ok(DeviceName { device_type: Some(device_type), id, ..DeviceName::default() })
    }

    /// TF's `ParseFullOrLocalName`.
    pub fn parse_full_or_local(input: &str) -> Result<DeviceName> {
        DeviceName::parse(input).or_else(|_| DeviceName::parse_local(input))
    }

    /// Whether any field is set (`HasSomeDetails`).
    pub fn has_some_details(&self) -> bool {
        self.job.is_some()
            || self.replica.is_some()
            || self.task.is_some()
            || self.device_type.is_some()
            || self.id.is_some()
    }

    /// Whether every field is set.
    pub fn is_fully_specified(&self) -> bool {
        self.job.is_some()
            && self.replica.is_some()
            && self.task.is_some()
            && self.device_type.is_some()
            && self.id.is_some()
    }

    /// `IsSpecification(self, more)`: every field set here is set to the same value in
    /// `more`.
    pub fn is_specification_of(&self, more: &DeviceName) -> bool {
        fn ok<T: PartialEq>(less: &Option<T>, more: &Option<T>) -> bool {
            less.as_ref().is_none_or(|l| more.as_ref() == Some(l))
        }
        ok(&self.job, &more.job)
            && ok(&self.replica, &more.replica)
            && ok(&self.task, &more.task)
            && ok(&self.device_type, &more.device_type)
            && ok(&self.id, &more.id)
    }

    /// `IsCompleteSpecification(self, name)`: `name` (a full name) matches this pattern.
    /// The device-matching predicate of `DeviceSet::FindMatchingDevices`.
    pub fn matches(&self, name: &DeviceName) -> bool {
        self.is_specification_of(name)
    }

    /// `AreCompatibleDevNames`: no field is set on both sides to different values.
    pub fn is_compatible_with(&self, other: &DeviceName) -> bool {
        fn ok<T: PartialEq>(a: &Option<T>, b: &Option<T>) -> bool {
            match (a, b) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
        }
        ok(&self.job, &other.job)
            && ok(&self.replica, &other.replica)
            && ok(&self.task, &other.task)
            && ok(&self.device_type, &other.device_type)
            && ok(&self.id, &other.id)
    }

    /// `MergeDevNames` / `MergeOverrideDevNames`: merges `other` into `self`. A job,
    /// replica or task conflict is always an error; type and id conflicts follow `mode`.
    /// On error `self` may be partly merged (callers merge into a copy, as TF does).
    pub fn merge(&mut self, other: &DeviceName, mode: MergeMode) -> Result<(), MergeConflict> {
        let conflict = |field, target: &DeviceName| MergeConflict {
            field,
            target: target.to_string(),
            other: other.to_string(),
        };
        if let Some(job) = &other.job {
            if self.job.as_ref().is_some_and(|j| j != job) {
                return Err(conflict(NameField::Job, self));
            }
            self.job = Some(job.clone());
        }
        if let Some(replica) = other.replica {
            if self.replica.is_some_and(|r| r != replica) {
                return Err(conflict(NameField::Replica, self));
            }
            self.replica = Some(replica);
        }
        if let Some(task) = other.task {
            if self.task.is_some_and(|t| t != task) {
                return Err(conflict(NameField::Task, self));
            }
            self.task = Some(task);
        }
        if let Some(other_type) = &other.device_type {
            if self.device_type.as_ref().is_some_and(|t| t != other_type) {
                match mode {
                    MergeMode::Hard => return Err(conflict(NameField::Type, self)),
                    MergeMode::Override => self.device_type = Some(other_type.clone()),
                    MergeMode::Soft => {
                        // TF clears type and id and returns early: `other`'s id is not
                        // merged.
                        self.device_type = None;
                        self.id = None;
                        return Ok(());
                    }
                }
            } else {
                self.device_type = Some(other_type.clone());
            }
        }
        if let Some(other_id) = other.id {
            if self.id.is_some_and(|i| i != other_id) {
                match mode {
                    MergeMode::Hard => return Err(conflict(NameField::Id, self)),
                    MergeMode::Override => self.id = Some(other_id),
                    MergeMode::Soft => self.id = None,
                }
            } else {
                self.id = Some(other_id);
            }
        }
        Ok(())
    }

    /// `MergeUnsetDevNames`: fills only the fields unset here; never fails.
    pub fn merge_unset(&mut self, other: &DeviceName) {
        if self.job.is_none() {
            self.job.clone_from(&other.job);
        }
        if self.replica.is_none() {
            self.replica = other.replica;
        }
        if self.task.is_none() {
            self.task = other.task;
        }
        if self.device_type.is_none() {
            self.device_type.clone_from(&other.device_type);
        }
        if self.id.is_none() {
            self.id = other.id;
        }
    }

    /// `EnsureSpecification(self, less)`: copies every field set in `less`.
    pub fn ensure_specification(&mut self, less: &DeviceName) {
        if less.job.is_some() {
            self.job.clone_from(&less.job);
        }
        if less.replica.is_some() {
            self.replica = less.replica;
        }
        if less.task.is_some() {
            self.task = less.task;
        }
        if less.device_type.is_some() {
            self.device_type.clone_from(&less.device_type);
        }
        if less.id.is_some() {
            self.id = less.id;
        }
    }

    /// The job/replica/task part (`AddressSpace`).
    pub fn address_space(&self) -> DeviceName {
        DeviceName {
            job: self.job.clone(),
            replica: self.replica,
            task: self.task,
            device_type: None,
            id: None,
        }
    }

    /// `IsDifferentAddressSpace`: some of job/replica/task is set on both sides to
    /// different values.
    pub fn is_different_address_space(&self, other: &DeviceName) -> bool {
        (self.job.is_some() && other.job.is_some() && self.job != other.job)
            || (self.replica.is_some() && other.replica.is_some() && self.replica != other.replica)
            || (self.task.is_some() && other.task.is_some() && self.task != other.task)
    }

    /// `IsSameAddressSpace`: job, replica and task all set and equal.
    pub fn is_same_address_space(&self, other: &DeviceName) -> bool {
        self.job.is_some()
            && self.replica.is_some()
            && self.task.is_some()
            && self.job == other.job
            && self.replica == other.replica
            && self.task == other.task
    }

    /// `LocalName`: `/device:TYPE:ID` (or `:*`), without the address space.
    pub fn local_name(&self) -> String {
        DeviceName { device_type: self.device_type.clone(), id: self.id, ..DeviceName::default() }
            .to_string()
    }

    /// `SplitDeviceName`: the address-space part (`/job:../replica:../task:..`) and
    /// `TYPE:ID`. Needs a type and an id.
    pub fn split(&self) -> Option<(String, String)> {
        let (device_type, id) = (self.device_type.as_ref()?, self.id?);
        Some((self.address_space().to_string(), format!("{device_type}:{id}")))
    }

    /// `GetNamesForDeviceMappings`: the canonical name and the legacy lower-case one, for
    /// a fully specified name; none otherwise.
    pub fn names_for_device_mappings(&self) -> Vec<String> {
        if !self.is_fully_specified() {
            return Vec::new();
        }
        let prefix = self.address_space().to_string();
        let device_type = self.device_type.as_deref().unwrap_or_default();
        let id = self.id.unwrap_or_default();
        vec![self.to_string(), format!("{prefix}/{}:{id}", device_type.to_ascii_lowercase())]
    }

    /// `CanonicalizeDeviceName(name, basename)`: `name` (full, partial or local) with its
    /// unset fields taken from the fully specified `basename`.
    pub fn canonicalize(name: &str, basename: &str) -> Result<String> {
        let base = DeviceName::parse(basename)?;
        if !base.is_fully_specified() {
            return Err(Error::MalformedDeviceName { input: basename.to_owned() });
        }
        let mut parsed = DeviceName::parse_full_or_local(name)?;
        parsed.merge_unset(&base);
        Ok(parsed.to_string())
    }
}

/// `CompareFullNames`: job, replica, task, type, id ascending, an unset field before a
/// set one; names that do not parse sort first.
pub fn compare_full_names(a: &str, b: &str) -> Ordering {
    match (DeviceName::parse(a), DeviceName::parse(b)) {
        (Err(_), Err(_)) => Ordering::Equal,
        (Err(_), Ok(_)) => Ordering::Less,
        (Ok(_), Err(_)) => Ordering::Greater,
        (Ok(a), Ok(b)) => (a.job, a.replica, a.task, a.device_type, a.id).cmp(&(
            b.job,
            b.replica,
            b.task,
            b.device_type,
            b.id,
        )),
    }
}

impl fmt::Display for DeviceName {
    /// TF's `ParsedNameToString`: set fields only; a type prints as `/device:T:ID` or
    /// `/device:T:*` (an id without a type is not printed).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(job) = &self.job {
            write!(f, "/job:{job}")?;
        }
        if let Some(replica) = self.replica {
            write!(f, "/replica:{replica}")?;
        }
        if let Some(task) = self.task {
            write!(f, "/task:{task}")?;
        }
        if let Some(device_type) = &self.device_type {
            write!(f, "/device:{device_type}:")?;
            match self.id {
                Some(id) => write!(f, "{id}")?,
                None => f.write_str("*")?,
            }
        }
        Ok(())
    }
}

impl FromStr for DeviceName {
    type Err = Error;

    fn from_str(s: &str) -> Result<DeviceName> {
        DeviceName::parse(s)
    }
}

/// The rest of the input, consumed from the front.
struct Cursor<'a>(&'a str);

impl Cursor<'_> {
    fn take(&mut self, prefix: &str) -> bool {
        match self.0.strip_prefix(prefix) {
            Some(rest) => {
                self.0 = rest;
                true
            }
            None => false,
        }
    }

    /// Decimal digits that fit in an `i32` (TF stores these as `int`).
    fn number(&mut self) -> Option<u32> {
        let digits = self.0.bytes().take_while(u8::is_ascii_digit).count();
        let value: i32 = self.0[..digits].parse().ok()?;
        self.0 = &self.0[digits..];
        u32::try_from(value).ok()
    }

    /// `[A-Za-z][A-Za-z0-9_]*`, ending at one of `terminators` or the end.
    fn ident(&mut self, terminators: &[u8]) -> Option<Arc<str>> {
        if !self.0.starts_with(|c: char| c.is_ascii_alphabetic()) {
            return None;
        }
        let end = self.0.bytes().position(|b| terminators.contains(&b)).unwrap_or(self.0.len());
        let token = &self.0[..end];
        if !token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return None;
        }
        self.0 = &self.0[end..];
        Some(token.into())
    }
}

/// TF's `ParseFullName`; `None` if malformed.
fn parse_full(input: &str) -> Option<DeviceName> {
    let mut name = DeviceName::default();
    if input == "/" {
        return Some(name);
    }
    let mut c = Cursor(input);
    while !c.0.is_empty() {
        let mut progress = false;
        if c.take("/job:") {
            name.job = if c.take("*") { None } else { Some(c.ident(b"/")?) };
            progress = true;
        }
        if c.take("/replica:") {
            name.replica = if c.take("*") { None } else { Some(c.number()?) };
            progress = true;
        }
        if c.take("/task:") {
            name.task = if c.take("*") { None } else { Some(c.number()?) };
            progress = true;
        }
        if c.take("/device:") {
            name.device_type = if c.take("*") { None } else { Some(c.ident(b"/:")?) };
            name.id = if !c.take(":") || c.take("*") { None } else { Some(c.number()?) };
            progress = true;
        }
        for (legacy, device_type) in
            [("/cpu:", "CPU"), ("/CPU:", "CPU"), ("/gpu:", "GPU"), ("/GPU:", "GPU")]
        {
            if c.take(legacy) {
                name.device_type = Some(device_type.into());
                name.id = if c.take("*") { None } else { Some(c.number()?) };
                progress = true;
                break;
            }
        }
        if !progress {
            return None;
        }
    }
    Some(name)
}

#[cfg(test)]
mod tests;
