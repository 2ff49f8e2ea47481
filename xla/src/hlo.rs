//! What a compiled program really does, read from the HLO XLA optimized
//! ([`Executable::optimized_program`](crate::Executable::optimized_program): a
//! serialized `HloModuleProtoWithConfig`): its collectives, each with the bytes it
//! produces per device. A few fields of XLA's `hlo.proto` and `xla_data.proto` are
//! read by hand (no generated code, as for the compile options); everything else is
//! skipped by its wire type. A collective inside a loop's body is counted once, as
//! written (meshwork's programs have no loops; XLA rarely makes one of a collective).

use crate::{Error, Result};

/// A collective in a compiled program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveOp {
    /// XLA's opcode (`all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`,
    /// `collective-permute`), an asynchronous pair counted once by its `-start`.
    pub kind: String,
    /// The bytes of its result on each device.
    pub bytes: u64,
}

/// The collectives of every computation of a serialized `HloModuleProtoWithConfig`
/// (or a bare `HloModuleProto`), in program order.
pub fn collectives(module: &[u8]) -> Result<Vec<CollectiveOp>> {
    let bad = |what: &str| Error::Host(format!("the optimized HLO module: {what}"));
    // HloModuleProtoWithConfig.hlo_module = 1; a bare HloModuleProto has its name
    // (a string) as field 1 too, so the wrapper is recognized by holding computations.
    let mut module_bytes = module;
    for (field, value) in fields(module).map_err(|e| bad(&e))? {
        if let (1, Wire::Bytes(inner)) = (field, value)
            && fields(inner).is_ok_and(|f| f.iter().any(|(n, _)| *n == 3))
        {
            module_bytes = inner;
        }
    }
    let mut out = Vec::new();
    for (field, value) in fields(module_bytes).map_err(|e| bad(&e))? {
        // HloModuleProto.computations = 3.
        let (3, Wire::Bytes(computation)) = (field, value) else { continue };
        for (field, value) in fields(computation).map_err(|e| bad(&e))? {
            // HloComputationProto.instructions = 2.
            let (2, Wire::Bytes(instruction)) = (field, value) else { continue };
            let (mut opcode, mut shape) = (String::new(), None);
            for (field, value) in fields(instruction).map_err(|e| bad(&e))? {
                match (field, value) {
                    (2, Wire::Bytes(s)) => opcode = String::from_utf8_lossy(s).into_owned(),
                    (3, Wire::Bytes(s)) => shape = Some(s),
                    _ => {}
                }
            }
            let Some(kind) = collective_kind(&opcode) else { continue };
            let bytes = match shape {
                Some(s) => result_bytes(s, start_form(&opcode)).map_err(|e| bad(&e))?,
                None => 0,
            };
            out.push(CollectiveOp { kind: kind.to_string(), bytes });
        }
    }
    Ok(out)
}

/// The collective an opcode is (its `-start` counted, its `-done` not).
fn collective_kind(opcode: &str) -> Option<&str> {
    let base = opcode.strip_suffix("-start").unwrap_or(opcode);
    ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
        .into_iter()
        .find(|&k| k == base)
}

/// Where an asynchronous `-start`'s shape holds its results: `all-reduce-start`'s is
/// its results' (as the synchronous op's); `all-gather-start`'s a tuple of its
/// operands then its results; `collective-permute-start`'s a tuple of its operand,
/// its output and context scalars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The shape is the results'.
    Whole,
    /// The tuple's second half.
    SecondHalf,
    /// The tuple's element 1.
    Second,
}

fn start_form(opcode: &str) -> Start {
    match opcode {
        "all-gather-start" => Start::SecondHalf,
        "collective-permute-start" => Start::Second,
        _ => Start::Whole,
    }
}

/// A `ShapeProto`'s bytes (a tuple's, summed), taking the part `start` says holds the
/// results.
fn result_bytes(shape: &[u8], start: Start) -> std::result::Result<u64, String> {
    let (mut element, mut dims, mut tuple) = (0u64, Vec::new(), Vec::new());
    for (field, value) in fields(shape)? {
        match (field, value) {
            (2, Wire::Varint(t)) => element = t,
            (3, Wire::Varint(d)) => dims.push(d),
            (3, Wire::Bytes(packed)) => {
                let mut at = 0;
                while at < packed.len() {
                    dims.push(varint(packed, &mut at)?);
                }
            }
            (4, Wire::Bytes(s)) => tuple.push(s),
            _ => {}
        }
    }
    // PrimitiveType: TUPLE = 13.
    if element == 13 {
        let parts =
            tuple.iter().map(|s| result_bytes(s, Start::Whole)).collect::<Result<Vec<_>, _>>()?;
        return Ok(match start {
            Start::Whole => parts.iter().sum(),
            Start::SecondHalf => parts[parts.len() / 2..].iter().sum(),
            Start::Second => parts.get(1).copied().unwrap_or(0),
        });
    }
    let size = match element {
        1..=2 | 6 => 1,       // PRED, S8, U8
        3 | 7 | 10 | 16 => 2, // S16, U16, F16, BF16
        4 | 8 | 11 => 4,      // S32, U32, F32
        5 | 9 | 12 => 8,      // S64, U64, F64
        _ => 0,               // tokens and the rest carry no data
    };
    Ok(dims.iter().product::<u64>() * size)
}

/// A field's value by wire type.
enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The top-level fields of a protobuf message, in order.
fn fields(buf: &[u8]) -> std::result::Result<Vec<(u64, Wire<'_>)>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let key = varint(buf, &mut at)?;
        let value = match key & 7 {
            0 => Wire::Varint(varint(buf, &mut at)?),
            1 | 5 => {
                at += if key & 7 == 1 { 8 } else { 4 };
                Wire::Fixed
            }
            2 => {
                let len = usize::try_from(varint(buf, &mut at)?).map_err(|e| e.to_string())?;
                let end = at
                    .checked_add(len)
                    .filter(|&e| e <= buf.len())
                    .ok_or("a field past the end")?;
                let bytes = &buf[at..end];
                at = end;
                Wire::Bytes(bytes)
            }
            w => return Err(format!("wire type {w}")),
        };
        if at > buf.len() {
            return Err("a field past the end".into());
        }
        out.push((key >> 3, value));
    }
    Ok(out)
}

fn varint(buf: &[u8], at: &mut usize) -> std::result::Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*at).ok_or("a varint past the end")?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(field: u64, wire: u64, out: &mut Vec<u8>) {
        put(field << 3 | wire, out);
    }
    fn put(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn bytes(field: u64, b: &[u8], out: &mut Vec<u8>) {
        key(field, 2, out);
        put(b.len() as u64, out);
        out.extend_from_slice(b);
    }
    fn shape(element: u64, dims: &[u64]) -> Vec<u8> {
        let mut s = Vec::new();
        key(2, 0, &mut s);
        put(element, &mut s);
        let mut packed = Vec::new();
        for &d in dims {
            put(d, &mut packed);
        }
        bytes(3, &packed, &mut s);
        s
    }
    fn instruction(opcode: &str, shape: &[u8]) -> Vec<u8> {
        let mut i = Vec::new();
        bytes(1, b"x", &mut i);
        bytes(2, opcode.as_bytes(), &mut i);
        bytes(3, shape, &mut i);
        i
    }

    /// A module written field by field as XLA serializes it: an all-reduce of f64[4,8],
    /// an async all-gather (counted once, by its start's result half), an add.
    #[test]
    fn collectives_are_read_with_their_result_bytes() {
        let mut computation = Vec::new();
        bytes(1, b"main", &mut computation);
        bytes(2, &instruction("all-reduce", &shape(12, &[4, 8])), &mut computation);
        let mut tuple = Vec::new();
        key(2, 0, &mut tuple);
        put(13, &mut tuple);
        bytes(4, &shape(11, &[2]), &mut tuple);
        bytes(4, &shape(11, &[8]), &mut tuple);
        bytes(2, &instruction("all-gather-start", &tuple), &mut computation);
        bytes(2, &instruction("all-gather-done", &shape(11, &[8])), &mut computation);
        // A combined asynchronous all-reduce: its shape is its two results'.
        let mut pair = Vec::new();
        key(2, 0, &mut pair);
        put(13, &mut pair);
        bytes(4, &shape(12, &[3]), &mut pair);
        bytes(4, &shape(12, &[5]), &mut pair);
        bytes(2, &instruction("all-reduce-start", &pair), &mut computation);
        // A permute's: its operand, its output, two u32 contexts.
        let mut permute = Vec::new();
        key(2, 0, &mut permute);
        put(13, &mut permute);
        bytes(4, &shape(11, &[6]), &mut permute);
        bytes(4, &shape(11, &[6]), &mut permute);
        bytes(4, &shape(8, &[]), &mut permute);
        bytes(4, &shape(8, &[]), &mut permute);
        bytes(2, &instruction("collective-permute-start", &permute), &mut computation);
        bytes(2, &instruction("add", &shape(12, &[4, 8])), &mut computation);
        let mut module = Vec::new();
        bytes(1, b"jit_f", &mut module);
        bytes(3, &computation, &mut module);
        let mut with_config = Vec::new();
        bytes(1, &module, &mut with_config);
        bytes(2, b"", &mut with_config);
        let want = vec![
            CollectiveOp { kind: "all-reduce".into(), bytes: 256 },
            CollectiveOp { kind: "all-gather".into(), bytes: 32 },
            CollectiveOp { kind: "all-reduce".into(), bytes: 64 },
            CollectiveOp { kind: "collective-permute".into(), bytes: 24 },
        ];
        assert_eq!(collectives(&with_config).unwrap(), want);
        assert_eq!(collectives(&module).unwrap(), want);
        // Cut anywhere, it is an error, never a panic.
        for n in 1..with_config.len() {
            let _ = collectives(&with_config[..n]);
        }
    }
}
