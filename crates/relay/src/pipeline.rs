//! The relay pipeline: reader → publisher → LSN feedback, with reconnects.
//!
//! ```text
//!   Postgres slot ──► WalReader ──mpsc<WalBatch> (bounded)──► Publisher ──► RabbitMQ
//!        ▲                │                                       │
//!        └─ status update ┘◄──────── watch<Lsn> acked watermark ◄─┘
//! ```
//!
//! One *session* is a reader and a publisher running together. The reader owns the
//! replication connection and reads only while the bounded channel has room; the
//! publisher owns the AMQP connection and channel, keeps up to `max_in_flight`
//! messages in flight and publishes the acked watermark, which the reader reports to
//! Postgres as the flush position (promptly when it moves, and on a timer).
//!
//! Failures:
//! - broker side (nack, return, channel or connection loss): the publisher retries
//!   from its buffer of unacked messages by itself, in order; the session goes on.
//! - Postgres side (connection lost, server restart, crash, failover): the reader
//!   ends; the publisher drains what it has (bounded by the shutdown timeout). The
//!   acked watermark is carried to the next session, which first advances the slot
//!   to it with `pg_replication_slot_advance` on whichever server the URL reaches
//!   then (a crashed Postgres 15 brings the slot back to its last checkpoint), unless
//!   that server's WAL does not reach it; then it resumes from the slot's confirmed
//!   position. `run --start-lsn` applies to the first session only.
//! - the stored position (docs/design.md §3): the acked watermark is also kept in
//!   the table `outbox_relay_state` (crate::state), written in its own short
//!   transaction at most once per status interval (sooner only when half the window
//!   waits for it) and at the end of a session. Each session starts streaming from
//!   max(slot's confirmed position, stored position), unless the stored one is past
//!   the server's WAL or belongs to another slot of that name; so a Postgres crash
//!   re-sends nothing acked even when the relay restarted too. The publisher counts
//!   a message in flight until a position past it is both sent to Postgres and
//!   stored, which keeps the duplicate bound of a relay kill plus a Postgres crash.
//! - broker refusals after the first connection (530 while a node boots, 403 while a
//!   vhost or its permissions are restored): retried with backoff like an
//!   unreachable broker (docs/reliability.md).
//! - an unmet precondition (bad password, missing slot, renamed column): the relay
//!   stops with exit code 2 and a sentence that names the fix.
//! - slot held by another relay: this one is a standby; it waits and takes over
//!   when the slot is released.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch, WalItem};
use publisher::{Publisher, PublisherConfig, PublisherStatus};
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn, Instrument};
use wal_reader::{PgConnectOptions, ReaderConfig, ReaderError, ReaderProgress, WalReader};

use crate::error::CliError;
use crate::state::{self, Resume, StateError};

/// Batches buffered between reader and publisher (each is one socket read).
const CHANNEL_BATCHES: usize = 64;
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How often a standby checks whether the slot was released.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// Bound on saving the acked position to the slot (the advance decodes the WAL
/// between the slot's position and the acked one).
const SAVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on one statement on the state table.
const STATE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the state writer looks at the watermark and the window.
const STATE_POLL: Duration = Duration::from_millis(20);

/// Live state for `/readyz` and metrics.
#[derive(Clone, Default)]
pub struct Health {
    streaming: Arc<AtomicBool>,
    publisher: Arc<std::sync::Mutex<Option<PublisherStatus>>>,
    reader: Arc<std::sync::Mutex<Option<ReaderProgress>>>,
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

    fn set_reader(&self, r: Option<ReaderProgress>) {
        if let Ok(mut p) = self.reader.lock() {
            *p = r;
        }
    }

    fn set_streaming(&self, v: bool) {
        self.streaming.store(v, Ordering::Relaxed);
    }

    fn set_publisher(&self, s: Option<PublisherStatus>) {
        if let Ok(mut p) = self.publisher.lock() {
            *p = s;
        }
    }
}

/// Everything a pipeline needs.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub reader: ReaderConfig,
    pub publisher: PublisherConfig,
    /// Bound on a clean stop: finishing the open transaction and awaiting confirms.
    pub shutdown_timeout: Duration,
}

/// How one session ended.
enum SessionEnd {
    /// Clean stop requested: done.
    Stopped,
    /// Reconnect after this error, which happened on this side.
    Retry(Side, String),
}

/// Which side a session failed on (the `side` label of the reconnect metric).
#[derive(Debug, Clone, Copy)]
enum Side {
    Postgres,
    Rabbitmq,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Postgres => "postgres",
            Side::Rabbitmq => "rabbitmq",
        }
    }
}

/// What one session hands on to the next.
#[derive(Debug, Default)]
struct Carried {
    /// A publisher has connected once. From then on every broker failure is retried:
    /// a node that is booting answers 530 (vhost down) and one whose vhost or
    /// permissions are being restored 403, both of which are definite only at startup
    /// (docs/reliability.md).
    broker_connected: bool,
    /// The acked watermark of the last session whose reader started; `None` before
    /// the first one (only then does `run --start-lsn` apply).
    acked: Option<Lsn>,
    /// `acked` is still to be saved to the slot before the next session streams.
    unsaved: bool,
    /// The state table was found unusable and said so (one warning per process).
    state_warned: bool,
}

/// Runs sessions until `shutdown` turns true. Returns an error only for problems
/// that retrying cannot fix (exit code 2) or a bug (exit code 1).
pub async fn run(
    cfg: PipelineConfig,
    mut shutdown: watch::Receiver<bool>,
    health: Health,
) -> Result<(), CliError> {
    let mut attempt: u32 = 0;
    let mut standby_logged = false;
    let mut carried = Carried::default();
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        match session(
            &cfg,
            &mut shutdown,
            &health,
            &mut standby_logged,
            &mut carried,
        )
        .await
        {
            Ok(SessionEnd::Stopped) => return Ok(()),
            Ok(SessionEnd::Retry(side, why)) => {
                metrics::counter!("outbox_relay_reconnects_total", "side" => side.label())
                    .increment(1);
                attempt = attempt.saturating_add(1);
                let wait = publisher::backoff::delay(BACKOFF_INITIAL, BACKOFF_MAX, attempt);
                warn!(error = %why, side = side.label(), retry_in = ?wait, "session ended; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.changed() => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn reader_error(e: ReaderError) -> Result<SessionEnd, CliError> {
    if e.is_precondition() {
        Err(CliError::Precondition(e.to_string()))
    } else if e.is_transient() {
        Ok(SessionEnd::Retry(Side::Postgres, e.to_string()))
    } else {
        // Decoding or protocol errors: a new session starts over from the slot.
        error!(error = %e, "replication stream failed");
        Ok(SessionEnd::Retry(Side::Postgres, e.to_string()))
    }
}

async fn session(
    cfg: &PipelineConfig,
    shutdown: &mut watch::Receiver<bool>,
    health: &Health,
    standby_logged: &mut bool,
    carried: &mut Carried,
) -> Result<SessionEnd, CliError> {
    // `run --start-lsn` names where the first session starts; later ones resume from
    // the slot, which has moved past it (asking for it again would be refused).
    let explicit = if carried.acked.is_some() {
        None
    } else {
        cfg.reader.start_lsn
    };
    let mut reader_cfg = cfg.reader.clone();
    reader_cfg.start_lsn = explicit;
    let mut state_client: Option<tokio_postgres::Client> = None;
    // The reader first: a standby must not hold a broker connection it cannot use.
    let (reader, stored) = loop {
        if carried.unsaved {
            if let Some(acked) = carried.acked {
                match save_position(&cfg.reader, acked).await {
                    Ok(done) => carried.unsaved = !done,
                    // Not answering (yet): streaming now would start from the slot's
                    // older position, so this session waits like the reader would.
                    Err(why) => return Ok(SessionEnd::Retry(Side::Postgres, why)),
                }
            }
        }
        // The stored position (docs/design.md §3), read again before every attempt
        // (a standby's slot moves while it waits).
        let found = match stored_position(&cfg.reader, &mut state_client, carried).await {
            Ok(f) => f,
            Err(why) => return Ok(SessionEnd::Retry(Side::Postgres, why)),
        };
        let from_stored = match (explicit, found.resume) {
            (None, Some(l)) => {
                reader_cfg.start_lsn = Some(l);
                true
            }
            _ => {
                reader_cfg.start_lsn = explicit;
                false
            }
        };
        match WalReader::start(reader_cfg.clone()).await {
            Ok(r) => {
                if from_stored {
                    info!(lsn = %r.start_info().start_lsn, slot_confirmed = %r.start_info().slot_confirmed,
                        "resuming from the stored acked position (transactions whose commit ends at or before it were published)");
                }
                break (r, found.stored);
            }
            Err(ReaderError::SlotInUse { slot, pid }) => {
                if !*standby_logged {
                    info!(%slot, pid, "slot in use by another relay; standing by");
                    *standby_logged = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(STANDBY_POLL) => continue,
                    _ = shutdown.changed() => return Ok(SessionEnd::Stopped),
                }
            }
            // The slot moved past the stored position since it was read (another
            // relay streamed meanwhile): read both again.
            Err(e) if from_stored && e.is_precondition() => {
                return Ok(SessionEnd::Retry(Side::Postgres, e.to_string()))
            }
            Err(e) => return reader_error(e),
        }
    };
    if *standby_logged {
        info!("slot released; taking over");
        *standby_logged = false;
    }
    let start = reader.start_info().clone();
    health.set_reader(Some(reader.progress()));
    let initial = start.slot_confirmed.max(start.start_lsn);
    carried.acked = Some(initial);
    carried.unsaved = true;
    // The session's start is acked (the slot's position only ever moved to acked
    // positions; the stored one was acked): store it, or, after `--start-lsn`, store
    // exactly it so that a restart goes on re-publishing from there.
    let state_client = match (state_client, stored) {
        (Some(c), Some(stored)) => {
            let res = if explicit.is_some() && initial < stored {
                state::reset(&c, &cfg.reader.slot, initial).await
            } else if initial > stored {
                state::save(&c, &cfg.reader.slot, initial).await
            } else {
                Ok(())
            };
            match res {
                Ok(()) => Some(c),
                Err(e) => {
                    warn_state(carried, &e);
                    None
                }
            }
        }
        _ => None,
    };
    // Only the process's first connection may find a broker refusal definite: after
    // that, a refused login, vhost or exchange is a broker restarting (or being
    // restored) and is retried with backoff.
    let publisher = match Publisher::connect(cfg.publisher.clone()).await {
        Ok(p) => p,
        Err(e) if e.is_transient() || carried.broker_connected => {
            return Ok(SessionEnd::Retry(Side::Rabbitmq, e.to_string()))
        }
        Err(e) => return Err(CliError::Precondition(e.to_string())),
    };
    carried.broker_connected = true;
    health.set_publisher(Some(publisher.status()));

    let (tx, rx) = mpsc::channel(CHANNEL_BATCHES);
    let (acked_tx, acked_rx) = watch::channel(initial);
    let acked_seen = acked_tx.subscribe();
    let (stop_tx, stop_rx) = watch::channel(false);
    // What the reader actually sent Postgres: the publisher counts a message against
    // max_in_flight until a position past it is there (the duplicate bound) — and,
    // with the state table, until it is stored too.
    let flushed = reader.flushed();
    let reader_task = tokio::spawn(
        reader
            .run(tx, acked_rx, stop_rx)
            .instrument(tracing::info_span!("reader", slot = %cfg.reader.slot)),
    );
    let (rx, flushed, writer) = match state_client {
        Some(client) => {
            let last_event_end = Arc::new(AtomicU64::new(0));
            let rx = tap_events(rx, last_event_end.clone());
            let (stored_tx, stored_rx) = watch::channel(initial);
            let (finish_tx, finish_rx) = watch::channel(false);
            let writer = StateWriter {
                client,
                slot: cfg.reader.slot.clone(),
                acked: acked_tx.subscribe(),
                last_event_end,
                status: publisher.status(),
                max_in_flight: cfg.publisher.max_in_flight,
                interval: cfg.reader.status_interval,
                written: initial,
                stored: stored_tx,
            };
            let task = tokio::spawn(
                writer
                    .run(finish_rx)
                    .instrument(tracing::info_span!("state")),
            );
            (rx, min_of(flushed, stored_rx), Some((finish_tx, task)))
        }
        None => (rx, flushed, None),
    };
    let publisher_task = tokio::spawn(
        publisher
            .run_with_flushed(rx, acked_tx, flushed)
            .instrument(tracing::info_span!("publisher", exchange = %cfg.publisher.exchange)),
    );
    health.set_streaming(true);

    let mut reader_task = reader_task;
    let mut publisher_task = publisher_task;
    let outcome = tokio::select! {
        _ = wait_true(shutdown) => {
            info!(timeout = ?cfg.shutdown_timeout, "stopping: finishing the open transaction and awaiting confirms");
            let _ = stop_tx.send(true);
            let both = async {
                let p = (&mut publisher_task).await;
                let r = (&mut reader_task).await;
                (r, p)
            };
            // The publisher bounds its own wait for confirms; this bounds the rest
            // (a huge open transaction still being read).
            match tokio::time::timeout(cfg.shutdown_timeout * 2 + Duration::from_secs(5), both).await {
                Ok((r, p)) => {
                    if let Ok(Ok(report)) = &p {
                        info!(watermark = %report.watermark, abandoned = report.abandoned, "publisher finished");
                    }
                    match r {
                        Ok(Ok(exit)) => info!(flushed = %exit.flushed, "stopped cleanly"),
                        Ok(Err(e)) => warn!(error = %e, "reader ended with an error during shutdown"),
                        Err(e) => warn!(error = %e, "reader task failed during shutdown"),
                    }
                }
                Err(_) => {
                    warn!("shutdown timed out; the open transaction will be published again after restart");
                    reader_task.abort();
                    publisher_task.abort();
                }
            }
            Ok(SessionEnd::Stopped)
        }
        r = &mut reader_task => {
            health.set_streaming(false);
            // The reader dropped its sender: the publisher drains what it has (the
            // watermark it reaches is saved by the next session).
            let _ = publisher_task.await;
            match r {
                Ok(Ok(_)) => Ok(SessionEnd::Retry(Side::Postgres, "replication ended".into())),
                Ok(Err(e)) => reader_error(e),
                Err(e) => Ok(SessionEnd::Retry(Side::Postgres, format!("reader task failed: {e}"))),
            }
        }
        p = &mut publisher_task => {
            health.set_streaming(false);
            // The publisher only returns early on an error it did not retry itself
            // (a refusal while reconnecting); the reader sees the watermark sender
            // dropped, confirms what was acked and closes. The broker was connected,
            // so whatever it refuses now is retried with a new session.
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut reader_task).await;
            reader_task.abort();
            let why = match p {
                Ok(Ok(_)) => "publisher ended".to_string(),
                Ok(Err(e)) => e.to_string(),
                Err(e) => format!("publisher task failed: {e}"),
            };
            Ok(SessionEnd::Retry(Side::Rabbitmq, why))
        }
    };
    health.set_streaming(false);
    health.set_publisher(None);
    health.set_reader(None);
    // Only broker acks moved it: the position the next session saves to the slot.
    carried.acked = Some(*acked_seen.borrow());
    // The last write of the stored position: the final watermark of a clean stop (or
    // what a failed session reached, if the server still answers).
    if let Some((finish, task)) = writer {
        let _ = finish.send(true);
        match tokio::time::timeout(STATE_TIMEOUT * 2, task).await {
            Ok(Ok(Ok(lsn))) => debug!(%lsn, "stored the acked position"),
            // The server went away: the next session stores the position.
            Ok(Ok(Err(e))) if e.is_closed() => {
                debug!(error = %e, "could not store the acked position")
            }
            Ok(Ok(Err(e))) => warn_state(carried, &e),
            _ => debug!("the last write of the stored position did not finish"),
        }
    }
    outcome
}

/// Where the stored position says to start, and what is stored.
struct Found {
    /// Start here (past the slot's position), unless `run --start-lsn` names a start.
    resume: Option<Lsn>,
    /// The stored position (`None`: no row, or the table is not usable).
    stored: Option<Lsn>,
}

/// Reads the slot and the stored position, creating the table if missing; keeps the
/// connection in `client` for the session's writes (`None` when the table is not
/// usable). Errors only when the server cannot be reached: the session waits rather
/// than starting from an older position.
async fn stored_position(
    cfg: &ReaderConfig,
    client: &mut Option<tokio_postgres::Client>,
    carried: &mut Carried,
) -> Result<Found, String> {
    if client.as_ref().is_none_or(|c| c.is_closed()) {
        *client = match tokio::time::timeout(STATE_TIMEOUT, connect_sql(&cfg.conn)).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => return Err(format!("cannot connect to Postgres: {e}")),
            Err(_) => {
                return Err(format!(
                    "connecting to Postgres timed out after {STATE_TIMEOUT:?}"
                ))
            }
        };
    }
    let c = client.as_ref().expect("connected");
    let parse = |v: Option<String>| v.and_then(|s| s.parse::<Lsn>().ok());
    let res = async {
        let slot = c
            .query_opt(
                "SELECT confirmed_flush_lsn::text, restart_lsn::text, \
                        (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                              ELSE pg_current_wal_lsn() END)::text \
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&cfg.slot],
            )
            .await
            .map_err(StateError::Other)?;
        state::ensure_table(c).await?;
        let stored = state::read(c, &cfg.slot).await?;
        Ok::<_, StateError>((slot, stored))
    };
    let (slot, stored) = match tokio::time::timeout(STATE_TIMEOUT, res).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) if e.is_closed() => {
            *client = None;
            return Err(format!("connection to Postgres lost: {e}"));
        }
        Ok(Err(e)) => {
            warn_state(carried, &e);
            *client = None;
            return Ok(Found {
                resume: None,
                stored: None,
            });
        }
        Err(_) => {
            *client = None;
            return Err(format!(
                "reading the stored position timed out after {STATE_TIMEOUT:?}"
            ));
        }
    };
    // No slot: the reader says so.
    let Some(slot) = slot else {
        return Ok(Found {
            resume: None,
            stored: None,
        });
    };
    let confirmed = parse(slot.get(0)).unwrap_or(Lsn::ZERO);
    let mut stored_lsn = stored.as_ref().map(|s| s.acked).unwrap_or(Lsn::ZERO);
    let resume = match state::resume(
        stored.as_ref(),
        confirmed,
        parse(slot.get(1)),
        parse(slot.get(2)),
    ) {
        Resume::Stored(l) => Some(l),
        Resume::Slot => None,
        Resume::Ignored(why) => {
            stored_lsn = confirmed;
            warn!(slot = %cfg.slot, slot_confirmed = %confirmed, "{why}; resuming from the slot's position and storing that");
            // Void it so that the session's writes start from the slot's position.
            if let Err(e) = state::reset(c, &cfg.slot, confirmed).await {
                warn_state(carried, &e);
            }
            None
        }
    };
    Ok(Found {
        resume,
        stored: Some(stored_lsn),
    })
}

/// One warning per process when the state table cannot be used, naming the cost.
fn warn_state(carried: &mut Carried, e: &StateError) {
    if !carried.state_warned {
        carried.state_warned = true;
        warn!(error = %e, table = state::TABLE, "cannot keep the acked position in Postgres: {}", state::COST);
    } else {
        debug!(error = %e, "state table not usable");
    }
}

/// Forwards the reader's batches to the publisher, noting the end LSN of the last
/// transaction that had outbox events (only those make a stored position worth
/// writing: an idle outbox would otherwise write one row per interval forever, each
/// write moving the WAL the next keepalive confirms).
fn tap_events(
    mut rx: mpsc::Receiver<WalBatch>,
    last_event_end: Arc<AtomicU64>,
) -> mpsc::Receiver<WalBatch> {
    let (tx, out) = mpsc::channel(4);
    tokio::spawn(async move {
        while let Some(batch) = rx.recv().await {
            for item in &batch {
                if let WalItem::Commit(c) = item {
                    if c.events > 0 {
                        last_event_end.store(c.end_lsn.0, Ordering::Relaxed);
                    }
                }
            }
            if tx.send(batch).await.is_err() {
                break;
            }
        }
    });
    out
}

/// `min(a, b)`, updated as either moves; `b` gone counts as no bound. Ends with `a`.
fn min_of(mut a: watch::Receiver<Lsn>, mut b: watch::Receiver<Lsn>) -> watch::Receiver<Lsn> {
    let initial = (*a.borrow()).min(*b.borrow());
    let (tx, out) = watch::channel(initial);
    tokio::spawn(async move {
        let mut b_open = true;
        loop {
            let bound = if b_open {
                *b.borrow_and_update()
            } else {
                Lsn(u64::MAX)
            };
            let v = (*a.borrow_and_update()).min(bound);
            tx.send_if_modified(|cur| {
                let changed = *cur != v;
                *cur = v;
                changed
            });
            tokio::select! {
                r = a.changed() => if r.is_err() { return },
                r = b.changed(), if b_open => if r.is_err() { b_open = false },
            }
        }
    });
    out
}

/// Writes the acked watermark to the state table (docs/design.md §3): once per status
/// interval while outbox events were acked since the last write, sooner when half of
/// `max_in_flight` waits for it, and once more when the session ends.
struct StateWriter {
    client: tokio_postgres::Client,
    slot: String,
    acked: watch::Receiver<Lsn>,
    last_event_end: Arc<AtomicU64>,
    status: PublisherStatus,
    max_in_flight: usize,
    interval: Duration,
    written: Lsn,
    /// What is stored; `Lsn(u64::MAX)` once writing failed (no bound any more).
    stored: watch::Sender<Lsn>,
}

impl StateWriter {
    async fn run(mut self, mut finish: watch::Receiver<bool>) -> Result<Lsn, StateError> {
        let mut last_write = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(STATE_POLL.min(self.interval));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let finishing = tokio::select! {
                _ = tick.tick() => *finish.borrow(),
                r = finish.changed() => r.is_err() || *finish.borrow(),
            };
            let acked = *self.acked.borrow();
            let events = Lsn(self.last_event_end.load(Ordering::Relaxed));
            let due = finishing
                || last_write.elapsed() >= self.interval
                || self.status.in_flight() >= (self.max_in_flight / 2).max(1);
            if due && acked > self.written && events > self.written {
                last_write = tokio::time::Instant::now();
                let res = tokio::time::timeout(
                    STATE_TIMEOUT,
                    state::save(&self.client, &self.slot, acked),
                )
                .await;
                match res {
                    Ok(Ok(())) => {
                        self.written = acked;
                        self.stored.send_replace(acked);
                    }
                    Ok(Err(e)) => {
                        // Never hold the publisher on a table that cannot be written.
                        self.stored.send_replace(Lsn(u64::MAX));
                        return Err(e);
                    }
                    Err(_) => {
                        self.stored.send_replace(Lsn(u64::MAX));
                        return Err(StateError::Timeout(STATE_TIMEOUT));
                    }
                }
            }
            if finishing {
                return Ok(self.written);
            }
        }
    }
}

async fn wait_true(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            // Sender gone: nobody can ask us to stop any more; run on.
            std::future::pending::<()>().await;
        }
    }
}

/// What [`save_position`] found.
enum Saved {
    /// The slot was advanced from this position.
    Advanced(Option<Lsn>),
    /// The slot is already there, or missing (the reader reports that).
    NotNeeded,
    /// A walsender still holds the slot (ours, not yet gone, or another relay's).
    Busy,
    /// The server's WAL (current, or replayed on a standby) is behind the position.
    PastWal(Option<Lsn>),
}

/// Before a session streams, saves the previous session's acked watermark to the slot
/// on whichever server the URL reaches now, so that nothing the broker acked is
/// published again. The previous server may have died before it saved the slot
/// (Postgres 15 writes a slot's confirmed position only at checkpoints, so a crash
/// brings it back); only the relay still knows the position. It is not applied
/// when the server's WAL does not reach it (a failover to a server that lacks it:
/// it means nothing there). Returns whether it is done (false: the slot is still
/// held, try again before the next attempt), or why the server cannot be reached.
async fn save_position(cfg: &ReaderConfig, acked: Lsn) -> Result<bool, String> {
    if acked == Lsn::ZERO {
        return Ok(true);
    }
    let parse = |v: Option<String>| v.and_then(|s| s.parse::<Lsn>().ok());
    let client = match tokio::time::timeout(SAVE_TIMEOUT, connect_sql(&cfg.conn)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("cannot connect to Postgres: {e}")),
        Err(_) => {
            return Err(format!(
                "connecting to Postgres timed out after {SAVE_TIMEOUT:?}"
            ))
        }
    };
    let res = async {
        let Some(row) = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, active, \
                        (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                              ELSE pg_current_wal_lsn() END)::text \
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&cfg.slot],
            )
            .await?
        else {
            return Ok(Saved::NotNeeded);
        };
        let confirmed = parse(row.get(0));
        let active: bool = row.get(1);
        let server_wal = parse(row.get(2));
        if confirmed.is_some_and(|c| c >= acked) {
            return Ok(Saved::NotNeeded);
        }
        if active {
            return Ok(Saved::Busy);
        }
        if server_wal.is_none_or(|w| w < acked) {
            return Ok(Saved::PastWal(server_wal));
        }
        let n = client
            .execute(
                "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn) \
                   FROM pg_replication_slots \
                  WHERE slot_name = $1 AND NOT active AND confirmed_flush_lsn < $2::text::pg_lsn",
                &[&cfg.slot, &acked.to_string()],
            )
            .await?;
        Ok::<_, tokio_postgres::Error>(if n > 0 {
            Saved::Advanced(confirmed)
        } else {
            Saved::Busy
        })
    };
    match tokio::time::timeout(SAVE_TIMEOUT, res).await {
        Ok(Ok(Saved::Advanced(from))) => {
            let from = from.map(|l| l.to_string()).unwrap_or_default();
            info!(lsn = %acked, %from, "saved the acked position to the slot");
            Ok(true)
        }
        Ok(Ok(Saved::NotNeeded)) => Ok(true),
        Ok(Ok(Saved::Busy)) => Ok(false),
        Ok(Ok(Saved::PastWal(server_wal))) => {
            let server_wal = server_wal.map(|l| l.to_string()).unwrap_or_default();
            warn!(acked = %acked, %server_wal,
                "the acked position is past this server's WAL (a failover?); resuming from the slot's position");
            Ok(true)
        }
        Ok(Err(e)) if e.is_closed() => Err(format!("connection to Postgres lost: {e}")),
        Ok(Err(e)) => {
            warn!(error = %e, lsn = %acked,
                "could not save the acked position to the slot; resuming from the slot's position");
            Ok(true)
        }
        Err(_) => {
            debug!(timeout = ?SAVE_TIMEOUT, "saving the acked position timed out");
            Ok(false)
        }
    }
}

/// An ordinary SQL connection under the replication connection's rules
/// (docs/security.md): TLS per `sslmode`, no cleartext or md5 password over a plain
/// link unless `sslmode=disable` is explicit, a size cap before login.
pub async fn connect_sql(opts: &PgConnectOptions) -> Result<tokio_postgres::Client, String> {
    let (client, conn) = wal_reader::tls::connect_sql(opts)
        .await
        .map_err(|e| match e {
            wal_reader::tls::SqlConnectError::Postgres(e) => describe_pg_error(&e),
            other => other.to_string(),
        })?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// tokio-postgres prints "error connecting to server" or "db error" alone: add the
/// cause (the server's own message for a server error).
pub fn describe_pg_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}
