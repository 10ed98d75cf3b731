//! What a publisher run did (both targets).

use outbox_event::Lsn;

/// What [`crate::Publisher::run`] (or the stream publisher's) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublisherReport {
    /// basic.publish calls for events (first publishes and retries).
    pub published: u64,
    /// Events acked (each counted once per ack, retries included).
    pub acked: u64,
    pub nacked: u64,
    pub returned: u64,
    pub dead_lettered: u64,
    /// Failure recoveries: each republished the buffer from the oldest unacked.
    pub retries: u64,
    pub reconnects: u64,
    /// The acked watermark at return.
    pub watermark: Lsn,
    /// Messages still unacked when the shutdown timeout passed (0 on a clean finish).
    pub abandoned: usize,
}
