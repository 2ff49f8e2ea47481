//! Properties: exactly-once, in-order delivery under random budgets and source counts;
//! the queue stays within budget plus one frame; shutdown at random moments delivers
//! everything sent before it; payloads roundtrip for every dtype and rank.

use std::sync::{Arc, Mutex};

use meshwork_outfeed::{
    Config, Delivery, Receiver, Registry, Sender, Source, Tensor, channel, decode_payload,
    encode_payload,
};
use meshwork_types::TensorSpec;
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(1, "small", vec!["u32[2]".parse().unwrap()]).unwrap();
    r.register(2, "medium", vec!["u32[64]".parse().unwrap()]).unwrap();
    r.register(3, "large", vec!["u32[1024]".parse().unwrap()]).unwrap();
    r
}

fn frame(consumer: u32, source: u32, seq: u32) -> Tensor {
    let n = [0, 2, 64, 1024][consumer as usize];
    let mut data = vec![0u32; n];
    data[0] = source;
    data[1] = seq;
    Tensor::U32(ArrayD::from_shape_vec(IxDyn(&[n]), data).unwrap())
}

/// (source, (source tag, sequence number)) of every delivery.
type Tagged = Arc<Mutex<Vec<(usize, (u32, u32))>>>;

fn tag(t: &Tensor) -> (u32, u32) {
    match t {
        Tensor::U32(a) => (a[[0]], a[[1]]),
        other => panic!("{other:?}"),
    }
}

proptest! {
    #[test]
    fn prop_exactly_once_in_order_within_budget(
        plan in proptest::collection::vec(proptest::collection::vec(1u32..4, 0..40), 1..5),
        budget in prop_oneof![0usize..16, 0usize..20_000],
        workers in 1usize..4,
        slow in any::<bool>(),
    ) {
        let delivered: Tagged = Arc::default();
        let log = delivered.clone();
        let cb = move |d: &Delivery| {
            if slow {
                std::thread::yield_now();
            }
            // The delivery names the frame's own consumer (a worker reuses one
            // delivery for a run of frames): its name, and specs its payload fits.
            let len = [0, 2, 64, 1024].iter().position(|&n| n * 4 == d.payload().len());
            assert_eq!(len, Some(d.consumer as usize), "consumer {} got a payload of {} bytes", d.consumer, d.payload().len());
            assert_eq!(&*d.name, ["", "small", "medium", "large"][d.consumer as usize]);
            log.lock().unwrap().push((d.source, tag(&d.tensors()[0])));
            Ok(())
        };
        let mut sinks = Vec::new();
        let mut sources: Vec<Box<dyn Source>> = Vec::new();
        for _ in &plan {
            let (sink, source) = channel(2);
            sinks.push(sink);
            sources.push(Box::new(source));
        }
        let mut receiver = Receiver::start(registry(), sources, Arc::new(cb), None, Config { budget, workers, ..Config::default() });
        let threads: Vec<_> = plan.iter().cloned().zip(sinks).enumerate().map(|(s, (consumers, sink))| {
            std::thread::spawn(move || {
                let mut sender = Sender::new(registry(), sink);
                for (seq, c) in consumers.iter().enumerate() {
                    sender.send(*c, &[frame(*c, s as u32, seq as u32)]).unwrap();
                }
                sender.shutdown().unwrap();
            })
        }).collect();
        for t in threads {
            t.join().unwrap();
        }
        let report = receiver.join();
        prop_assert!(report.errors.is_empty(), "{:?}", report.errors);
        let delivered = delivered.lock().unwrap();
        for (s, consumers) in plan.iter().enumerate() {
            let seqs: Vec<u32> = delivered.iter().filter(|(src, _)| *src == s).map(|(_, (tag_src, seq))| {
                assert_eq!(*tag_src, s as u32);
                *seq
            }).collect();
            prop_assert_eq!(seqs, (0..consumers.len() as u32).collect::<Vec<_>>(), "source {}", s);
        }
        let max_frame = plan.iter().flatten().map(|&c| [0, 8, 256, 4096][c as usize]).max().unwrap_or(0);
        prop_assert!(report.metrics.queue_high_water <= budget + max_frame, "{} > {} + {}", report.metrics.queue_high_water, budget, max_frame);
    }

    /// Shutdown at a random moment: every frame sent before `shutdown()` was called is
    /// delivered exactly once, and what is delivered from each source is a prefix of
    /// what it sent.
    #[test]
    fn prop_shutdown_at_random_moments_loses_nothing_received(
        counts in proptest::collection::vec(0usize..60, 1..4),
        cut in 0usize..60,
        budget in prop_oneof![0usize..16, 0usize..2048],
    ) {
        let delivered: Tagged = Arc::default();
        let log = delivered.clone();
        let cb = move |d: &Delivery| {
            log.lock().unwrap().push((d.source, tag(&d.tensors()[0])));
            Ok(())
        };
        let mut senders = Vec::new();
        let mut sources: Vec<Box<dyn Source>> = Vec::new();
        for _ in &counts {
            let (sink, source) = channel(4);
            senders.push(Sender::new(registry(), sink));
            sources.push(Box::new(source));
        }
        let mut receiver = Receiver::start(registry(), sources, Arc::new(cb), None, Config { budget, ..Config::default() });
        // Send `cut` frames per source, shut down, then keep sending (those may be lost).
        let mut sent_before = vec![0usize; counts.len()];
        for (s, sender) in senders.iter_mut().enumerate() {
            for seq in 0..cut.min(counts[s]) {
                sender.send(2, &[frame(2, s as u32, seq as u32)]).unwrap();
                sent_before[s] += 1;
            }
        }
        let stopper = std::thread::spawn(move || receiver.shutdown());
        for (s, sender) in senders.iter_mut().enumerate() {
            for seq in sent_before[s]..counts[s] {
                if sender.send(2, &[frame(2, s as u32, seq as u32)]).is_err() {
                    break;
                }
            }
        }
        drop(senders);
        let report = stopper.join().unwrap();
        prop_assert!(report.errors.is_empty(), "{:?}", report.errors);
        let delivered = delivered.lock().unwrap();
        for (s, &before) in sent_before.iter().enumerate() {
            let seqs: Vec<u32> = delivered.iter().filter(|(src, _)| *src == s).map(|(_, (_, seq))| *seq).collect();
            prop_assert!(seqs.len() >= before, "source {}: {} delivered, {} sent before shutdown", s, seqs.len(), before);
            prop_assert_eq!(seqs.clone(), (0..seqs.len() as u32).collect::<Vec<_>>());
        }
    }

    #[test]
    fn prop_payloads_roundtrip_for_every_dtype_and_rank(specs in proptest::collection::vec(meshwork_types::testing::tensor_spec(4, 5), 0..4), seed in any::<u64>()) {
        let tensors: Vec<Tensor> = specs.iter().enumerate().map(|(i, s)| random_tensor(s, seed.wrapping_add(i as u64))).collect();
        let mut bytes = Vec::new();
        encode_payload(9, &specs, &tensors, &mut bytes).unwrap();
        let total: usize = specs.iter().map(|s| s.byte_size().unwrap()).sum();
        prop_assert_eq!(bytes.len(), total);
        prop_assert_eq!(decode_payload(&specs, &bytes), tensors);
    }
}

fn random_tensor(spec: &TensorSpec, seed: u64) -> Tensor {
    let n = spec.shape.num_elements();
    let dims = IxDyn(spec.shape.dims());
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    macro_rules! arr {
        ($f:expr) => {
            ArrayD::from_shape_vec(dims.clone(), (0..n).map(|_| $f(next())).collect()).unwrap()
        };
    }
    use meshwork_types::DType;
    match spec.dtype {
        DType::Bool => Tensor::Bool(arr!(|x: u64| x.is_multiple_of(2))),
        DType::U8 => Tensor::U8(arr!(|x: u64| x as u8)),
        DType::U16 => Tensor::U16(arr!(|x: u64| x as u16)),
        DType::U32 => Tensor::U32(arr!(|x: u64| x as u32)),
        DType::U64 => Tensor::U64(arr!(|x: u64| x)),
        DType::I8 => Tensor::I8(arr!(|x: u64| x as i8)),
        DType::I16 => Tensor::I16(arr!(|x: u64| x as i16)),
        DType::I32 => Tensor::I32(arr!(|x: u64| x as i32)),
        DType::I64 => Tensor::I64(arr!(|x: u64| x as i64)),
        // Any bit pattern but a NaN's (which compares unequal to itself).
        DType::F16 => Tensor::F16(arr!(|x: u64| {
            let v = meshwork_types::f16::from_bits(x as u16);
            if v.is_nan() { meshwork_types::f16::ZERO } else { v }
        })),
        DType::BF16 => Tensor::BF16(arr!(|x: u64| {
            let v = meshwork_types::bf16::from_bits(x as u16);
            if v.is_nan() { meshwork_types::bf16::ZERO } else { v }
        })),
        DType::F32 => Tensor::F32(arr!(|x: u64| (x % 1000) as f32 / 7.0)),
        DType::F64 => Tensor::F64(arr!(|x: u64| (x % 100_000) as f64 / 3.0)),
    }
}

/// A byte stream that hands out at most `chunk` bytes per read, as a socket may, and
/// counts its reads.
struct Trickle {
    bytes: Vec<u8>,
    at: usize,
    chunk: usize,
    reads: Arc<std::sync::atomic::AtomicUsize>,
}

impl Trickle {
    fn new(bytes: Vec<u8>, chunk: usize) -> Trickle {
        Trickle { bytes, at: 0, chunk, reads: Arc::default() }
    }
}

impl std::io::Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let n = buf.len().min(self.chunk).min(self.bytes.len() - self.at);
        buf[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Frames of the given payload lengths, the payload of frame `i` filled with `i`, as
/// one byte stream.
fn stream_of(lens: &[usize]) -> (Vec<meshwork_outfeed::frame::RawFrame>, Vec<u8>) {
    use meshwork_outfeed::frame::{Header, RawFrame};
    use meshwork_outfeed::{Sink, StreamSink};
    let frames: Vec<RawFrame> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let payload = vec![i as u8; n];
            RawFrame { header: Header::for_payload(1 + i as u32 % 3, &payload).unwrap(), payload }
        })
        .collect();
    let mut sink = StreamSink::new(Vec::new());
    for f in &frames {
        sink.send(f.header, f.payload.clone()).unwrap();
    }
    (frames, sink.into_inner())
}

proptest! {
    /// A stream source yields every frame once and in order whatever mix of waiting
    /// reads (`next_frame`) and ready takes (`ready_frame`, which must never wait and
    /// never consume a frame it does not return) takes them, however the stream
    /// splits its bytes.
    #[test]
    fn prop_stream_frames_come_whole_and_in_order_ready_or_not(
        lens in proptest::collection::vec(prop_oneof![0usize..64, 0usize..70_000], 0..24),
        chunk in prop_oneof![1usize..64, 1usize..200_000],
        ready in proptest::collection::vec(any::<bool>(), 0..64),
        cap in prop_oneof![Just(u32::MAX), 0u32..80_000],
    ) {
        let (frames, bytes) = stream_of(&lens);
        let trickle = Trickle::new(bytes, chunk);
        let reads = trickle.reads.clone();
        let mut source = meshwork_outfeed::StreamSource::new(trickle);
        let mut got = Vec::new();
        let mut step = 0;
        // Frames up to the first one over the cap, then that frame's error, whichever
        // way it is read.
        let error = loop {
            if ready.get(step).copied().unwrap_or(false) {
                let before = reads.load(std::sync::atomic::Ordering::SeqCst);
                let taken = loop {
                    match source.ready_frame(0, cap) {
                        Ok(Some(f)) => got.push(f),
                        Ok(None) => break None,
                        Err(e) => break Some(e),
                    }
                };
                prop_assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), before, "ready_frame read the stream");
                if let Some(e) = taken {
                    break Some(e);
                }
            }
            step += 1;
            match source.next_frame(0, cap) {
                Ok(Some(f)) => got.push(f),
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        let over = lens.iter().position(|&n| n as u64 > u64::from(cap));
        prop_assert_eq!(&got[..], &frames[..over.unwrap_or(frames.len())]);
        match (over, error) {
            (None, None) => {}
            (Some(k), Some(meshwork_outfeed::Error::FrameTooLong { len, .. })) => {
                prop_assert_eq!(len, lens[k] as u64);
            }
            (over, error) => prop_assert!(false, "frame {:?} over the cap, error {:?}", over, error),
        }
    }
}

/// Frames a read brought in whole are ready at once, and a frame cut by the buffer
/// waits for the next read.
#[test]
fn stream_frames_in_the_buffer_are_ready_without_waiting() {
    let (frames, bytes) = stream_of(&[10, 0, 4096, 7]);
    let mut source = meshwork_outfeed::StreamSource::new(std::io::Cursor::new(bytes.clone()));
    assert_eq!(source.ready_frame(0, u32::MAX).unwrap(), None, "nothing read yet");
    assert_eq!(source.next_frame(0, u32::MAX).unwrap().as_ref(), Some(&frames[0]));
    for f in &frames[1..] {
        assert_eq!(source.ready_frame(0, u32::MAX).unwrap().as_ref(), Some(f));
    }
    assert_eq!(source.ready_frame(0, u32::MAX).unwrap(), None);
    assert_eq!(source.next_frame(0, u32::MAX).unwrap(), None);

    // The first read brings 100 bytes: frame 0 (30 bytes), frame 1 (20) and 50 of frame 2.
    let mut source = meshwork_outfeed::StreamSource::new(Trickle::new(bytes.clone(), 100));
    assert_eq!(source.next_frame(0, u32::MAX).unwrap().as_ref(), Some(&frames[0]));
    assert_eq!(source.ready_frame(0, u32::MAX).unwrap().as_ref(), Some(&frames[1]));
    assert_eq!(source.ready_frame(0, u32::MAX).unwrap(), None, "frame 2 is cut");
    assert_eq!(source.next_frame(0, u32::MAX).unwrap().as_ref(), Some(&frames[2]));

    // A frame over the cap is refused from its buffered header alone.
    let mut source = meshwork_outfeed::StreamSource::new(std::io::Cursor::new(bytes));
    source.next_frame(0, u32::MAX).unwrap();
    source.ready_frame(0, u32::MAX).unwrap();
    let err = source.ready_frame(3, 100).unwrap_err();
    assert!(
        matches!(err, meshwork_outfeed::Error::FrameTooLong { stream: 3, len: 4096, cap: 100, .. }),
        "{err:?}"
    );

    // A bad header in the buffer is the stream's error, as a waiting read reports it.
    let (_, mut bad) = stream_of(&[10, 10]);
    bad[30] ^= 0xff; // the second frame's magic
    let mut source = meshwork_outfeed::StreamSource::new(std::io::Cursor::new(bad));
    source.next_frame(0, u32::MAX).unwrap();
    let err = source.ready_frame(4, u32::MAX).unwrap_err();
    assert!(matches!(err, meshwork_outfeed::Error::BadMagic { stream: 4, .. }), "{err:?}");

    // A recording of a stream records the frames it hands out ready, in order.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = dir.join("frames.bin");
    let (frames, bytes) = stream_of(&[3, 5, 7]);
    let stream = meshwork_outfeed::StreamSource::new(std::io::Cursor::new(bytes));
    let mut recording = meshwork_outfeed::Recording::new(stream, &path).unwrap();
    let mut got = vec![recording.next_frame(0, u32::MAX).unwrap().unwrap()];
    while let Some(f) = recording.ready_frame(0, u32::MAX).unwrap() {
        got.push(f);
    }
    assert_eq!(recording.next_frame(0, u32::MAX).unwrap(), None);
    drop(recording);
    let mut replay = meshwork_outfeed::StreamSource::file(&path).unwrap();
    let mut replayed = Vec::new();
    while let Some(f) = replay.next_frame(0, u32::MAX).unwrap() {
        replayed.push(f);
    }
    assert_eq!(got, frames);
    assert_eq!(replayed.len(), 3);
    for (r, f) in replayed.iter().zip(&frames) {
        assert_eq!((r.header.consumer, &r.payload), (f.header.consumer, &f.payload));
    }
}
