//! The seed's test scenarios (outfeed_receiver_test.cc), with its 128-byte budget so
//! back pressure is always engaged, and shutdown by dropping the receiver.

use meshwork_outfeed::{Config, Error, Receiver, Registry, Sender, channel};

use crate::common::{iota_u32, recorder};

fn config() -> Config {
    Config { budget: 128, ..Config::default() }
}

#[test]
fn receive_outfeed_simple() {
    let mut registry = Registry::new();
    registry.register(5, "simple", vec!["u32[16]".parse().unwrap()]).unwrap();
    let (log, cb) = recorder();
    let (sink, source) = channel(4);
    let receiver = Receiver::start(registry.clone(), vec![Box::new(source)], cb, None, config());
    Sender::new(registry, sink).send(5, &[iota_u32(16, 0)]).unwrap();
    drop(receiver); // waits to deliver the callbacks
    assert_eq!(*log.lock().unwrap(), vec![(0, 5, vec![iota_u32(16, 0)])]);
}

#[test]
fn receive_outfeed_two_computations() {
    let mut registry = Registry::new();
    registry.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    registry.register(6, "b", vec!["u32[128]".parse().unwrap()]).unwrap();
    let (log, cb) = recorder();
    let (sink, source) = channel(4);
    let receiver = Receiver::start(registry.clone(), vec![Box::new(source)], cb, None, config());
    let mut device = Sender::new(registry, sink);
    device.send(5, &[iota_u32(16, 0)]).unwrap();
    device.send(6, &[iota_u32(128, 1000)]).unwrap();
    drop(receiver);
    assert_eq!(
        *log.lock().unwrap(),
        vec![(0, 5, vec![iota_u32(16, 0)]), (0, 6, vec![iota_u32(128, 1000)])]
    );
}

#[test]
fn receive_outfeed_two_outfeeds_in_one_computation() {
    let mut registry = Registry::new();
    registry.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    registry
        .register(6, "b", vec!["u32[128]".parse().unwrap(), "u32[16]".parse().unwrap()])
        .unwrap();
    let (log, cb) = recorder();
    let (sink, source) = channel(4);
    let mut receiver =
        Receiver::start(registry.clone(), vec![Box::new(source)], cb, None, config());
    let mut device = Sender::new(registry, sink);
    device.send(5, &[iota_u32(16, 0)]).unwrap();
    device.send(6, &[iota_u32(128, 7), iota_u32(16, 9)]).unwrap();
    let report = receiver.shutdown();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        *log.lock().unwrap(),
        vec![(0, 5, vec![iota_u32(16, 0)]), (0, 6, vec![iota_u32(128, 7), iota_u32(16, 9)])]
    );
    // 128 + 64 bytes never fit a 128-byte budget together: the queue held at most one
    // frame over the budget.
    assert!(report.metrics.queue_high_water <= 128 + 576, "{}", report.metrics.queue_high_water);
}

#[test]
fn different_spec_for_consumer_id_is_an_error() {
    let mut registry = Registry::new();
    registry.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    let err = registry.register(5, "a", vec!["u32[17]".parse().unwrap()]).unwrap_err();
    assert!(matches!(err, Error::ConflictingSpec { consumer: 5, .. }));
    assert!(err.to_string().contains("does not match previous spec"), "{err}");
    // The same spec again is fine.
    assert!(registry.register(5, "a", vec!["u32[16]".parse().unwrap()]).is_ok());
}

#[test]
fn reserved_and_unregistered_consumer_ids() {
    let mut registry = Registry::new();
    let err = registry.register(0, "shutdown", vec![]).unwrap_err();
    assert!(err.to_string().contains("Consumer ID cannot be a reserved value"), "{err}");
    // A frame for a consumer the receiver does not know is an error event, not a crash;
    // later frames are still delivered.
    registry.register(5, "a", vec!["u32[16]".parse().unwrap()]).unwrap();
    let mut device_registry = registry.clone();
    device_registry.register(7, "unknown to the host", vec!["u32[4]".parse().unwrap()]).unwrap();
    let (log, cb) = recorder();
    let (sink, source) = channel(4);
    let mut receiver = Receiver::start(registry, vec![Box::new(source)], cb, None, config());
    let mut device = Sender::new(device_registry, sink);
    device.send(7, &[iota_u32(4, 0)]).unwrap();
    device.send(5, &[iota_u32(16, 0)]).unwrap();
    let report = receiver.shutdown();
    assert!(
        matches!(report.errors.as_slice(), [Error::UnknownConsumer { stream: 0, consumer: 7 }]),
        "{:?}",
        report.errors
    );
    assert_eq!(log.lock().unwrap().len(), 1);
}
