//! [`TopologyConfig::validate`](super::TopologyConfig::validate): names, duplicates,
//! the source exchanges of bindings, and the types of the arguments RabbitMQ reads.

use std::collections::HashSet;

use super::{ArgValue, Arguments, Binding, QueueType, TopologyConfig, MAX_NAME_BYTES};
use crate::settings::{RabbitMqConfig, SettingError};

const EXCHANGE_KEY: &str = "topology.exchange";
const QUEUE_KEY: &str = "topology.queue";

/// What an argument RabbitMQ reads must hold.
#[derive(Clone, Copy)]
enum Want {
    /// A whole number ≥ the bound.
    Int(i64),
    /// A whole number in a range.
    IntIn(i64, i64),
    Str,
    Bool,
    /// One of these strings.
    OneOf(&'static [&'static str]),
}

/// The queue arguments RabbitMQ gives a meaning to, and what each must hold.
const QUEUE_ARGS: &[(&str, Want)] = &[
    ("x-message-ttl", Want::Int(0)),
    ("x-expires", Want::Int(1)),
    ("x-max-length", Want::Int(0)),
    ("x-max-length-bytes", Want::Int(0)),
    ("x-delivery-limit", Want::Int(0)),
    ("x-max-priority", Want::IntIn(0, 255)),
    ("x-max-in-memory-length", Want::Int(0)),
    ("x-max-in-memory-bytes", Want::Int(0)),
    ("x-quorum-initial-group-size", Want::Int(1)),
    ("x-initial-cluster-size", Want::Int(1)),
    ("x-stream-max-segment-size-bytes", Want::Int(1)),
    ("x-dead-letter-exchange", Want::Str),
    ("x-dead-letter-routing-key", Want::Str),
    ("x-max-age", Want::Str),
    ("x-queue-master-locator", Want::Str),
    ("x-single-active-consumer", Want::Bool),
    (
        "x-overflow",
        Want::OneOf(&["drop-head", "reject-publish", "reject-publish-dlx"]),
    ),
    ("x-queue-mode", Want::OneOf(&["default", "lazy"])),
    (
        "x-dead-letter-strategy",
        Want::OneOf(&["at-most-once", "at-least-once"]),
    ),
    (
        "x-queue-leader-locator",
        Want::OneOf(&["client-local", "balanced"]),
    ),
];

/// The exchange arguments RabbitMQ (and the delayed-message plugin) read.
const EXCHANGE_ARGS: &[(&str, Want)] = &[
    ("alternate-exchange", Want::Str),
    ("x-delayed-type", Want::Str),
];

/// The binding arguments a headers exchange reads itself.
const BINDING_ARGS: &[(&str, Want)] = &[(
    "x-match",
    Want::OneOf(&["all", "any", "all-with-x", "any-with-x"]),
)];

impl TopologyConfig {
    /// Checks what serde cannot: names (non-empty, at most 255 bytes, no `amq.`
    /// prefix, no duplicates), that every binding's source exchange is declared here,
    /// or is `[rabbitmq] exchange` or `dead_letter_exchange`, or a broker default
    /// (`amq.*`), and the types of the arguments RabbitMQ gives a meaning to. Every
    /// problem is reported, each naming the object.
    pub fn validate(&self, rabbitmq: &RabbitMqConfig) -> Vec<SettingError> {
        validate(self, rabbitmq)
    }
}

fn validate(t: &TopologyConfig, r: &RabbitMqConfig) -> Vec<SettingError> {
    let mut errors = Vec::new();
    let declared: HashSet<&str> = t.exchanges.iter().map(|e| e.name.as_str()).collect();
    let known_source = |name: &str| {
        declared.contains(name)
            || (!r.exchange.is_empty() && name == r.exchange)
            || (!r.dead_letter_exchange.is_empty() && name == r.dead_letter_exchange)
            || name.starts_with("amq.")
    };

    let mut seen = HashSet::new();
    for (i, e) in t.exchanges.iter().enumerate() {
        let what = format!("exchange #{} ({:?})", i + 1, e.name);
        if let Err(reason) = check_name(&e.name) {
            errors.push(SettingError::new(EXCHANGE_KEY, format!("{what}: {reason}")));
        } else if !seen.insert(e.name.as_str()) {
            errors.push(SettingError::new(
                EXCHANGE_KEY,
                format!("{what} is declared twice: keep one [[topology.exchange]] per name"),
            ));
        }
        if e.kind.trim().is_empty() {
            errors.push(SettingError::new(
                EXCHANGE_KEY,
                format!("{what} has an empty type: use direct, topic, fanout, headers or a plugin's type such as x-consistent-hash"),
            ));
        }
        if r.declare_exchange
            && !r.exchange.is_empty()
            && e.name == r.exchange
            && e.kind != r.exchange_type.as_str()
        {
            errors.push(SettingError::new(
                EXCHANGE_KEY,
                format!(
                    "{what} is [rabbitmq] exchange, which is declared as {} (rabbitmq.exchange_type) but here as {}: give one type",
                    r.exchange_type.as_str(),
                    e.kind
                ),
            ));
        }
        check_args(
            &mut errors,
            EXCHANGE_KEY,
            &what,
            &e.arguments,
            EXCHANGE_ARGS,
        );
        check_bindings(&mut errors, EXCHANGE_KEY, &what, &e.bindings, &known_source);
    }

    let mut seen = HashSet::new();
    for (i, q) in t.queues.iter().enumerate() {
        let what = format!("queue #{} ({:?})", i + 1, q.name);
        if let Err(reason) = check_name(&q.name) {
            errors.push(SettingError::new(QUEUE_KEY, format!("{what}: {reason}")));
        } else if !seen.insert(q.name.as_str()) {
            errors.push(SettingError::new(
                QUEUE_KEY,
                format!("{what} is declared twice: keep one [[topology.queue]] per name"),
            ));
        }
        if !r.stream.is_empty() && q.name == r.stream {
            errors.push(SettingError::new(
                QUEUE_KEY,
                format!("{what} is [rabbitmq] stream, which the stream target declares itself (declare_stream): remove it here"),
            ));
        }
        if q.kind != QueueType::Classic && !q.durable {
            errors.push(SettingError::new(
                QUEUE_KEY,
                format!(
                    "{what}: a {} queue is always durable: remove durable = false, or use type = \"classic\"",
                    q.kind.as_str()
                ),
            ));
        }
        if let Some(v) = q.arguments.get("x-queue-type") {
            if v.as_str() != Some(q.kind.as_str()) {
                errors.push(SettingError::new(
                    QUEUE_KEY,
                    format!(
                        "{what}: arguments.x-queue-type = {v} disagrees with type = \"{}\": set the type with `type` only",
                        q.kind.as_str()
                    ),
                ));
            }
        }
        if q.arguments.contains_key("x-dead-letter-routing-key")
            && !q.arguments.contains_key("x-dead-letter-exchange")
        {
            errors.push(SettingError::new(
                QUEUE_KEY,
                format!("{what}: x-dead-letter-routing-key without x-dead-letter-exchange does nothing: add x-dead-letter-exchange (\"\" for the default exchange)"),
            ));
        }
        check_args(&mut errors, QUEUE_KEY, &what, &q.arguments, QUEUE_ARGS);
        check_bindings(&mut errors, QUEUE_KEY, &what, &q.bindings, &known_source);
    }
    errors
}

/// An exchange or queue name RabbitMQ accepts and does not reserve.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the name is empty: give name = \"...\"".into());
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "the name is {} bytes long: RabbitMQ takes at most {MAX_NAME_BYTES}",
            name.len()
        ));
    }
    if name.starts_with("amq.") {
        return Err("names starting with `amq.` are reserved by the broker: choose another".into());
    }
    if name.chars().any(char::is_control) {
        return Err("the name holds a control character: remove it".into());
    }
    Ok(())
}

fn check_bindings(
    errors: &mut Vec<SettingError>,
    key: &'static str,
    what: &str,
    bindings: &[Binding],
    known_source: &dyn Fn(&str) -> bool,
) {
    let mut seen = HashSet::new();
    for (j, b) in bindings.iter().enumerate() {
        let which = format!("{what}, binding #{}", j + 1);
        if b.exchange.is_empty() {
            errors.push(SettingError::new(
                key,
                format!("{which}: the default exchange \"\" cannot be bound (it routes by queue name already): name an exchange"),
            ));
        } else if !known_source(&b.exchange) {
            errors.push(SettingError::new(
                key,
                format!(
                    "{which}: the exchange {:?} is not declared: add a [[topology.exchange]] for it, or bind to [rabbitmq] exchange, dead_letter_exchange or an amq.* exchange",
                    b.exchange
                ),
            ));
        }
        if b.routing_key.len() > MAX_NAME_BYTES {
            errors.push(SettingError::new(
                key,
                format!("{which}: the routing key is longer than {MAX_NAME_BYTES} bytes"),
            ));
        }
        let args = serde_json::to_string(&b.arguments).unwrap_or_default();
        if !seen.insert((b.exchange.as_str(), b.routing_key.as_str(), args)) {
            errors.push(SettingError::new(
                key,
                format!("{which} repeats an earlier binding: remove it"),
            ));
        }
        check_args(errors, key, &which, &b.arguments, BINDING_ARGS);
    }
}

fn check_args(
    errors: &mut Vec<SettingError>,
    key: &'static str,
    what: &str,
    args: &Arguments,
    known: &[(&str, Want)],
) {
    for (name, value) in args {
        if let Some(reason) = unusable(value) {
            errors.push(SettingError::new(
                key,
                format!("{what}: arguments.{name} {reason}"),
            ));
            continue;
        }
        let Some(&(_, want)) = known.iter().find(|(k, _)| k == name) else {
            continue;
        };
        let ok = match want {
            Want::Int(min) => value.as_i64().is_some_and(|n| n >= min),
            Want::IntIn(lo, hi) => value.as_i64().is_some_and(|n| (lo..=hi).contains(&n)),
            Want::Str => value.is_string(),
            Want::Bool => value.is_boolean(),
            Want::OneOf(allowed) => value.as_str().is_some_and(|s| allowed.contains(&s)),
        };
        if !ok {
            let expected = match want {
                Want::Int(0) => "a whole number ≥ 0 (no quotes)".to_string(),
                Want::Int(min) => format!("a whole number ≥ {min} (no quotes)"),
                Want::IntIn(lo, hi) => format!("a whole number from {lo} to {hi} (no quotes)"),
                Want::Str => "a string".to_string(),
                Want::Bool => "true or false".to_string(),
                Want::OneOf(allowed) => format!(
                    "one of {}",
                    allowed
                        .iter()
                        .map(|s| format!("{s:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            errors.push(SettingError::new(
                key,
                format!("{what}: arguments.{name} = {value} must be {expected}"),
            ));
        }
    }
}

/// Why a value cannot be sent as an AMQP field value, if it cannot.
fn unusable(value: &ArgValue) -> Option<&'static str> {
    match value {
        ArgValue::Null => Some("has no value"),
        ArgValue::Number(n) if n.as_i64().is_none() && n.as_f64().is_none() => {
            Some("is a number out of range (a signed 64-bit whole number at most)")
        }
        ArgValue::Array(items) => items.iter().find_map(unusable),
        // How a TOML date or time comes through serde.
        ArgValue::Object(map) if map.contains_key("$__toml_private_datetime") => {
            Some("is a date or time, which AMQP arguments cannot hold: give a number or a string")
        }
        ArgValue::Object(map) => map.values().find_map(unusable),
        _ => None,
    }
}
