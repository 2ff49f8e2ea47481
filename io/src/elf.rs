//! The pre-check of a shared object before `dlopen`: `dlopen` maps a library's
//! segments as its program headers say, and touching a page past the end of a
//! truncated file kills the process with SIGBUS. So a plugin is checked first: a
//! regular file (a FIFO is refused without waiting), an ELF shared object for this
//! machine (class, byte order, machine, type), every `PT_LOAD` segment's bytes inside
//! the file, and the section-header table inside it too (a truncation keeps the
//! program headers at byte 64, so checking those alone would pass a cut file).

use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::{Error, Result};

/// ELF's `e_machine` for this build's architecture.
#[cfg(target_arch = "x86_64")]
const MACHINE: u16 = 62;
/// ELF's `e_machine` for this build's architecture.
#[cfg(target_arch = "aarch64")]
const MACHINE: u16 = 183;
/// ELF's `e_machine` for this build's architecture (none known here: the machine is
/// not checked, `dlopen` refuses a foreign one).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const MACHINE: u16 = 0;

/// The most program headers read (ELF's own `PN_XNUM` bound).
const MAX_PHNUM: usize = 0xffff;

/// Checks the ELF headers of a file of `len` bytes, read through `read_at(offset,
/// buf)` (which fills `buf` from `offset` or fails): the problem in words.
pub fn check_image(
    len: u64,
    read_at: &dyn Fn(u64, &mut [u8]) -> std::io::Result<()>,
) -> std::result::Result<(), String> {
    let mut eh = [0u8; 64];
    if len < 64 {
        return Err(format!("{len} bytes, too short for an ELF header"));
    }
    read_at(0, &mut eh).map_err(|e| format!("cannot read its ELF header: {e}"))?;
    if &eh[..4] != b"\x7fELF" {
        return Err("not an ELF file (no ELF magic)".into());
    }
    if eh[4] != 2 {
        return Err("not a 64-bit ELF file".into());
    }
    if eh[5] != 1 {
        return Err("not a little-endian ELF file".into());
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    if u16_at(&eh, 16) != 3 {
        return Err("not a shared object (ELF type is not ET_DYN)".into());
    }
    let machine = u16_at(&eh, 18);
    if MACHINE != 0 && machine != MACHINE {
        return Err(format!("built for ELF machine {machine}, not this machine's {MACHINE}"));
    }
    let phoff = u64_at(&eh, 32);
    let shoff = u64_at(&eh, 40);
    let phentsize = usize::from(u16_at(&eh, 54));
    let phnum = usize::from(u16_at(&eh, 56));
    let shentsize = u64::from(u16_at(&eh, 58));
    let shnum = u64::from(u16_at(&eh, 60));
    let inside = |offset: u64, bytes: u64| offset.checked_add(bytes).is_some_and(|end| end <= len);
    if shoff != 0 && !inside(shoff, shentsize * shnum) {
        return Err(format!(
            "its section headers ({shnum} of {shentsize} bytes at {shoff}) lie past its end \
             ({len} bytes): the file is cut short"
        ));
    }
    if phnum == 0 || phnum > MAX_PHNUM || phentsize < 56 {
        return Err(format!("{phnum} program headers of {phentsize} bytes"));
    }
    let table = (phnum * phentsize) as u64;
    if !inside(phoff, table) {
        return Err(format!("its program headers lie past its end ({len} bytes)"));
    }
    let mut ph = vec![0u8; phnum * phentsize];
    read_at(phoff, &mut ph).map_err(|e| format!("cannot read its program headers: {e}"))?;
    let mut loads = 0;
    for (k, h) in ph.chunks_exact(phentsize).enumerate() {
        // PT_LOAD
        if u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) != 1 {
            continue;
        }
        loads += 1;
        let offset = u64_at(h, 8);
        let filesz = u64_at(h, 32);
        if !inside(offset, filesz) {
            return Err(format!(
                "its loadable segment {k} (bytes {offset}..+{filesz}) lies past its end \
                 ({len} bytes): the file is cut short"
            ));
        }
    }
    if loads == 0 {
        return Err("no loadable segment".into());
    }
    Ok(())
}

/// Checks that `path` (named `what` in an error) is a shared object this machine can
/// map whole, before anything `dlopen`s it.
pub fn check_shared_object(what: &str, path: &Path) -> Result<()> {
    check(path).map_err(|p| Error::new(format!("{what}: {} cannot be loaded: {p}", path.display())))
}

/// [`check_shared_object`], the problem in words.
pub fn check(path: &Path) -> std::result::Result<(), String> {
    let (file, len) = crate::files::open_regular_io(path).map_err(|e| e.to_string())?;
    check_image(len, &|offset, buf| file.read_exact_at(buf, offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary itself is an executable (ET_DYN when position-independent),
    /// so the tests build a minimal shared object image by hand.
    fn image(loads: &[(u64, u64)], shoff: u64, shnum: u16, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[16..18].copy_from_slice(&3u16.to_le_bytes());
        b[18..20].copy_from_slice(&MACHINE.to_le_bytes());
        b[32..40].copy_from_slice(&64u64.to_le_bytes());
        b[40..48].copy_from_slice(&shoff.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&(loads.len() as u16).to_le_bytes());
        b[58..60].copy_from_slice(&64u16.to_le_bytes());
        b[60..62].copy_from_slice(&shnum.to_le_bytes());
        for (k, &(offset, filesz)) in loads.iter().enumerate() {
            let h = 64 + k * 56;
            b[h..h + 4].copy_from_slice(&1u32.to_le_bytes());
            b[h + 8..h + 16].copy_from_slice(&offset.to_le_bytes());
            b[h + 32..h + 40].copy_from_slice(&filesz.to_le_bytes());
        }
        b
    }

    fn check(b: &[u8]) -> std::result::Result<(), String> {
        check_image(b.len() as u64, &|offset, buf| {
            let s = b
                .get(offset as usize..offset as usize + buf.len())
                .ok_or_else(|| std::io::Error::other("past the end"))?;
            buf.copy_from_slice(s);
            Ok(())
        })
    }

    /// A whole image passes; cut anywhere after its headers, it is refused by its
    /// section table or a segment, never passed.
    #[test]
    fn a_cut_image_is_refused_wherever_it_is_cut() {
        let whole = image(&[(0, 4096), (4096, 4000)], 8192, 4, 8192 + 4 * 64);
        check(&whole).unwrap();
        for cut in [100, 4095, 4097, 8096, 8192, whole.len() - 1] {
            let e = check(&whole[..cut]).unwrap_err();
            assert!(e.contains("past its end") || e.contains("cut short"), "cut at {cut}: {e}");
        }
        assert!(check(&whole[..10]).unwrap_err().contains("too short"));
    }

    #[test]
    fn other_files_are_refused_in_words() {
        let good = image(&[(0, 100)], 0, 0, 200);
        check(&good).unwrap();
        let mut b = good.clone();
        b[0] = b'#';
        assert!(check(&b).unwrap_err().contains("no ELF magic"));
        let mut b = good.clone();
        b[16] = 2;
        assert!(check(&b).unwrap_err().contains("not a shared object"));
        let mut b = good.clone();
        b[18] ^= 0xff;
        assert!(check(&b).unwrap_err().contains("ELF machine"));
        let mut b = good.clone();
        b[4] = 1;
        assert!(check(&b).unwrap_err().contains("64-bit"));
        assert!(check(&image(&[], 0, 0, 200)).is_err());
    }

    /// The test binary itself, a real (position-independent) ELF file of this machine,
    /// passes; cut short, it is refused.
    #[test]
    fn a_real_elf_file_is_read() {
        let exe = std::env::current_exe().unwrap();
        // Position-independent, so an ET_DYN image like a shared object.
        check_shared_object("--pjrt-plugin", &exe).unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cut = dir.path().join("cut.so");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let e = check_shared_object("--pjrt-plugin", &cut).unwrap_err().0;
        assert!(e.contains("cut short"), "{e}");
    }
}
