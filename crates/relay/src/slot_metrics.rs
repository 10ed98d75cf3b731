//! Slot gauges: what the relay's slot costs the server, sampled from
//! `pg_replication_slots` every [`INTERVAL`] while `run` is up.
//!
//! | gauge | value |
//! |---|---|
//! | `outbox_relay_slot_retained_wal_bytes` | current WAL − `restart_lsn`: WAL the server keeps for the slot |
//! | `outbox_relay_slot_pending_wal_bytes` | current WAL − `confirmed_flush_lsn`: WAL not yet confirmed by the relay |
//! | `outbox_relay_slot_safe_wal_bytes` | `safe_wal_size`: WAL that can still be written before the slot is invalidated (absent when `max_slot_wal_keep_size` is unlimited) |
//!
//! The task owns one ordinary SQL connection; on any error it drops it, logs at
//! debug level (the pipeline reports Postgres outages itself) and reconnects on the
//! next tick.

use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::Instrument;
use wal_reader::{admin, PgConnectOptions};

use crate::background::tick::{every_tick, Task, Then};
use crate::config::Config;
use crate::shutdown::Shutdown;
use crate::sql;

/// How often the slot is sampled.
pub const INTERVAL: Duration = Duration::from_secs(5);

pub const SLOT_RETAINED_WAL: &str = "outbox_relay_slot_retained_wal_bytes";
pub const SLOT_PENDING_WAL: &str = "outbox_relay_slot_pending_wal_bytes";
pub const SLOT_SAFE_WAL: &str = "outbox_relay_slot_safe_wal_bytes";

/// Starts the task that samples the slot for metrics; `None` when metrics are off
/// or the URL cannot be parsed (`run` reports that itself).
pub fn spawn(cfg: &Config, stop: Shutdown) -> Option<JoinHandle<()>> {
    cfg.metrics_listen()?;
    let opts = cfg.pg_options().ok()?;
    let slot = cfg.postgres.slot.clone();
    let span = tracing::info_span!("slot_metrics", slot = %slot);
    let sampler = Sampler { opts, slot };
    Some(tokio::spawn(
        every_tick(sampler, INTERVAL, stop).instrument(span),
    ))
}

/// The sampling task: one read of the slot per tick.
struct Sampler {
    opts: PgConnectOptions,
    slot: String,
}

impl Task for Sampler {
    async fn connect(&mut self) -> Result<tokio_postgres::Client, String> {
        sql::connect(&self.opts).await.map_err(|e| e.to_string())
    }

    fn connect_failed(&mut self, error: &str, _failures: u32) -> Option<Duration> {
        tracing::debug!(error = %error, "cannot connect for slot metrics; retrying");
        None
    }

    async fn step(&mut self, c: &tokio_postgres::Client, _stop: &Shutdown) -> Then {
        match admin::slot_state(c, &self.slot).await {
            Ok(Some(s)) => record(&s),
            Ok(None) => tracing::debug!("slot not found for slot metrics"),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the slot for slot metrics; reconnecting");
                return Then::Reconnect;
            }
        }
        Then::Tick
    }
}

fn record(s: &admin::SlotState) {
    if let Some(retained) = s.retained_wal_bytes {
        metrics::gauge!(SLOT_RETAINED_WAL).set(retained as f64);
    }
    if let Some(confirmed) = s.confirmed_flush_lsn {
        let pending = s.current_wal_lsn.0.saturating_sub(confirmed.0);
        metrics::gauge!(SLOT_PENDING_WAL).set(pending as f64);
    }
    if let Some(safe) = s.safe_wal_size {
        metrics::gauge!(SLOT_SAFE_WAL).set(safe as f64);
    }
}
