//! `status [--json]`: the slot's state and what it costs the server.

use std::time::Duration;

use outbox_event::history::History;
use outbox_event::redact::{printable, printable_json};
use outbox_event::Lsn;
use serde_json::json;
use wal_reader::admin::{self, SlotState};

use crate::cli::StatusArgs;
use crate::config::Config;
use crate::error::CliError;
use crate::pipeline::start::{self, Source, StartPlan};
use crate::state::Stored;

mod health;

pub(crate) use health::human_bytes;
pub use health::warnings;
use health::{anchor_warning, human_secs};

/// `println!` of one line of the text form, escaped: slot, database and stuck-message
/// fields come from the database and the broker (docs/security.md).
macro_rules! say {
    ($($arg:tt)*) => {
        println!("{}", printable(&format!($($arg)*)))
    };
}

/// What `status` found, gathered before it prints.
struct Report {
    slot: SlotState,
    /// WAL not yet confirmed: the server's position minus the slot's.
    pending: Option<i64>,
    anchor: Option<SlotState>,
    window: Option<Duration>,
    /// The state table's row, or why it cannot be read.
    stored: Result<Option<Stored>, String>,
    history: Option<History>,
    /// The next session starts from the stored position.
    used: bool,
    /// A stored position is ignored (a warning says why).
    ignored: bool,
    resumes_at: Option<Lsn>,
    producer: Option<String>,
    poison: Option<serde_json::Value>,
    /// The running relay's ignored logical messages by reason, when messages are
    /// relayed and it could be asked.
    messages_ignored: Option<Vec<(String, u64)>>,
    standbys: Vec<super::standby::Standby>,
    warnings: Vec<String>,
}

/// Prints the slot's state.
pub async fn status(cfg: &Config, args: &StatusArgs) -> Result<(), CliError> {
    let report = gather(cfg, args).await?;
    if args.json {
        println!(
            "{}",
            printable_json(&serde_json::to_string_pretty(&report.to_json()).unwrap_or_default())
        );
    } else {
        report.print();
    }
    Ok(())
}

/// Reads the slot, its anchor, the stored position, the server's history, the
/// running relay's stuck message and the standbys, and collects the warnings.
async fn gather(cfg: &Config, args: &StatusArgs) -> Result<Report, CliError> {
    let client = crate::sql::connect_for_command(cfg).await?;
    let s = admin::require_slot(&client, &cfg.postgres.slot).await?;
    let pending = s
        .confirmed_flush_lsn
        .map(|c| s.current_wal_lsn.0.saturating_sub(c.0) as i64);
    let mut warns = warnings(&s);
    let anchor_name = crate::anchor::anchor_slot_name(&cfg.postgres.slot);
    let anchor = admin::slot_state(&client, &anchor_name).await?;
    let window = cfg.replay_window();
    warns.extend(anchor_warning(&anchor_name, anchor.as_ref(), window));
    // The stored acked position beside the slot's (docs/design.md §3).
    let stored = match crate::state::read(&client, &cfg.postgres.slot).await {
        Ok(row) => Ok(row),
        Err(e) => {
            warns.push(format!(
                "the acked position is not kept in {} ({e}): {}",
                crate::state::TABLE,
                crate::state::COST
            ));
            Err(e.to_string())
        }
    };
    // Where the next session starts: the session's own decision (docs/design.md §3),
    // with the server's WAL history when the role may read it.
    let history = match wal_reader::identify_server(&cfg.pg_options()?).await {
        Ok((h, _)) => Some(h),
        Err(e) => {
            warns.push(format!(
                "cannot read the server's WAL history over a replication connection ({e}): the stored position is shown without the history check"
            ));
            None
        }
    };
    let plan = next_start(&s, &stored, history.as_ref());
    let ignored = plan.as_ref().is_some_and(|p| !p.fallbacks.is_empty());
    let used = plan.as_ref().is_some_and(|p| p.source == Source::Stored);
    for fallback in plan.iter().flat_map(|p| &p.fallbacks) {
        warns.push(format!(
            "{fallback}: the next session resumes from the slot's position"
        ));
    }
    let resumes_at = match &plan {
        Some(p) => Some(p.start),
        None => s.confirmed_flush_lsn,
    };
    let producer = stream_producer(cfg, &s, history.as_ref());
    let poison = match (s.active, cfg.metrics_endpoint()) {
        (true, Some(ep)) => match fetch_poison(&ep).await {
            Ok(poison) => poison,
            Err(why) => {
                warns.push(format!(
                    "could not ask the running relay for a stuck message at {} ({why}): a message RabbitMQ refuses would not show here, its log and the alert OutboxRelayPoisonMessage would",
                    ep.addr
                ));
                None
            }
        },
        _ => None,
    };
    let messages_ignored = match (s.active, cfg.metrics_endpoint()) {
        (true, Some(ep)) if !cfg.postgres.messages.is_empty() => {
            match crate::endpoint::client::get(
                &crate::endpoint::client::Target::of(&ep),
                "/metrics",
            )
            .await
            {
                Ok(body) => Some(ignored_messages(&body)),
                Err(why) => {
                    warns.push(format!(
                        "could not ask the running relay how many logical messages it ignored ({why}): see {} on its /metrics",
                        wal_reader::messages::MESSAGES_IGNORED
                    ));
                    None
                }
            }
        }
        _ => None,
    };
    if let Some(p) = &poison {
        warns.push(format!(
            "RabbitMQ refuses message {} and the relay holds the slot before it: fix the cause (see docs/recovery.md, \"A message RabbitMQ refuses\") or set [rabbitmq] dead_letter_exchange",
            p["message_id"].as_str().unwrap_or("?")
        ));
    }
    let standbys = super::standby::check_all(&args.standbys, &s).await;
    warns.extend(super::standby::warnings(&standbys, &s));
    // The failover configuration, on the primary (always: a stale
    // synchronized_standby_slots stalls decoding) and on each standby read.
    let primary = super::standby::setup::read_primary(&client).await;
    let setups: Vec<(&str, &super::standby::setup::StandbySetup)> = standbys
        .iter()
        .filter_map(|sb| Some((sb.target.as_str(), sb.setup.as_ref()?)))
        .collect();
    warns.extend(super::standby::setup::warnings(
        &s.slot_name,
        s.failover,
        primary.as_ref(),
        &setups,
    ));
    Ok(Report {
        slot: s,
        pending,
        anchor,
        window,
        stored,
        history,
        used,
        ignored,
        resumes_at,
        producer,
        poison,
        messages_ignored,
        standbys,
        warnings: warns,
    })
}

/// The session's own start decision for what `status` found; `None` when the state
/// table cannot be read.
fn next_start(
    s: &SlotState,
    stored: &Result<Option<Stored>, String>,
    history: Option<&History>,
) -> Option<StartPlan> {
    let row = stored.as_ref().ok()?;
    Some(start::plan(&start::Found {
        explicit: None,
        slot_confirmed: s.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
        slot_restart: s.restart_lsn,
        server_wal: s.current_wal_lsn,
        history,
        carried: None,
        stored: row.as_ref(),
        table: true,
    }))
}

/// The stream target's producer reference at the server's current position (with
/// the history; `None` for the queue target).
fn stream_producer(cfg: &Config, s: &SlotState, history: Option<&History>) -> Option<String> {
    cfg.stream().and(history).map(|h| {
        let database = s.database.clone().unwrap_or_default();
        let source = crate::pipeline::sink::stream_source_of(
            cfg.producer_name(),
            &cfg.postgres.slot,
            &database,
            h,
            s.current_wal_lsn,
        );
        source.reference_of(source.key(s.current_wal_lsn))
    })
}

fn lsn_text(l: Option<Lsn>) -> Option<String> {
    l.map(|l| l.to_string())
}

fn window_text(window: Option<Duration>) -> Option<String> {
    window.map(|w| humantime::format_duration(w).to_string())
}

impl Report {
    /// The `--json` form.
    fn to_json(&self) -> serde_json::Value {
        let (s, anchor) = (&self.slot, &self.anchor);
        let anchor_json = anchor.as_ref().map(|a| {
            json!({
                "slot": a.slot_name,
                "active": a.active,
                "wal_status": a.wal_status,
                "confirmed_flush_lsn": lsn_text(a.confirmed_flush_lsn),
                "restart_lsn": lsn_text(a.restart_lsn),
                "retained_wal_bytes": a.retained_wal_bytes,
            })
        });
        let replay_window = json!({
            "configured": window_text(self.window),
            "start_lsn": lsn_text(anchor.as_ref().and_then(|a| a.confirmed_flush_lsn)),
            "end_lsn": lsn_text(s.confirmed_flush_lsn),
            "retained_wal_bytes": anchor.as_ref().and_then(|a| a.retained_wal_bytes),
            "anchor": anchor_json,
        });
        json!({
            "slot": s.slot_name,
            "plugin": s.plugin,
            "database": s.database,
            "active": s.active,
            "active_pid": s.active_pid,
            "wal_status": s.wal_status,
            "safe_wal_size": s.safe_wal_size,
            "invalidation_reason": s.invalidation_reason,
            "idle_timeout_left_secs": s.idle_timeout_left_secs,
            "confirmed_flush_lsn": lsn_text(s.confirmed_flush_lsn),
            "restart_lsn": lsn_text(s.restart_lsn),
            "current_wal_lsn": s.current_wal_lsn.to_string(),
            "retained_wal_bytes": s.retained_wal_bytes,
            "pending_wal_bytes": self.pending,
            "two_phase": s.two_phase,
            "failover": s.failover,
            "stored_position": self.stored_json(),
            "resumes_at_lsn": lsn_text(self.resumes_at),
            "system_identifier": self.history.as_ref().map(|h| h.system_id.to_string()),
            "timeline": self.history.as_ref().map(|h| h.timeline),
            "stream_producer": self.producer,
            "replay_window": replay_window,
            "stuck_message": self.poison,
            "messages_ignored": self.messages_ignored.as_ref().map(|m| {
                m.iter().map(|(reason, n)| (reason.clone(), json!(n))).collect::<serde_json::Map<_, _>>()
            }),
            "standbys": self.standbys.iter().map(super::standby::to_json).collect::<Vec<_>>(),
            "warnings": self.warnings,
        })
    }

    fn stored_json(&self) -> serde_json::Value {
        match &self.stored {
            Ok(Some(row)) => json!({
                "acked_lsn": row.acked.to_string(),
                "updated_at": row.updated_at,
                "slot_restart_lsn_at_create": lsn_text(row.slot_restart_lsn),
                "used": self.used,
                "system_identifier": row.origin.map(|o| o.system_id.to_string()),
                "timeline": row.origin.map(|o| o.timeline),
            }),
            Ok(None) => serde_json::Value::Null,
            Err(e) => json!({ "error": e }),
        }
    }

    /// The text form.
    fn print(&self) {
        let s = &self.slot;
        say!("slot:                {}", s.slot_name);
        say!("database:            {}", opt(s.database.clone()));
        say!(
            "active:              {}",
            match s.active_pid {
                Some(pid) if s.active => format!("yes (pid {pid})"),
                _ => "no".into(),
            }
        );
        say!("wal_status:          {}", opt(s.wal_status.clone()));
        if let Some(reason) = &s.invalidation_reason {
            say!("invalidation_reason: {reason}");
        }
        if let Some(left) = s.idle_timeout_left_secs {
            say!("idle_timeout_left:   {}", human_secs(left.max(0)));
        }
        say!(
            "safe_wal_size:       {}",
            s.safe_wal_size
                .map(human_bytes)
                .unwrap_or_else(|| "unlimited (max_slot_wal_keep_size = -1)".into())
        );
        say!(
            "confirmed_flush_lsn: {}",
            opt(lsn_text(s.confirmed_flush_lsn))
        );
        say!("restart_lsn:         {}", opt(lsn_text(s.restart_lsn)));
        say!("stored_acked_lsn:    {}", self.stored_text());
        say!("resumes_at:          {}", opt(lsn_text(self.resumes_at)));
        say!("current_wal_lsn:     {}", s.current_wal_lsn);
        if let Some(h) = &self.history {
            say!("system / timeline:   {} / {}", h.system_id, h.timeline);
        }
        if let Some(p) = &self.producer {
            say!("stream_producer:     {p}");
        }
        say!(
            "retained_wal:        {}",
            opt(s.retained_wal_bytes.map(human_bytes))
        );
        say!(
            "pending_wal:         {}",
            opt(self.pending.map(human_bytes))
        );
        self.print_window();
        if let Some(p) = &self.poison {
            let field = |k: &str| {
                p[k].as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| p[k].to_string())
            };
            say!(
                "stuck_message:       {} (commit_lsn {}, tx_index {}, routing key {}): {}",
                field("message_id"),
                field("commit_lsn"),
                field("tx_index"),
                field("routing_key"),
                field("reason")
            );
        }
        if let Some(ignored) = &self.messages_ignored {
            let text = if ignored.is_empty() {
                "none".to_string()
            } else {
                ignored
                    .iter()
                    .map(|(reason, n)| format!("{n} {reason}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            say!("messages_ignored:    {text} (since the relay started)");
        }
        for sb in &self.standbys {
            say!("standby:             {}", super::standby::describe(sb));
        }
        for w in &self.warnings {
            say!("warning: {w}");
        }
    }

    fn stored_text(&self) -> String {
        match &self.stored {
            Ok(Some(row)) => format!(
                "{} (updated {}){}",
                row.acked,
                row.updated_at,
                if self.ignored {
                    ", ignored (see the warning)"
                } else if self.used {
                    ", ahead of the slot: the next session starts there"
                } else {
                    ""
                }
            ),
            Ok(None) => format!("- (no row in {})", crate::state::TABLE),
            Err(e) => format!("- ({e})"),
        }
    }

    fn print_window(&self) {
        let Some(a) = &self.anchor else {
            say!(
                "replay_window:       {}",
                if self.window.is_some() {
                    "configured, but no anchor slot yet"
                } else {
                    "none"
                }
            );
            return;
        };
        say!(
            "replay_window:       {} .. {} ({})",
            opt(lsn_text(a.confirmed_flush_lsn)),
            opt(lsn_text(self.slot.confirmed_flush_lsn)),
            window_text(self.window).unwrap_or_else(|| "not configured".into())
        );
        say!(
            "anchor_slot:         {} (wal_status {}, restart_lsn {})",
            a.slot_name,
            opt(a.wal_status.clone()),
            opt(lsn_text(a.restart_lsn))
        );
        say!(
            "anchor_retained_wal: {}",
            opt(a.retained_wal_bytes.map(human_bytes))
        );
    }
}

fn opt(v: Option<String>) -> String {
    v.unwrap_or_else(|| "-".into())
}

/// Asks the running relay (its `/poison` endpoint on `[relay] metrics_listen`, with
/// the endpoint's credentials and TLS, or its control token on this host:
/// crate::endpoint::client) which message RabbitMQ refuses, if any; why it could not
/// be asked otherwise.
async fn fetch_poison(
    ep: &crate::endpoint::EndpointConfig,
) -> Result<Option<serde_json::Value>, String> {
    let target = crate::endpoint::client::Target::of(ep);
    let body = crate::endpoint::client::get(&target, "/poison").await?;
    let value: serde_json::Value = serde_json::from_str(body.trim())
        .map_err(|_| "the endpoint's /poison answer is not JSON".to_string())?;
    Ok((!value.is_null()).then_some(value))
}

/// The ignored logical messages by reason, read off a Prometheus text scrape
/// (`outbox_relay_messages_ignored_total{reason="…"} N`); reasons without any are left out.
fn ignored_messages(scrape: &str) -> Vec<(String, u64)> {
    let name = wal_reader::messages::MESSAGES_IGNORED;
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix("{"))
        .filter_map(|rest| {
            let (labels, value) = rest.split_once('}')?;
            let reason = labels
                .split(',')
                .find_map(|kv| kv.trim().strip_prefix("reason=\""))?
                .trim_end_matches('"');
            let n = value.trim().parse::<f64>().ok()? as u64;
            (n > 0).then(|| (reason.to_string(), n))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A healthy slot, for tests.
    pub(crate) fn state() -> SlotState {
        SlotState {
            slot_name: "s".into(),
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            database: Some("d".into()),
            active: true,
            active_pid: Some(7),
            confirmed_flush_lsn: Some(Lsn(100)),
            restart_lsn: Some(Lsn(50)),
            wal_status: Some("reserved".into()),
            safe_wal_size: None,
            retained_wal_bytes: Some(10),
            two_phase: false,
            failover: false,
            current_wal_lsn: Lsn(200),
            invalidation_reason: None,
            idle_timeout_left_secs: None,
        }
    }

    #[test]
    fn ignored_messages_are_read_off_a_scrape() {
        let scrape = "# TYPE outbox_relay_messages_ignored_total counter\n\
            outbox_relay_messages_ignored_total{reason=\"non_transactional\"} 3\n\
            outbox_relay_messages_ignored_total{reason=\"other_prefix\"} 0\n\
            outbox_relay_messages_ignored_totally 9\n";
        assert_eq!(
            ignored_messages(scrape),
            [("non_transactional".to_string(), 3)]
        );
    }
}
