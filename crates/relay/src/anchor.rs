//! The replay window's anchor slot (docs/design.md §7).
//!
//! Postgres cannot move a logical slot backwards, and the live slot only moves
//! forwards as the broker acks. To keep the WAL of the last `[relay] replay_window`
//! the relay holds a second slot, `<slot>_anchor`, that nobody streams from: it only
//! pins WAL. This task trails it behind the live slot by the window:
//!
//! ```text
//!   every SAMPLE: read the live slot's confirmed_flush_lsn ──► samples (time, lsn)
//!                 newest sample older than the window ──► pg_replication_slot_advance(anchor)
//!                 current WAL − anchor restart_lsn ──► gauge REPLAY_WINDOW_RETAINED_WAL
//! ```
//!
//! The live slot's confirmed position is the acked watermark Postgres has been told,
//! so the anchor's confirmed position is the acked watermark of about `replay_window`
//! ago: the start of the window, from which `replay --from-lsn` can re-read. Samples
//! live in memory; after a restart the anchor stays put until the window has passed
//! again, which keeps more WAL for a while, never less.
//!
//! `slot create` creates the anchor (a copy of the live slot, so the window starts
//! exactly at the live slot's position) and `slot drop` drops it. If the anchor is
//! missing when the relay runs with a window, this task creates it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use outbox_event::Lsn;
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tracing::{debug, info, warn};
use wal_reader::admin::{self, ident::validate_slot_name};
use wal_reader::PgConnectOptions;

use crate::background::tick::{every_tick, Task, Then};
use crate::config::Config;
use crate::error::CliError;
use crate::shutdown::Shutdown;

/// The gauge of WAL bytes the anchor slot retains.
pub const REPLAY_WINDOW_RETAINED_WAL: &str = "outbox_relay_replay_window_retained_wal_bytes";

/// Longest time between two samples of the live slot.
const SAMPLE_MAX: Duration = Duration::from_secs(5);
/// Shortest time between two samples of the live slot.
const SAMPLE_MIN: Duration = Duration::from_millis(200);

/// The anchor slot's name for a live slot.
pub fn anchor_slot_name(slot: &str) -> String {
    admin::anchor_slot_name(slot)
}

/// How often the task samples for a window: a tenth of it, within
/// [`SAMPLE_MIN`]..[`SAMPLE_MAX`].
pub fn sample_interval(window: Duration) -> Duration {
    (window / 10).clamp(SAMPLE_MIN, SAMPLE_MAX)
}

/// Checks that the anchor slot's name is valid when a window is configured.
pub fn validate(cfg: &Config) -> Result<(), CliError> {
    if cfg.replay_window().is_some() {
        let name = anchor_slot_name(&cfg.postgres.slot);
        validate_slot_name(&name).map_err(|e| {
            CliError::Precondition(format!(
                "with [relay] replay_window the anchor slot is named {name:?}, which is not a valid slot name ({e}): choose a `postgres.slot` of at most 56 characters"
            ))
        })?;
    }
    Ok(())
}

/// Creates the anchor slot as a copy of the live slot (same position). Returns the
/// anchor's confirmed position, or `None` when it already existed.
pub async fn create(c: &Client, slot: &str) -> Result<Option<Lsn>, admin::AdminError> {
    let anchor = anchor_slot_name(slot);
    validate_slot_name(&anchor)?;
    if admin::slot_state(c, &anchor).await?.is_some() {
        return Ok(None);
    }
    admin::copy_slot(c, slot, &anchor).await?;
    let state = admin::require_slot(c, &anchor).await?;
    Ok(Some(state.confirmed_flush_lsn.unwrap_or(Lsn::ZERO)))
}

/// Starts the task that advances the anchor slot (none without a window).
pub fn spawn(cfg: &Config, stop: Shutdown) -> Option<JoinHandle<()>> {
    let window = cfg.replay_window()?;
    let opts = cfg.pg_options().ok()?;
    let slot = cfg.postgres.slot.clone();
    let task = Anchor::new(opts, slot, window);
    Some(tokio::spawn(every_tick(
        task,
        sample_interval(window),
        stop,
    )))
}

/// The anchor task's state: samples of the live slot's position over time.
struct Anchor {
    opts: PgConnectOptions,
    slot: String,
    anchor: String,
    window: Duration,
    samples: VecDeque<(Instant, Lsn)>,
    warned: bool,
}

impl Anchor {
    fn new(opts: PgConnectOptions, slot: String, window: Duration) -> Anchor {
        Anchor {
            opts,
            anchor: anchor_slot_name(&slot),
            slot,
            window,
            samples: VecDeque::new(),
            warned: false,
        }
    }

    fn warn_once(&mut self, e: &str) {
        if !self.warned {
            warn!(anchor = %self.anchor, error = %e, "cannot maintain the replay window's anchor slot");
            self.warned = true;
        } else {
            debug!(anchor = %self.anchor, error = %e, "anchor step failed");
        }
    }

    /// One sample, and the anchor moved to the newest sample older than the window.
    async fn advance(&mut self, c: &Client) -> Result<(), String> {
        let live = admin::slot_state(c, &self.slot)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("slot {} does not exist", self.slot))?;
        let now = Instant::now();
        if let Some(l) = live.confirmed_flush_lsn {
            if self.samples.back().is_none_or(|(_, last)| l > *last) {
                self.samples.push_back((now, l));
            }
        }
        let anchor = match admin::slot_state(c, &self.anchor)
            .await
            .map_err(|e| e.to_string())?
        {
            Some(a) => a,
            None => {
                let at = create(c, &self.slot).await.map_err(|e| e.to_string())?;
                info!(anchor = %self.anchor, at = ?at.map(|l| l.to_string()), "created the replay window's anchor slot");
                admin::require_slot(c, &self.anchor)
                    .await
                    .map_err(|e| e.to_string())?
            }
        };
        if anchor.wal_status.as_deref() == Some("lost") {
            return Err(format!(
                "the anchor slot {} was invalidated: drop it (the relay recreates it) and raise max_slot_wal_keep_size",
                self.anchor
            ));
        }
        let target = take_target(&mut self.samples, now, self.window);
        let current = anchor.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
        if let Some(t) = target.filter(|t| *t > current) {
            admin::advance_slot(c, &self.anchor, t)
                .await
                .map_err(|e| e.to_string())?;
            debug!(anchor = %self.anchor, to = %t, "replay window start advanced");
        }
        let retained = admin::slot_retained_wal(c, &self.anchor)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(bytes) = retained {
            metrics::gauge!(REPLAY_WINDOW_RETAINED_WAL).set(bytes);
        }
        self.warned = false;
        Ok(())
    }
}

impl Task for Anchor {
    async fn connect(&mut self) -> Result<Client, String> {
        crate::sql::connect(&self.opts)
            .await
            .map_err(|e| e.to_string())
    }

    fn connect_failed(&mut self, error: &str, _failures: u32) -> Option<Duration> {
        debug!(error = %error, "anchor: cannot connect to postgres");
        None
    }

    async fn step(&mut self, c: &Client, _stop: &Shutdown) -> Then {
        if let Err(e) = self.advance(c).await {
            self.warn_once(&e);
        }
        Then::Tick
    }
}

/// Removes the samples older than `window` and returns the newest of them: the
/// position the anchor may move to.
fn take_target(
    samples: &mut VecDeque<(Instant, Lsn)>,
    now: Instant,
    window: Duration,
) -> Option<Lsn> {
    let mut target = None;
    while let Some((t, l)) = samples.front().copied() {
        if now.saturating_duration_since(t) < window {
            break;
        }
        target = Some(l);
        samples.pop_front();
    }
    target
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_is_the_newest_sample_older_than_the_window() {
        let start = Instant::now();
        let w = Duration::from_secs(10);
        let mut s: VecDeque<_> = [
            (start, Lsn(1)),
            (start + Duration::from_secs(5), Lsn(2)),
            (start + Duration::from_secs(12), Lsn(3)),
        ]
        .into();
        assert_eq!(take_target(&mut s, start + Duration::from_secs(9), w), None);
        assert_eq!(s.len(), 3);
        assert_eq!(
            take_target(&mut s, start + Duration::from_secs(16), w),
            Some(Lsn(2))
        );
        assert_eq!(s.len(), 1);
        assert_eq!(
            take_target(&mut s, start + Duration::from_secs(17), w),
            None
        );
    }

    #[test]
    fn names_and_intervals() {
        assert_eq!(anchor_slot_name("relay"), "relay_anchor");
        assert_eq!(
            sample_interval(Duration::from_secs(3)),
            Duration::from_millis(300)
        );
        assert_eq!(sample_interval(Duration::from_secs(3600)), SAMPLE_MAX);
        assert_eq!(sample_interval(Duration::from_millis(100)), SAMPLE_MIN);
    }
}
