//! The bounded export queue: a span processor whose `on_end` never waits (a full
//! queue drops the span and counts it), and a thread that sends the queue in
//! batches over OTLP. The SDK's own batch processor keeps its drop count private;
//! `outbox_relay_trace_spans_dropped_total` needs it, so the relay has this small
//! one (docs/design.md §8).

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

/// Counter: spans never sent: the queue was full, or the receiver did not take
/// them (an export error or timeout).
pub const SPANS_DROPPED: &str = "outbox_relay_trace_spans_dropped_total";
/// Counter: spans the receiver accepted.
pub const SPANS_EXPORTED: &str = "outbox_relay_trace_spans_exported_total";

/// Spans per OTLP request, at most.
const MAX_BATCH: usize = 512;
/// How long a span waits for its batch to fill before it is sent anyway.
const BATCH_DELAY: Duration = Duration::from_millis(1000);
/// Least time between two warnings about failed exports.
const WARN_EVERY: Duration = Duration::from_secs(60);

enum Item {
    Span(Box<SpanData>),
    /// Send what is queued, then answer.
    Flush(SyncSender<()>),
    /// Send what is queued, answer, and stop.
    Shutdown(SyncSender<()>),
}

/// The span processor: the queue's sending end.
#[derive(Debug)]
pub struct BoundedExport {
    queue: SyncSender<Item>,
    resource: SyncSender<Resource>,
}

impl BoundedExport {
    /// Starts the export thread with a queue of `capacity` spans.
    pub fn start<E>(exporter: E, capacity: usize) -> std::io::Result<BoundedExport>
    where
        E: SpanExporter + 'static,
    {
        let (queue, items) = mpsc::sync_channel(capacity.max(1));
        let (resource, resources) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || run(exporter, items, resources))?;
        Ok(BoundedExport { queue, resource })
    }

    /// Sends a control item, waiting at most `timeout` for room and for the answer.
    fn control(&self, item: fn(SyncSender<()>) -> Item, timeout: Duration) -> OTelSdkResult {
        let deadline = Instant::now() + timeout;
        let (done, answered) = mpsc::sync_channel(1);
        let mut item = item(done);
        loop {
            match self.queue.try_send(item) {
                Ok(()) => break,
                Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                    item = back;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(TrySendError::Full(_)) => return Err(OTelSdkError::Timeout(timeout)),
                Err(TrySendError::Disconnected(_)) => return Err(OTelSdkError::AlreadyShutdown),
            }
        }
        answered
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| OTelSdkError::Timeout(timeout))
    }
}

impl SpanProcessor for BoundedExport {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.queue.try_send(Item::Span(Box::new(span))).is_err() {
            metrics::counter!(SPANS_DROPPED).increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.control(Item::Flush, Duration::from_secs(5))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.control(Item::Shutdown, timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        let _ = self.resource.try_send(resource.clone());
    }
}

/// The export thread: batches of up to [`MAX_BATCH`] spans, sent when full or
/// [`BATCH_DELAY`] after their first span, on a runtime of its own.
fn run<E: SpanExporter>(mut exporter: E, items: Receiver<Item>, resources: Receiver<Resource>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the trace export runtime; spans are dropped");
            while let Ok(item) = items.recv() {
                answer(item);
            }
            return;
        }
    };
    let mut warned: Option<Instant> = None;
    let mut batch: Vec<SpanData> = Vec::with_capacity(MAX_BATCH);
    let mut due: Option<Instant> = None;
    loop {
        if let Ok(resource) = resources.try_recv() {
            exporter.set_resource(&resource);
        }
        let next = match due {
            Some(due) => items.recv_timeout(due.saturating_duration_since(Instant::now())),
            None => items.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let (send, reply, stop) = match next {
            Ok(Item::Span(span)) => {
                batch.push(*span);
                due.get_or_insert_with(|| Instant::now() + BATCH_DELAY);
                (batch.len() >= MAX_BATCH, None, false)
            }
            Ok(Item::Flush(reply)) => (true, Some(reply), false),
            Ok(Item::Shutdown(reply)) => (true, Some(reply), true),
            Err(RecvTimeoutError::Timeout) => (true, None, false),
            Err(RecvTimeoutError::Disconnected) => (true, None, true),
        };
        if send && !batch.is_empty() {
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
            let n = spans.len() as u64;
            match runtime.block_on(exporter.export(spans)) {
                Ok(()) => metrics::counter!(SPANS_EXPORTED).increment(n),
                Err(e) => {
                    metrics::counter!(SPANS_DROPPED).increment(n);
                    if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                        warned = Some(Instant::now());
                        tracing::warn!(
                            spans = n,
                            error = %outbox_event::redact::printable(&e.to_string()),
                            "the OTLP receiver did not take a batch of spans; they are dropped (counted in outbox_relay_trace_spans_dropped_total; publishing is not affected)"
                        );
                    }
                }
            }
            due = None;
        }
        if let Some(reply) = reply {
            let _ = reply.try_send(());
        }
        if stop {
            let _ = exporter.shutdown();
            return;
        }
    }
}

/// Answers a control item without exporting (the export could not start).
fn answer(item: Item) {
    match item {
        Item::Flush(reply) | Item::Shutdown(reply) => {
            let _ = reply.try_send(());
        }
        Item::Span(_) => metrics::counter!(SPANS_DROPPED).increment(1),
    }
}
