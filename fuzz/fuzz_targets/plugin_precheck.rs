//! Any bytes as a PJRT plugin before `dlopen`: the ELF pre-check passes only an image
//! whose loadable segments and section table lie inside it. Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let read = |offset: u64, buf: &mut [u8]| -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        let s = data
            .get(start..start.saturating_add(buf.len()))
            .ok_or_else(|| std::io::Error::other("past the end"))?;
        buf.copy_from_slice(s);
        Ok(())
    };
    if meshwork_io::elf::check_image(data.len() as u64, &read).is_ok() {
        // Passed: its program headers are inside it, so it is at least an ELF header.
        assert!(data.len() >= 64 && &data[..4] == b"\x7fELF");
    }
});
