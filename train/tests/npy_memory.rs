//! The `.npy` reader's allocation limit, measured: every allocation this thread makes
//! while reading is counted, and the most it held at once stays within the byte limit
//! it was given (plus the header, which is at most `MAX_HEADER`, and a few small
//! strings) — for any file, however its header lies about its shape.
//!
//! A test binary of its own: it replaces the global allocator.

// The counting allocator forwards every call to the system allocator unchanged.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use meshwork_io::npy::{self, MAX_HEADER};
use proptest::prelude::*;

/// The system allocator, counting the bytes the current thread holds and the most it
/// has held since the count was reset.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE.try_with(|live| {
        live.set(live.get() + delta);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments, and only
// adds bookkeeping in thread-local cells (which never allocate: const-initialized).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout`, as the caller promises.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc` and `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The most this thread held at once, above what it held before, while `f` ran.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, (peak - base).max(0) as usize)
}

/// A `.npy` file of `descr` whose header declares `shape` and which holds `data`.
fn npy_bytes(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    [npy::header(descr, shape), data.to_vec()].concat()
}

/// What reading `bytes` as a file may hold at once: the limit, the header, and room
/// for the path and an error's words.
fn bound(limit: u64, bytes: &[u8]) -> usize {
    limit as usize + bytes.len().min(MAX_HEADER + 12) + 16 * 1024
}

fn read_counted(path: &Path, bytes: &[u8], limit: u64) -> (bool, usize) {
    std::fs::write(path, bytes).unwrap();
    let (result, peak) = peak_of(|| npy::read("--data-x", path, limit).is_ok());
    (result, peak)
}

/// The counter sees what the reader holds: a file whose data the limit admits is read,
/// and the reader holds at least its data and values.
#[test]
fn the_counter_sees_what_a_read_holds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.npy");
    let data: Vec<u8> = (0..4096u32).flat_map(|v| f64::from(v).to_le_bytes()).collect();
    let bytes = npy_bytes("<f8", &[4096], &data);
    let (ok, peak) = read_counted(&path, &bytes, 1 << 20);
    assert!(ok);
    assert!(peak >= 2 * 4096 * 8, "the counter missed the read's {peak} bytes");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// However a header's shape lies (up to 2^50 elements) and whatever the file holds,
    /// the reader never holds more than its limit beyond the header; it reads the file
    /// exactly when the data and the f64 values they become fit the limit.
    #[test]
    fn prop_a_read_never_holds_more_than_its_limit(
        dims in prop::collection::vec(prop_oneof![0u64..70, 1u64..(1 << 25)], 1..3),
        held in 0usize..8192,
        descr in prop::sample::select(vec!["<f8", "<f4", "<i4", "|u1"]),
        limit in 0u64..65536,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        let size: u64 = match descr { "<f8" => 8, "<f4" | "<i4" => 4, _ => 1 };
        let count = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        // The data the header declares when that is small, or `held` bytes otherwise.
        let data = match count.and_then(|c| c.checked_mul(size)) {
            Some(n) if n <= 1 << 16 => vec![1u8; n as usize],
            _ => vec![1u8; held],
        };
        let bytes = npy_bytes(descr, &shape, &data);
        let (ok, peak) = read_counted(&path, &bytes, limit);
        prop_assert!(peak <= bound(limit, &bytes), "held {peak} bytes at once under a limit of {limit}");
        let fits = count.is_some_and(|c| c * size == data.len() as u64 && data.len() as u64 + c * 8 <= limit);
        prop_assert_eq!(ok, fits);
    }

    /// Any bytes — a valid file's cut, mutated or padded — read as an array or an
    /// error, never a panic, and never hold more than the limit beyond the header.
    #[test]
    fn prop_any_bytes_read_within_the_limit(
        cut in 0usize..200,
        flips in prop::collection::vec((0usize..200, any::<u8>()), 0..6),
        tail in prop::collection::vec(any::<u8>(), 0..40),
        limit in 0u64..4096,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let a = ndarray::Array2::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64);
        npy::write_f64(&path, &a).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(cut.max(1).min(bytes.len()));
        for (at, v) in flips {
            if let Some(b) = bytes.get_mut(at) {
                *b = v;
            }
        }
        bytes.extend(tail);
        let (_, peak) = read_counted(&path, &bytes, limit);
        prop_assert!(peak <= bound(limit, &bytes), "held {peak} bytes at once under a limit of {limit}");
    }
}
