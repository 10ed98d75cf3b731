//! Command-line interface (docs/design.md §6), declared with clap's derive API.
//!
//! ```text
//! outbox-relay [--config FILE] [--log-format text|json] <COMMAND>
//!   run [--start-lsn LSN | --skip-through MESSAGE_ID [--yes]] [--paused]
//!   slot create [--if-not-exists] [--failover]
//!   slot drop [--if-exists] [--force]
//!   slot skip <MESSAGE_ID | --lsn LSN> [--yes]
//!   status [--json]
//!   peek [--limit N] [--json]
//!   replay --from-lsn LSN [--to-lsn LSN]         [filters and overrides]
//!   replay --from-table [--since TIME] [--until TIME]   [filters and overrides]
//!          [--where FIELD=VALUE]... [--exchange NAME | --stream NAME]
//!          [--routing-key TEMPLATE] [--dry-run]
//!   check [--declare] | check --routes [--since DURATION]
//!   ctl [--endpoint URL] pause | resume | drain [--wait [--timeout D]] | status [--json] | reload
//!   completions <bash|zsh|fish|elvish|powershell>
//!   man                       (hidden: the man page, docs/man/outbox-relay.1)
//! ```
//!
//! Parsing only: each command's behaviour lives elsewhere. Clap rejects bad usage
//! with exit code 2 before anything runs. LSNs are parsed by [`outbox_event::Lsn`]
//! (`X/Y` in hex), times as RFC 3339 in UTC by `humantime`
//! (`2024-05-01T12:00:00Z`; a missing `Z` also means UTC).

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use outbox_event::Lsn;

use crate::error::CliError;

/// Default `peek --limit`.
pub const DEFAULT_PEEK_LIMIT: u32 = 100;

/// Relays a transactional outbox from a Postgres logical replication slot to RabbitMQ.
#[derive(Debug, Parser)]
// `-V` prints the version alone (it is also the man page's); `--version` adds the
// git commit and the target (crate::build_info).
#[command(
    name = "outbox-relay",
    version,
    long_version = crate::build_info::LONG_VERSION,
    about,
    propagate_version = true
)]
pub struct Cli {
    /// Configuration file [default: ./outbox-relay.toml if present]. Every key can be
    /// overridden by an OUTBOX_RELAY_<SECTION>_<KEY> environment variable.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Log line format on stderr. The level comes from [relay] log_filter when it is
    /// set (a reload can change it), else from RUST_LOG, else info.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the relay until SIGTERM/SIGINT or `ctl drain`. SIGHUP (or `ctl reload`)
    /// rereads the configuration file.
    Run(RunArgs),
    /// Create or drop the replication slot.
    #[command(subcommand)]
    Slot(SlotCommand),
    /// Show the slot's state, confirmed/restart LSN, retained WAL and outbox lag.
    Status(StatusArgs),
    /// Print pending events without consuming them.
    Peek(PeekArgs),
    /// Re-publish events from a past WAL position or from the outbox table.
    Replay(ReplayArgs),
    /// Validate the configuration and every precondition, one line each. Changes
    /// nothing unless --declare is given.
    Check(CheckArgs),
    /// Control the running relay through its endpoint ([relay] metrics_listen, with
    /// the control token the relay writes at start, or the credentials and TLS of
    /// /metrics): pause, resume, drain, status, reload. Reads only those keys of the
    /// file: errors elsewhere in it are warned about.
    Ctl(CtlArgs),
    /// Print a shell completion script to stdout, e.g.
    /// `outbox-relay completions bash > /etc/bash_completion.d/outbox-relay`.
    Completions(CompletionsArgs),
    /// Print the man page (roff) to stdout; docs/man/outbox-relay.1 is its output.
    #[command(hide = true)]
    Man,
}

/// `check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Create what `run` would create and is missing (the exchange or the stream,
    /// when declare_exchange / declare_stream is on) and the publication, as `slot
    /// create` would; without it `check` changes nothing.
    #[arg(long)]
    pub declare: bool,
    /// Instead of the preconditions: which queues each (table, aggregate_type,
    /// event_type) of the slot's pending events and of the outbox tables' recent rows
    /// would reach, through [[topology.*]] and, with [rabbitmq] management_url, the
    /// broker's own bindings. Exits 2 when one reaches no queue.
    #[arg(long, conflicts_with = "declare")]
    pub routes: bool,
    /// With --routes: how far back the tables' rows are read (by created_at), e.g.
    /// 7d [default: 24h].
    #[arg(long, value_name = "DURATION", requires = "routes", value_parser = parse_duration)]
    pub since: Option<Duration>,
}

/// `completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum, value_name = "SHELL")]
    pub shell: clap_complete::Shell,
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Stream from this LSN (X/Y) instead of the slot's confirmed position; it cannot
    /// be older than the slot's confirmed_flush_lsn.
    #[arg(long, value_name = "LSN", conflicts_with = "skip_through")]
    pub start_lsn: Option<Lsn>,
    /// Before starting, skip a poison event as `slot skip` does: the transaction of
    /// this message id is never published (to skip by position, use `slot skip
    /// --lsn`). Logged, and counted in outbox_relay_skipped_events_total.
    #[arg(long, value_name = "MESSAGE_ID")]
    pub skip_through: Option<String>,
    /// Skip without asking (with --skip-through).
    #[arg(long, requires = "skip_through")]
    pub yes: bool,
    /// Start paused, as after `ctl pause`: the slot is held and nothing is published
    /// until `ctl resume`. Without it a restarted relay runs.
    #[arg(long)]
    pub paused: bool,
}

/// `ctl`: commands to the running relay (docs/operations.md, "Incident levers").
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The relay's endpoint, e.g. http://127.0.0.1:9187 or https://relay.example:9187,
    /// instead of [relay] metrics_listen; works without a configuration file (the
    /// credentials, certificate and control token file then come from
    /// OUTBOX_RELAY_RELAY_* variables or their defaults).
    #[arg(long, global = true, value_name = "URL")]
    pub endpoint: Option<String>,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// The commands of `ctl`.
#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// Stop publishing at the next transaction boundary; in-flight messages are
    /// confirmed, the slot stays held (no standby takes over).
    Pause,
    /// Publish again from where the pause stopped.
    Resume,
    /// Confirm everything read so far, then stop cleanly (exit 0), as SIGTERM does.
    Drain(CtlDrainArgs),
    /// The state (running, paused since, draining), the positions and the in-flight
    /// count.
    Status(CtlStatusArgs),
    /// Reread the configuration file as SIGHUP does: the log filter, the secret
    /// files, retention and alert settings; other changed keys are reported as
    /// needing a restart and are not applied.
    Reload,
}

/// `ctl drain`.
#[derive(Debug, Args)]
pub struct CtlDrainArgs {
    /// Return only when the relay has stopped.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up (exit 1) when the relay still runs after this long.
    #[arg(long, value_name = "DURATION", default_value = "10m", requires = "wait",
          value_parser = parse_duration)]
    pub timeout: Duration,
}

/// `ctl status`.
#[derive(Debug, Args)]
pub struct CtlStatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `slot create` / `slot drop` / `slot skip`.
#[derive(Debug, Subcommand)]
pub enum SlotCommand {
    /// Create the publication (if missing) and the pgoutput slot.
    Create(SlotCreateArgs),
    /// Drop the slot (refuses while a relay holds it, unless --force).
    Drop(SlotDropArgs),
    /// Skip a poison event: move the slot and the stored position past the
    /// transaction of this message id (or of every transaction committed up to this
    /// LSN), so that it is never published. Stop the relay first.
    Skip(SlotSkipArgs),
}

/// `slot skip`.
#[derive(Debug, Args)]
#[command(group = ArgGroup::new("target").required(true).args(["message_id", "lsn"]))]
pub struct SlotSkipArgs {
    /// The event's message_id (the `message_id` property, as `status` and the relay's
    /// log name it): its transaction, and every pending one before it, is skipped.
    /// Always a message id, even when it reads like an LSN.
    #[arg(value_name = "MESSAGE_ID")]
    pub message_id: Option<String>,
    /// Skip every pending transaction committed at or before this commit LSN X/Y (the
    /// `commit_lsn` header) instead of naming a message id.
    #[arg(long, value_name = "LSN")]
    pub lsn: Option<Lsn>,
    /// Skip without asking (for scripts); otherwise the events are listed and a
    /// terminal is asked to confirm.
    #[arg(long)]
    pub yes: bool,
}

/// `slot create`.
#[derive(Debug, Args)]
pub struct SlotCreateArgs {
    /// Succeed if the slot already exists.
    #[arg(long)]
    pub if_not_exists: bool,
    /// Create a failover slot synchronised to standbys (Postgres 17+).
    #[arg(long)]
    pub failover: bool,
}

/// `slot drop`.
#[derive(Debug, Args)]
pub struct SlotDropArgs {
    /// Succeed if the slot does not exist.
    #[arg(long)]
    pub if_exists: bool,
    /// Terminate the relay holding the slot, then drop it.
    #[arg(long)]
    pub force: bool,
}

/// `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also check the copy of the (failover) slot on this physical standby
    /// (Postgres 17+): libpq URL or key=value conninfo; repeat for several. Keep its
    /// password in PGPASSWORD or ~/.pgpass rather than on the command line.
    #[arg(long = "standby", value_name = "URL")]
    pub standbys: Vec<String>,
}

/// `peek`.
#[derive(Debug, Args)]
pub struct PeekArgs {
    /// Print at most N events.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PEEK_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: u32,
    /// Print a JSON array instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `replay`: exactly one of `--from-lsn` and `--from-table`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("source").required(true).args(["from_lsn", "from_table"])))]
pub struct ReplayArgs {
    /// Re-publish, from the replay window's anchor slot, events committed at or after LSN.
    #[arg(long, value_name = "LSN")]
    pub from_lsn: Option<Lsn>,
    /// Stop at this LSN [default: the live slot's position].
    #[arg(
        long,
        value_name = "LSN",
        requires = "from_lsn",
        conflicts_with = "from_table"
    )]
    pub to_lsn: Option<Lsn>,
    /// Re-publish rows still in the outbox table, in created_at/id order.
    #[arg(long)]
    pub from_table: bool,
    /// Only rows created at or after TIME (RFC 3339, UTC, e.g. 2024-05-01T12:00:00Z).
    #[arg(long, value_name = "TIME", requires = "from_table", conflicts_with = "from_lsn", value_parser = parse_time)]
    pub since: Option<SystemTime>,
    /// Only rows created before TIME (RFC 3339, UTC).
    #[arg(long, value_name = "TIME", requires = "from_table", conflicts_with = "from_lsn", value_parser = parse_time)]
    pub until: Option<SystemTime>,
    /// Only events whose FIELD is VALUE: aggregate_type, aggregate_id, event_type,
    /// table (schema.table) or message_id. Repeat it: the same field repeated
    /// matches any of its values, different fields must all match.
    #[arg(long = "where", value_name = "FIELD=VALUE", value_parser = parse_filter)]
    pub filters: Vec<Filter>,
    /// Publish to this exchange instead of [rabbitmq] exchange ("" is the default
    /// exchange, which routes by queue name: with --routing-key QUEUE the replay
    /// reaches that one queue). It must exist.
    #[arg(long, value_name = "NAME", conflicts_with = "stream")]
    pub exchange: Option<String>,
    /// Routing key template instead of [rabbitmq] routing_key (the same placeholders:
    /// {aggregate_type}, {aggregate_id}, {event_type}, {table}), or a queue's name.
    #[arg(long, value_name = "TEMPLATE", conflicts_with = "stream")]
    pub routing_key: Option<String>,
    /// Publish into this RabbitMQ stream (over [rabbitmq] stream_url) instead of the
    /// configured target. It must exist.
    #[arg(long, value_name = "NAME")]
    pub stream: Option<String>,
    /// Count what would be re-published, and publish nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// The fields `replay --where` filters on: the mapped columns of docs/design.md §5.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterField {
    AggregateType,
    AggregateId,
    EventType,
    Table,
    MessageId,
}

impl FilterField {
    /// Every field, by its name on the command line.
    pub const ALL: [(&'static str, FilterField); 5] = [
        ("aggregate_type", FilterField::AggregateType),
        ("aggregate_id", FilterField::AggregateId),
        ("event_type", FilterField::EventType),
        ("table", FilterField::Table),
        ("message_id", FilterField::MessageId),
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, f)| *f == self)
            .map_or("?", |(n, _)| n)
    }
}

/// One `--where FIELD=VALUE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub field: FilterField,
    pub value: String,
}

fn parse_filter(s: &str) -> Result<Filter, String> {
    let names: Vec<&str> = FilterField::ALL.iter().map(|(n, _)| *n).collect();
    let Some((name, value)) = s.split_once('=') else {
        return Err(format!(
            "write FIELD=VALUE, e.g. aggregate_type=order; FIELD is one of {}",
            names.join(", ")
        ));
    };
    let name = name.trim();
    let field = FilterField::ALL
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
        .ok_or_else(|| {
            format!(
                "{name:?} is not a field replay can filter on: use one of {}",
                names.join(", ")
            )
        })?;
    Ok(Filter {
        field,
        value: value.to_string(),
    })
}

/// Which events a replay re-publishes: every filter field given must match one of
/// its values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    filters: Vec<Filter>,
}

impl Selection {
    pub fn new(filters: &[Filter]) -> Selection {
        Selection {
            filters: filters.to_vec(),
        }
    }

    /// True when nothing is filtered.
    pub fn is_all(&self) -> bool {
        self.filters.is_empty()
    }

    /// The values given for `field` (empty: any).
    pub fn values(&self, field: FilterField) -> Vec<&str> {
        self.filters
            .iter()
            .filter(|f| f.field == field)
            .map(|f| f.value.as_str())
            .collect()
    }

    /// Whether an event with these field values is selected.
    pub fn matches(&self, value_of: impl Fn(FilterField) -> Option<String>) -> bool {
        FilterField::ALL.iter().all(|(_, field)| {
            let wanted = self.values(*field);
            wanted.is_empty() || value_of(*field).is_some_and(|v| wanted.iter().any(|w| *w == v))
        })
    }

    /// `aggregate_type=order, event_type=created` for messages.
    pub fn describe(&self) -> String {
        self.filters
            .iter()
            .map(|f| format!("{}={}", f.field.name(), f.value))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What `replay` re-publishes, once the arguments are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplaySource {
    /// `--from-lsn` [`--to-lsn`].
    Wal { from: Lsn, to: Option<Lsn> },
    /// `--from-table` [`--since`] [`--until`].
    Table {
        since: Option<SystemTime>,
        until: Option<SystemTime>,
    },
}

impl ReplayArgs {
    /// The replay source, with the checks clap cannot express (ranges in order).
    pub fn source(&self) -> Result<ReplaySource, CliError> {
        if let Some(from) = self.from_lsn {
            if let Some(to) = self.to_lsn {
                if to < from {
                    return Err(CliError::Usage(format!(
                        "--to-lsn {to} is before --from-lsn {from}: give an end position after the start"
                    )));
                }
            }
            return Ok(ReplaySource::Wal {
                from,
                to: self.to_lsn,
            });
        }
        if let (Some(since), Some(until)) = (self.since, self.until) {
            if until < since {
                return Err(CliError::Usage(
                    "--until is before --since: give an end time after the start time".into(),
                ));
            }
        }
        Ok(ReplaySource::Table {
            since: self.since,
            until: self.until,
        })
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}: give a duration, e.g. 24h or 7d"))
}

fn parse_time(s: &str) -> Result<SystemTime, String> {
    humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("{e}: use RFC 3339 in UTC, e.g. 2024-05-01T12:00:00Z"))
}

#[cfg(test)]
mod tests;
