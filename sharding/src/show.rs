//! A text picture of which device holds which block of a 1-D or 2-D array, in the
//! manner of `jax.debug.visualize_array_sharding`.

use std::ops::Range;

use crate::{Error, Mode, Result, Sharding};

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
