//! Any bytes as a safetensors file: a header is refused in words or checked whole —
//! every tensor's bytes inside the file, contiguous, in data order, named once — and
//! then every box of every tensor reads back its bytes. Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_io::safetensors;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = safetensors::parse(data) else {
        return;
    };
    let mut at = header.data_start;
    for e in &header.entries {
        assert_eq!(e.start, at, "{} is not where the last one ended", e.name);
        at += e.bytes;
        assert_eq!(header.get(&e.name), Some(e));
    }
    assert_eq!(at, data.len() as u64);
    let dir = meshwork_fuzz::scratch("safetensors");
    let path = dir.join("w.safetensors");
    std::fs::write(&path, data).unwrap();
    let (file, again) = safetensors::open("--init", &path).unwrap();
    assert_eq!(again, header);
    for e in header.entries.iter().take(8) {
        let whole: Vec<_> = e.shape.iter().map(|&d| 0..d).collect();
        if let Ok(bytes) = safetensors::read_box("--init", &path, &file, e, &whole) {
            let start = e.start as usize;
            assert_eq!(bytes, &data[start..start + e.bytes as usize]);
        }
        let half: Vec<_> = e.shape.iter().map(|&d| d / 2..d).collect();
        let _ = safetensors::read_box("--init", &path, &file, e, &half);
    }
});
