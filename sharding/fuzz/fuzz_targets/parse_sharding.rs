//! Fuzzes the XLA-sharding and partition-spec parsers: no input may panic, and
//! whatever parses must print to text that parses back to the same value.
//!
//! `cd sharding/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run parse_sharding`

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_sharding::{HloSharding, PartitionSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sharding) = text.parse::<HloSharding>() {
        let printed = sharding.to_string();
        let back: HloSharding = printed.parse().expect("printed sharding parses");
        assert_eq!(back, sharding);
        assert_eq!(back.to_string(), printed);
    }
    if let Ok(spec) = text.parse::<PartitionSpec>() {
        let printed = spec.to_string();
        assert_eq!(
            printed
                .parse::<PartitionSpec>()
                .expect("printed spec parses"),
            spec
        );
    }
});
