//! A sharding for people: a text picture of which device holds which block of a 1-D or
//! 2-D array, in the manner of `jax.debug.visualize_array_sharding`; a description of
//! a sharding (shard shape, XLA text, index map); and what a reshard moves.

use std::fmt::Write as _;
use std::ops::Range;

use meshwork_types::{DType, Shape};

use crate::{Error, Mode, ReshardPlan, Result, Sharding};

/// `[0:4, 4:8, 0:2]`.
fn ranges_text(r: &[Range<usize>]) -> String {
    let parts: Vec<String> = r.iter().map(|r| format!("{}:{}", r.start, r.end)).collect();
    format!("[{}]", parts.join(", "))
}

/// An array of `shape` under `sharding` (strict, as JAX): the picture for rank 1 and
/// 2, the shard shape, the XLA sharding, and the index map — each device and the index
/// ranges it holds, with its replica id where several devices hold the same block.
/// Everything is computed before any text is made, so an error leaves no half.
///
/// ```
/// use meshwork_sharding::{Mesh, NamedSharding, describe};
///
/// let mesh = Mesh::iota(&[("a", 2)])?;
/// let sharding = NamedSharding::new(mesh, "P('a')".parse()?)?.to_sharding(3)?;
/// let text = describe(&sharding, &[4, 2, 2])?;
/// assert!(text.contains("shard shape: [2, 2, 2] of [4, 2, 2]"));
/// assert!(text.contains("  device 1: [2:4, 0:2, 0:2]\n"));
/// # Ok::<(), meshwork_sharding::Error>(())
/// ```
pub fn describe(sharding: &Sharding, shape: &[usize]) -> Result<String> {
    let shard = sharding.shard_shape(shape, Mode::Strict)?;
    let map = sharding.index_map(shape, Mode::Strict)?;
    let mut out = match shape.len() {
        1 | 2 => visualize(sharding, shape, Mode::Strict)?,
        rank => format!("(no picture for rank {rank}: only arrays of rank 1 and 2 are drawn)"),
    };
    let replicated = map.iter().any(|e| e.replica_id > 0);
    let _ = writeln!(out, "\nshard shape: {shard:?} of {shape:?}");
    let _ = writeln!(out, "XLA sharding: {}", sharding.hlo());
    let _ = writeln!(
        out,
        "index map ({} devices: the index ranges each holds{}):",
        map.len(),
        if replicated { ", and which copy of its block" } else { "" }
    );
    for e in &map {
        let _ = write!(out, "  device {}: {}", e.device.0, ranges_text(&e.ranges));
        let _ =
            if replicated { writeln!(out, " (replica {})", e.replica_id) } else { writeln!(out) };
    }
    Ok(out)
}

/// What resharding an array of `shape` and `dtype` from `from` to `to` moves: the box
/// copies (local and between devices), and the elements and bytes that cross devices
/// against the array's total (more than 100% when the target replicates blocks onto
/// devices that lacked them).
pub fn describe_reshard(
    from: &Sharding,
    to: &Sharding,
    shape: &[usize],
    dtype: DType,
) -> Result<String> {
    let array_bytes = Shape::new(shape)?.byte_size(dtype)?;
    let plan = ReshardPlan::new(from, to, shape, Mode::Strict)?;
    // Sums in u128: a replicated target holds the array once per device.
    let size = dtype.size_in_bytes() as u128;
    let elements = |r: &[Range<usize>]| r.iter().map(|r| r.len() as u128).product::<u128>();
    let local = plan.transfers().iter().filter(|t| t.is_local()).count();
    let moved: u128 =
        plan.transfers().iter().filter(|t| !t.is_local()).map(|t| elements(&t.region)).sum();
    let held: u128 = plan.target_index().iter().map(|e| elements(&e.ranges)).sum();
    let total: u128 = shape.iter().map(|&d| d as u128).product();
    let copies = if total > 0 && held.is_multiple_of(total) {
        match held / total {
            1 => " (the array once)".to_string(),
            k => format!(" (the array {k} times over)"),
        }
    } else {
        String::new()
    };
    let keeps =
        if moved == 0 { "; nothing crosses devices: each device keeps what it holds" } else { "" };
    let mut out = format!("reshard {shape:?} {dtype}: {} -> {}\n", from.hlo(), to.hlo());
    let _ = writeln!(out, "  array          {total} elements, {array_bytes} bytes");
    let _ = writeln!(
        out,
        "  target shards  {held} elements, {} bytes on {} devices{copies}",
        held * size,
        plan.target_index().len()
    );
    let _ = writeln!(
        out,
        "  transfers      {} ({local} local copies, {} between devices)",
        plan.transfers().len(),
        plan.transfers().len() - local
    );
    let _ = writeln!(
        out,
        "  moved          {moved} of {total} elements ({:.1}%), {} of {array_bytes} bytes, against the array's total{keeps}",
        100.0 * moved as f64 / total.max(1) as f64,
        moved * size,
    );
    Ok(out)
}

/// Draws which devices hold each block of an array of `shape` (rank 1 or 2; a 1-D
/// array is drawn as one row). Each cell names its block's rows and columns and the
/// devices holding it, first holder first.
///
/// ```
/// use meshwork_sharding::{Mesh, Mode, NamedSharding, visualize};
///
/// let mesh = Mesh::iota(&[("a", 2), ("b", 2)])?;
/// let sharding = NamedSharding::new(mesh, "P('a')".parse()?)?.to_sharding(2)?;
/// let picture = visualize(&sharding, &[4, 6], Mode::Strict)?;
/// assert_eq!(picture, "\
/// ┌──────────────┐
/// │ [0:2, 0:6]   │
/// │ devices 0,1  │
/// ├──────────────┤
/// │ [2:4, 0:6]   │
/// │ devices 2,3  │
/// └──────────────┘
/// ");
/// # Ok::<(), meshwork_sharding::Error>(())
/// ```
pub fn visualize(sharding: &Sharding, shape: &[usize], mode: Mode) -> Result<String> {
    let (rows_dim, shape2) = match shape {
        [n] => (None, [1, *n]),
        [r, c] => (Some(()), [*r, *c]),
        _ => {
            return Err(Error::RankMismatch { sharding_rank: 2, shape_rank: shape.len() });
        }
    };
    let map = sharding.index_map(shape, mode)?;
    let regions: Vec<(Range<usize>, Range<usize>, u32)> = map
        .iter()
        .map(|e| match rows_dim {
            Some(()) => (e.ranges[0].clone(), e.ranges[1].clone(), e.device.0),
            None => (0..1, e.ranges[0].clone(), e.device.0),
        })
        .collect();
    let bounds = |axis: usize| {
        let mut cuts: Vec<usize> = vec![0, shape2[axis]];
        for (r, c, _) in &regions {
            let range = if axis == 0 { r } else { c };
            cuts.extend([range.start, range.end]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2).map(|w| w[0]..w[1]).filter(|r| !r.is_empty()).collect::<Vec<_>>()
    };
    let (row_bands, col_bands) = (bounds(0), bounds(1));
    // Cell text: the block and its holders.
    let cells: Vec<Vec<[String; 2]>> = row_bands
        .iter()
        .map(|rows| {
            col_bands
                .iter()
                .map(|cols| {
                    let holders: Vec<String> = regions
                        .iter()
                        .filter(|(r, c, _)| {
                            r.start <= rows.start
                                && rows.end <= r.end
                                && c.start <= cols.start
                                && cols.end <= c.end
                        })
                        .map(|(_, _, d)| d.to_string())
                        .collect();
                    let block = match rows_dim {
                        Some(()) => {
                            format!("[{}:{}, {}:{}]", rows.start, rows.end, cols.start, cols.end)
                        }
                        None => format!("[{}:{}]", cols.start, cols.end),
                    };
                    let who = if holders.is_empty() {
                        "nobody".to_owned()
                    } else {
                        format!("devices {}", holders.join(","))
                    };
                    [block, who]
                })
                .collect()
        })
        .collect();
    let width = cells.iter().flatten().flatten().map(|s| s.chars().count()).max().unwrap_or(0) + 2;
    let line = |left: &str, mid: &str, right: &str| {
        let seg = "─".repeat(width + 1);
        format!("{left}{}{right}\n", vec![seg; col_bands.len()].join(mid))
    };
    let mut out = line("┌", "┬", "┐");
    for (i, row) in cells.iter().enumerate() {
        if i > 0 {
            out.push_str(&line("├", "┼", "┤"));
        }
        for part in 0..2 {
            out.push('│');
            for cell in row {
                out.push_str(&format!(" {:<width$}│", cell[part]));
            }
            out.push('\n');
        }
    }
    out.push_str(&line("└", "┴", "┘"));
    Ok(out)
}
