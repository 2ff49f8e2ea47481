//! `xla.CompileOptionsProto`, encoded by hand: the few fields meshwork sets, in
//! protobuf's wire format (field numbers from `xla/pjrt/proto/compile_options.proto`
//! and `xla/xla.proto`).

/// How a program is compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    /// Replicas (SPMD over replica groups): at least 1.
    pub replicas: usize,
    /// Partitions (XLA's partitioner, `num_partitions`): at least 1.
    pub partitions: usize,
    /// Let XLA's SPMD partitioner split the program by its shardings.
    pub spmd_partitioning: bool,
    /// The device of each `(replica, partition)`, replica-major; empty for XLA's
    /// default assignment.
    pub devices: Vec<i64>,
    /// XLA flags set for this compile (`env_option_overrides`), as JAX passes its
    /// `jax_…` compile flags.
    pub flags: Vec<(String, bool)>,
    /// Compile one executable that runs on any device of the client
    /// (`compile_portable_executable`; [`Executable::execute_on`]): one replica, one
    /// partition, no device assignment.
    ///
    /// [`Executable::execute_on`]: crate::Executable::execute_on
    pub portable: bool,
}

impl Default for CompileOptions {
    /// One device, and `max`/`min` that propagate NaN as JAX's do on every platform
    /// (XLA's "fast" min/max, which may return the other operand, off).
    fn default() -> Self {
        CompileOptions {
            replicas: 1,
            partitions: 1,
            spmd_partitioning: false,
            devices: Vec::new(),
            flags: vec![
                ("xla_cpu_enable_fast_min_max".into(), false),
                ("xla_gpu_enable_fast_min_max".into(), false),
            ],
            portable: false,
        }
    }
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn int_field(out: &mut Vec<u8>, field: u32, v: i64) {
    tag(out, field, 0);
    varint(out, v as u64);
}

fn message_field(out: &mut Vec<u8>, field: u32, body: &[u8]) {
    tag(out, field, 2);
    varint(out, body.len() as u64);
    out.extend_from_slice(body);
}

impl CompileOptions {
    /// The serialized `CompileOptionsProto`.
    pub fn encode(&self) -> Vec<u8> {
        // ExecutableBuildOptionsProto.
        let mut build = Vec::new();
        int_field(&mut build, 1, -1); // device_ordinal: any
        // proto3 drops zeros, and XLA reads an absent count as 0: always written.
        int_field(&mut build, 4, self.replicas as i64);
        int_field(&mut build, 5, self.partitions as i64);
        if self.spmd_partitioning {
            int_field(&mut build, 6, 1);
        }
        if !self.devices.is_empty() {
            // DeviceAssignmentProto: replica_count = 1, computation_count = 2, one
            // computation_devices (field 3) per partition listing its replicas' ids.
            let mut assignment = Vec::new();
            int_field(&mut assignment, 1, self.replicas as i64);
            int_field(&mut assignment, 2, self.partitions as i64);
            for p in 0..self.partitions {
                let mut ids = Vec::new();
                for r in 0..self.replicas {
                    int_field(&mut ids, 1, self.devices[r * self.partitions + p]);
                }
                message_field(&mut assignment, 3, &ids);
            }
            message_field(&mut build, 9, &assignment);
        }
        let mut out = Vec::new();
        message_field(&mut out, 3, &build);
        if self.portable {
            int_field(&mut out, 4, 1); // compile_portable_executable
        }
        for (name, value) in &self.flags {
            // map<string, OptionOverrideProto>: an entry {key = 1, value = 2}, the
            // override's `bool_field = 2`.
            let mut value_msg = Vec::new();
            int_field(&mut value_msg, 2, i64::from(*value));
            let mut entry = Vec::new();
            message_field(&mut entry, 1, name.as_bytes());
            message_field(&mut entry, 2, &value_msg);
            message_field(&mut out, 7, &entry);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_device_encodes_as_the_reference_bytes() {
        // The hand-encoded one-device options of the project's PJRT notes.
        let want = [
            0x1A, 0x0F, 0x08, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01, 0x20,
            0x01, 0x28, 0x01,
        ];
        let plain = CompileOptions { flags: Vec::new(), ..CompileOptions::default() };
        assert_eq!(plain.encode(), want);
    }

    #[test]
    fn a_flag_is_a_map_entry_of_field_seven() {
        let one = CompileOptions { flags: vec![("f".into(), false)], ..CompileOptions::default() };
        let bytes = one.encode();
        // ... 0x3A len { 0x0A 0x01 'f' 0x12 0x02 { 0x10 0x00 } }
        assert_eq!(&bytes[17..], [0x3A, 0x07, 0x0A, 0x01, b'f', 0x12, 0x02, 0x10, 0x00]);
    }

    #[test]
    fn portable_is_field_four_after_the_build_options() {
        let portable =
            CompileOptions { flags: Vec::new(), portable: true, ..CompileOptions::default() };
        let bytes = portable.encode();
        // The one-device bytes, then compile_portable_executable = 1.
        assert_eq!(
            bytes[..17],
            CompileOptions { flags: Vec::new(), ..CompileOptions::default() }.encode()[..]
        );
        assert_eq!(&bytes[17..], [0x20, 0x01]);
    }

    #[test]
    fn varints_split_into_seven_bit_groups() {
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xAC, 0x02]);
    }
}
