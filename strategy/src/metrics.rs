//! Per-step metrics from replicas to a host callback through the outfeed crate: the
//! executor's sink adapted onto outfeed senders, one in-memory stream per device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use meshwork_executor::{OutfeedSink, ReplicaError, Tensor};
use meshwork_outfeed as outfeed;
use meshwork_types::{Shape, TensorSpec};

use crate::{Error, Result};

/// One metrics record as the host sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricEvent {
    /// The step the replica tagged it with.
    pub step: u64,
    /// The replica that sent it.
    pub replica: usize,
    /// The consumer id it was sent to.
    pub consumer: u32,
    /// The consumer's name.
    pub name: String,
    /// The tensors.
    pub tensors: Vec<Tensor>,
}

/// A metrics consumer: an id, a name and the specs of its tensors (the step tag is
/// added in front by the strategy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricSpec {
    /// The consumer id (not 0, which the outfeed reserves).
    pub id: u32,
    /// Its name.
    pub name: String,
    /// The tensors each record carries.
    pub specs: Vec<TensorSpec>,
}

/// The host's callback for metrics records.
pub type MetricCallback = dyn Fn(&MetricEvent) + Send + Sync;

/// Sends each (local) device's emits down its own outfeed stream.
pub(crate) struct Streams {
    /// The first executor replica whose stream is `senders[0]`.
    first: usize,
    senders: Vec<Mutex<outfeed::Sender<outfeed::ChannelSink>>>,
    receiver: Mutex<outfeed::Receiver>,
    sent: AtomicU64,
    delivered: Arc<Delivered>,
    errors: Arc<Mutex<Vec<String>>>,
    /// What each consumer takes.
    consumers: Vec<MetricSpec>,
}

/// Records delivered so far, with a condition variable to wait on.
#[derive(Default)]
struct Delivered {
    count: Mutex<u64>,
    changed: Condvar,
}

impl Delivered {
    fn add(&self) {
        *self.count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }
}

impl Streams {
    /// Streams for the executor replicas `devices` (this process's), whose replicas
    /// have `logical` logical devices each.
    pub(crate) fn start(
        devices: std::ops::Range<usize>,
        logical: usize,
        consumers: &[MetricSpec],
        callback: Arc<MetricCallback>,
    ) -> Result<Streams> {
        let mut registry = outfeed::Registry::new();
        let step = TensorSpec::new(meshwork_types::DType::I64, Shape::new(&[])?);
        for c in consumers {
            let mut specs = vec![step.clone()];
            specs.extend(c.specs.iter().cloned());
            registry.register(c.id, &c.name, specs)?;
        }
        let first = devices.start;
        let (sinks, sources): (Vec<_>, Vec<_>) = devices.map(|_| outfeed::channel(1024)).unzip();
        let delivered = Arc::new(Delivered::default());
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let counter = delivered.clone();
        let on_delivery = move |d: &outfeed::Delivery| {
            let mut tensors = d.tensors().into_iter();
            let step = match tensors.next() {
                Some(Tensor::I64(a)) => a.iter().next().copied().unwrap_or(0) as u64,
                _ => 0,
            };
            let event = MetricEvent {
                step,
                replica: (first + d.source) / logical,
                consumer: d.consumer,
                name: d.name.to_string(),
                tensors: tensors.collect(),
            };
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(&event)));
            counter.add();
            result.map_err(|_| outfeed::CallbackError::from("the metrics callback panicked"))
        };
        let (log, wake) = (errors.clone(), delivered.clone());
        let on_error = move |e: &outfeed::Error| {
            log.lock().unwrap_or_else(|p| p.into_inner()).push(e.to_string());
            wake.changed.notify_all();
        };
        let receiver = outfeed::Receiver::start(
            registry.clone(),
            sources.into_iter().map(|s| Box::new(s) as Box<dyn outfeed::Source>).collect(),
            Arc::new(on_delivery),
            Some(Arc::new(on_error)),
            outfeed::Config::default(),
        );
        Ok(Streams {
            first,
            senders: sinks
                .into_iter()
                .map(|s| Mutex::new(outfeed::Sender::new(registry.clone(), s)))
                .collect(),
            receiver: Mutex::new(receiver),
            sent: AtomicU64::new(0),
            delivered,
            errors,
            consumers: consumers.to_vec(),
        })
    }

    /// Whether consumer `id` is registered and takes records of `specs`.
    pub(crate) fn takes(&self, id: u32, specs: &[TensorSpec]) -> Result<()> {
        match self.consumers.iter().find(|c| c.id == id) {
            Some(c) if c.specs == specs => Ok(()),
            Some(c) => Err(Error::Metrics {
                problem: format!(
                    "consumer {id} ({}) takes {:?}, a program emits {:?}",
                    c.name,
                    c.specs.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    specs.iter().map(ToString::to_string).collect::<Vec<_>>()
                ),
            }),
            None => {
                Err(Error::Metrics { problem: format!("no metrics consumer {id} is registered") })
            }
        }
    }

    /// Waits until every record sent so far reached the callback (or `timeout`).
    pub(crate) fn flush(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let sent = self.sent.load(Ordering::SeqCst);
        let mut delivered = self.delivered.count.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = self.errors.lock().unwrap_or_else(|p| p.into_inner()).first() {
                return Err(Error::Metrics { problem: e.clone() });
            }
            if *delivered >= sent {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Metrics {
                    problem: format!(
                        "{} of {sent} records undelivered after {timeout:?}",
                        sent - *delivered
                    ),
                });
            }
            delivered = self
                .delivered
                .changed
                .wait_timeout(delivered, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        for s in &self.senders {
            let _ = s.lock().unwrap_or_else(|p| p.into_inner()).shutdown();
        }
        self.receiver.lock().unwrap_or_else(|p| p.into_inner()).shutdown();
    }
}

/// The executor's sink: device `e`'s emits go down stream `e`.
pub(crate) struct Sink(pub(crate) Arc<Streams>);

impl OutfeedSink for Sink {
    fn emit(
        &self,
        replica: usize,
        consumer_id: u32,
        tensors: &[Tensor],
    ) -> std::result::Result<(), ReplicaError> {
        let sender = replica
            .checked_sub(self.0.first)
            .and_then(|k| self.0.senders.get(k))
            .ok_or("no metrics stream for this device")?;
        sender.lock().unwrap_or_else(|p| p.into_inner()).send(consumer_id, tensors)?;
        self.0.sent.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
