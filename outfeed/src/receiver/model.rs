//! Model check of the receiver's queueing, back pressure and shutdown under shuttle's
//! schedulers (`RUSTFLAGS="--cfg shuttle" cargo test -p meshwork-outfeed --lib ::model::`):
//! the real listener, worker and budget code, with shuttle's threads, locks and
//! channels, and sources whose devices run as shuttle threads.

use std::sync::Arc;

use shuttle::sync::{Condvar, Mutex};

use crate::frame::{Header, RawFrame};
use crate::transport::{Sink, Source, Stop};
use crate::{Config, Delivery, Receiver, Registry};

/// A device link: frames pushed by a device thread, taken by the listener; `stop` (or the
/// device finishing) ends it once drained.
#[derive(Default)]
struct Link {
    state: Mutex<(Vec<RawFrame>, bool)>,
    ready: Condvar,
}

struct LinkSource(Arc<Link>);

struct LinkStop(Arc<Link>);

impl Stop for LinkStop {
    fn stop(&self) {
        self.0.state.lock().unwrap().1 = true;
        self.0.ready.notify_all();
    }
}

impl Source for LinkSource {
    fn next_frame(&mut self, _stream: usize, _max: u32) -> crate::Result<Option<RawFrame>> {
        let mut state = self.0.state.lock().unwrap();
        loop {
            if !state.0.is_empty() {
                return Ok(Some(state.0.remove(0)));
            }
            if state.1 {
                return Ok(None);
            }
            state = self.0.ready.wait(state).unwrap();
        }
    }

    fn ready_frame(&mut self, _stream: usize, _max: u32) -> crate::Result<Option<RawFrame>> {
        let mut state = self.0.state.lock().unwrap();
        Ok((!state.0.is_empty()).then(|| state.0.remove(0)))
    }

    fn stopper(&self) -> Arc<dyn Stop> {
        Arc::new(LinkStop(self.0.clone()))
    }
}

fn frame(source: u8, seq: u8, len: usize) -> RawFrame {
    let mut payload = vec![seq; len];
    payload[0] = source;
    RawFrame { header: Header::for_payload(1 + (len == 8) as u32, &payload).unwrap(), payload }
}

/// Two devices send frames of 4 and 8 bytes while the host shuts down at an arbitrary
/// point; a 6-byte budget keeps back pressure engaged. Every frame pushed before
/// `shutdown()` is delivered exactly once, in each device's order; the queue never
/// holds more than budget + one frame; nothing deadlocks.
fn scenario() {
    let mut registry = Registry::new();
    registry.register(1, "small", vec!["u8[4]".parse().unwrap()]).unwrap();
    registry.register(2, "large", vec!["u8[8]".parse().unwrap()]).unwrap();
    let links: Vec<Arc<Link>> = (0..2).map(|_| Arc::new(Link::default())).collect();
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let log = delivered.clone();
    let cb = move |d: &Delivery| {
        log.lock().unwrap().push((d.source, d.payload()[0], d.payload()[1]));
        Ok(())
    };
    let sources: Vec<Box<dyn Source>> =
        links.iter().map(|l| Box::new(LinkSource(l.clone())) as Box<dyn Source>).collect();
    let config = Config { budget: 6, workers: 2, ..Config::default() };
    let mut receiver = Receiver::start(registry, sources, Arc::new(cb), None, config);
    let pushed_before: Vec<Arc<Mutex<usize>>> = (0..2).map(|_| Arc::default()).collect();
    let devices: Vec<_> = links
        .iter()
        .zip(&pushed_before)
        .enumerate()
        .map(|(d, (link, count))| {
            let (link, count) = (link.clone(), count.clone());
            shuttle::thread::spawn(move || {
                for seq in 0..3u8 {
                    let mut state = link.state.lock().unwrap();
                    if state.1 {
                        return;
                    }
                    state.0.push(frame(d as u8, seq, if seq == 1 { 8 } else { 4 }));
                    *count.lock().unwrap() += 1;
                    drop(state);
                    link.ready.notify_all();
                }
            })
        })
        .collect();
    shuttle::thread::yield_now();
    // Frames pushed before shutdown starts must all arrive.
    let before: Vec<usize> = pushed_before.iter().map(|c| *c.lock().unwrap()).collect();
    let report = receiver.shutdown();
    for d in devices {
        d.join().unwrap();
    }
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(report.metrics.queue_high_water <= 6 + 8, "{}", report.metrics.queue_high_water);
    let delivered = delivered.lock().unwrap();
    for (source, &must) in before.iter().enumerate() {
        check_source(&delivered, source, must);
    }
}

/// Source `source` delivered at least `must` frames, in its order, each once.
fn check_source(delivered: &[(usize, u8, u8)], source: usize, must: usize) {
    let seqs: Vec<u8> = delivered
        .iter()
        .filter(|(s, ..)| *s == source)
        .map(|(_, tag, seq)| {
            assert_eq!(*tag as usize, source);
            *seq
        })
        .collect();
    assert!(
        seqs.len() >= must,
        "source {source}: {} delivered, {must} pushed before shutdown",
        seqs.len()
    );
    assert_eq!(seqs, (0..seqs.len() as u8).collect::<Vec<_>>(), "source {source} out of order");
}

/// One worker reads two in-process channels itself (bursts from each in turn, waiting
/// when none is ready) and the queue a listener fills from a third source, while the
/// host shuts down at an arbitrary point. Channel 0's device sends 3 frames into a
/// channel of 1 (blocking when it is full), channel 1's sends 3 then its shutdown
/// marker. Every frame sent before `shutdown()` is delivered exactly once and in order,
/// a device blocked on a full channel is released when the worker ends, and nothing
/// deadlocks. With `join`, the host waits for the sources to end by themselves instead:
/// channel 0's when its sink is dropped (no marker), the listened one's when its device
/// closes it; then every frame sent is delivered.
fn in_process_scenario(join: bool) {
    let mut registry = Registry::new();
    registry.register(1, "small", vec!["u8[4]".parse().unwrap()]).unwrap();
    registry.register(2, "large", vec!["u8[8]".parse().unwrap()]).unwrap();
    let (sink0, source0) = crate::channel(1);
    let (sink1, source1) = crate::channel(2);
    let link = Arc::new(Link::default());
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let log = delivered.clone();
    let cb = move |d: &Delivery| {
        log.lock().unwrap().push((d.source, d.payload()[0], d.payload()[1]));
        Ok(())
    };
    let sources: Vec<Box<dyn Source>> =
        vec![Box::new(source0), Box::new(source1), Box::new(LinkSource(link.clone()))];
    let config = Config { budget: 6, workers: 1, ..Config::default() };
    let mut receiver = Receiver::start(registry, sources, Arc::new(cb), None, config);
    let sent: Vec<Arc<Mutex<usize>>> = (0..3).map(|_| Arc::default()).collect();
    let mut devices = Vec::new();
    for (d, sink) in [(0usize, sink0), (1, sink1)] {
        let count = sent[d].clone();
        devices.push(shuttle::thread::spawn(move || {
            let mut sink = sink;
            for seq in 0..3u8 {
                let f = frame(d as u8, seq, if seq == 1 { 8 } else { 4 });
                if sink.send(f.header, f.payload).is_err() {
                    return;
                }
                *count.lock().unwrap() += 1;
            }
            if d == 1 {
                let _ = sink.send(Header::shutdown(), Vec::new());
            }
        }));
    }
    let count = sent[2].clone();
    devices.push(shuttle::thread::spawn(move || {
        for seq in 0..3u8 {
            let mut state = link.state.lock().unwrap();
            if state.1 {
                return;
            }
            state.0.push(frame(2, seq, 4));
            *count.lock().unwrap() += 1;
            drop(state);
            link.ready.notify_all();
        }
        if join {
            LinkStop(link).stop();
        }
    }));
    let (report, before) = if join {
        let report = receiver.join();
        for d in devices {
            d.join().unwrap();
        }
        let all: Vec<usize> = sent.iter().map(|c| *c.lock().unwrap()).collect();
        assert_eq!(all, [3, 3, 3], "every device sends everything when nobody stops it");
        (report, all)
    } else {
        shuttle::thread::yield_now();
        let before: Vec<usize> = sent.iter().map(|c| *c.lock().unwrap()).collect();
        let report = receiver.shutdown();
        for d in devices {
            d.join().unwrap();
        }
        (report, before)
    };
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let delivered = delivered.lock().unwrap();
    for (source, &must) in before.iter().enumerate() {
        check_source(&delivered, source, must);
    }
}

#[test]
fn model_random_schedules() {
    shuttle::check_random(scenario, 2000);
}

#[test]
fn model_pct_schedules() {
    shuttle::check_pct(scenario, 2000, 3);
}

#[test]
fn model_in_process_random_schedules() {
    shuttle::check_random(|| in_process_scenario(false), 2000);
}

#[test]
fn model_in_process_pct_schedules() {
    shuttle::check_pct(|| in_process_scenario(false), 2000, 3);
}

#[test]
fn model_in_process_join_random_schedules() {
    shuttle::check_random(|| in_process_scenario(true), 1000);
}

#[test]
fn model_in_process_join_pct_schedules() {
    shuttle::check_pct(|| in_process_scenario(true), 1000, 3);
}
