//! The relay's live state, read by `/readyz` and the metrics (crate::metrics) and
//! written by the session loop (crate::pipeline).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use outbox_event::Lsn;
use publisher::PublisherStatus;
use tokio::sync::watch;
use wal_reader::OldestUnacked;

/// Live state for `/readyz` and metrics.
#[derive(Clone, Default)]
pub struct Health {
    streaming: Arc<AtomicBool>,
    publisher: Arc<std::sync::Mutex<Option<PublisherStatus>>>,
    reader: Arc<std::sync::Mutex<Option<OldestUnacked>>>,
    /// The flush positions the session's reader sent Postgres.
    confirmed: Arc<std::sync::Mutex<Option<watch::Receiver<Lsn>>>>,
}

impl Health {
    /// True while the reader streams and the publisher is connected and unblocked.
    pub fn ready(&self) -> bool {
        self.streaming.load(Ordering::Relaxed)
            && self
                .publisher
                .lock()
                .map(|p| p.as_ref().is_some_and(|s| s.ready()))
                .unwrap_or(false)
    }

    /// The current session's publisher status, if a session runs.
    pub fn publisher(&self) -> Option<PublisherStatus> {
        self.publisher.lock().ok().and_then(|p| p.clone())
    }

    /// Commit time (µs since the Unix epoch) of the oldest event read but not yet
    /// acked, including events still queued towards the publisher.
    pub fn oldest_unacked_commit_micros(&self) -> Option<i64> {
        let reader = self
            .reader
            .lock()
            .ok()
            .and_then(|r| r.as_ref().and_then(|r| r.oldest_unacked_commit_micros()));
        let publisher = self
            .publisher()
            .and_then(|p| p.oldest_unacked_commit_micros());
        match (reader, publisher) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The last position confirmed to Postgres in the current session.
    pub fn confirmed(&self) -> Option<Lsn> {
        self.confirmed
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|r| *r.borrow()))
    }

    pub(crate) fn set_confirmed(&self, c: Option<watch::Receiver<Lsn>>) {
        if let Ok(mut p) = self.confirmed.lock() {
            *p = c;
        }
    }

    pub(crate) fn set_reader(&self, r: Option<OldestUnacked>) {
        if let Ok(mut p) = self.reader.lock() {
            *p = r;
        }
    }

    pub(crate) fn set_streaming(&self, v: bool) {
        self.streaming.store(v, Ordering::Relaxed);
    }

    pub(crate) fn set_publisher(&self, s: Option<PublisherStatus>) {
        if let Ok(mut p) = self.publisher.lock() {
            *p = s;
        }
    }
}
