//! The stored position (docs/design.md §3): the session's SQL connection to the
//! state table `outbox_relay_state` (crate::state), read before a session streams,
//! and the writer that keeps the acked watermark there while it runs.

use std::time::Duration;

use outbox_event::history::Origin;
use outbox_event::Lsn;
use publisher::PublisherStatus;
use tokio::sync::watch;
use tracing::{debug, warn};
use wal_reader::{LastEventCommit, ReaderConfig};

use super::SessionError;
use crate::state::{self, Columns, StateError, Stored};

/// Bound on one statement on the state table.
pub(super) const STATE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the state writer looks at the watermark and the window.
const STATE_POLL: Duration = Duration::from_millis(20);

/// The state table as a session found it.
pub(super) struct StateFound {
    pub(super) columns: Columns,
    /// The slot's row, if any.
    pub(super) row: Option<Stored>,
}

/// Opens (or reuses) the session's SQL connection in `client` and reads the slot's
/// row, creating the table if missing. `Ok(None)`: the table is not usable (said
/// once, with what that costs). Errors only when the server cannot be reached: the
/// session waits rather than starting from an older position.
pub(super) async fn read_state(
    cfg: &ReaderConfig,
    client: &mut Option<tokio_postgres::Client>,
    warned: &mut bool,
) -> Result<Option<StateFound>, SessionError> {
    if client.as_ref().is_none_or(|c| c.is_closed()) {
        *client = match tokio::time::timeout(STATE_TIMEOUT, crate::sql::connect(&cfg.conn)).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => return Err(SessionError::StateConnect(e)),
            Err(_) => return Err(SessionError::State(StateError::Timeout(STATE_TIMEOUT))),
        };
    }
    let c = client.as_ref().expect("connected");
    let res = async {
        let columns = state::ensure_table(c).await?;
        let row = state::read(c, &cfg.slot).await?;
        Ok::<_, StateError>(StateFound { columns, row })
    };
    match tokio::time::timeout(STATE_TIMEOUT, res).await {
        Ok(Ok(found)) => {
            if !found.columns.history && !*warned {
                *warned = true;
                warn!(
                    table = state::TABLE,
                    "the state table has no history columns: {}",
                    state::HISTORY_COST
                );
            }
            Ok(Some(found))
        }
        Ok(Err(e)) if e.is_closed() => {
            *client = None;
            Err(SessionError::State(e))
        }
        Ok(Err(e)) => {
            warn_state(warned, &e);
            *client = None;
            Ok(None)
        }
        Err(_) => {
            *client = None;
            Err(SessionError::State(StateError::Timeout(STATE_TIMEOUT)))
        }
    }
}

/// One warning per process when the state table cannot be used, naming the cost.
pub(super) fn warn_state(warned: &mut bool, e: &StateError) {
    if !*warned {
        *warned = true;
        warn!(error = %e, table = state::TABLE, "cannot keep the acked position in Postgres: {}", state::COST);
    } else {
        debug!(error = %e, "state table not usable");
    }
}

/// Writes the acked watermark to the state table (docs/design.md §3): once per status
/// interval while outbox events were acked since the last write, sooner when half of
/// `max_in_flight` waits for it, and once more when the session ends. It owns the
/// publisher's flushed bound: a message counts in flight until a position past it
/// was both sent to Postgres (`flushed`) and stored.
pub(super) struct StateWriter {
    pub(super) client: tokio_postgres::Client,
    pub(super) slot: String,
    /// Where the session's positions come from (`None`: no history columns).
    pub(super) origin: Option<Origin>,
    pub(super) acked: watch::Receiver<Lsn>,
    pub(super) last_event_end: LastEventCommit,
    pub(super) status: PublisherStatus,
    pub(super) max_in_flight: usize,
    pub(super) interval: Duration,
    pub(super) written: Lsn,
    /// What the reader sent Postgres as flushed.
    pub(super) flushed: watch::Receiver<Lsn>,
    /// `min(flushed, stored)`, for the publisher; `flushed` alone once writing failed,
    /// `stored` alone once the reader is gone (nothing more will be flushed, and the
    /// publisher must still drain what it holds: a bound stuck at the reader's last
    /// flush held a full window for ever), and no bound once both are.
    pub(super) bound: watch::Sender<Lsn>,
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
        let mut flushed_open = true;
        // Once a write failed: no more writes, the bound follows `flushed` alone, and
        // the error is returned at the end.
        let mut broken: Option<StateError> = None;
        loop {
            let finishing = tokio::select! {
                _ = tick.tick() => *finish.borrow(),
                r = finish.changed() => r.is_err() || *finish.borrow(),
                r = self.flushed.changed(), if flushed_open => {
                    flushed_open = r.is_ok();
                    *finish.borrow()
                }
            };
            let reader_gone = !flushed_open;
            if broken.is_some() {
                self.publish_bound(Lsn(u64::MAX), reader_gone);
                if finishing {
                    return Err(broken.take().expect("broken"));
                }
                continue;
            }
            self.publish_bound(self.written, reader_gone);
            let acked = *self.acked.borrow();
            let events = self.last_event_end.get();
            let due = finishing
                || last_write.elapsed() >= self.interval
                || self.status.in_flight() >= (self.max_in_flight / 2).max(1);
            if due && acked > self.written && events > self.written {
                last_write = tokio::time::Instant::now();
                let res = tokio::time::timeout(
                    STATE_TIMEOUT,
                    state::save(&self.client, &self.slot, acked, self.origin),
                )
                .await;
                match res {
                    Ok(Ok(())) => {
                        self.written = acked;
                        self.publish_bound(acked, reader_gone);
                    }
                    // Never hold the publisher on a table that cannot be written.
                    Ok(Err(e)) => broken = Some(e),
                    Err(_) => broken = Some(StateError::Timeout(STATE_TIMEOUT)),
                }
                if broken.is_some() {
                    self.publish_bound(Lsn(u64::MAX), reader_gone);
                    if finishing {
                        return Err(broken.take().expect("broken"));
                    }
                    continue;
                }
            }
            if finishing {
                return Ok(self.written);
            }
        }
    }

    fn publish_bound(&self, stored: Lsn, reader_gone: bool) {
        let v = if reader_gone {
            stored
        } else {
            (*self.flushed.borrow()).min(stored)
        };
        self.bound.send_if_modified(|cur| {
            let changed = *cur != v;
            *cur = v;
            changed
        });
    }
}
