//! `check` when `[rabbitmq] exchange` is a template (`"events.{aggregate_type}"`,
//! docs/routing.md): there is no one exchange to look up, the exchange is chosen per
//! event. `check` renders the template for the slot's pending events (peeked, not
//! consumed, as `peek` reads them) and the outbox tables' recent rows (as `check
//! --routes` reads them), and looks each name up without creating anything.
//!
//! ```text
//!   ok    exchange events.{aggregate_type}: a template: the exchange is chosen per event; …
//!   ok    exchange events.order: exists (from pending 2, rows)
//!   FAIL  exchange events.invoice: missing, and run will not declare it (declare_exchange = false): …
//! ```

use std::collections::BTreeMap;

use publisher::probe::{self, Presence};

use super::routes::{self, Seen};
use super::{line, Status};
use crate::config::Config;
use crate::error::CliError;

/// One line for the template, then one per name it rendered. Fails (exit 2) when a
/// name is missing and `run` will not declare it; a source that cannot be read is a
/// `warn` line (its own failure is on the Postgres lines).
pub async fn lines(cfg: &Config) -> Result<(), CliError> {
    let template = &cfg.rabbitmq.exchange;
    let declares = cfg.rabbitmq.declare_exchange;
    let head = format!("exchange {template}");
    let how = if declares {
        "a template: the exchange is chosen per event, and run declares each one before the first event published to it (declare_exchange = true)"
    } else {
        "a template: the exchange is chosen per event, and run looks each one up before the first event published to it (declare_exchange = false): an event whose exchange is missing is poison"
    };
    let mut warnings = Vec::new();
    let since = routes::DEFAULT_SINCE;
    let shapes = routes::sources::collect(cfg, since, &mut |text: &str| {
        // The sources' `ok` lines are summed up below; their warnings are kept.
        if let Some(warning) = text.strip_prefix("warn") {
            warnings.push(warning.trim_start().to_string());
        }
    })
    .await;
    let shapes = match shapes {
        Ok(shapes) => shapes,
        Err(e) => {
            line(
                Status::Warn,
                &head,
                &format!("{how}; the names it renders cannot be listed: {e}"),
            );
            return Ok(());
        }
    };
    let mut names: BTreeMap<String, Seen> = BTreeMap::new();
    for (shape, seen) in shapes {
        let sum = names.entry(shape.exchange).or_default();
        sum.pending += seen.pending;
        sum.rows += seen.rows;
    }
    let pending: u64 = names.values().map(|s| s.pending).sum();
    let rows: u64 = names.values().map(|s| s.rows).sum();
    let span = routes::span(since);
    let rendered = if names.is_empty() {
        format!("no pending event and no row of the last {span} to render it for")
    } else {
        format!(
            "{} names rendered from {pending} pending events and {rows} distinct rows of the last {span}",
            names.len()
        )
    };
    line(Status::Ok, &head, &format!("{how}; {rendered}"));
    for warning in &warnings {
        let (name, detail) = warning.split_once(": ").unwrap_or(("sources", warning));
        line(Status::Warn, name, detail);
    }
    if names.is_empty() {
        return Ok(());
    }
    look_up(cfg, names).await
}

/// One line per rendered name: in `[topology]`, exists, or missing (and whether `run`
/// declares it).
async fn look_up(cfg: &Config, names: BTreeMap<String, Seen>) -> Result<(), CliError> {
    let declares = cfg.rabbitmq.declare_exchange;
    let mut probed = Vec::new();
    for (name, seen) in &names {
        let label = format!("exchange {name}");
        if name.is_empty() {
            line(
                Status::Warn,
                "exchange \"\"",
                &format!("the template renders an empty name (from {seen}): such an event is refused as poison rather than sent to the default exchange (docs/routing.md)"),
            );
        } else if cfg.topology.exchange(name).is_some() {
            line(
                Status::Ok,
                &label,
                &format!("in [topology], compared on its own line (from {seen})"),
            );
        } else {
            probed.push(name.clone());
        }
    }
    if probed.is_empty() {
        return Ok(());
    }
    let found = match probe::probe_exchange_names(&cfg.publisher_config(), &probed).await {
        Ok(found) => found,
        Err(e) => {
            line(Status::Fail, "rabbitmq", &e.to_string());
            return Err(e.into());
        }
    };
    let mut missing = Vec::new();
    for (name, presence) in found {
        let seen = names.get(&name).copied().unwrap_or_default();
        let label = format!("exchange {name}");
        match presence {
            Presence::Exists => line(Status::Ok, &label, &format!("exists (from {seen})")),
            Presence::Missing if declares => line(
                Status::Ok,
                &label,
                &format!("missing, run will declare it before the first event published to it (declare_exchange = true) (from {seen})"),
            ),
            Presence::Missing => {
                line(
                    Status::Fail,
                    &label,
                    &format!(
                        "missing, and run will not declare it (declare_exchange = false), so its events are poison (from {seen}): declare it ({} exchange, durable) or set declare_exchange = true",
                        cfg.rabbitmq.exchange_type.as_str()
                    ),
                );
                missing.push(name);
            }
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CliError::Precondition(format!(
            "exchanges {} do not exist and declare_exchange = false: declare them, or set [rabbitmq] declare_exchange = true",
            missing.join(", ")
        )))
    }
}
