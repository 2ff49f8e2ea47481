//! Fuzzes TF device-name parsing: no input may panic; a parsed name prints to text that
//! parses back to a name printing the same.
//!
//! `cd placer/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run device_name`

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_placer::DeviceName;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for parsed in [DeviceName::parse(text), DeviceName::parse_local(text), DeviceName::parse_full_or_local(text)] {
        if let Ok(name) = parsed {
            let printed = name.to_string();
            let again = DeviceName::parse(&printed).expect("printed names parse");
            assert_eq!(again.to_string(), printed);
            let mut merged = name.clone();
            let _ = merged.merge(&again, meshwork_placer::MergeMode::Soft);
        }
    }
});
