//! The bounded export queue: a span processor whose `on_end` never waits (a full
//! queue drops the span and counts it), and a thread that sends the queue in
//! batches over OTLP. The SDK's own batch processor keeps its drop count private;
//! `outbox_relay_trace_spans_dropped_total` needs it, so the relay has this small
//! one (docs/design.md §8).
//!
//! The queue is a vector under a mutex, not a channel: a channel wakes the export
//! thread for every span, two system calls per event on the publish path, which on
//! a machine where they are costly was most of tracing's cost. Here a span is a
//! push under an uncontended lock, and the thread is woken twice per batch: when a
//! batch starts (its delay runs from then) and when it is full.

use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
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

/// What the publishers and the export thread share.
#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// The export thread waits on it.
    wake: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Ended spans waiting for export, at most the queue's capacity.
    spans: Vec<SpanData>,
    /// Answers owed once everything queued before them has been sent.
    flushes: Vec<SyncSender<()>>,
    /// Send what is queued, then stop.
    stop: bool,
    resource: Option<Resource>,
    /// The export thread has ended: spans are dropped, requests refused.
    gone: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The span processor: the queue's sending end.
#[derive(Debug)]
pub struct BoundedExport {
    shared: Arc<Shared>,
    capacity: usize,
}

impl BoundedExport {
    /// Starts the export thread with a queue of `capacity` spans.
    pub fn start<E>(exporter: E, capacity: usize) -> std::io::Result<BoundedExport>
    where
        E: SpanExporter + 'static,
    {
        BoundedExport::start_with_delay(exporter, capacity, BATCH_DELAY)
    }

    /// [`BoundedExport::start`] with a batch that waits at most `delay` to fill.
    fn start_with_delay<E>(
        exporter: E,
        capacity: usize,
        delay: Duration,
    ) -> std::io::Result<BoundedExport>
    where
        E: SpanExporter + 'static,
    {
        let shared = Arc::new(Shared::default());
        let theirs = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || run(exporter, &theirs, delay))?;
        Ok(BoundedExport {
            shared,
            capacity: capacity.max(1),
        })
    }

    /// Asks the export thread to send what is queued (and to stop, with `stop`),
    /// waiting at most `timeout` for its answer.
    fn request(&self, stop: bool, timeout: Duration) -> OTelSdkResult {
        let (done, answered) = mpsc::sync_channel(1);
        {
            let mut state = self.shared.lock();
            if state.gone {
                return Err(OTelSdkError::AlreadyShutdown);
            }
            state.flushes.push(done);
            state.stop |= stop;
        }
        self.shared.wake.notify_one();
        answered
            .recv_timeout(timeout)
            .map_err(|_| OTelSdkError::Timeout(timeout))
    }
}

impl SpanProcessor for BoundedExport {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let queued = {
            let mut state = self.shared.lock();
            if state.gone || state.stop || state.spans.len() >= self.capacity {
                None
            } else {
                state.spans.push(span);
                Some(state.spans.len())
            }
        };
        match queued {
            None => metrics::counter!(SPANS_DROPPED).increment(1),
            Some(1) | Some(MAX_BATCH) => self.shared.wake.notify_one(),
            Some(_) => {}
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.request(false, Duration::from_secs(5))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.request(true, timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.shared.lock().resource = Some(resource.clone());
        self.shared.wake.notify_one();
    }
}

/// One turn of the export thread: what it takes from the queue.
struct Turn {
    spans: Vec<SpanData>,
    replies: Vec<SyncSender<()>>,
    stop: bool,
    resource: Option<Resource>,
}

/// Waits until there is something to send: a full batch, a batch whose delay has
/// run out, a flush or the stop; then takes it, leaving `fresh` as the queue.
fn next_turn(shared: &Shared, fresh: Vec<SpanData>, delay: Duration) -> Turn {
    let mut state = shared.lock();
    let mut due: Option<Instant> = None;
    loop {
        if state.stop || !state.flushes.is_empty() || state.spans.len() >= MAX_BATCH {
            break;
        }
        if state.resource.is_some() {
            break;
        }
        if state.spans.is_empty() {
            due = None;
            state = shared
                .wake
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            continue;
        }
        let at = *due.get_or_insert_with(|| Instant::now() + delay);
        let now = Instant::now();
        if now >= at {
            break;
        }
        state = shared
            .wake
            .wait_timeout(state, at - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    Turn {
        spans: std::mem::replace(&mut state.spans, fresh),
        replies: std::mem::take(&mut state.flushes),
        stop: state.stop,
        resource: state.resource.take(),
    }
}

/// The export thread: batches of up to [`MAX_BATCH`] spans, sent when full or
/// `delay` after their first span, on a runtime of its own.
fn run<E: SpanExporter>(mut exporter: E, shared: &Shared, delay: Duration) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the trace export runtime; spans are dropped");
            answer(close(shared));
            return;
        }
    };
    let mut warned: Option<Instant> = None;
    let mut fresh = Vec::with_capacity(MAX_BATCH);
    loop {
        let turn = next_turn(shared, fresh, delay);
        if let Some(resource) = &turn.resource {
            exporter.set_resource(resource);
        }
        let mut spans = turn.spans;
        while !spans.is_empty() {
            let rest = spans.split_off(spans.len().min(MAX_BATCH));
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
            spans = rest;
        }
        if turn.stop {
            // Answered once the exporter is shut down too.
            let late = close(shared);
            let _ = exporter.shutdown();
            answer(turn.replies.into_iter().chain(late));
            return;
        }
        answer(turn.replies);
        fresh = Vec::with_capacity(MAX_BATCH);
    }
}

/// Marks the export thread gone: what is still queued is dropped and counted. Gives
/// the requests still waiting for an answer.
fn close(shared: &Shared) -> Vec<SyncSender<()>> {
    let (dropped, replies) = {
        let mut state = shared.lock();
        state.gone = true;
        (
            std::mem::take(&mut state.spans).len() as u64,
            std::mem::take(&mut state.flushes),
        )
    };
    if dropped > 0 {
        metrics::counter!(SPANS_DROPPED).increment(dropped);
    }
    replies
}

/// Answers flush and shutdown requests.
fn answer(replies: impl IntoIterator<Item = SyncSender<()>>) {
    for reply in replies {
        let _ = reply.try_send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId};
    use opentelemetry::InstrumentationScope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};

    /// An exporter that records each batch's span names, and can be made to fail.
    #[derive(Debug, Default)]
    struct Recorder {
        batches: Arc<Mutex<Vec<Vec<String>>>>,
        refuse: Arc<AtomicBool>,
        shut: Arc<AtomicBool>,
    }

    impl SpanExporter for Recorder {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if self.refuse.load(Ordering::SeqCst) {
                return Err(OTelSdkError::InternalFailure("refused".into()));
            }
            let names = batch.iter().map(|s| s.name.to_string()).collect();
            self.batches.lock().unwrap().push(names);
            Ok(())
        }

        fn shutdown(&self) -> OTelSdkResult {
            self.shut.store(true, Ordering::SeqCst);
            Ok(())
        }
    }

    fn span(n: usize, sampled: bool) -> SpanData {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(n as u128 + 1),
                SpanId::from(n as u64 + 1),
                flags,
                false,
                Default::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Producer,
            name: format!("s{n}").into(),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("test").build(),
        }
    }

    fn names(batches: &Mutex<Vec<Vec<String>>>) -> Vec<String> {
        batches.lock().unwrap().iter().flatten().cloned().collect()
    }

    #[test]
    fn full_batches_go_at_once_in_order_and_a_flush_sends_the_rest() {
        let recorder = Recorder::default();
        let batches = Arc::clone(&recorder.batches);
        // A batch would wait an hour to fill: what leaves before the flush left full.
        let export =
            BoundedExport::start_with_delay(recorder, 10_000, Duration::from_secs(3600)).unwrap();
        let total = 2 * MAX_BATCH + 7;
        for n in 0..total {
            export.on_end(span(n, true));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while batches.lock().unwrap().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(batches.lock().unwrap().len() >= 2, "full batches waited");
        export.force_flush().unwrap();
        let sent = names(&batches);
        let want: Vec<String> = (0..total).map(|n| format!("s{n}")).collect();
        assert_eq!(sent, want);
        assert!(batches.lock().unwrap().iter().all(|b| b.len() <= MAX_BATCH));
    }

    #[test]
    fn a_lone_span_leaves_after_the_delay() {
        let recorder = Recorder::default();
        let batches = Arc::clone(&recorder.batches);
        let export =
            BoundedExport::start_with_delay(recorder, 100, Duration::from_millis(50)).unwrap();
        export.on_end(span(1, true));
        export.on_end(span(2, false));
        let deadline = Instant::now() + Duration::from_secs(30);
        while names(&batches).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(names(&batches), vec!["s1".to_string()]);
    }

    #[test]
    fn a_full_queue_drops_and_never_waits_and_shutdown_stops_the_thread() {
        let recorder = Recorder::default();
        let batches = Arc::clone(&recorder.batches);
        let shut = Arc::clone(&recorder.shut);
        let export = BoundedExport::start(recorder, 3).unwrap();
        for n in 0..10 {
            export.on_end(span(n, true));
        }
        export
            .shutdown_with_timeout(Duration::from_secs(5))
            .unwrap();
        assert_eq!(names(&batches), vec!["s0", "s1", "s2"]);
        assert!(shut.load(Ordering::SeqCst));
        assert!(matches!(
            export.force_flush(),
            Err(OTelSdkError::AlreadyShutdown)
        ));
        export.on_end(span(11, true));
        assert_eq!(names(&batches).len(), 3);
    }

    #[test]
    fn a_refused_batch_is_dropped_and_the_next_one_goes() {
        let recorder = Recorder::default();
        let batches = Arc::clone(&recorder.batches);
        let refuse = Arc::clone(&recorder.refuse);
        let export = BoundedExport::start(recorder, 100).unwrap();
        refuse.store(true, Ordering::SeqCst);
        export.on_end(span(1, true));
        export.force_flush().unwrap();
        refuse.store(false, Ordering::SeqCst);
        export.on_end(span(2, true));
        export.force_flush().unwrap();
        assert_eq!(names(&batches), vec!["s2".to_string()]);
    }
}
