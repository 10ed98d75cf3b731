//! What the relay reads for `/readyz` and metrics, and the metric names.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use outbox_event::Lsn;

pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_ACKED: &str = "outbox_relay_events_acked_total";
pub const EVENTS_NACKED: &str = "outbox_relay_events_nacked_total";
pub const EVENTS_RETURNED: &str = "outbox_relay_events_returned_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
/// Events AMQP cannot carry (a content header over the frame size): poison.
pub const EVENTS_UNFIT: &str = "outbox_relay_events_unfit_total";
pub const PUBLISH_RETRIES: &str = "outbox_relay_publish_retries_total";
/// With label `side = "rabbitmq"`.
pub const RECONNECTS: &str = "outbox_relay_reconnects_total";
pub const IN_FLIGHT: &str = "outbox_relay_in_flight";
pub const ACKED_LSN: &str = "outbox_relay_acked_lsn";
pub const PUBLISH_LATENCY: &str = "outbox_relay_publish_latency_seconds";
/// 1 while a message the broker refuses holds the relay (no dead-letter exchange).
pub const POISON_MESSAGES: &str = "outbox_relay_poison_messages";
/// How long events have waited with nothing confirmed, once that is `stall_after`
/// or longer (0 otherwise): the watchdog's (docs/reliability.md, "No event waits
/// silently").
pub const STALLED_SECONDS: &str = "outbox_relay_stalled_seconds";

/// The oldest event waiting, as a stall names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub message_id: String,
    pub commit_lsn: Lsn,
    /// Its exchange (or stream).
    pub destination: String,
}

/// What an event waiting in a publisher's window says of itself.
pub(crate) trait Describe: Send + Sync + std::fmt::Debug {
    fn waiting(&self) -> Waiting;
}

/// Events wait and nothing was confirmed for `stall_after` (§1.8 of the design).
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    /// How long nothing was confirmed while events waited.
    pub quiet: std::time::Duration,
    /// The oldest event waiting, if known.
    pub oldest: Option<Waiting>,
    /// The broker's last answer (a failure, a refusal, a notice), if any.
    pub last_answer: Option<String>,
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no event confirmed for {}s", self.quiet.as_secs())?;
        if let Some(w) = &self.oldest {
            write!(
                f,
                "; the oldest waiting is {} (commit LSN {}, to {:?})",
                outbox_event::redact::printable(&w.message_id),
                w.commit_lsn,
                outbox_event::redact::printable(&w.destination)
            )?;
        }
        match &self.last_answer {
            Some(a) => write!(
                f,
                "; the broker's last answer: {}",
                outbox_event::redact::printable(a)
            ),
            None => f.write_str("; no answer from the broker"),
        }
    }
}

/// A message the broker refuses for its content, holding the watermark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoisonMessage {
    pub message_id: String,
    pub commit_lsn: Lsn,
    pub tx_index: u64,
    pub routing_key: String,
    pub reason: String,
}

#[derive(Debug, Default)]
struct Inner {
    connected: AtomicBool,
    blocked: AtomicBool,
    in_flight: AtomicUsize,
    /// Commit time (µs since the Unix epoch) of the oldest unacked event; `i64::MIN`
    /// when nothing is in flight.
    oldest_unacked_micros: AtomicI64,
    acked_lsn: AtomicU64,
    reconnects: AtomicU64,
    poison: Mutex<Option<PoisonMessage>>,
    /// Messages received and not acked (waiting).
    buffered: AtomicUsize,
    /// Batches wait on the publisher's input (the reader's queue).
    queued: AtomicBool,
    /// Counts every step of progress (an event settled): the watchdog compares it.
    progress: AtomicU64,
    /// The oldest waiting event, kept as it changes.
    oldest: Mutex<Option<Arc<dyn Describe>>>,
    last_answer: Mutex<Option<String>>,
    stall: Mutex<Option<Stall>>,
    destination: Mutex<String>,
    /// With `channels = N` (`crate::lanes`): the front's view of its lanes, which
    /// the getters combine.
    lanes: Vec<PublisherStatus>,
    /// A lane's front: a lane sets no gauge of its own but has the front set the
    /// combined one.
    front: OnceLock<Weak<Inner>>,
}

/// A cheap, cloneable view of the publisher's state, updated as it runs.
#[derive(Debug, Clone)]
pub struct PublisherStatus(Arc<Inner>);

impl PublisherStatus {
    pub(crate) fn new(acked: Lsn) -> Self {
        let inner = Inner::default();
        inner
            .oldest_unacked_micros
            .store(i64::MIN, Ordering::Relaxed);
        inner.acked_lsn.store(acked.0, Ordering::Relaxed);
        Self(Arc::new(inner))
    }

    /// The status of N lanes, each publishing on its own channel: connected when
    /// all are, blocked or poisoned when one is, in flight their sum, and the acked
    /// watermark the global one (set by the lanes' runner).
    pub(crate) fn of_lanes(lanes: Vec<PublisherStatus>) -> Self {
        let inner = Inner {
            lanes,
            ..Inner::default()
        };
        inner
            .oldest_unacked_micros
            .store(i64::MIN, Ordering::Relaxed);
        let front = Self(Arc::new(inner));
        for lane in &front.0.lanes {
            let _ = lane.0.front.set(Arc::downgrade(&front.0));
        }
        front
    }

    /// The front of this lane, if it is one.
    fn front(&self) -> Option<PublisherStatus> {
        self.0
            .front
            .get()
            .and_then(Weak::upgrade)
            .map(PublisherStatus)
    }

    /// True while a connection with a confirm-mode channel is open (every lane's).
    pub fn connected(&self) -> bool {
        if self.0.lanes.is_empty() {
            self.0.connected.load(Ordering::Relaxed)
        } else {
            self.0.lanes.iter().all(PublisherStatus::connected)
        }
    }

    /// True while the broker blocks publishing (a memory or disk alarm).
    pub fn blocked(&self) -> bool {
        self.0.blocked.load(Ordering::Relaxed) || self.0.lanes.iter().any(PublisherStatus::blocked)
    }

    /// Ready to publish: connected, not blocked, not held by a poison message, not
    /// stalled.
    pub fn ready(&self) -> bool {
        self.connected() && !self.blocked() && self.poison().is_none() && self.stalled().is_none()
    }

    /// The stall, while events wait and nothing is confirmed for `stall_after`.
    pub fn stalled(&self) -> Option<Stall> {
        let own = self.0.stall.lock().ok().and_then(|s| s.clone());
        own.or_else(|| self.0.lanes.iter().find_map(PublisherStatus::stalled))
    }

    pub(crate) fn set_stall(&self, stall: Option<Stall>) {
        if let Ok(mut s) = self.0.stall.lock() {
            *s = stall;
        }
        let front = self.front().unwrap_or_else(|| self.clone());
        let seconds = front
            .all()
            .filter_map(|s| {
                s.0.stall
                    .lock()
                    .ok()
                    .and_then(|s| s.as_ref().map(|s| s.quiet))
            })
            .max()
            .map_or(0.0, |q| q.as_secs_f64());
        metrics::gauge!(STALLED_SECONDS).set(seconds);
    }

    /// This status and its lanes'.
    fn all(&self) -> impl Iterator<Item = &PublisherStatus> {
        std::iter::once(self).chain(self.0.lanes.iter())
    }

    /// Messages received and not acked.
    pub(crate) fn buffered(&self) -> usize {
        self.0.buffered.load(Ordering::Relaxed)
    }

    /// Whether events wait: received and not acked, or queued towards the publisher.
    pub(crate) fn waiting(&self) -> bool {
        self.buffered() > 0 || self.0.queued.load(Ordering::Relaxed)
    }

    /// Whether batches wait on the publisher's input.
    pub(crate) fn set_queued(&self, queued: bool) {
        self.0.queued.store(queued, Ordering::Relaxed);
    }

    /// The progress count (it moves whenever an event settles).
    pub(crate) fn progress(&self) -> u64 {
        self.0.progress.load(Ordering::Relaxed)
    }

    pub(crate) fn add_progress(&self) {
        self.0.progress.fetch_add(1, Ordering::Relaxed);
    }

    /// The oldest waiting event changed.
    pub(crate) fn set_oldest(&self, oldest: Option<Arc<dyn Describe>>) {
        if let Ok(mut o) = self.0.oldest.lock() {
            *o = oldest;
        }
    }

    /// The oldest waiting event, its destination the publisher's own (the
    /// configured exchange, or the stream) when it has none of its own.
    pub(crate) fn oldest(&self) -> Option<Waiting> {
        let o = self.0.oldest.lock().ok()?.clone()?;
        let mut waiting = o.waiting();
        if waiting.destination.is_empty() {
            if let Ok(d) = self.0.destination.lock() {
                waiting.destination = d.clone();
            }
        }
        Some(waiting)
    }

    /// The publisher's own destination (the configured exchange, or the stream).
    pub(crate) fn set_destination(&self, destination: &str) {
        if let Ok(mut d) = self.0.destination.lock() {
            *d = destination.to_string();
        }
    }

    /// What the broker last said that matters to an operator (a failure, a
    /// refusal, a notice).
    pub(crate) fn set_last_answer(&self, answer: impl Into<String>) {
        if let Ok(mut a) = self.0.last_answer.lock() {
            *a = Some(answer.into());
        }
    }

    pub(crate) fn last_answer(&self) -> Option<String> {
        self.0.last_answer.lock().ok()?.clone()
    }

    /// The message the broker refuses, while one holds the relay.
    pub fn poison(&self) -> Option<PoisonMessage> {
        let own = self.0.poison.lock().ok().and_then(|p| p.clone());
        own.or_else(|| self.0.lanes.iter().find_map(PublisherStatus::poison))
    }

    pub(crate) fn set_poison(&self, poison: Option<PoisonMessage>) {
        if let Ok(mut p) = self.0.poison.lock() {
            *p = poison;
        }
        let shown = match self.front() {
            Some(front) => front.poison().is_some(),
            None => self.poison().is_some(),
        };
        metrics::gauge!(POISON_MESSAGES).set(if shown { 1.0 } else { 0.0 });
    }

    /// Messages received and not yet below the acked watermark.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Relaxed)
            + self
                .0
                .lanes
                .iter()
                .map(PublisherStatus::in_flight)
                .sum::<usize>()
    }

    /// Commit time (µs since the Unix epoch) of the oldest event not yet acked.
    pub fn oldest_unacked_commit_micros(&self) -> Option<i64> {
        let v = self.0.oldest_unacked_micros.load(Ordering::Relaxed);
        let own = (v != i64::MIN).then_some(v);
        self.0
            .lanes
            .iter()
            .filter_map(PublisherStatus::oldest_unacked_commit_micros)
            .chain(own)
            .min()
    }

    /// The acked watermark.
    pub fn acked_lsn(&self) -> Lsn {
        Lsn(self.0.acked_lsn.load(Ordering::Relaxed))
    }

    /// Reconnections to RabbitMQ since the publisher started.
    pub fn reconnects(&self) -> u64 {
        self.0.reconnects.load(Ordering::Relaxed)
            + self
                .0
                .lanes
                .iter()
                .map(PublisherStatus::reconnects)
                .sum::<u64>()
    }

    pub(crate) fn add_reconnect(&self) {
        self.0.reconnects.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(RECONNECTS, "side" => "rabbitmq").increment(1);
    }

    pub(crate) fn set_connected(&self, v: bool) {
        self.0.connected.store(v, Ordering::Relaxed);
    }

    pub(crate) fn set_blocked(&self, v: bool) {
        self.0.blocked.store(v, Ordering::Relaxed);
    }

    pub(crate) fn set_in_flight(&self, n: usize, buffered: usize, oldest_micros: Option<i64>) {
        self.0.in_flight.store(n, Ordering::Relaxed);
        self.0.buffered.store(buffered, Ordering::Relaxed);
        self.0
            .oldest_unacked_micros
            .store(oldest_micros.unwrap_or(i64::MIN), Ordering::Relaxed);
        let shown = self.front().map_or(n, |front| front.in_flight());
        metrics::gauge!(IN_FLIGHT).set(shown as f64);
    }

    /// The acked watermark; a lane's is its own, which no gauge shows (the global
    /// one is its front's).
    pub(crate) fn set_acked_lsn(&self, lsn: Lsn) {
        self.0.acked_lsn.store(lsn.0, Ordering::Relaxed);
        if self.0.front.get().is_none() {
            metrics::gauge!(ACKED_LSN).set(lsn.0 as f64);
        }
    }
}
