//! The progress bookkeeping both run loops share (the AMQP one, `run.rs`, and the
//! stream one, `stream/run.rs`): feeding the engine a batch in order, following the
//! positions sent to Postgres as flushed, and publishing the acked watermark. The
//! engines differ in everything the broker decides; this part is the same.

use outbox_event::{Lsn, OutboxEvent, WalBatch, WalItem};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::report::PublisherReport;
use crate::status::PublisherStatus;

/// What the run loops ask of both engines here.
pub(crate) trait Progress<M> {
    /// An event's message, in order.
    fn push_message(&mut self, message: M);
    /// A commit's end or a keepalive position, in order.
    fn push_mark(&mut self, lsn: Lsn);
    /// A position sent to Postgres as flushed.
    fn flushed(&mut self, lsn: Lsn);
    /// The acked watermark.
    fn watermark(&self) -> Lsn;
}

/// Hands a batch to the engine in order: each event as `build` makes its message,
/// each commit's end and each keepalive as a mark. Stops at the first event `build`
/// refuses, with its error (the rest of the batch is not taken).
pub(crate) fn feed<M, E>(
    engine: &mut impl Progress<M>,
    batch: WalBatch,
    mut build: impl FnMut(OutboxEvent) -> Result<M, E>,
) -> Result<(), E> {
    for item in batch {
        match item {
            WalItem::Event(event) => engine.push_message(build(event)?),
            WalItem::Commit(commit) => engine.push_mark(commit.end_lsn),
            WalItem::Keepalive(lsn) => engine.push_mark(lsn),
        }
    }
    Ok(())
}

/// What the `flushed` watch said: a new position, or (`None`) that the reader is
/// gone. From then on the watermark is what counts, including what it already
/// passed, or a window full of acked but unflushed messages would never publish
/// again (and never take the input that would tell it to finish).
pub(crate) fn on_flushed<M>(
    engine: &mut impl Progress<M>,
    flushed: &mut Option<watch::Receiver<Lsn>>,
    changed: Option<Lsn>,
) {
    match changed {
        Some(lsn) => engine.flushed(lsn),
        None => {
            *flushed = None;
            let lsn = engine.watermark();
            engine.flushed(lsn);
        }
    }
}

/// Sends `lsn` as the acked watermark, to the relay and the status, when it passed
/// the one reported; returns whether it did.
pub(crate) fn publish_watermark(
    lsn: Lsn,
    report: &mut PublisherReport,
    watermark: &watch::Sender<Lsn>,
    status: &PublisherStatus,
) -> bool {
    if lsn <= report.watermark {
        return false;
    }
    report.watermark = lsn;
    watermark.send_replace(lsn);
    status.set_acked_lsn(lsn);
    true
}

/// The next position sent to Postgres as flushed; `None` once the sender is gone.
pub(crate) async fn changed_lsn(rx: Option<&mut watch::Receiver<Lsn>>) -> Option<Lsn> {
    let rx = rx?;
    rx.changed().await.ok()?;
    Some(*rx.borrow_and_update())
}

/// Sleeps until `deadline`; forever without one.
pub(crate) async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
