//! `check --routes [--since D]`: which queues each (table, aggregate_type,
//! event_type) would reach, before it is published (issue #43; docs/routing.md,
//! "Checking routes before deploying").
//!
//! ```text
//!   the slot's pending events (peek's decoding, logical messages included:
//!   table message:<prefix>)  +  each outbox table's rows with created_at >= now() - since
//!        │ distinct (table, aggregate_type, event_type, exchange, routing key)
//!        ▼
//!   publisher::routing::Topology: the broker's exchanges, bindings and queues
//!   (management_url) + the relay's exchange(s) as run would declare them
//!        │ route(exchange, key, headers)
//!        ▼
//!   one line each: the queues reached, NONE, or "not evaluated" (and why)
//!   exit 2 when some reach no queue (not-evaluated ones are listed, not counted)
//! ```
//!
//! Read-only everywhere: the slot is peeked (not consumed; skipped with a `warn`
//! while a relay streams from it, or when it does not exist yet), the tables are read
//! with one `SELECT DISTINCT` each, the broker through its management API's GETs.

pub(crate) mod management;
pub(crate) mod sources;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use outbox_event::redact::printable;
use publisher::message::{ExchangeRule, RoutingKeyTemplate, TemplateFields};
use publisher::routing::{Exchange, Headers, Kind, Route, Topology, Verdict};

use crate::config::{Config, HeaderProfileKind};
use crate::error::CliError;

pub use sources::Seen;

/// Default `--since`.
pub const DEFAULT_SINCE: Duration = Duration::from_secs(24 * 3600);

/// One distinct event shape and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Shape {
    pub table: String,
    pub aggregate_type: Option<String>,
    pub event_type: Option<String>,
    pub exchange: String,
    pub routing_key: String,
}

/// The fields an exchange or routing-key template may use.
#[derive(Debug, Clone, Default)]
pub struct Fields {
    pub table: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
}

impl Fields {
    /// The fields as the publisher's templates take them.
    fn as_template(&self) -> TemplateFields<'_> {
        TemplateFields {
            table: &self.table,
            aggregate_type: self.aggregate_type.as_deref().map(str::as_bytes),
            aggregate_id: self.aggregate_id.as_deref().map(str::as_bytes),
            event_type: self.event_type.as_deref().map(str::as_bytes),
        }
    }
}

/// A template (already checked by `RoutingKeyTemplate::parse` at load) rendered by
/// the publisher's own renderer: NULL fields as empty text, cut to 255 bytes.
pub fn render(template: &str, f: &Fields) -> String {
    RoutingKeyTemplate::parse(template)
        .map(|t| t.render_fields(&f.as_template()))
        .unwrap_or_default()
}

/// The exchange a table row goes to, decided by the publisher's `ExchangeRule` as
/// for an event (pending events carry the publisher's own answer): the row's
/// exchange column when it is not empty, else `[rabbitmq] exchange` rendered when it
/// is a template (possibly empty: such an event is poison), else as written.
pub fn exchange_of(cfg: &Config, column: Option<&str>, f: &Fields) -> String {
    let configured = &cfg.rabbitmq.exchange;
    ExchangeRule::new(configured, true)
        .ok()
        .and_then(|rule| rule.of_fields(column.map(str::as_bytes), &f.as_template()))
        .unwrap_or_else(|| configured.clone())
}

/// Whether `[rabbitmq] exchange` is a template (checked at load).
pub(crate) fn is_template(cfg: &Config) -> bool {
    ExchangeRule::new(&cfg.rabbitmq.exchange, false)
        .map(|r| r.is_template())
        .unwrap_or(false)
}

/// The headers every message of a shape carries (docs/design.md §5); the others
/// (aggregate_id, commit_lsn, xid, the headers column's keys) vary per row.
fn headers_of(cfg: &Config, shape: &Shape) -> Headers {
    let mut values = BTreeMap::new();
    let text = |v: &Option<String>| v.clone().unwrap_or_default();
    values.insert("event_type".to_string(), text(&shape.event_type));
    if cfg.message.headers == HeaderProfileKind::Full {
        values.insert("aggregate_type".to_string(), text(&shape.aggregate_type));
        values.insert("outbox_table".to_string(), shape.table.clone());
    }
    Headers {
        values,
        complete: false,
    }
}

/// `check --routes`.
pub async fn execute(cfg: &Config, since: Option<Duration>) -> Result<(), CliError> {
    let since = since.unwrap_or(DEFAULT_SINCE);
    let mut out = std::io::stdout().lock();
    let mut say = |text: &str| {
        let _ = writeln!(out, "{}", printable(text));
        let _ = out.flush();
    };
    if let Some(stream) = cfg.stream() {
        say(&format!(
            "ok    routes: every event goes to stream {stream} ([rabbitmq] stream), which has no routing"
        ));
        return Ok(());
    }
    // The broker's own topology first: it decides whether the rest is complete.
    let (mut topology, from_broker) = broker_topology(cfg, &mut say).await?;
    let declared = declared_topology(cfg);
    say(&format!(
        "ok    declared topology: {} exchanges, {} queues ([[topology.*]] and [rabbitmq] exchange)",
        cfg.topology.exchanges.len() + usize::from(!is_template(cfg)),
        cfg.topology.queues.len()
    ));
    topology.merge(declared);
    topology.add_broker_defaults();

    let seen = sources::collect(cfg, since, &mut say).await?;
    if seen.is_empty() {
        say(&format!(
            "ok    routes: no pending event and no row created in the last {}: nothing to check",
            span(since)
        ));
        return Ok(());
    }
    // The exchanges events go to that the broker lacks: run declares them (with
    // declare_exchange), without bindings.
    let mut declared_by_run = BTreeSet::new();
    for shape in seen.keys() {
        if !shape.exchange.is_empty()
            && !topology.exchanges.contains_key(&shape.exchange)
            && cfg.rabbitmq.declare_exchange
        {
            let kind = Kind::of(cfg.rabbitmq.exchange_type.as_str(), &BTreeMap::new());
            topology
                .exchanges
                .insert(shape.exchange.clone(), Exchange::new(kind));
            declared_by_run.insert(shape.exchange.clone());
        }
    }
    if from_broker {
        for x in &declared_by_run {
            say(&format!(
                "warn  exchange {x}: missing on the broker; run declares it ({}, declare_exchange = true), with no binding",
                cfg.rabbitmq.exchange_type.as_str()
            ));
        }
    }

    let rows: Vec<(&Shape, &Seen, Route)> = seen
        .iter()
        .map(|(shape, s)| {
            let route = if shape.exchange.is_empty() && is_template(cfg) {
                Route {
                    notes: vec![
                        "[rabbitmq] exchange renders no name for it: the relay holds it as poison"
                            .into(),
                    ],
                    ..Route::default()
                }
            } else {
                topology.route(&shape.exchange, &shape.routing_key, &headers_of(cfg, shape))
            };
            (shape, s, route)
        })
        .collect();
    for line in table(&rows).lines() {
        say(line);
    }
    verdict(&rows, &mut say)
}

/// The broker's topology read through the management API (`true`), or an empty one
/// when `management_url` is not set (`false`), with what `say` prints about it.
async fn broker_topology(
    cfg: &Config,
    say: &mut impl FnMut(&str),
) -> Result<(Topology, bool), CliError> {
    let management = management::Management::from_config(cfg).map_err(CliError::Usage)?;
    for warning in management.iter().flat_map(|m| &m.warnings) {
        say(&format!("warn  management API: {warning}"));
    }
    let Some(m) = &management else {
        say("warn  management API: [rabbitmq] management_url is not set: only the declared topology is matched, and the broker's own bindings are not seen");
        return Ok((Topology::default(), false));
    };
    let t = m
        .topology(cfg.ca_file())
        .await
        .map_err(CliError::Precondition)?;
    let bindings: usize = t.exchanges.values().map(|x| x.bindings.len()).sum();
    say(&format!(
        "ok    management API: {} (vhost {:?}): {} exchanges, {} queues, {bindings} bindings",
        m.shown,
        m.vhost(),
        t.exchanges.len(),
        t.queues.len()
    ));
    Ok((t, true))
}

/// The last lines: how many were not evaluated, and whether every shape reaches a
/// queue (else the error that lists those that reach none).
fn verdict(rows: &[(&Shape, &Seen, Route)], say: &mut impl FnMut(&str)) -> Result<(), CliError> {
    let unroutable: Vec<&Shape> = rows
        .iter()
        .filter(|(_, _, r)| r.verdict() == Verdict::Unroutable)
        .map(|(s, _, _)| *s)
        .collect();
    let not_evaluated = rows
        .iter()
        .filter(|(_, _, r)| r.verdict() == Verdict::NotEvaluated)
        .count();
    if not_evaluated > 0 {
        say(&format!(
            "warn  routes: {not_evaluated} not evaluated (an exchange type or headers this check cannot decide): check them on the broker"
        ));
    }
    if unroutable.is_empty() {
        say(&format!(
            "ok    routes: every one of {} reaches a queue",
            rows.len()
        ));
        return Ok(());
    }
    let list: Vec<String> = unroutable
        .iter()
        .map(|s| {
            format!(
                "{} {}/{} (exchange {:?}, routing key {:?})",
                s.table,
                shown(&s.aggregate_type),
                shown(&s.event_type),
                s.exchange,
                s.routing_key
            )
        })
        .collect();
    say(&format!(
        "FAIL  routes: {} of {} reach no queue",
        unroutable.len(),
        rows.len()
    ));
    Err(CliError::Precondition(format!(
        "{} (table, aggregate_type, event_type) reach no queue: {}; bind a queue to their exchange with a matching key (docs/routing.md), or set [rabbitmq] dead_letter_exchange",
        unroutable.len(),
        list.join("; ")
    )))
}

/// The topology `[topology]` declares (issue #43 part 3), with the relay's own
/// exchange as run declares it (when it is one name, not a template).
fn declared_topology(cfg: &Config) -> Topology {
    let own = (!is_template(cfg)).then_some(cfg.rabbitmq.exchange.as_str());
    let kind = Topology::kind_of_type(cfg.rabbitmq.exchange_type.as_str());
    Topology::declared(&cfg.topology, own, &kind)
}

/// A `--since` as an operator writes it: `24h`, `7d`.
pub fn span(d: Duration) -> String {
    match d.as_secs() {
        s if s > 0 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s > 0 && s % 3_600 == 0 => format!("{}h", s / 3_600),
        _ => humantime::format_duration(d).to_string(),
    }
}

fn shown(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "NULL".into())
}

/// The report: one row per shape, columns padded.
fn table(rows: &[(&Shape, &Seen, Route)]) -> String {
    let mut cells = vec![[
        "TABLE".to_string(),
        "AGGREGATE_TYPE".into(),
        "EVENT_TYPE".into(),
        "EXCHANGE".into(),
        "ROUTING_KEY".into(),
        "SEEN".into(),
        "QUEUES".into(),
    ]];
    for (shape, seen, route) in rows {
        let queues = match route.verdict() {
            Verdict::Routed => {
                let mut q = route.queues.iter().cloned().collect::<Vec<_>>().join(", ");
                if !route.not_evaluated.is_empty() {
                    q.push_str(" (and not evaluated: ");
                    q.push_str(&route.not_evaluated.join("; "));
                    q.push(')');
                }
                q
            }
            Verdict::NotEvaluated => {
                format!("not evaluated: {}", route.not_evaluated.join("; "))
            }
            Verdict::Unroutable => {
                let mut q = "NONE".to_string();
                if !route.notes.is_empty() {
                    let _ = write!(q, " ({})", route.notes.join("; "));
                }
                q
            }
        };
        let exchange = if shape.exchange.is_empty() {
            "(default)".to_string()
        } else {
            shape.exchange.clone()
        };
        cells.push([
            shape.table.clone(),
            shown(&shape.aggregate_type),
            shown(&shape.event_type),
            exchange,
            shape.routing_key.clone(),
            seen.to_string(),
            queues,
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &cells {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(printable(c).chars().count());
        }
    }
    let mut out = String::new();
    for (n, row) in cells.iter().enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let mut line = String::new();
        for (i, c) in row.iter().enumerate() {
            let c = printable(c);
            if i + 1 == row.len() {
                line.push_str(&c);
            } else {
                let pad = widths[i] - c.chars().count();
                let _ = write!(line, "{c}{}  ", " ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn fields() -> Fields {
        Fields {
            table: "public.outbox".into(),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("o-1".into()),
            event_type: None,
        }
    }

    #[test]
    fn templates_render_as_the_publisher_does() {
        let f = fields();
        assert_eq!(render("{aggregate_type}.{event_type}", &f), "order.");
        assert_eq!(
            render("x.{table}.{aggregate_id}", &f),
            "x.public.outbox.o-1"
        );
        assert_eq!(render("plain", &f), "plain");
        let long = Fields {
            aggregate_type: Some("é".repeat(200)),
            ..f
        };
        let key = render("{aggregate_type}", &long);
        assert_eq!(key.len(), 254);
    }

    /// A row's exchange as the publisher decides it: its column when set, whole
    /// (the publisher checks a name, it never cuts one: a cut name would be another
    /// exchange; the copy this replaced cut it at 255 bytes), else the template.
    #[test]
    fn a_rows_exchange_is_the_publishers_choice() {
        let mut cfg = Config::default();
        cfg.rabbitmq.exchange = "events.{aggregate_type}".into();
        let f = fields();
        assert_eq!(exchange_of(&cfg, None, &f), "events.order");
        assert_eq!(exchange_of(&cfg, Some(""), &f), "events.order");
        let long = "x".repeat(300);
        assert_eq!(exchange_of(&cfg, Some(&long), &f), long);
        cfg.rabbitmq.exchange = "outbox".into();
        assert_eq!(exchange_of(&cfg, None, &f), "outbox");
    }

    /// `[[topology.*]]` as the matcher's model: exchange-to-exchange and queue
    /// bindings, the alternate exchange, plugin types, the relay's own exchange.
    #[test]
    fn declared_topology_is_the_configs() {
        use publisher::settings::{Binding as B, ExchangeDecl, QueueDecl, QueueType};
        use serde_json::json;
        let bind = |exchange: &str, key: &str| B {
            exchange: exchange.into(),
            routing_key: key.into(),
            arguments: Default::default(),
        };
        let exchange = |name: &str, kind: &str, bindings: Vec<B>| ExchangeDecl {
            name: name.into(),
            kind: kind.into(),
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: Default::default(),
            bindings,
        };
        let queue = |name: &str, bindings: Vec<B>| QueueDecl {
            name: name.into(),
            kind: QueueType::Quorum,
            durable: true,
            arguments: Default::default(),
            bindings,
        };
        let mut cfg = Config::default();
        let mut orders = exchange("orders", "direct", vec![bind("outbox", "order.#")]);
        orders
            .arguments
            .insert("alternate-exchange".into(), json!("unrouted"));
        cfg.topology.exchanges = vec![
            orders,
            exchange("unrouted", "fanout", vec![]),
            exchange(
                "hash",
                "x-consistent-hash",
                vec![bind("outbox", "shipment.*")],
            ),
        ];
        cfg.topology.queues = vec![
            queue("billing", vec![bind("orders", "order.created")]),
            queue("parking", vec![bind("unrouted", "")]),
            queue("everything", vec![bind("amq.topic", "#")]),
        ];
        let t = declared_topology(&cfg);
        let h = Headers::default();
        let queues = |x: &str, key: &str| -> Vec<String> {
            t.route(x, key, &h).queues.into_iter().collect()
        };
        // outbox (the relay's, a topic exchange) → orders (direct) → billing.
        assert_eq!(queues("outbox", "order.created"), ["billing"]);
        // orders matches nothing: its alternate exchange takes it.
        assert_eq!(queues("outbox", "order.deleted"), ["parking"]);
        assert_eq!(
            t.route("outbox", "shipment.sent", &h).verdict(),
            Verdict::NotEvaluated
        );
        assert_eq!(
            t.route("outbox", "invoice.paid", &h).verdict(),
            Verdict::Unroutable
        );
        assert_eq!(queues("amq.topic", "x"), ["everything"]);
        assert!(!t.queues_complete);
    }

    #[test]
    fn management_url_must_be_http() {
        let mut r = crate::config::RabbitMqConfig::default();
        for (url, ok) in [
            ("", true),
            ("http://127.0.0.1:15672", true),
            ("https://u:p@mq/admin", true),
            ("amqp://u:secret@mq", false),
        ] {
            r.management_url = url.into();
            let errors = r.validate();
            assert_eq!(errors.is_empty(), ok, "{url}: {errors:?}");
            if !ok {
                assert_eq!(errors[0].key, "rabbitmq.management_url");
                assert!(!errors[0].reason.contains("secret"));
            }
        }
    }
}
