//! `replay --from-lsn X [--to-lsn Y]` and `replay --from-table [--since] [--until]`
//! (docs/design.md §7): re-publish past events with the header `replay = true` and their
//! original `message_id`, with publisher confirms, while a live relay keeps running.
//!
//! The two modes are two files: `from_lsn.rs` (a copy of the anchor slot) and
//! `from_table.rs` (the rows still in the outbox tables); this one holds what they
//! share (the replay slots, the publisher, where the copies go) and `progress.rs` the
//! progress display.
//!
//! # Reaching one consumer
//!
//! `--where FIELD=VALUE` keeps the events whose mapped field has that value
//! (aggregate_type, aggregate_id, event_type, table, message_id); `--exchange`,
//! `--routing-key` and `--stream` send the copies elsewhere than the relay's target:
//! `--exchange "" --routing-key billing` reaches the one queue `billing` through the
//! default exchange, not every queue bound to the relay's exchange. `--dry-run`
//! counts what would be re-published and publishes nothing (no broker connection).
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
use publisher::{PublisherConfig, PublisherReport, Target, TargetConfig};

use tokio_postgres::Client;
use tracing::{info, warn};
use wal_reader::admin;

use crate::cli::{LogFormat, ReplayArgs, ReplaySource, Selection};
use crate::config::Config;
use crate::error::CliError;

/// Where a replay's copies go and which events it re-publishes (the arguments beside
/// the source).
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub selection: Selection,
    /// `--exchange`: instead of the configured target.
    pub exchange: Option<String>,
    /// `--routing-key`.
    pub routing_key: Option<String>,
    /// `--stream`: instead of the configured target.
    pub stream: Option<String>,
    pub dry_run: bool,
    pub format: LogFormat,
}

impl Plan {
    fn of(args: &ReplayArgs, format: LogFormat) -> Result<Plan, CliError> {
        if let Some(template) = &args.routing_key {
            publisher::message::RoutingKeyTemplate::parse(template).map_err(|e| {
                CliError::Usage(format!(
                    "--routing-key {template:?} is not a routing key template ({e}): give a queue name, or use only the placeholders {{aggregate_type}}, {{aggregate_id}}, {{event_type}}, {{table}}"
                ))
            })?;
        }
        if let Some(stream) = &args.stream {
            if stream.is_empty() || stream.len() > 255 || stream.contains(char::is_whitespace) {
                return Err(CliError::Usage(format!(
                    "--stream {stream:?} is not a stream name: give the name of an existing stream (1 to 255 bytes, no whitespace)"
                )));
            }
        }
        Ok(Plan {
            selection: Selection::new(&args.filters),
            exchange: args.exchange.clone(),
            routing_key: args.routing_key.clone(),
            stream: args.stream.clone(),
            dry_run: args.dry_run,
            format,
        })
    }

    /// The stream the copies go to, if they go to one.
    fn target_stream<'a>(&'a self, cfg: &'a Config) -> Option<&'a str> {
        match (&self.stream, &self.exchange) {
            (Some(s), _) => Some(s),
            (None, Some(_)) => None,
            (None, None) => cfg.stream(),
        }
    }

    /// `exchange outbox with routing key {aggregate_type}.{event_type}` or
    /// `stream orders`: where the copies go, for the last line.
    pub fn destination(&self, cfg: &Config) -> String {
        match self.target_stream(cfg) {
            Some(stream) => format!("stream {stream}"),
            None => format!(
                "exchange {:?} with routing key {}",
                self.exchange.as_deref().unwrap_or(&cfg.rabbitmq.exchange),
                self.routing_key
                    .as_deref()
                    .unwrap_or(&cfg.rabbitmq.routing_key)
            ),
        }
    }

    /// ` matching aggregate_type=order` (empty without filters).
    pub fn matching(&self) -> String {
        if self.selection.is_all() {
            String::new()
        } else {
            format!(" matching {}", self.selection.describe())
        }
    }
}

/// Runs the replay the arguments ask for; `format` chooses how progress is shown
/// (`progress.rs`).
pub async fn replay(cfg: &Config, args: &ReplayArgs, format: LogFormat) -> Result<(), CliError> {
    let plan = Plan::of(args, format)?;
    match args.source()? {
        ReplaySource::Wal { from, to } => from_lsn::replay(cfg, from, to, &plan).await,
        ReplaySource::Table { since, until } => from_table::replay(cfg, since, until, &plan).await,
    }
}

/// The prefix of the temporary replay slots of `slot`.
pub fn replay_slot_prefix(slot: &str) -> String {
    format!("{slot}_replay_")
}

/// Every replay slot of `slot` (`<slot>_replay_<pid>`) with whether it is active.
pub async fn replay_slots(c: &Client, slot: &str) -> Result<Vec<(String, bool)>, CliError> {
    let prefix = replay_slot_prefix(slot);
    let mut slots = admin::slots_with_prefix(c, &prefix)
        .await
        .map_err(|e| match e {
            admin::AdminError::Sql(e) => CliError::from(e),
            e => CliError::from(e),
        })?;
    slots.retain(|(name, _)| name[prefix.len()..].chars().all(|c| c.is_ascii_digit()));
    Ok(slots)
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

/// The replay connection's publisher: the relay's, plus `replay = true`, and the
/// plan's exchange and routing key. An exchange named on the command line is the
/// operator's: it is used, never declared.
fn replay_publisher_config(cfg: &Config, plan: &Plan) -> PublisherConfig {
    let mut p = cfg.publisher_config();
    p.extra_headers = vec![("replay".into(), "true".into())];
    p.connection_name = format!("outbox-relay replay {}", cfg.postgres.slot);
    if let Some(exchange) = &plan.exchange {
        p.exchange = exchange.clone();
        p.exchange_from_events = false;
        p.declare_exchange = false;
    }
    if let Some(template) = &plan.routing_key {
        p.routing_key = template.clone();
    }
    p
}

/// The replay's stream publisher: no producer reference, so the broker does not drop
/// the copies as duplicates of the relay's own messages, and `replay = true` on each
/// (docs/streams.md). A stream named on the command line must exist.
fn replay_stream_config(cfg: &Config, plan: &Plan) -> StreamConfig {
    let mut s = cfg.stream_config();
    s.source = None;
    s.extra_properties = vec![("replay".into(), "true".into())];
    if let Some(stream) = &plan.stream {
        s.stream = stream.clone();
        s.declare_stream = false;
    }
    s
}

/// The replay's publisher: to a stream (the plan's, or the configured one), else to
/// the exchange.
pub(super) async fn connect_publisher(cfg: &Config, plan: &Plan) -> Result<Target, CliError> {
    let sink = match plan.target_stream(cfg) {
        Some(_) => TargetConfig::Stream {
            config: replay_stream_config(cfg, plan),
            producer_name: None,
        },
        None => TargetConfig::Exchange(replay_publisher_config(cfg, plan)),
    };
    Target::connect(&sink, None).await.map_err(CliError::from)
}

/// Checks what the publisher reports at the end.
///
/// Copies the broker returned as unroutable are named as such, with where they
/// went: a replay to a queue that does not exist (`--exchange "" --routing-key
/// <queue>`) is the likely mistake, not a broker in trouble.
pub(super) fn check_report(
    res: Result<Result<PublisherReport, publisher::PublishError>, tokio::task::JoinError>,
    destination: &str,
) -> Result<PublisherReport, CliError> {
    let report = res
        .map_err(|e| CliError::Runtime(format!("the publisher task failed: {e}")))?
        .map_err(|e| CliError::Runtime(format!("{e}: fix it and run the same replay again")))?;
    if report.abandoned > 0 && report.returned > 0 {
        return Err(CliError::Runtime(format!(
            "{} replayed messages were returned unroutable by {destination}: declare or bind the queue they are meant for, or correct --exchange / --routing-key, then run the same replay again",
            report.abandoned
        )));
    }
    if report.abandoned > 0 {
        return Err(CliError::Runtime(format!(
            "{} replayed messages were not confirmed by the broker in time: check RabbitMQ and run the same replay again",
            report.abandoned
        )));
    }
    Ok(report)
}
