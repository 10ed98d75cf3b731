//! The relay pipeline: reader → publisher → LSN feedback, with reconnects. The path
//! of one outbox row through it, file by file, is the diagram of docs/design.md §2.
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
//!
//! Files: this one runs the sessions; `sink.rs` is the target published to (an
//! exchange, or a stream exactly once); `stored.rs` reads and writes the stored
//! position; `slot_advance.rs` saves the carried position to the slot.

pub mod sink;
mod slot_advance;
mod stored;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use outbox_event::Lsn;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn, Instrument};
use wal_reader::{ReaderConfig, ReaderError, WalReader};

use sink::{Sink, SinkConfig};
use slot_advance::save_position;
use stored::{min_of, stored_position, tap_events, warn_state, StateWriter, STATE_TIMEOUT};

use crate::error::CliError;
use crate::health::Health;
use crate::shutdown::Shutdown;
use crate::state;

/// Batches buffered between reader and publisher (each is one socket read).
const CHANNEL_BATCHES: usize = 64;
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How often a standby checks whether the slot was released.
const STANDBY_POLL: Duration = Duration::from_secs(1);

/// Everything a pipeline needs.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub reader: ReaderConfig,
    pub publisher: SinkConfig,
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

/// Runs sessions, one after another, until a stop is requested. Returns an error
/// only for problems that retrying cannot fix (exit code 2) or a bug (exit code 1).
pub async fn run_sessions(
    cfg: PipelineConfig,
    mut shutdown: Shutdown,
    health: Health,
) -> Result<(), CliError> {
    let mut attempt: u32 = 0;
    let mut standby_logged = false;
    let mut carried = Carried::default();
    loop {
        if shutdown.is_requested() {
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
                    _ = shutdown.requested() => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn reader_error(e: ReaderError) -> Result<SessionEnd, CliError> {
    if e.is_precondition() {
        Err(e.into())
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
    shutdown: &mut Shutdown,
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
                    _ = shutdown.requested() => return Ok(SessionEnd::Stopped),
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
    health.set_reader(Some(reader.oldest_unacked()));
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
    let publisher = match Sink::connect(&cfg.publisher).await {
        Ok(p) => p,
        Err(e) if e.is_transient() || carried.broker_connected => {
            return Ok(SessionEnd::Retry(Side::Rabbitmq, e.to_string()))
        }
        // Not transient: a refusal (exit 2).
        Err(e) => return Err(e.into()),
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
                max_in_flight: cfg.publisher.max_in_flight(),
                interval: cfg.reader.status_interval,
                written: initial,
                stored: stored_tx,
            };
            let task = tokio::spawn(
                writer
                    .write_until_finished(finish_rx)
                    .instrument(tracing::info_span!("state")),
            );
            (rx, min_of(flushed, stored_rx), Some((finish_tx, task)))
        }
        None => (rx, flushed, None),
    };
    let publisher_task = tokio::spawn(
        publisher
            .run_with_flushed(rx, acked_tx, flushed)
            .instrument(tracing::info_span!("publisher", target = %cfg.publisher.target())),
    );
    health.set_streaming(true);

    let mut reader_task = reader_task;
    let mut publisher_task = publisher_task;
    let outcome = tokio::select! {
        _ = shutdown.requested() => {
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
                    // The bounded wait is over: abort is the point of the bound. What
                    // is acked is carried; the rest is published again after restart.
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
            // Only a reader still running after that bounded wait is aborted: the
            // next session's reader starts over from the acked position anyway.
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
