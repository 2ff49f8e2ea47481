//! TCP and Unix sockets, and record/replay through a file.

use std::net::TcpListener;

use meshwork_outfeed::{
    Config, Receiver, Recording, Registry, Sender, Source, StreamSink, StreamSource, channel,
};

use crate::common::{iota_u32, recorder, within_a_minute};

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    r.register(6, "b", vec!["u32[1024]".parse().unwrap()]).unwrap();
    r
}

#[test]
fn tcp_loopback_from_two_devices_keeps_each_devices_order() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let devices: Vec<_> = (0..2u32)
        .map(|d| {
            std::thread::spawn(move || {
                let stream = std::net::TcpStream::connect(addr).unwrap();
                let mut sender = Sender::new(registry(), StreamSink::tcp(stream));
                for k in 0..50 {
                    sender.send(5, &[iota_u32(16, d * 1000 + k)]).unwrap();
                    sender.send(6, &[iota_u32(1024, k)]).unwrap();
                }
                sender.shutdown().unwrap();
            })
        })
        .collect();
    let sources: Vec<Box<dyn Source>> = (0..2)
        .map(|_| {
            Box::new(StreamSource::tcp(listener.accept().unwrap().0).unwrap()) as Box<dyn Source>
        })
        .collect();
    let (log, cb) = recorder();
    let mut receiver = Receiver::start(
        registry(),
        sources,
        cb,
        None,
        Config { budget: 8 << 10, ..Config::default() },
    );
    for d in devices {
        d.join().unwrap();
    }
    let report = receiver.join();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 200);
    for source in 0..2 {
        let firsts: Vec<u32> = log
            .iter()
            .filter(|(s, c, _)| *s == source && *c == 5)
            .map(|(_, _, t)| match &t[0] {
                meshwork_outfeed::Tensor::U32(a) => a[[0]] % 1000,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(firsts, (0..50).collect::<Vec<_>>(), "source {source} out of order");
    }
}

#[test]
fn tcp_sources_bind_to_loopback_by_default() {
    let sources = meshwork_outfeed::TcpSources::bind(None).unwrap();
    let addr = sources.local_addr().unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    let device = std::thread::spawn(move || {
        let mut sender =
            Sender::new(registry(), StreamSink::tcp(std::net::TcpStream::connect(addr).unwrap()));
        sender.send(5, &[iota_u32(16, 1)]).unwrap();
        sender.shutdown().unwrap();
    });
    let accepted: Vec<Box<dyn Source>> =
        sources.accept(1).unwrap().into_iter().map(|s| Box::new(s) as Box<dyn Source>).collect();
    let (log, cb) = recorder();
    let report = Receiver::start(registry(), accepted, cb, None, Config::default()).join();
    device.join().unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[test]
fn registries_travel_as_json() {
    let json = serde_json::to_string(&registry()).unwrap();
    let back: Registry = serde_json::from_str(&json).unwrap();
    assert_eq!(back, registry());
    assert!(json.contains("\"u32[16]\""), "{json}");
}

#[test]
fn shutdown_stops_a_silent_tcp_source() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let source = StreamSource::tcp(listener.accept().unwrap().0).unwrap();
    let (_, cb) = recorder();
    let mut receiver =
        Receiver::start(registry(), vec![Box::new(source)], cb, None, Config::default());
    // The device never sends anything and never closes: shutdown must still return.
    let report = receiver.shutdown();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    drop(client);
}

#[cfg(unix)]
#[test]
fn unix_socket() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let (log, cb) = recorder();
    let mut receiver = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::unix(b).unwrap())],
        cb,
        None,
        Config::default(),
    );
    let mut sender = Sender::new(registry(), StreamSink::new(a));
    sender.send(5, &[iota_u32(16, 3)]).unwrap();
    sender.shutdown().unwrap();
    assert!(receiver.join().errors.is_empty());
    assert_eq!(*log.lock().unwrap(), vec![(0, 5, vec![iota_u32(16, 3)])]);
}

#[test]
fn record_then_replay_delivers_the_same_frames() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = dir.join("run.outfeed");
    let (sink, source) = channel(8);
    let (live, cb) = recorder();
    let mut receiver = Receiver::start(
        registry(),
        vec![Box::new(Recording::new(source, &path).unwrap())],
        cb,
        None,
        Config::default(),
    );
    let mut device = Sender::new(registry(), sink);
    for k in 0..10 {
        device.send(5, &[iota_u32(16, k)]).unwrap();
    }
    device.send(6, &[iota_u32(1024, 0)]).unwrap();
    device.shutdown().unwrap();
    assert!(receiver.join().errors.is_empty());

    let (replayed, cb) = recorder();
    let report = Receiver::start(
        registry(),
        vec![Box::new(StreamSource::file(&path).unwrap())],
        cb,
        None,
        Config::default(),
    )
    .join();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    // A second recording to the same path is refused; the first file is untouched.
    let before = std::fs::read(&path).unwrap();
    let (_, again) = channel(1);
    let refused = Recording::new(again, &path).err().map(|e| e.kind());
    assert_eq!(refused, Some(std::io::ErrorKind::AlreadyExists));
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(*replayed.lock().unwrap(), *live.lock().unwrap());
    assert_eq!(replayed.lock().unwrap().len(), 11);
}

#[test]
fn a_channel_ends_after_its_frames_once_every_sink_is_gone() {
    // Read directly: nothing sent, the sink dropped — the source ends (with the
    // shutdown marker that wakes a waiting reader, as a stop's does).
    let (sink, mut source) = channel(1);
    drop(sink);
    let frames = within_a_minute(move || {
        let mut frames = Vec::new();
        while let Some(f) = source.next_frame(0, 1 << 20).unwrap() {
            frames.push(f.header.consumer);
        }
        frames
    });
    assert!(frames.is_empty() || frames == [0], "{frames:?}");

    // Devices that finish (one of them by panicking) without a shutdown marker: `join`
    // returns with every frame they sent, in order; a clone keeps the channel open
    // until it too is gone.
    let (a, source_a) = channel(2);
    let (b, source_b) = channel(2);
    let (log, cb) = recorder();
    let sources: Vec<Box<dyn Source>> = vec![Box::new(source_a), Box::new(source_b)];
    let mut receiver = Receiver::start(registry(), sources, cb, None, Config::default());
    let a2 = a.clone();
    let devices = [
        std::thread::spawn(move || {
            let mut device = Sender::new(registry(), a);
            for i in 0..5 {
                device.send(5, &[iota_u32(16, i)]).unwrap();
            }
        }),
        std::thread::spawn(move || {
            let mut device = Sender::new(registry(), b);
            for i in 0..3 {
                device.send(5, &[iota_u32(16, i)]).unwrap();
            }
            panic!("device b dies without a shutdown marker");
        }),
    ];
    for d in devices {
        let _ = d.join();
    }
    let mut late = Sender::new(registry(), a2);
    late.send(5, &[iota_u32(16, 5)]).unwrap();
    drop(late);
    let report = within_a_minute(move || receiver.join());
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let log = log.lock().unwrap();
    for (source, n) in [(0usize, 6u32), (1, 3)] {
        let got: Vec<_> =
            log.iter().filter(|(s, ..)| *s == source).map(|(.., t)| t.clone()).collect();
        let want: Vec<_> = (0..n).map(|i| vec![iota_u32(16, i)]).collect();
        assert_eq!(got, want, "source {source}");
    }
}
