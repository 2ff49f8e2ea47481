//! Benchmarks of meshwork-outfeed: framing (header + CRC32C), payload encode/decode, and
//! the receiver end to end with one source (the `outfeed_bench` example runs 8 sources
//! beside a bare channel and memcpy).
//!
//! `cargo bench -p meshwork-outfeed` (or `cargo xtask bench`).

#![allow(missing_docs)]

use std::sync::Arc;

use divan::Bencher;
use divan::counter::BytesCount;
use meshwork_outfeed::frame::Header;
use meshwork_outfeed::{
    Config, Delivery, Receiver, Registry, Sender, Tensor, channel, decode_payload, encode_payload,
};
use ndarray::{ArrayD, IxDyn};

const SIZES: [usize; 3] = [64, 4 << 10, 1 << 20];

fn main() {
    divan::main();
}

#[divan::bench(args = SIZES)]
fn frame_header(bencher: Bencher<'_, '_>, bytes: usize) {
    let payload = vec![3u8; bytes];
    bencher
        .counter(BytesCount::new(bytes))
        .bench(|| Header::for_payload(1, divan::black_box(&payload)).unwrap().encode());
}

#[divan::bench(args = SIZES)]
fn encode_decode_f32(bencher: Bencher<'_, '_>, bytes: usize) {
    let n = bytes / 4;
    let spec = vec![format!("f32[{n}]").parse().unwrap()];
    let tensor = Tensor::F32(
        ArrayD::from_shape_vec(IxDyn(&[n]), (0..n).map(|i| i as f32).collect()).unwrap(),
    );
    let mut buf = Vec::new();
    bencher.counter(BytesCount::new(bytes)).bench_local(|| {
        encode_payload(1, &spec, std::slice::from_ref(&tensor), &mut buf).unwrap();
        decode_payload(&spec, &buf)
    });
}

#[divan::bench(args = SIZES)]
fn one_source_end_to_end(bencher: Bencher<'_, '_>, bytes: usize) {
    let frames = ((8 << 20) / bytes).clamp(16, 20_000);
    let mut registry = Registry::new();
    registry.register(1, "p", vec![format!("u8[{bytes}]").parse().unwrap()]).unwrap();
    bencher
        .counter(BytesCount::new(bytes * frames))
        .with_inputs(|| (0..frames).map(|_| vec![1u8; bytes]).collect::<Vec<_>>())
        .bench_local_values(|payloads| {
            let (sink, source) = channel(64);
            let cb = |_: &Delivery| Ok(());
            let mut receiver = Receiver::start(
                registry.clone(),
                vec![Box::new(source)],
                Arc::new(cb),
                None,
                Config::default(),
            );
            let mut sender = Sender::new(registry.clone(), sink);
            for p in payloads {
                sender.send_bytes(1, p).unwrap();
            }
            sender.shutdown().unwrap();
            receiver.join()
        });
}
