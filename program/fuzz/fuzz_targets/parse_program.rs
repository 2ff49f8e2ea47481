//! Fuzzes the program text parser: no input may panic (or allocate what its shapes
//! claim without checking), and whatever parses must print to text that parses back
//! to the same program and prints the same.
//!
//! `cd program/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run parse_program`

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_program::Program;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(program) = text.parse::<Program>() {
        let printed = program.to_string();
        let back: Program = printed.parse().expect("a printed program parses");
        assert_eq!(back, program);
        assert_eq!(back.to_string(), printed);
    }
});
