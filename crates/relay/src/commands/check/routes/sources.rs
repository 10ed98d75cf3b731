//! The event shapes `check --routes` looks at: the slot's pending events (as `peek`
//! reads them, logical messages included) and each outbox table's recent rows.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use publisher::message::RoutingKeyTemplate;
use wal_reader::admin::{self, ident};

use super::{exchange_of, render, Fields, Shape};
use crate::config::Config;
use crate::error::CliError;

/// Pending events read from the slot at most (its oldest first).
const MAX_PENDING: usize = 50_000;
/// Distinct rows read per table at most.
const MAX_ROWS: i64 = 100_000;

/// How often a shape was seen, by source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    pub pending: u64,
    /// Distinct rows (by the fields the templates use) of the table's recent rows.
    pub rows: u64,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.pending, self.rows) {
            (p, 0) => write!(f, "pending {p}"),
            (0, _) => write!(f, "rows"),
            (p, _) => write!(f, "pending {p}, rows"),
        }
    }
}

fn text(v: Option<&Bytes>) -> Option<String> {
    v.map(|b| String::from_utf8_lossy(b).into_owned())
}

/// A table row's shape: its exchange and routing key as the publisher renders them.
fn shape_of(cfg: &Config, column: Option<&str>, f: &Fields) -> Shape {
    Shape {
        table: f.table.clone(),
        aggregate_type: f.aggregate_type.clone(),
        event_type: f.event_type.clone(),
        exchange: exchange_of(cfg, column, f),
        routing_key: render(&cfg.rabbitmq.routing_key, f),
    }
}

/// Every distinct shape, with what `say` prints about the sources (one `ok` or
/// `warn` line each).
pub async fn collect(
    cfg: &Config,
    since: Duration,
    say: &mut impl FnMut(&str),
) -> Result<BTreeMap<super::Shape, Seen>, CliError> {
    // The templates are checked at load; parsed here for what peek needs.
    let routing = RoutingKeyTemplate::parse(&cfg.rabbitmq.routing_key)
        .map_err(publisher::PublishError::from)?;
    let client = crate::sql::connect_for_command(cfg).await?;
    let mut seen: BTreeMap<Shape, Seen> = BTreeMap::new();

    read_pending(cfg, &client, &routing, say, &mut seen).await?;

    // The id only matters when a template uses it: else one row per shape.
    let uses_id = cfg.rabbitmq.routing_key.contains("{aggregate_id}")
        || cfg.rabbitmq.exchange.contains("{aggregate_id}");
    let mapping = cfg.mapping();
    for table in cfg.tables() {
        let name = table.qualified();
        let cols = match admin::check_columns(&client, &table, &mapping).await {
            Ok(cols) => cols,
            Err(e) => {
                say(&format!("warn  table {name}: {e}; its rows are not read"));
                continue;
            }
        };
        let has_created_at = client
            .query_opt(
                "SELECT 1 FROM pg_catalog.pg_attribute \
                  WHERE attrelid = $1 AND attname = 'created_at' AND NOT attisdropped",
                &[&cols.table_oid],
            )
            .await
            .map_err(|e| CliError::Runtime(format!("Postgres: {e}")))?
            .is_some();
        if !has_created_at {
            say(&format!(
                "warn  table {name}: no created_at column, so its recent rows cannot be told apart: only pending events are read"
            ));
            continue;
        }
        let q = |c: &str| ident::quote_ident(c);
        let id = if uses_id {
            format!("{}::text", q(&cols.aggregate_id.name))
        } else {
            "NULL::text".into()
        };
        let exchange = match &cols.exchange {
            Some(c) => format!("{}::text", q(&c.name)),
            None => "NULL::text".into(),
        };
        let sql = format!(
            "SELECT DISTINCT {}::text, {}::text, {id}, {exchange} FROM {} \
              WHERE created_at >= pg_catalog.now() - $1::text::interval LIMIT {MAX_ROWS}",
            q(&cols.aggregate_type.name),
            q(&cols.event_type.name),
            ident::quote_table(&cols.table),
        );
        let interval = format!("{} seconds", since.as_secs());
        let rows = client
            .query(&sql, &[&interval])
            .await
            .map_err(|e| CliError::Runtime(format!("cannot read table {name}: {e}")))?;
        say(&format!(
            "ok    table {name}: {} distinct rows created in the last {}",
            rows.len(),
            super::span(since)
        ));
        for r in rows {
            let f = Fields {
                table: name.clone(),
                aggregate_type: r.get(0),
                event_type: r.get(1),
                aggregate_id: r.get(2),
            };
            let column: Option<String> = r.get(3);
            seen.entry(shape_of(cfg, column.as_deref(), &f))
                .or_default()
                .rows += 1;
        }
    }
    Ok(seen)
}

/// The slot's pending events, peeked (not consumed), with the exchange and routing
/// key the publisher gave each; skipped, with a `warn`, while a relay streams from
/// the slot or when it does not exist.
async fn read_pending(
    cfg: &Config,
    client: &tokio_postgres::Client,
    routing: &RoutingKeyTemplate,
    say: &mut impl FnMut(&str),
    seen: &mut BTreeMap<Shape, Seen>,
) -> Result<(), CliError> {
    let slot = &cfg.postgres.slot;
    match admin::require_slot(client, slot).await {
        Err(e) => say(&format!(
            "warn  slot {slot}: {e}; only the tables' recent rows are read"
        )),
        Ok(state) => match state.holder() {
            Some(pid) => say(&format!(
                "warn  slot {slot}: in use by pid {pid}, and a slot a relay streams from cannot be peeked: only the tables' recent rows are read"
            )),
            None => {
                let first = (MAX_PENDING as i64).saturating_mul(2);
                let pending = crate::commands::peek::read_pending_until(
                    client,
                    cfg,
                    first,
                    MAX_PENDING,
                    routing,
                    |_| false,
                )
                .await?;
                say(&format!(
                    "ok    slot {slot}: {} pending events read{}",
                    pending.len(),
                    if pending.len() == MAX_PENDING {
                        " (the first ones only)"
                    } else {
                        ""
                    }
                ));
                // The publisher's own exchange and routing key of each.
                for p in &pending {
                    let e = &p.event;
                    let shape = Shape {
                        table: e.table.qualified_name.clone(),
                        aggregate_type: text(e.aggregate_type.as_ref()),
                        event_type: text(e.event_type.as_ref()),
                        exchange: p
                            .exchange
                            .clone()
                            .unwrap_or_else(|| cfg.rabbitmq.exchange.clone()),
                        routing_key: p.routing_key.clone(),
                    };
                    seen.entry(shape).or_default().pending += 1;
                }
            }
        },
    }
    Ok(())
}
