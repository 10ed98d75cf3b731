//! `[topology]` on the wire: its exchanges, queues and bindings declared on the
//! control channel (at every connect with `declare_topology = true`, and by `check
//! --declare`), and compared with the broker's by `check` (issue #43, part 3).
//!
//! Order: the topology's exchanges, then the configured exchange and the
//! dead-letter exchange as without a topology (those the topology declares are
//! declared once, with its arguments), then the queues, then every binding (their
//! sources and destinations exist by then). Every declaration is idempotent: the
//! same declaration again changes nothing, and one with other arguments is refused
//! (406 PRECONDITION_FAILED) without changing anything either.
//!
//! Comparing without creating: a passive declaration says whether an object exists,
//! but not with which arguments (AMQP has no way to read them). So `check` declares
//! an object that exists once more, actively, with the configured arguments: the
//! broker answers declare-ok when they are equivalent and 406 naming the argument
//! when not. A missing object is never declared actively by `check`, since that
//! would create it.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

use crate::amqp::config::PublisherConfig;
use crate::amqp::connection::{ConnError, Connection, Declare, ExchangeFlags};
use crate::error::{scrub, PublishError};
use crate::settings::{ArgValue, Arguments, ExchangeDecl, QueueDecl, TopologyConfig};

/// The AMQP field table of a declaration's or binding's arguments.
pub(crate) fn field_table(args: &Arguments) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in args {
        table.insert(ShortString::from(name.as_str()), field_value(value));
    }
    table
}

/// A TOML value as an AMQP field value: whole numbers as signed 64-bit (RabbitMQ
/// takes any integer type for its numeric arguments), strings as long strings.
fn field_value(value: &ArgValue) -> AMQPValue {
    match value {
        ArgValue::Null => AMQPValue::Void,
        ArgValue::Bool(b) => AMQPValue::Boolean(*b),
        ArgValue::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => AMQPValue::Void,
        },
        ArgValue::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        ArgValue::Array(items) => {
            let mut array = FieldArray::default();
            for item in items {
                array.push(field_value(item));
            }
            AMQPValue::FieldArray(array)
        }
        ArgValue::Object(map) => {
            let mut table = FieldTable::default();
            for (k, v) in map {
                table.insert(ShortString::from(k.as_str()), field_value(v));
            }
            AMQPValue::FieldTable(table)
        }
    }
}

/// A queue's arguments with its type as `x-queue-type` (always sent: RabbitMQ
/// takes `classic` for a classic queue declared without it, and refuses a quorum
/// queue declared without it).
pub(crate) fn queue_arguments(q: &QueueDecl) -> FieldTable {
    let mut table = field_table(&q.arguments);
    table.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from(q.kind.as_str())),
    );
    table
}

fn flags(e: &ExchangeDecl) -> ExchangeFlags {
    ExchangeFlags {
        durable: e.durable,
        auto_delete: e.auto_delete,
        internal: e.internal,
    }
}

/// Declares `e` (or only checks it exists, passively).
pub(crate) async fn declare_exchange(
    conn: &mut Connection,
    e: &ExchangeDecl,
    how: Declare,
) -> Result<(), ConnError> {
    conn.declare_exchange_with(&e.name, &e.kind, flags(e), field_table(&e.arguments), how)
        .await
}

/// Declares `q` (or only checks it exists, passively).
pub(crate) async fn declare_queue(
    conn: &mut Connection,
    q: &QueueDecl,
    how: Declare,
) -> Result<(), ConnError> {
    conn.declare_queue(&q.name, q.durable, queue_arguments(q), how)
        .await
        .map(|_| ())
}

/// What is declared at connect: with `config.topology`, the topology around the
/// configured exchange and dead-letter exchange (module docs); without, those two
/// alone ([`declare`]).
pub(crate) async fn declare_all(
    conn: &mut Connection,
    config: &PublisherConfig,
) -> Result<(), PublishError> {
    let Some(topology) = config.topology.clone() else {
        return declare(conn, config, |_| false).await;
    };
    declare_exchanges(conn, config, &topology).await?;
    // The configured exchange and the DLX, unless the topology declared them.
    declare(conn, config, |x| topology.exchange(x).is_some()).await?;
    declare_queues_and_bindings(conn, config, &topology).await
}

/// Declares the exchange (or checks it passively when `declare_exchange` is off)
/// and checks the dead-letter exchange, which is the operator's, on the control
/// channel. A refusal is [`PublishError::Exchange`]; a connection that ends
/// meanwhile is an outage.
/// `declared`: the names a `[topology]` already declared (with their arguments:
/// declaring them again without would be refused), skipped here.
pub(crate) async fn declare(
    conn: &mut Connection,
    config: &PublisherConfig,
    declared: impl Fn(&str) -> bool,
) -> Result<(), PublishError> {
    // An exchange per event is declared when first seen (`run.rs`), not here.
    let template =
        crate::message::ExchangeRule::new(&config.exchange, false).is_ok_and(|r| r.is_template());
    if !config.exchange.is_empty() && !template && !declared(&config.exchange) {
        let how = if config.declare_exchange {
            Declare::Active
        } else {
            Declare::Passive
        };
        conn.declare_exchange(&config.exchange, &config.exchange_type, how)
            .await
            .map_err(|e| exchange_refused(config, conn.node, &config.exchange, e))?;
    }
    if let Some(dlx) = config
        .dead_letter_exchange
        .as_deref()
        .filter(|d| !declared(d))
    {
        conn.declare_exchange(dlx, "fanout", Declare::Passive)
            .await
            .map_err(|e| exchange_refused(config, conn.node, dlx, e))?;
    }
    Ok(())
}

/// A declaration's failure: the broker's refusal of the exchange, or an outage.
pub(crate) fn exchange_refused(
    config: &PublisherConfig,
    node: usize,
    exchange: &str,
    e: ConnError,
) -> PublishError {
    let url = &config.urls[node];
    match e {
        ConnError::ChannelClosed { code, text } => PublishError::Exchange {
            exchange: exchange.to_string(),
            reason: scrub(&format!("({code}) {text}"), url),
        },
        other => PublishError::Unreachable {
            url: crate::error::redact_url(url),
            reason: scrub(&other.to_string(), url),
        },
    }
}

/// Every exchange, queue and binding of `topology`, in the order of the module
/// docs (for `check --declare`, whose configured exchange is declared apart).
pub(crate) async fn declare_topology(
    conn: &mut Connection,
    config: &PublisherConfig,
    topology: &TopologyConfig,
) -> Result<(), PublishError> {
    declare_exchanges(conn, config, topology).await?;
    declare_queues_and_bindings(conn, config, topology).await
}

async fn declare_exchanges(
    conn: &mut Connection,
    config: &PublisherConfig,
    topology: &TopologyConfig,
) -> Result<(), PublishError> {
    for e in &topology.exchanges {
        declare_exchange(conn, e, Declare::Active)
            .await
            .map_err(|err| refused(config, conn.node, Object::Exchange(&e.name), err))?;
    }
    Ok(())
}

async fn declare_queues_and_bindings(
    conn: &mut Connection,
    config: &PublisherConfig,
    topology: &TopologyConfig,
) -> Result<(), PublishError> {
    for q in &topology.queues {
        declare_queue(conn, q, Declare::Active)
            .await
            .map_err(|err| refused(config, conn.node, Object::Queue(&q.name), err))?;
    }
    for e in &topology.exchanges {
        for b in &e.bindings {
            conn.bind_exchange(
                &e.name,
                &b.exchange,
                &b.routing_key,
                field_table(&b.arguments),
            )
            .await
            .map_err(|err| {
                let object = Object::Binding {
                    source: &b.exchange,
                    destination: &e.name,
                    routing_key: &b.routing_key,
                };
                refused(config, conn.node, object, err)
            })?;
        }
    }
    for q in &topology.queues {
        for b in &q.bindings {
            conn.bind_queue(
                &q.name,
                &b.exchange,
                &b.routing_key,
                field_table(&b.arguments),
            )
            .await
            .map_err(|err| {
                let object = Object::Binding {
                    source: &b.exchange,
                    destination: &q.name,
                    routing_key: &b.routing_key,
                };
                refused(config, conn.node, object, err)
            })?;
        }
    }
    Ok(())
}

/// What a declaration was about, for its error.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Object<'a> {
    Exchange(&'a str),
    Queue(&'a str),
    Binding {
        source: &'a str,
        destination: &'a str,
        routing_key: &'a str,
    },
}

impl std::fmt::Display for Object<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Object::Exchange(name) => write!(f, "exchange {name:?}"),
            Object::Queue(name) => write!(f, "queue {name:?}"),
            Object::Binding {
                source,
                destination,
                routing_key,
            } => write!(
                f,
                "binding {source:?} → {destination:?} (routing key {routing_key:?})"
            ),
        }
    }
}

/// A declaration's failure: the broker's refusal, with what to do, or an outage.
pub(crate) fn refused(
    config: &PublisherConfig,
    node: usize,
    object: Object<'_>,
    e: ConnError,
) -> PublishError {
    let url = &config.urls[node];
    match e {
        ConnError::ChannelClosed { code, text } => PublishError::Topology {
            object: object.to_string(),
            reason: scrub(
                &format!("({code}) {text}: {}", fix(object, code, &text)),
                url,
            ),
        },
        // 503 and 530 close the connection: an unknown exchange type, a name the
        // broker refuses.
        ConnError::Closed { code, text } if code != 320 => PublishError::Topology {
            object: object.to_string(),
            reason: scrub(
                &format!(
                    "the broker closed the connection ({code}) {text}: {}",
                    fix(object, code, &text)
                ),
                url,
            ),
        },
        other => PublishError::Unreachable {
            url: crate::error::redact_url(url),
            reason: scrub(&other.to_string(), url),
        },
    }
}

/// The argument a 406 names (`inequivalent arg 'x-queue-type' for queue ...`).
pub fn inequivalent_argument(text: &str) -> Option<&str> {
    let rest = text.split_once("inequivalent arg '")?.1;
    rest.split_once('\'').map(|(name, _)| name)
}

/// What to do about a refusal of `object` (the broker's code and text).
pub(crate) fn fix(object: Object<'_>, code: u16, text: &str) -> String {
    match (object, code) {
        (Object::Queue(name), 406) => {
            let what = match inequivalent_argument(text) {
                Some("x-queue-type") => "its type cannot change".to_string(),
                Some(arg) => format!("it was declared with another {arg}"),
                None => "it was declared otherwise".to_string(),
            };
            format!(
                "the queue exists and {what}: delete it and let the relay declare it again (`rabbitmqctl delete_queue {name}`; its messages go with it, move them first if they matter), or change its [[topology.queue]] to what the broker has"
            )
        }
        (Object::Exchange(name), 406) => {
            let what = match inequivalent_argument(text) {
                Some(arg) => format!("it was declared with another {arg}"),
                None => "it was declared otherwise".to_string(),
            };
            format!(
                "the exchange exists and {what}: delete it and let the relay declare it again (`rabbitmqadmin delete exchange name={name}`; its bindings go with it), or change its [[topology.exchange]] to what the broker has"
            )
        }
        (_, 403) => "the relay's user lacks the permission: declaring needs `configure` on the queue or exchange, binding `write` on the queue or destination exchange and `read` on the source exchange (docs/security.md), or declare it with another user (`check --declare`) and set declare_topology = false".to_string(),
        (Object::Binding { .. }, 404) => "an exchange or queue of the binding does not exist: declare it ([[topology.exchange]] / [[topology.queue]]), or fix the binding".to_string(),
        (_, 404) => "it does not exist: declare it, or set [rabbitmq] declare_topology = true".to_string(),
        (_, 503) => "the broker does not know the exchange type: enable its plugin (rabbitmq-plugins enable ...), or fix the type".to_string(),
        _ => "fix the [topology] entry".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{QueueType, TopologyConfig};

    fn queue(json: serde_json::Value) -> QueueDecl {
        serde_json::from_value(json).unwrap()
    }

    /// TOML values become the AMQP values RabbitMQ reads: whole numbers as signed
    /// 64-bit integers (never strings, which it refuses for x-message-ttl), strings
    /// as long strings, tables and arrays nested; the queue's type is always sent.
    #[test]
    fn arguments_are_typed_and_the_queue_type_is_always_sent() {
        let q = queue(serde_json::json!({
            "name": "billing",
            "type": "quorum",
            "arguments": {
                "x-message-ttl": 60000,
                "x-dead-letter-exchange": "dlx",
                "x-single-active-consumer": true,
                "ratio": 0.5,
                "nested": {"a": [1, "b"]}
            }
        }));
        assert_eq!(q.kind, QueueType::Quorum);
        let t = queue_arguments(&q);
        let get = |k: &str| t.inner().get(k).cloned();
        assert_eq!(get("x-message-ttl"), Some(AMQPValue::LongLongInt(60_000)));
        assert_eq!(
            get("x-dead-letter-exchange"),
            Some(AMQPValue::LongString("dlx".into()))
        );
        assert_eq!(
            get("x-single-active-consumer"),
            Some(AMQPValue::Boolean(true))
        );
        assert_eq!(get("ratio"), Some(AMQPValue::Double(0.5)));
        assert_eq!(
            get("x-queue-type"),
            Some(AMQPValue::LongString("quorum".into()))
        );
        let Some(AMQPValue::FieldTable(nested)) = get("nested") else {
            panic!("nested is not a table")
        };
        let Some(AMQPValue::FieldArray(items)) = nested.inner().get("a") else {
            panic!("a is not an array")
        };
        assert_eq!(
            items.as_slice(),
            [AMQPValue::LongLongInt(1), AMQPValue::LongString("b".into())]
        );
        let classic = queue(serde_json::json!({"name": "audit"}));
        assert_eq!(
            queue_arguments(&classic).inner().get("x-queue-type"),
            Some(&AMQPValue::LongString("classic".into()))
        );
        assert!(TopologyConfig::default().is_empty());
    }

    /// The argument a 406 names, and a fix that says what to do with it.
    #[test]
    fn a_406_names_the_argument_and_the_fix() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received 'quorum' but current is 'classic'";
        assert_eq!(inequivalent_argument(text), Some("x-queue-type"));
        let what = fix_of_queue(text);
        assert!(what.contains("its type cannot change"), "{what}");
        assert!(what.contains("rabbitmqctl delete_queue q"), "{what}");
        assert!(what.contains("change its [[topology.queue]]"), "{what}");
        let ttl = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '1000' but current is '60000'";
        assert!(fix_of_queue(ttl).contains("another x-message-ttl"));
        let kind = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'fanout' but current is 'topic'";
        assert_eq!(inequivalent_argument(kind), Some("type"));
        assert!(fix(Object::Exchange("x"), 406, kind).contains("another type"));
        assert_eq!(inequivalent_argument("NOT_FOUND - no queue 'q'"), None);
        assert!(fix(Object::Queue("q"), 403, "ACCESS_REFUSED").contains("configure"));
    }

    fn fix_of_queue(text: &str) -> String {
        fix(Object::Queue("q"), 406, text)
    }
}
