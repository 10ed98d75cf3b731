//! `replay --from-lsn X [--to-lsn Y]` and `replay --from-table [--since] [--until]`
//! (docs/design.md §7): re-publish past events with the header `replay = true` and their
//! original `message_id`, with publisher confirms, while a live relay keeps running.
//!
//! The two modes are two files: `from_lsn.rs` (a copy of the anchor slot) and
//! `from_table.rs` (the rows still in the outbox tables); this one holds what they
//! share (the replay slots, the publisher) and `progress.rs` the progress display.
//!
//! # Restart safety
//!
//! A replay stopped by SIGINT/SIGTERM drops its slot before exiting. Every replay
//! first drops inactive `<slot>_replay_*` slots, so a replay killed halfway
//! (SIGKILL, crash) leaves nothing behind after the next one; a replay can simply be
//! run again (consumers deduplicate on `message_id`).

mod from_lsn;
mod from_table;
mod progress;

use publisher::stream::StreamConfig;
use publisher::{PublisherConfig, PublisherReport};

use crate::pipeline::sink::{Sink, SinkConfig};
use tokio_postgres::Client;
use tracing::{info, warn};
use wal_reader::admin;

use crate::cli::{LogFormat, ReplayArgs, ReplaySource};
use crate::config::Config;
use crate::error::CliError;

/// Runs the replay the arguments ask for; `format` chooses how progress is shown
/// (`progress.rs`).
pub async fn replay(cfg: &Config, args: &ReplayArgs, format: LogFormat) -> Result<(), CliError> {
    match args.source()? {
        ReplaySource::Wal { from, to } => from_lsn::replay(cfg, from, to, format).await,
        ReplaySource::Table { since, until } => from_table::replay(cfg, since, until, format).await,
    }
}

/// The prefix of the temporary replay slots of `slot`.
pub fn replay_slot_prefix(slot: &str) -> String {
    format!("{slot}_replay_")
}

/// Every replay slot of `slot` (`<slot>_replay_<pid>`) with whether it is active.
pub async fn replay_slots(c: &Client, slot: &str) -> Result<Vec<(String, bool)>, CliError> {
    let prefix = replay_slot_prefix(slot);
    let rows = c
        .query(
            "SELECT slot_name::text, active FROM pg_replication_slots \
              WHERE left(slot_name::text, length($1)) = $1",
            &[&prefix],
        )
        .await?;
    let mut out = Vec::new();
    for r in rows {
        let name: String = r.get(0);
        let active: bool = r.get(1);
        if name[prefix.len()..].chars().all(|c| c.is_ascii_digit()) {
            out.push((name, active));
        }
    }
    Ok(out)
}

/// Drops the replay slots nobody streams from (left by a killed replay).
pub(super) async fn drop_stale(c: &Client, slot: &str) -> Result<(), CliError> {
    for (name, active) in replay_slots(c, slot).await? {
        if active {
            info!(slot = %name, "another replay is running on its own slot; leaving it");
            continue;
        }
        match admin::drop_slot(c, &name, true, false).await {
            Ok(true) => {
                info!(slot = %name, "dropped a replay slot left behind by an earlier replay")
            }
            Ok(false) => {}
            Err(e) => warn!(slot = %name, error = %e, "cannot drop a stale replay slot"),
        }
    }
    Ok(())
}

/// The replay connection's publisher: the relay's, plus `replay = true`.
fn replay_publisher_config(cfg: &Config) -> PublisherConfig {
    let mut p = cfg.publisher_config();
    p.extra_headers = vec![("replay".into(), "true".into())];
    p.connection_name = format!("outbox-relay replay {}", cfg.postgres.slot);
    p
}

/// The replay's stream publisher (with `rabbitmq.stream` set): no producer reference,
/// so the broker does not drop the copies as duplicates of the relay's own messages,
/// and `replay = true` on each (docs/streams.md).
fn replay_stream_config(cfg: &Config) -> StreamConfig {
    let mut s = cfg.stream_config();
    s.producer_reference = None;
    s.extra_properties = vec![("replay".into(), "true".into())];
    s
}

/// The replay's publisher: to the stream when `rabbitmq.stream` is set, else to the
/// exchange.
pub(super) async fn connect_publisher(cfg: &Config) -> Result<Sink, CliError> {
    let sink = match cfg.stream() {
        Some(_) => SinkConfig::Stream(replay_stream_config(cfg)),
        None => SinkConfig::Exchange(replay_publisher_config(cfg)),
    };
    Sink::connect(&sink).await.map_err(CliError::from)
}

/// Checks what the publisher reports at the end.
pub(super) fn check_report(
    res: Result<Result<PublisherReport, publisher::PublishError>, tokio::task::JoinError>,
) -> Result<PublisherReport, CliError> {
    let report = res
        .map_err(|e| CliError::Runtime(format!("the publisher task failed: {e}")))?
        .map_err(|e| CliError::Runtime(format!("{e}: fix it and run the same replay again")))?;
    if report.abandoned > 0 {
        return Err(CliError::Runtime(format!(
            "{} replayed messages were not confirmed by the broker in time: check RabbitMQ and run the same replay again",
            report.abandoned
        )));
    }
    Ok(report)
}
