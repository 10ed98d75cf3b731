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
//! - Postgres side (connection lost, server restart): the reader ends; the publisher
//!   drains what it has (bounded by the shutdown timeout), the acked position is
//!   saved to the slot with `pg_replication_slot_advance` when the server is back,
//!   and a new session resumes from the slot's confirmed position — never from a
//!   position the relay tracked itself.
//! - an unmet precondition (bad password, missing slot, renamed column): the relay
//!   stops with exit code 2 and a sentence that names the fix.
//! - slot held by another relay: this one is a standby; it waits and takes over
//!   when the slot is released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use publisher::{Publisher, PublisherConfig, PublisherStatus};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn, Instrument};
use wal_reader::{Lsn, PgConnectOptions, ReaderConfig, ReaderError, ReaderProgress, WalReader};

use crate::error::CliError;

/// Batches buffered between reader and publisher (each is one socket read).
const CHANNEL_BATCHES: usize = 64;
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How often a standby checks whether the slot was released.
const STANDBY_POLL: Duration = Duration::from_secs(1);

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
}

/// Runs sessions until `shutdown` turns true. Returns an error only for problems
/// that retrying cannot fix (exit code 2) or a bug (exit code 1).
pub async fn run(
    cfg: PipelineConfig,
    mut shutdown: watch::Receiver<bool>,
    health: Health,
) -> Result<(), CliError> {
    let mut backoff = BACKOFF_INITIAL;
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
                let wait = backoff.mul_f64(jitter());
                warn!(error = %why, side = side.label(), retry_in = ?wait, "session ended; reconnecting");
                backoff = (backoff * 2).min(BACKOFF_MAX);
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
    // The reader first: a standby must not hold a broker connection it cannot use.
    let reader = loop {
        match WalReader::start(cfg.reader.clone()).await {
            Ok(r) => break r,
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
            Err(e) => return reader_error(e),
        }
    };
    if *standby_logged {
        info!("slot released; taking over");
        *standby_logged = false;
    }
    let start = reader.start_info().clone();
    health.set_reader(Some(reader.progress()));
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
    let (acked_tx, acked_rx) = watch::channel(start.slot_confirmed.max(start.start_lsn));
    let (stop_tx, stop_rx) = watch::channel(false);
    // What the reader actually sent Postgres: the publisher counts a message against
    // max_in_flight until a position past it is there (the duplicate bound).
    let flushed = reader.flushed();
    let reader_task = tokio::spawn(
        reader
            .run(tx, acked_rx, stop_rx)
            .instrument(tracing::info_span!("reader", slot = %cfg.reader.slot)),
    );
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
            // The reader dropped its sender: the publisher drains what it has.
            let report = publisher_task.await;
            let watermark = match &report {
                Ok(Ok(rep)) => Some(rep.watermark),
                _ => None,
            };
            match r {
                Ok(Ok(_)) => Ok(SessionEnd::Retry(Side::Postgres, "replication ended".into())),
                Ok(Err(e)) => {
                    if let Some(w) = watermark {
                        save_position(&cfg.reader, w).await;
                    }
                    reader_error(e)
                }
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
    outcome
}

/// A factor in [0.5, 1.0) for backoff jitter (no need for a random number crate).
fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    0.5 + f64::from(nanos % 1000) / 2000.0
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

/// After the replication connection died, saves the acked position to the slot so
/// the next session does not publish those messages again. Best effort: the old
/// walsender may still hold the slot, or the server may be down; then the next
/// session simply resumes from the slot's older position (bounded duplicates).
async fn save_position(cfg: &ReaderConfig, acked: Lsn) {
    if acked == Lsn::ZERO {
        return;
    }
    let res = async {
        let client = connect_sql(&cfg.conn).await?;
        client
            .execute(
                "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn) \
                   FROM pg_replication_slots \
                  WHERE slot_name = $1 AND NOT active AND confirmed_flush_lsn < $2::text::pg_lsn",
                &[&cfg.slot, &acked.to_string()],
            )
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(5), res).await {
        Ok(Ok(n)) if n > 0 => info!(lsn = %acked, "saved the acked position to the slot"),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "could not save the acked position"),
        Err(_) => tracing::debug!("saving the acked position timed out"),
    }
}

/// An ordinary SQL connection with the same TLS rules as the replication one.
pub async fn connect_sql(opts: &PgConnectOptions) -> Result<tokio_postgres::Client, String> {
    let tls = wal_reader::tls::make_tls_connect(opts).map_err(|e| e.to_string())?;
    let (client, conn) = opts
        .to_tokio_postgres()
        .connect(tls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}
