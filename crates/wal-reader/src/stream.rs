//! The replication stream: `START_REPLICATION … LOGICAL`, decoding, and LSN feedback.
//!
//! ```text
//!             socket ──read (only when the consumer has room)──► read buffer (conn)
//!                                                                   │ CopyData payloads
//!                            parse_copy_data ◄──────────────────────┘ (Bytes slices)
//!                  XLogData │             │ keepalive ──(reply_requested)──► status update
//!                           ▼             ▼
//!      pgoutput Decoder ─► Begin/Relation/Insert/Commit ─► WalBatch ──► mpsc ──► publisher
//!                                                                                  │
//!      status update (write = received, flush = acked) ◄── watch<Lsn> acked ◄──────┘
//! ```
//!
//! # How LSN progress is tracked
//!
//! - Each transaction's events carry its commit LSN (from Begin); its
//!   [`CommitMarker`](outbox_event::CommitMarker) carries the *end* LSN of the commit record. Postgres resumes a
//!   slot *after* the confirmed position, so confirming a commit LSN would re-send that
//!   transaction; the end LSN is the position to confirm.
//! - The reader never decides what is confirmed: it reports as `flush` only what the
//!   consumer sends back on the `acked` watch (the publisher's acked watermark), never
//!   less than the slot's position at start (Postgres 15 would move the slot back).
//! - Between transactions the reader emits [`WalItem::Keepalive`] with the server's
//!   WAL end; the publisher passes it through the same ordered watermark, so an idle
//!   outbox (or WAL from other tables) does not pin WAL on the server.
//! - A status update is sent when `acked` advances (at most one per
//!   [`STATUS_COALESCE`], so a watermark moving with every confirm costs the server
//!   one update per few milliseconds), on every `status_interval` (capped at half of
//!   `wal_sender_timeout`), and at once when the server asks.
//!
//! # Backpressure and memory
//!
//! The reader only reads the socket when the previous batch has been handed to the
//! consumer, so a stalled broker stops reading at the TCP level. A transaction of at
//! most `max_in_flight` events (and [`HOLD_BYTES`]) is handed on once its Commit has
//! arrived, so a connection lost in its middle publishes nothing of it; a larger one
//! goes on as it is decoded (pgoutput v1 only sends committed transactions), so any
//! transaction size streams through in bounded memory.
//!
//! # Clean stop
//!
//! On `stop`, the reader finishes the open transaction (reads up to its Commit), then
//! closes its output. It keeps answering the server until the consumer drops the
//! `acked` sender (all confirms are in), sends a last status update with the final
//! watermark, ends the copy and closes the connection.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use outbox_event::{Lsn, WalBatch, WalItem};
use pgoutput::replication::{
    encode_standby_status_update, parse_copy_data, pg_now_micros, ReplicationMessage,
};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info};

use crate::admin;
use crate::assemble::Assembler;
use crate::conn::ReplicationConnection;
use crate::conninfo::PgConnectOptions;
use crate::error::ReaderError;
use crate::mapping::{ColumnMapping, TableName};

mod start;

pub use start::{identify, identify_server, parse_pg_duration, Prepared, StartInfo};

/// What the reader needs to stream.
#[derive(Debug, Clone)]
pub struct ReaderConfig {
    pub conn: PgConnectOptions,
    pub slot: String,
    pub publication: String,
    /// The outbox tables to relay; inserts into other published tables are skipped.
    pub tables: Vec<TableName>,
    /// Prefixes of the transactional logical messages relayed as events
    /// (`[postgres] messages`, docs/messages.md); empty: messages are not asked for.
    pub messages: Vec<String>,
    pub mapping: ColumnMapping,
    /// Start here instead of the slot's position (`run --start-lsn`). Must not be
    /// older than the slot's `confirmed_flush_lsn`.
    pub start_lsn: Option<Lsn>,
    /// Period of standby status updates (capped at half of `wal_sender_timeout`).
    pub status_interval: Duration,
    /// The flow limit (`[rabbitmq] max_in_flight`, the publisher's window): a
    /// transaction of at most this many outbox events (and [`HOLD_BYTES`]) is handed
    /// on only once its Commit has arrived, so a connection lost in the middle of it
    /// publishes nothing of it, and the next session sends it whole without a
    /// duplicate (docs/design.md §3). A larger one is streamed as it is decoded.
    pub max_in_flight: usize,
}

/// The most pgoutput bytes of one transaction held back until its Commit (see
/// [`ReaderConfig::max_in_flight`]); a larger transaction is streamed.
pub const HOLD_BYTES: usize = 16 << 20;

/// How a reader ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderExit {
    /// The last flush position sent to Postgres.
    pub flushed: Lsn,
}

/// Least time between two status updates sent because the acked watermark moved:
/// under load the watermark moves with every confirm, and each update costs the
/// walsender a slot update (and, when the slot's restart point moves, a write of
/// the slot file). A moved watermark is reported at most this much later; the
/// duplicate bound is unchanged, since a message counts against `max_in_flight`
/// until a position past it was *sent* (docs/design.md §1.3, §4).
const STATUS_COALESCE: Duration = Duration::from_millis(5);

/// A streaming replication session on one slot.
pub struct WalReader {
    conn: ReplicationConnection,
    cfg: ReaderConfig,
    info: StartInfo,
    assembler: Assembler,
    /// Highest position received (reported as `write`).
    received: Lsn,
    /// Highest flush position reported (never below the slot's position at start).
    flushed: Lsn,
    /// `flushed`, for the publisher: what Postgres was actually sent (the duplicate
    /// bound counts a message until a position past it is here).
    flushed_tx: watch::Sender<Lsn>,
    /// When the last status update went out (for [`STATUS_COALESCE`]).
    last_status: Instant,
    status_buf: BytesMut,
    /// Commit LSN and time of each transaction with events sent but not yet acked,
    /// oldest first: the source of the outbox lag (docs/design.md §7).
    unacked: VecDeque<(Lsn, i64)>,
    oldest_unacked: OldestUnacked,
    last_event_commit: LastEventCommit,
    /// The open transaction's events, held back until its Commit
    /// ([`ReaderConfig::max_in_flight`]).
    held: WalBatch,
    /// pgoutput bytes behind `held`.
    held_bytes: usize,
    /// The open transaction outgrew the hold: its events go on as decoded.
    streaming_tx: bool,
    /// The relay's pause (`ctl pause`): true stops reading at the next transaction
    /// boundary ([`WalReader::with_pause`]).
    pause: Option<watch::Receiver<bool>>,
}

/// The end LSN of the last transaction with outbox events the reader read (0: none
/// yet), shared with the relay's state writer: a stored position is only worth
/// writing once events were acked, or an idle outbox would write a row per interval
/// forever (docs/design.md §3).
#[derive(Debug, Clone, Default)]
pub struct LastEventCommit(Arc<AtomicU64>);

impl LastEventCommit {
    pub fn get(&self) -> Lsn {
        Lsn(self.0.load(Ordering::Relaxed))
    }
}

/// The commit time of the oldest transaction the reader read but the consumer has
/// not acked, shared with metrics (the outbox lag, docs/design.md §7): covers events
/// still queued towards the publisher too (a broker outage stops the publisher from
/// taking them, but they are no less late).
#[derive(Debug, Clone, Default)]
pub struct OldestUnacked(Arc<AtomicI64>);

impl OldestUnacked {
    /// Commit time (µs since the Unix epoch) of the oldest transaction whose events
    /// were read but are not all acked; `None` when everything read is acked.
    pub fn oldest_unacked_commit_micros(&self) -> Option<i64> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            t => Some(t),
        }
    }
}

impl WalReader {
    /// Connects, checks the slot, and starts streaming from `cfg.start_lsn` (or the
    /// slot's position).
    pub async fn start(cfg: ReaderConfig) -> Result<WalReader, ReaderError> {
        let start_lsn = cfg.start_lsn;
        Self::prepare(cfg).await?.start(start_lsn).await
    }

    /// Connects, reads the server's identity and WAL history and the slot, and checks
    /// that the slot can be streamed from (it exists, belongs to this database, is
    /// usable and free: a held slot is [`ReaderError::SlotInUse`]).
    pub async fn prepare(cfg: ReaderConfig) -> Result<Prepared, ReaderError> {
        let mut conn = ReplicationConnection::connect(&cfg.conn).await?;
        let settings = conn
            .simple_query(
                "SELECT pg_catalog.current_setting('wal_sender_timeout'::text), pg_catalog.current_setting('server_version_num'::text)",
            )
            .await?;
        let setting = |i: usize| settings.first().and_then(|r| r.get(i).cloned().flatten());
        let timeout = setting(0)
            .and_then(|v| parse_pg_duration(&v))
            .filter(|d| !d.is_zero());
        let version = setting(1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| ReaderError::Protocol("no server_version_num".into()))?;
        let history = identify(&mut conn).await?;
        let rows = conn
            .simple_query(&admin::StreamStart::sql(version, &cfg.slot)?)
            .await?;
        let found = admin::StreamStart::from_rows(&cfg.slot, &rows)?;
        admin::check_usable(&found.state, &found.database)?;
        found.state.check_free()?;
        Ok(Prepared {
            conn,
            cfg,
            timeout,
            found,
            history,
        })
    }

    /// The commit time of the oldest transaction read but not yet acked, updated
    /// as the session goes.
    pub fn oldest_unacked(&self) -> OldestUnacked {
        self.oldest_unacked.clone()
    }

    /// The end of the last transaction with outbox events read, as the session goes.
    pub fn last_event_commit(&self) -> LastEventCommit {
        self.last_event_commit.clone()
    }

    /// The flush positions sent to Postgres in standby status updates, as they are
    /// sent.
    pub fn flushed(&self) -> watch::Receiver<Lsn> {
        self.flushed_tx.subscribe()
    }

    /// Where this session started.
    pub fn start_info(&self) -> &StartInfo {
        &self.info
    }

    /// Pauses reading while `pause` is true: the open transaction is read to its
    /// Commit and handed on, then the socket is left unread (as when the consumer
    /// has no room) while status updates go on with the acked watermark, so the
    /// walsender keeps the connection and the slot stays held; no keepalive position
    /// is passed on, so the confirmed position stops at the last transaction handed
    /// on. False resumes where it stopped.
    pub fn with_pause(mut self, pause: watch::Receiver<bool>) -> WalReader {
        self.pause = Some(pause);
        self
    }

    /// Streams until `stop` turns true (then finishes at a transaction boundary) or an
    /// error. `out` receives batches in order; `acked` is the consumer's acked
    /// watermark, reported to Postgres as the flush position.
    pub async fn run(
        mut self,
        out: mpsc::Sender<WalBatch>,
        mut acked: watch::Receiver<Lsn>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<ReaderExit, ReaderError> {
        let (interval, silence) = self.status_timing();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        let mut out = Some(out);
        let mut pending: WalBatch = Vec::new();
        let mut stopping = *stop.borrow();
        let mut last_recv = Instant::now();
        let mut asked_at: Option<Instant> = None;
        let mut consumer_gone = false;
        // A moved watermark waiting for its coalesced status update.
        let mut status_due: Option<Instant> = None;
        // A pause requested (it takes effect at the next transaction boundary).
        let mut pause = self.pause.take();
        let mut pausing = pause.as_ref().is_some_and(|p| *p.borrow());
        let mut paused_logged = false;

        loop {
            if consumer_gone {
                out = None;
                pending.clear();
            }
            // Finished reading: the consumer has everything; wait for its last acks.
            if stopping && !self.assembler.in_transaction() && pending.is_empty() && out.is_some() {
                out = None;
                debug!("reader stopped at a transaction boundary");
            }
            let paused = pausing && !self.assembler.in_transaction() && pending.is_empty();
            if paused != paused_logged {
                paused_logged = paused;
                if paused {
                    info!(flushed = %self.flushed, "reader paused at a transaction boundary");
                }
            }
            let reading = out.is_some() && pending.is_empty() && !paused;
            if !reading {
                last_recv = Instant::now();
                asked_at = None;
            }
            tokio::select! {
                biased;
                changed = acked.changed() => {
                    if changed.is_err() {
                        let last = *acked.borrow();
                        return self.close(last).await;
                    }
                    let a = *acked.borrow_and_update();
                    self.on_acked(a, &mut status_due).await?;
                }
                _ = async { tokio::time::sleep_until(status_due.expect("guarded").into()).await }, if status_due.is_some() => {
                    status_due = None;
                    let a = *acked.borrow();
                    if a > self.flushed {
                        self.send_status(a, false).await?;
                    }
                }
                res = stop.changed(), if !stopping => {
                    if res.is_err() || *stop.borrow() {
                        stopping = true;
                    }
                }
                res = async { pause.as_mut().expect("guarded").changed().await }, if pause.is_some() => {
                    let was = pausing;
                    pausing = match (res, pause.as_ref()) {
                        (Ok(()), Some(p)) => *p.borrow(),
                        // The pause's owner is gone: read on.
                        _ => { pause = None; false }
                    };
                    if was && !pausing {
                        info!("reader resumed");
                        // Frames read before the pause took effect wait in the buffer.
                        if pending.is_empty() && out.is_some() {
                            let reply = self.drain_frames(&mut pending, stopping)?;
                            if reply {
                                let a = *acked.borrow();
                                self.send_status(a, false).await?;
                            }
                        }
                    }
                }
                _ = tick.tick() => {
                    let reply = reading && ask_for_reply(&mut asked_at, last_recv, silence)?;
                    let a = *acked.borrow();
                    self.send_status(a, reply).await?;
                }
                permit = async { out.as_ref().expect("guarded").reserve().await }, if out.is_some() && !pending.is_empty() => {
                    match permit {
                        Ok(p) => p.send(std::mem::take(&mut pending)),
                        // Consumer gone: stop reading; wait for `acked` to close.
                        Err(_) => consumer_gone = true,
                    }
                }
                n = self.conn.fill(), if reading => {
                    if n? == 0 {
                        return Err(ReaderError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "Postgres closed the replication connection",
                        )));
                    }
                    last_recv = Instant::now();
                    asked_at = None;
                    let reply = self.drain_frames(&mut pending, stopping || pausing)?;
                    if reply {
                        let a = *acked.borrow();
                        self.send_status(a, false).await?;
                    }
                }
            }
        }
    }

    /// The status interval (at most half the server's `wal_sender_timeout`), and
    /// how long the socket may stay silent while we wait on it before we ask the
    /// server for a reply, and how long after asking before we give up.
    fn status_timing(&self) -> (Duration, Duration) {
        let server_timeout = self.info.wal_sender_timeout;
        let mut interval = self.cfg.status_interval.max(Duration::from_millis(10));
        if let Some(t) = server_timeout {
            interval = interval.min(t / 2);
        }
        (interval, server_timeout.unwrap_or(Duration::from_secs(60)))
    }

    /// The consumer is done (clean stop) or gone (its error ends the pipeline):
    /// reports the final watermark and closes.
    async fn close(&mut self, last: Lsn) -> Result<ReaderExit, ReaderError> {
        self.send_status(last, false).await?;
        self.conn.finish_copy(Duration::from_secs(5)).await?;
        info!(flushed = %self.flushed, "replication stopped");
        Ok(ReaderExit {
            flushed: self.flushed,
        })
    }

    /// The consumer's watermark moved to `a`: a status update now, or one coalesced
    /// into `status_due` when the last went out less than [`STATUS_COALESCE`] ago.
    async fn on_acked(
        &mut self,
        a: Lsn,
        status_due: &mut Option<Instant>,
    ) -> Result<(), ReaderError> {
        if a > self.flushed {
            if self.last_status.elapsed() >= STATUS_COALESCE {
                self.send_status(a, false).await?;
            } else if status_due.is_none() {
                *status_due = Some(self.last_status + STATUS_COALESCE);
            }
        }
        Ok(())
    }

    /// Decodes every CopyData payload in the read buffer into `pending`. Returns true
    /// when the server asked for an immediate reply. When `stopping` (or pausing),
    /// stops after the first Commit that closes the open transaction and passes no
    /// keepalive position on.
    fn drain_frames(
        &mut self,
        pending: &mut WalBatch,
        stopping: bool,
    ) -> Result<bool, ReaderError> {
        let mut reply = false;
        while let Some(data) = self.conn.try_copy_data()? {
            match parse_copy_data(data)? {
                ReplicationMessage::PrimaryKeepalive(k) => {
                    reply |= k.reply_requested;
                    self.received = self.received.max(k.wal_end);
                    if !self.assembler.in_transaction() && !stopping {
                        if let Some(WalItem::Keepalive(l)) = pending.last_mut() {
                            *l = (*l).max(k.wal_end);
                        } else {
                            pending.push(WalItem::Keepalive(k.wal_end));
                        }
                    }
                }
                ReplicationMessage::XLogData(x) => {
                    self.received = self.received.max(x.wal_start);
                    let done = self.decode(x.data, pending)?;
                    if let (true, Some(WalItem::Commit(c))) = (done, pending.last()) {
                        self.received = self.received.max(c.end_lsn);
                    }
                    if done && stopping {
                        // Leave what follows for the next session.
                        return Ok(reply);
                    }
                }
            }
        }
        Ok(reply)
    }

    /// Decodes one pgoutput message into `pending`, or, inside a transaction that
    /// still fits the hold, into `held`, which moves to `pending` with its Commit (or
    /// when the transaction outgrows the hold). Returns true when a Commit closed a
    /// transaction.
    fn decode(&mut self, data: bytes::Bytes, pending: &mut WalBatch) -> Result<bool, ReaderError> {
        let holding = self.assembler.in_transaction() && !self.streaming_tx;
        let size = data.len();
        let target = if holding {
            &mut self.held
        } else {
            &mut *pending
        };
        let before = target.len();
        let done = self.assembler.handle(data, target)?;
        track_unacked(&mut self.unacked, &self.oldest_unacked, &target[before..]);
        if holding {
            self.held_bytes += size;
            let outgrown = self.held.len() > self.cfg.max_in_flight || self.held_bytes > HOLD_BYTES;
            if done || outgrown {
                pending.append(&mut self.held);
                self.held_bytes = 0;
                self.streaming_tx = !done;
            }
        } else if done {
            self.streaming_tx = false;
        }
        if done {
            if let Some(WalItem::Commit(c)) = pending.last() {
                if c.events > 0 {
                    self.last_event_commit
                        .0
                        .store(c.end_lsn.0, Ordering::Relaxed);
                }
            }
        }
        Ok(done)
    }

    /// Forgets transactions the consumer acked: a commit record starting at C ends
    /// after C, and no acked position falls inside it, so `acked > C` means acked.
    fn forget_acked(&mut self, acked: Lsn) {
        let before = self.unacked.len();
        while self.unacked.front().is_some_and(|(c, _)| *c < acked) {
            self.unacked.pop_front();
        }
        if self.unacked.len() != before {
            let oldest = self.unacked.front().map(|(_, t)| (*t).max(1)).unwrap_or(0);
            self.oldest_unacked.0.store(oldest, Ordering::Relaxed);
        }
    }

    async fn send_status(&mut self, acked: Lsn, reply: bool) -> Result<(), ReaderError> {
        self.forget_acked(acked);
        let flush = self.flushed.max(acked);
        self.status_buf.clear();
        encode_standby_status_update(
            self.received.max(flush),
            flush,
            flush,
            pg_now_micros(),
            reply,
            &mut self.status_buf,
        );
        let payload = std::mem::take(&mut self.status_buf);
        self.conn.queue_copy_data(&payload);
        self.status_buf = payload;
        self.conn.flush().await?;
        if flush > self.flushed {
            metrics::gauge!("outbox_relay_confirmed_lsn").set(flush.0 as f64);
            self.flushed_tx.send_replace(flush);
        }
        self.flushed = flush;
        self.last_status = Instant::now();
        Ok(())
    }
}

/// While the socket is read and silent: after `silence`, asks the server for a
/// reply once (returns true: this status update asks); a reply still missing
/// `silence` after that is a timeout.
fn ask_for_reply(
    asked_at: &mut Option<Instant>,
    last_recv: Instant,
    silence: Duration,
) -> Result<bool, ReaderError> {
    match *asked_at {
        Some(t) if t.elapsed() > silence => Err(ReaderError::Timeout(last_recv.elapsed())),
        None if last_recv.elapsed() > silence => {
            *asked_at = Some(Instant::now());
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Remembers the first event of each transaction (for the outbox lag).
fn track_unacked(unacked: &mut VecDeque<(Lsn, i64)>, oldest: &OldestUnacked, items: &[WalItem]) {
    for item in items {
        if let WalItem::Event(e) = item {
            if unacked.back().map(|(l, _)| *l) != Some(e.commit_lsn) {
                if unacked.is_empty() {
                    oldest
                        .0
                        .store(e.commit_time_micros.max(1), Ordering::Relaxed);
                }
                unacked.push_back((e.commit_lsn, e.commit_time_micros));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_durations() {
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("abc"), None);
    }
}
