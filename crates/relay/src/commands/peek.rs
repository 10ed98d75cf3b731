//! `peek [--limit N] [--json]`: the pending outbox events (what the next `run` would
//! publish), read without consuming them.
//!
//! ```text
//!   pg_logical_slot_peek_binary_changes(slot, NULL, n, proto_version 1, publication)
//!        │ one pgoutput message per row (whole transactions, from confirmed_flush_lsn)
//!        ▼
//!   assemble::Assembler (the decoder `run` uses) ─► committed events ─► first N printed
//! ```
//!
//! The SQL function decodes whole transactions and stops once it has returned at
//! least `n` rows, so `peek` asks for a generous multiple of N rows and, when that
//! was not enough (transactions with few outbox rows among many changes), reads again
//! from the start with twice as many, up to [`MAX_CHANGES`]. Postgres refuses to
//! decode a slot that a walsender streams from, so `peek` refuses an active slot
//! up front (exit 2, like every other "the environment is not ready" failure).

use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use outbox_event::redact::{printable, printable_json};
use outbox_event::{Lsn, OutboxEvent, WalItem};
use publisher::message::cloudevents::{self, CloudEvents};
use publisher::message::{ExchangeRule, MessageFormat, RoutingKeyTemplate};
use serde_json::json;
use tokio_postgres::error::SqlState;
use wal_reader::admin::{self, ident::quote_ident};
use wal_reader::assemble::Assembler;
use wal_reader::MessageSource;

use crate::cli::PeekArgs;
use crate::config::Config;
use crate::error::CliError;

/// Changes asked for per event wanted, on the first read.
const CHANGES_PER_EVENT: i64 = 4;
/// Extra changes asked for on the first read (Begin/Commit/Relation messages).
const CHANGES_EXTRA: i64 = 64;
/// Upper bound on the changes one `peek` decodes: past it, fewer than N events are
/// printed rather than decoding a huge backlog of unrelated changes.
pub const MAX_CHANGES: i64 = 1_000_000;
/// Payload characters shown per line in text output.
const TEXT_PAYLOAD_CHARS: usize = 200;

/// One pending event, with its transaction's positions.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) event: OutboxEvent,
    /// The end of its transaction's commit record.
    pub(crate) end_lsn: Lsn,
    pub(crate) routing_key: String,
    /// Its exchange when it is named per event (docs/routing.md); `None`: the
    /// configured `[rabbitmq] exchange`.
    pub(crate) exchange: Option<String>,
}

/// Prints up to `--limit` pending events, oldest first.
pub async fn peek(cfg: &Config, args: &PeekArgs) -> Result<(), CliError> {
    let routing = RoutingKeyTemplate::parse(&cfg.rabbitmq.routing_key)
        .map_err(publisher::PublishError::from)?;
    let client = crate::sql::connect_for_command(cfg).await?;
    let slot = admin::require_slot(&client, &cfg.postgres.slot).await?;
    if let Some(pid) = slot.holder() {
        return Err(slot_active(&cfg.postgres.slot, &pid.to_string()));
    }
    let limit = usize::try_from(args.limit).unwrap_or(usize::MAX);
    let events = read_pending(&client, cfg, limit, &routing).await?;
    if args.json {
        let mut ce = match cfg.message_format() {
            MessageFormat::CloudEvents(f) => Some(CloudEvents::new(f)),
            MessageFormat::Native => None,
        };
        let list: Vec<serde_json::Value> = events
            .iter()
            .map(|p| with_cloudevents(for_target(to_json(p), cfg.stream()), p, ce.as_mut()))
            .collect();
        let text = serde_json::to_string_pretty(&list).unwrap_or_else(|_| "[]".into());
        println!("{}", printable_json(&text));
    } else if events.is_empty() {
        println!("no pending events");
    } else {
        for p in &events {
            println!("{}", line_for_target(to_line(p), p, cfg.stream()));
        }
    }
    Ok(())
}

pub(crate) fn slot_active(slot: &str, pid: &str) -> CliError {
    CliError::Precondition(format!(
        "replication slot \"{slot}\" is in use by pid {pid}, and `peek` cannot read a slot a relay is streaming from: stop that relay first, or use `outbox-relay status` to see the slot's position"
    ))
}

/// Decodes the slot's pending changes until `limit` committed events are found or
/// the slot has nothing more.
async fn read_pending(
    client: &tokio_postgres::Client,
    cfg: &Config,
    limit: usize,
    routing: &RoutingKeyTemplate,
) -> Result<Vec<Pending>, CliError> {
    let first = (limit as i64)
        .saturating_mul(CHANGES_PER_EVENT)
        .saturating_add(CHANGES_EXTRA);
    read_pending_until(client, cfg, first, limit, routing, |_| false).await
}

/// The slot's pending changes, without consuming them (pgoutput protocol 1); the
/// call's closing parenthesis follows its options.
const PEEK_SQL: &str =
    "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1::name, NULL::pg_lsn, \
     $2::integer, 'proto_version'::text, '1'::text, 'publication_names'::text, $3::text";

/// [`read_pending`] that reads `first` changes first, and also stops as soon as
/// `enough` says the events read so far suffice (`slot skip` looking for one
/// message id).
pub(crate) async fn read_pending_until(
    client: &tokio_postgres::Client,
    cfg: &Config,
    first: i64,
    limit: usize,
    routing: &RoutingKeyTemplate,
    enough: impl Fn(&[Pending]) -> bool,
) -> Result<Vec<Pending>, CliError> {
    // Logical messages too when some are relayed (docs/messages.md), with the ids the
    // relay gives them: derived from the server's system identifier.
    let (sql, source) = if cfg.postgres.messages.is_empty() {
        (format!("{PEEK_SQL})"), None)
    } else {
        let (history, _) = wal_reader::identify_server(&cfg.pg_options()?).await?;
        let database: String = client
            .query_one("SELECT pg_catalog.current_database()::text", &[])
            .await
            .map_err(|e| CliError::Runtime(format!("Postgres: {e}")))?
            .get(0);
        (
            format!("{PEEK_SQL}, 'messages'::text, 'true'::text)"),
            MessageSource::for_config(&cfg.postgres.messages, history.system_id, &database),
        )
    };
    let sql = sql.as_str();
    let publication = quote_ident(&cfg.postgres.publication);
    let exchanges = ExchangeRule::new(&cfg.rabbitmq.exchange, true)?;
    let mut changes = first.min(MAX_CHANGES);
    loop {
        let rows = client
            .query(sql, &[&cfg.postgres.slot, &(changes as i32), &publication])
            .await
            .map_err(|e| peek_error(e, &cfg.postgres.slot))?;
        let read = rows.len() as i64;
        let mut assembler =
            Assembler::new(cfg.tables(), cfg.mapping()).with_messages(source.clone());
        let mut items = Vec::new();
        for row in rows {
            let data: Vec<u8> = row
                .try_get(0)
                .map_err(|e| CliError::Runtime(format!("Postgres: {e}")))?;
            assembler
                .handle(Bytes::from(data), &mut items)
                .map_err(|e| {
                    if e.is_precondition() {
                        CliError::from(e)
                    } else {
                        CliError::Runtime(format!("cannot decode the slot's changes: {e}"))
                    }
                })?;
        }
        let events = committed(items, limit, routing, &exchanges);
        // Fewer rows than asked for: the slot has nothing more.
        if events.len() >= limit || read < changes || changes >= MAX_CHANGES || enough(&events) {
            return Ok(events);
        }
        changes = changes.saturating_mul(2).min(MAX_CHANGES);
    }
}

/// The first `limit` events of committed transactions (an event is kept only once
/// its transaction's Commit was decoded).
fn committed(
    items: Vec<WalItem>,
    limit: usize,
    routing: &RoutingKeyTemplate,
    exchanges: &ExchangeRule,
) -> Vec<Pending> {
    let mut out = Vec::new();
    let mut open: Vec<OutboxEvent> = Vec::new();
    for item in items {
        match item {
            WalItem::Event(e) => open.push(e),
            WalItem::Commit(c) => {
                for event in open.drain(..) {
                    if out.len() == limit {
                        return out;
                    }
                    out.push(Pending {
                        routing_key: routing.render(&event),
                        exchange: exchanges.of(&event),
                        event,
                        end_lsn: c.end_lsn,
                    });
                }
            }
            WalItem::Keepalive(_) => {}
        }
    }
    out
}

/// The server refusing to decode: an active slot (raced with a relay starting) is
/// the precondition error of [`slot_active`]; anything else a runtime failure.
fn peek_error(e: tokio_postgres::Error, slot: &str) -> CliError {
    if e.code() == Some(&SqlState::OBJECT_IN_USE) {
        let pid = e
            .as_db_error()
            .and_then(|d| d.message().rsplit(' ').next().map(str::to_string))
            .unwrap_or_else(|| "?".into());
        return slot_active(slot, &pid);
    }
    let text = e
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_else(|| e.to_string());
    CliError::Runtime(format!(
        "cannot peek at replication slot \"{slot}\" ({text}): check that the relay's role has the REPLICATION attribute and that Postgres is up"
    ))
}

fn text(v: Option<&Bytes>) -> Option<String> {
    v.map(|b| String::from_utf8_lossy(b).into_owned())
}

fn commit_time(micros: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_micros(micros.max(0) as u64);
    humantime::format_rfc3339_micros(t).to_string()
}

/// With `rabbitmq.stream` set, the event goes to that stream rather than by a routing
/// key: the line names the stream instead.
pub(crate) fn line_for_target(line: String, p: &Pending, stream: Option<&str>) -> String {
    match stream {
        Some(name) => line.replacen(
            &format!(" routing_key={} ", printable(&p.routing_key)),
            &format!(" stream={name} "),
            1,
        ),
        None => line,
    }
}

/// [`line_for_target`] for `--json`: `"stream"` instead of `"routing_key"`.
fn for_target(mut v: serde_json::Value, stream: Option<&str>) -> serde_json::Value {
    if let (Some(name), Some(map)) = (stream, v.as_object_mut()) {
        map.remove("routing_key");
        map.remove("exchange");
        map.insert("stream".into(), json!(name));
    }
    v
}

/// With `[message] format = "cloudevents"`, `--json` shows the CloudEvents attributes
/// the message will carry (docs/cloudevents.md) under `"cloudevents"`.
fn with_cloudevents(
    mut v: serde_json::Value,
    p: &Pending,
    ce: Option<&mut CloudEvents>,
) -> serde_json::Value {
    if let (Some(ce), Some(map)) = (ce, v.as_object_mut()) {
        let a = ce.attributes(&p.event);
        map.insert(
            "cloudevents".into(),
            json!({
                "specversion": cloudevents::SPECVERSION,
                "id": a.id,
                "source": a.source,
                "type": a.kind,
                "time": a.time,
                "subject": a.subject,
                "datacontenttype": p.event.table.content_type,
            }),
        );
    }
    v
}

/// One line: commit LSN, xid, table, id, event type, aggregate, routing key, payload.
/// Every field from the outbox is escaped (`printable`): a terminal shows what the
/// row holds and obeys nothing in it (docs/security.md).
pub(crate) fn to_line(p: &Pending) -> String {
    let e = &p.event;
    let or_null = |v: Option<&Bytes>| {
        let text = text(v).unwrap_or_else(|| "NULL".into());
        printable(&text).into_owned()
    };
    let payload = text(e.payload.as_ref()).unwrap_or_else(|| "NULL".into());
    let shown: String = payload.chars().take(TEXT_PAYLOAD_CHARS).collect();
    let ellipsis = if shown.len() < payload.len() {
        "…"
    } else {
        ""
    };
    let exchange = p
        .exchange
        .as_deref()
        .map(|x| format!(" exchange={}", printable(x)))
        .unwrap_or_default();
    format!(
        "{} xid={} {} id={} type={} aggregate={}/{}{exchange} routing_key={} payload={}{ellipsis}",
        e.commit_lsn,
        e.xid,
        printable(&e.table.qualified_name),
        or_null(e.id.as_ref()),
        or_null(e.event_type.as_ref()),
        or_null(e.aggregate_type.as_ref()),
        or_null(e.aggregate_id.as_ref()),
        printable(&p.routing_key),
        printable(&shown),
    )
}

/// Every field, the payload in full (as text exactly as Postgres renders it).
fn to_json(p: &Pending) -> serde_json::Value {
    let e = &p.event;
    json!({
        "commit_lsn": e.commit_lsn.to_string(),
        "end_lsn": p.end_lsn.to_string(),
        "xid": e.xid,
        "commit_time": commit_time(e.commit_time_micros),
        "table": e.table.qualified_name,
        "message_id": text(e.id.as_ref()),
        "aggregate_type": text(e.aggregate_type.as_ref()),
        "aggregate_id": text(e.aggregate_id.as_ref()),
        "event_type": text(e.event_type.as_ref()),
        "routing_key": p.routing_key,
        "exchange": p.exchange,
        "content_type": e.table.content_type,
        "payload": text(e.payload.as_ref()),
        "headers": text(e.headers.as_ref()),
        "correlation_id": text(e.correlation_id.as_ref()),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use outbox_event::{CommitMarker, OutboxTable};
    use wal_reader::pgtype::oid;

    use super::*;

    fn event(i: u32, payload: &str) -> OutboxEvent {
        OutboxEvent {
            table: Arc::new(OutboxTable {
                qualified_name: "public.outbox".into(),
                schema: "public".into(),
                name: "outbox".into(),
                payload_type: oid::JSONB,
                headers_type: None,
                content_type: "application/json",
            }),
            xid: 700 + i,
            commit_lsn: Lsn(0x100 * u64::from(i)),
            commit_time_micros: 1_700_000_000_000_000,
            index: 0,
            id: Some(Bytes::from(format!("id-{i}"))),
            aggregate_type: Some(Bytes::from_static(b"order")),
            aggregate_id: Some(Bytes::from(format!("o-{i}"))),
            event_type: Some(Bytes::from_static(b"created")),
            payload: Some(Bytes::from(payload.to_string())),
            body: Bytes::from(payload.to_string()),
            headers: None,
            correlation_id: None,
            exchange: None,
            properties: Vec::new(),
            malformed: None,
        }
    }

    fn commit(i: u32) -> WalItem {
        WalItem::Commit(CommitMarker {
            xid: 700 + i,
            commit_lsn: Lsn(0x100 * u64::from(i)),
            end_lsn: Lsn(0x100 * u64::from(i) + 8),
            commit_time_micros: 0,
            events: 1,
        })
    }

    #[test]
    fn only_committed_events_up_to_the_limit() {
        let rk = RoutingKeyTemplate::parse("{aggregate_type}.{event_type}").unwrap();
        let items = vec![
            WalItem::Event(event(1, "{}")),
            WalItem::Event(event(1, "{}")),
            commit(1),
            WalItem::Event(event(2, "{}")),
            commit(2),
            // A transaction cut off by the read: not pending yet as far as we know.
            WalItem::Event(event(3, "{}")),
        ];
        let all = committed(items.clone(), 10, &rk, &ExchangeRule::default());
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].end_lsn, Lsn(0x208));
        assert_eq!(all[0].routing_key, "order.created");
        assert_eq!(committed(items, 2, &rk, &ExchangeRule::default()).len(), 2);
    }

    #[test]
    fn text_line_truncates_the_payload_and_json_keeps_it() {
        let rk = RoutingKeyTemplate::parse("{aggregate_type}.{event_type}").unwrap();
        let long = format!("\"{}\"", "x".repeat(500));
        let p = committed(
            vec![WalItem::Event(event(1, &long)), commit(1)],
            1,
            &rk,
            &ExchangeRule::default(),
        )
        .pop()
        .unwrap();
        let line = to_line(&p);
        assert!(line.starts_with("0/100 xid=701 public.outbox id=id-1 type=created aggregate=order/o-1 routing_key=order.created payload=\"xxx"), "{line}");
        assert!(line.ends_with('…') && line.len() < 400, "{line}");
        let v = to_json(&p);
        assert_eq!(v["payload"].as_str().unwrap(), long);
        assert_eq!(v["commit_time"], "2023-11-14T22:13:20.000000Z");
        assert_eq!(v["content_type"], "application/json");
        assert!(v["headers"].is_null());
        assert!(v.get("cloudevents").is_none());
    }

    #[test]
    fn json_shows_the_cloudevents_attributes_with_that_format() {
        use publisher::message::cloudevents::CloudEventsFormat;
        let rk = RoutingKeyTemplate::parse("{aggregate_type}.{event_type}").unwrap();
        let p = committed(
            vec![WalItem::Event(event(1, "{}")), commit(1)],
            1,
            &rk,
            &ExchangeRule::default(),
        )
        .pop()
        .unwrap();
        let mut ce = CloudEvents::new(CloudEventsFormat::with_default_source("app", "x."));
        let v = with_cloudevents(to_json(&p), &p, Some(&mut ce));
        assert_eq!(
            v["cloudevents"],
            json!({
                "specversion": "1.0",
                "id": "id-1",
                "source": "/outbox-relay/app/public.outbox",
                "type": "x.created",
                "time": "2023-11-14T22:13:20.000000Z",
                "subject": "o-1",
                "datacontenttype": "application/json",
            })
        );
        // The same instant as the `commit_time` field.
        assert_eq!(v["cloudevents"]["time"], v["commit_time"]);
        assert_eq!(with_cloudevents(to_json(&p), &p, None), to_json(&p));
    }
}
