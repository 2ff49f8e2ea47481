//! Faults are reported, never aborts or hangs: failing and panicking callbacks, sources
//! that die mid-frame, corrupted streams, oversized frames.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use meshwork_outfeed::frame::{HEADER_LEN, Header};
use meshwork_outfeed::{
    Config, Delivery, Error, Receiver, Registry, Sender, StreamSink, StreamSource, channel,
};

use crate::common::{iota_u32, recorder, within_a_minute};

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    r
}

/// The bytes of `n` frames for consumer 5, each u32[16] starting at 100·k.
fn stream_bytes(n: u32) -> Vec<u8> {
    let mut sender = Sender::new(registry(), StreamSink::new(Vec::new()));
    for k in 0..n {
        sender.send(5, &[iota_u32(16, 100 * k)]).unwrap();
    }
    sender.into_sink().into_inner()
}

#[test]
fn failing_and_panicking_callbacks_are_reported_and_the_rest_is_delivered() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let cb = move |_: &Delivery| match counter.fetch_add(1, Ordering::SeqCst) {
        1 => Err("disk full".into()),
        2 => panic!("callback bug"),
        _ => Ok(()),
    };
    let seen = Arc::new(AtomicUsize::new(0));
    let errors_seen = seen.clone();
    let on_error = move |_: &Error| {
        errors_seen.fetch_add(1, Ordering::SeqCst);
    };
    let (sink, source) = channel(4);
    let mut receiver = Receiver::start(
        registry(),
        vec![Box::new(source)],
        Arc::new(cb),
        Some(Arc::new(on_error)),
        Config { budget: 128, ..Config::default() },
    );
    let mut device = Sender::new(registry(), sink);
    for k in 0..5 {
        device.send(5, &[iota_u32(16, k)]).unwrap();
    }
    let report = receiver.shutdown();
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert!(
        matches!(&report.errors[0], Error::Callback { stream: 0, consumer: 5, message } if message == "disk full")
    );
    assert!(
        matches!(&report.errors[1], Error::CallbackPanicked { stream: 0, consumer: 5, message } if message == "callback bug")
    );
    assert_eq!(report.metrics.delivered[&(0, 5)], (3, 3 * 64));
    // Shutting down again is harmless.
    assert!(receiver.shutdown().errors.is_empty());
}

#[test]
fn a_source_that_dies_mid_frame_is_reported_after_its_whole_frames() {
    let mut bytes = stream_bytes(3);
    bytes.truncate(bytes.len() - 10);
    let (log, cb) = recorder();
    let mut receiver = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::new(std::io::Cursor::new(bytes)))],
        cb,
        None,
        Config::default(),
    );
    let report = receiver.join();
    assert_eq!(log.lock().unwrap().len(), 2);
    let frame = HEADER_LEN + 64;
    assert!(
        matches!(report.errors.as_slice(), [Error::Truncated { stream: 0, got, needed }] if *got == frame - 10 && *needed == frame),
        "{:?}",
        report.errors
    );
}

#[test]
fn corrupted_streams_are_reported() {
    // A flipped payload byte: checksum error, the stream stays in sync.
    let mut bytes = stream_bytes(3);
    bytes[HEADER_LEN + 5] ^= 0xff;
    let (log, cb) = recorder();
    let report = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::new(std::io::Cursor::new(bytes)))],
        cb,
        None,
        Config::default(),
    )
    .join();
    assert!(
        matches!(report.errors.as_slice(), [Error::Checksum { stream: 0, consumer: 5, .. }]),
        "{:?}",
        report.errors
    );
    let delivered: Vec<u32> = log
        .lock()
        .unwrap()
        .iter()
        .map(|(_, _, t)| match &t[0] {
            meshwork_outfeed::Tensor::U32(a) => a[[0]],
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(delivered, [100, 200]);

    // A flipped magic: the stream cannot be read further.
    let mut bytes = stream_bytes(3);
    bytes[HEADER_LEN + 64] ^= 0x01;
    let (log, cb) = recorder();
    let report = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::new(std::io::Cursor::new(bytes)))],
        cb,
        None,
        Config::default(),
    )
    .join();
    assert!(
        matches!(report.errors.as_slice(), [Error::BadMagic { stream: 0, .. }]),
        "{:?}",
        report.errors
    );
    assert_eq!(log.lock().unwrap().len(), 1);

    // Garbage.
    let (_, cb) = recorder();
    let report = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::new(std::io::Cursor::new(
            b"not an outfeed stream at all".to_vec(),
        )))],
        cb,
        None,
        Config::default(),
    )
    .join();
    assert!(matches!(report.errors.as_slice(), [Error::BadMagic { .. }]), "{:?}", report.errors);
}

#[test]
fn oversized_frames_are_refused_before_allocation() {
    // A header announcing 4 GiB - 1 bytes, then nothing.
    let header = Header { consumer: 5, len: u32::MAX, crc: 0 }.encode().to_vec();
    let (_, cb) = recorder();
    let config = Config { max_payload: 1 << 20, ..Config::default() };
    let report = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::new(std::io::Cursor::new(header)))],
        cb,
        None,
        config,
    )
    .join();
    assert!(
        matches!(report.errors.as_slice(), [Error::FrameTooLong { stream: 0, consumer: 5, len, cap }] if *len == u32::MAX as u64 && *cap == 1 << 20),
        "{:?}",
        report.errors
    );
}

#[test]
fn payload_spec_mismatch_and_stop_on_error() {
    let mut wrong = Registry::new();
    wrong.register(5, "a", vec!["u32[8]".parse().unwrap()]).unwrap();
    let (sink_a, source_a) = channel(4);
    let (sink_b, source_b) = channel(4);
    let (log, cb) = recorder();
    let config = Config { stop_on_error: true, ..Config::default() };
    let mut receiver =
        Receiver::start(registry(), vec![Box::new(source_a), Box::new(source_b)], cb, None, config);
    Sender::new(wrong, sink_a).send(5, &[iota_u32(8, 0)]).unwrap();
    let report = receiver.join();
    assert!(
        matches!(
            report.errors.as_slice(),
            [Error::PayloadMismatch { stream: 0, consumer: 5, len: 32, expected: 64 }]
        ),
        "{:?}",
        report.errors
    );
    assert!(log.lock().unwrap().is_empty());
    drop(sink_b);
}

/// Budgets smaller than one frame, 0 included, still deliver everything: a frame is
/// admitted alone once the queue is empty, and `shutdown` returns. (A budget of 0 used
/// to block the listener for ever.) Run on a watchdog thread so a regression fails
/// instead of hanging the suite.
#[test]
fn budgets_below_one_frame_make_progress() {
    // A stream's frames wait for callbacks in the budgeted queue; a channel's in the
    // channel (its worker reads it directly).
    for (budget, stream) in [(0, false), (1, false), (63, false), (0, true), (1, true), (63, true)]
    {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let delivered = Arc::new(AtomicUsize::new(0));
            let count = delivered.clone();
            let cb = move |_: &Delivery| {
                count.fetch_add(1, Ordering::SeqCst);
                Ok(())
            };
            let config = Config { budget, workers: 1, ..Config::default() };
            let report = if stream {
                let source = StreamSource::new(std::io::Cursor::new(stream_bytes(20)));
                let mut receiver =
                    Receiver::start(registry(), vec![Box::new(source)], Arc::new(cb), None, config);
                receiver.join()
            } else {
                let (sink, source) = channel(1);
                let mut receiver =
                    Receiver::start(registry(), vec![Box::new(source)], Arc::new(cb), None, config);
                let mut device = Sender::new(registry(), sink);
                for k in 0..20 {
                    device.send(5, &[iota_u32(16, k)]).unwrap();
                }
                receiver.shutdown()
            };
            let _ = done_tx.send((delivered.load(Ordering::SeqCst), report));
        });
        let (delivered, report) = done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("budget {budget}: the receiver hung"));
        assert_eq!(delivered, 20, "budget {budget}, stream {stream}");
        assert!(report.errors.is_empty(), "budget {budget}: {:?}", report.errors);
        // The queue never holds more than the budget plus one frame.
        assert!(report.metrics.queue_high_water <= budget + 64, "budget {budget}");
        if stream {
            assert!(report.metrics.queue_high_water > 0, "the stream's frames were queued");
        }
    }
}

/// An in-process channel moves payloads by pointer: its frames carry no checksum and
/// the receiver verifies none, while a stream's frames carry one and a wrong one is
/// refused (above).
#[test]
fn channel_frames_carry_no_checksum_and_streams_do() {
    use meshwork_outfeed::{Sink, Source};
    let (sink, mut source) = channel(4);
    assert!(!sink.checksummed() && !source.checksummed());
    assert!(StreamSink::new(Vec::new()).checksummed());
    let mut sender = Sender::new(registry(), sink);
    sender.send(5, &[iota_u32(16, 0)]).unwrap();
    let frame = source.next_frame(0, 1 << 20).unwrap().unwrap();
    assert_eq!((frame.header.consumer, frame.header.len, frame.header.crc), (5, 64, 0));
    // Delivered as sent.
    let (sink, source) = channel(4);
    let (log, cb) = recorder();
    let mut receiver =
        Receiver::start(registry(), vec![Box::new(source)], cb, None, Config::default());
    let mut sender = Sender::new(registry(), sink);
    for k in 0..3 {
        sender.send(5, &[iota_u32(16, 100 * k)]).unwrap();
    }
    sender.shutdown().unwrap();
    let report = receiver.join();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(log.lock().unwrap().len(), 3);
}

/// The payload bytes of consumer 5's u32[16] starting at `k`.
fn payload_of(k: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let specs = registry().get(5).unwrap().specs.clone();
    meshwork_outfeed::encode_payload(5, &specs, &[iota_u32(16, k)], &mut out).unwrap();
    out
}

/// A stopped channel that is full (so the stop's marker cannot get in) still ends:
/// the frames it held when stopped are read, then nothing; one with room ends at the
/// marker.
#[test]
fn a_stopped_channel_ends_after_what_it_held_even_when_full() {
    use meshwork_outfeed::{Sink, Source};
    let frame = |k: u32| {
        let payload: Vec<u8> = payload_of(k);
        (Header::unchecked(5, &payload).unwrap(), payload)
    };
    for (capacity, marker) in [(2, false), (3, true)] {
        let (mut sink, mut source) = channel(capacity);
        for k in 0..2 {
            let (header, payload) = frame(k);
            sink.send(header, payload).unwrap();
        }
        source.stopper().stop();
        for k in 0..2 {
            let f = source.next_frame(0, 1 << 20).unwrap().expect("a frame held when stopped");
            assert_eq!(f.payload, frame(k).1);
        }
        match source.next_frame(0, 1 << 20).unwrap() {
            Some(f) => assert!(marker && f.header == Header::shutdown(), "{:?}", f.header),
            None => assert!(!marker, "capacity {capacity}: the marker fit"),
        }
    }
}

/// The receiver's shutdown with every channel full delivers what they held and returns.
#[test]
fn shutdown_with_full_channels_delivers_what_they_held() {
    let delivered = within_a_minute(|| {
        let (log, cb) = recorder();
        let mut sources: Vec<Box<dyn meshwork_outfeed::Source>> = Vec::new();
        let mut devices = Vec::new();
        for _ in 0..3 {
            let (sink, source) = channel(4);
            let mut device = Sender::new(registry(), sink);
            for k in 0..4 {
                device.send(5, &[iota_u32(16, k)]).unwrap();
            }
            devices.push(device);
            sources.push(Box::new(source));
        }
        let config = Config { workers: 2, ..Config::default() };
        let mut receiver = Receiver::start(registry(), sources, cb, None, config);
        let report = receiver.shutdown();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        // The host is gone: a device's next frame is refused, not lost in silence.
        assert!(matches!(devices[0].send(5, &[iota_u32(16, 9)]), Err(Error::Closed)));
        let log = log.lock().unwrap();
        (0..3).map(|s| log.iter().filter(|(src, _, _)| *src == s).count()).collect::<Vec<_>>()
    });
    assert_eq!(delivered, vec![4, 4, 4]);
}

/// An error under stop-on-error stops every source, also a full channel that only the
/// reporting worker drains (here a device keeps its channel full): the stop must not
/// wait for room there.
#[test]
fn stop_on_error_with_a_full_channel_does_not_hang() {
    use meshwork_outfeed::Sink;
    let report = within_a_minute(|| {
        let (mut bad, bad_source) = channel(2);
        let (busy, busy_source) = channel(2);
        // Sends until the host is gone.
        let device = std::thread::spawn(move || {
            let mut device = Sender::new(registry(), busy);
            while device.send(5, &[iota_u32(16, 0)]).is_ok() {}
        });
        while busy_source_len(&busy_source) < 2 {
            std::thread::yield_now();
        }
        let (_log, cb) = recorder();
        let config = Config { stop_on_error: true, workers: 1, ..Config::default() };
        let sources: Vec<Box<dyn meshwork_outfeed::Source>> =
            vec![Box::new(bad_source), Box::new(busy_source)];
        let mut receiver = Receiver::start(registry(), sources, cb, None, config);
        let payload = payload_of(0);
        bad.send(Header::unchecked(99, &payload).unwrap(), payload).unwrap();
        let report = receiver.join();
        drop(receiver);
        device.join().unwrap();
        report
    });
    assert!(
        matches!(report.errors.as_slice(), [Error::UnknownConsumer { stream: 0, consumer: 99 }]),
        "{:?}",
        report.errors
    );
}

/// How many frames an in-process channel holds now.
fn busy_source_len(source: &meshwork_outfeed::ChannelSource) -> usize {
    source.len()
}

/// One worker serving a channel (read directly) and a stream (through its listener
/// and the budgeted queue) delivers each source's frames in order.
#[test]
fn a_worker_serves_channels_and_streams_each_in_order() {
    let log = within_a_minute(|| {
        let (log, cb) = recorder();
        let (sink, channel_source) = channel(2);
        let stream = StreamSource::new(std::io::Cursor::new(stream_bytes(30)));
        let sources: Vec<Box<dyn meshwork_outfeed::Source>> =
            vec![Box::new(channel_source), Box::new(stream)];
        let config = Config { workers: 1, budget: 128, ..Config::default() };
        let mut receiver = Receiver::start(registry(), sources, cb, None, config);
        let mut device = Sender::new(registry(), sink);
        for k in 0..30 {
            device.send(5, &[iota_u32(16, 1000 + k)]).unwrap();
        }
        device.shutdown().unwrap();
        let report = receiver.join();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        log.lock().unwrap().clone()
    });
    for (source, base) in [(0usize, 1000u32), (1, 0)] {
        let got: Vec<_> =
            log.iter().filter(|(s, _, _)| *s == source).map(|(_, _, t)| t.clone()).collect();
        let step = if source == 0 { 1 } else { 100 };
        let want: Vec<_> = (0..30).map(|k| vec![iota_u32(16, base + step * k)]).collect();
        assert_eq!(got, want, "source {source}");
    }
}
