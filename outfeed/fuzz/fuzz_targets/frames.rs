//! Fuzzes the frame decoder and the receiver behind it: any byte stream is either
//! delivered or reported, never a panic, a hang or an allocation past the cap.
//!
//! `cd outfeed/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run frames`

#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use meshwork_outfeed::frame::read_frame;
use meshwork_outfeed::{Config, Delivery, Receiver, Registry, StreamSource};

fuzz_target!(|data: &[u8]| {
    // The bare decoder: frames until the end or the first error.
    let mut reader = data;
    while let Ok(Some(frame)) = read_frame(&mut reader, 0, 1 << 16) {
        let _ = frame.verify(0);
    }
    // The receiver, with two consumers and a small budget and cap.
    let mut registry = Registry::new();
    registry.register(1, "a", vec!["u8[4]".parse().unwrap()]).unwrap();
    registry.register(2, "b", vec!["f32[2]".parse().unwrap(), "bool[3]".parse().unwrap()]).unwrap();
    let cb = |d: &Delivery| {
        let _ = d.tensors();
        Ok(())
    };
    let config = Config { budget: 64, workers: 1, max_payload: 1 << 16, stop_on_error: false };
    let source = StreamSource::new(std::io::Cursor::new(data.to_vec()));
    let _ = Receiver::start(registry, vec![Box::new(source)], Arc::new(cb), None, config).join();
});
