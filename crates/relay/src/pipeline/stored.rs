//! The stored position (docs/design.md §3): where a session resumes from, read
//! before it streams, and the writer that keeps the acked watermark in the table
//! `outbox_relay_state` (crate::state) while it runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch, WalItem};
use publisher::PublisherStatus;
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};
use wal_reader::ReaderConfig;

use super::Carried;
use crate::state::{self, Resume, StateError};

/// Bound on one statement on the state table.
pub(super) const STATE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the state writer looks at the watermark and the window.
const STATE_POLL: Duration = Duration::from_millis(20);

/// Where the stored position says to start, and what is stored.
pub(super) struct Found {
    /// Start here (past the slot's position), unless `run --start-lsn` names a start.
    pub(super) resume: Option<Lsn>,
    /// The stored position (`None`: no row, or the table is not usable).
    pub(super) stored: Option<Lsn>,
}

/// Reads the slot and the stored position, creating the table if missing; keeps the
/// connection in `client` for the session's writes (`None` when the table is not
/// usable). Errors only when the server cannot be reached: the session waits rather
/// than starting from an older position.
pub(super) async fn stored_position(
    cfg: &ReaderConfig,
    client: &mut Option<tokio_postgres::Client>,
    carried: &mut Carried,
) -> Result<Found, String> {
    if client.as_ref().is_none_or(|c| c.is_closed()) {
        *client = match tokio::time::timeout(STATE_TIMEOUT, crate::sql::connect(&cfg.conn)).await {
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
pub(super) fn warn_state(carried: &mut Carried, e: &StateError) {
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
pub(super) fn tap_events(
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
pub(super) fn min_of(
    mut a: watch::Receiver<Lsn>,
    mut b: watch::Receiver<Lsn>,
) -> watch::Receiver<Lsn> {
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
pub(super) struct StateWriter {
    pub(super) client: tokio_postgres::Client,
    pub(super) slot: String,
    pub(super) acked: watch::Receiver<Lsn>,
    pub(super) last_event_end: Arc<AtomicU64>,
    pub(super) status: PublisherStatus,
    pub(super) max_in_flight: usize,
    pub(super) interval: Duration,
    pub(super) written: Lsn,
    /// What is stored; `Lsn(u64::MAX)` once writing failed (no bound any more).
    pub(super) stored: watch::Sender<Lsn>,
}

impl StateWriter {
    /// Writes until `finish` turns true, then once more; returns what is stored.
    pub(super) async fn write_until_finished(
        mut self,
        mut finish: watch::Receiver<bool>,
    ) -> Result<Lsn, StateError> {
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
