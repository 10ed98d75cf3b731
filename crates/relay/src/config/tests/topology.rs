//! `[topology]` and `[rabbitmq] declare_topology`: read from the file only, with
//! every declaration checked at load.

use super::*;
use publisher::settings::{ArgValue, QueueType};

const FULL: &str = r#"
[rabbitmq]
exchange = "outbox"
dead_letter_exchange = "outbox.dlx"
declare_topology = true

[[topology.exchange]]
name = "orders"
type = "x-consistent-hash"
arguments = { alternate-exchange = "orders.unrouted" }
bindings = [{ exchange = "outbox", routing_key = "orders.*" }]

[[topology.exchange]]
name = "orders.unrouted"
type = "fanout"
durable = false
auto_delete = true
internal = true

[[topology.queue]]
name = "billing"
type = "quorum"
arguments = { x-dead-letter-exchange = "outbox.dlx", x-delivery-limit = 5, x-message-ttl = 60000 }
bindings = [
    { exchange = "orders", routing_key = "10" },
    { exchange = "amq.headers", arguments = { x-match = "all", event_type = "OrderPlaced" } },
]

[[topology.queue]]
name = "audit"
"#;

#[test]
fn topology_is_read_with_its_defaults() {
    let c = load_toml(FULL).unwrap();
    assert!(c.rabbitmq.declare_topology);
    let t = &c.topology;
    assert_eq!(t.exchanges.len(), 2);
    let orders = t.exchange("orders").unwrap();
    assert_eq!(orders.kind, "x-consistent-hash");
    assert!(orders.durable && !orders.auto_delete && !orders.internal);
    assert_eq!(
        orders.arguments["alternate-exchange"],
        ArgValue::from("orders.unrouted")
    );
    assert_eq!(orders.bindings[0].exchange, "outbox");
    assert_eq!(orders.bindings[0].routing_key, "orders.*");
    let unrouted = t.exchange("orders.unrouted").unwrap();
    assert!(!unrouted.durable && unrouted.auto_delete && unrouted.internal);
    let billing = t.queue("billing").unwrap();
    assert_eq!(billing.kind, QueueType::Quorum);
    assert!(billing.durable);
    assert_eq!(billing.arguments["x-delivery-limit"], ArgValue::from(5));
    assert_eq!(billing.bindings[1].routing_key, "");
    assert_eq!(
        billing.bindings[1].arguments["x-match"],
        ArgValue::from("all")
    );
    let audit = t.queue("audit").unwrap();
    assert_eq!(audit.kind, QueueType::Classic);
    assert!(audit.arguments.is_empty() && audit.bindings.is_empty());
    // Nothing declared by default.
    assert!(Config::default().topology.is_empty());
    assert!(!Config::default().rabbitmq.declare_topology);
}

/// Every problem at once, each naming the object: empty, long, reserved and
/// repeated names, an undeclared source exchange, mistyped arguments.
#[test]
fn topology_problems_are_all_named() {
    let toml = r#"
[[topology.exchange]]
name = ""

[[topology.exchange]]
name = "amq.mine"

[[topology.queue]]
name = "q"
arguments = { x-message-ttl = "60s", x-max-length = -1, x-overflow = "drop-tail" }
bindings = [{ exchange = "nowhere", routing_key = "k" }, { exchange = "" }]

[[topology.queue]]
name = "q"
type = "quorum"
durable = false
"#;
    let e = load_toml(&format!(
        "{toml}\n[[topology.queue]]\nname = \"{}\"\n",
        "x".repeat(256)
    ))
    .expect_err("accepted");
    let msg = e.to_string();
    for needle in [
        "exchange #1 (\"\"): the name is empty",
        "exchange #2 (\"amq.mine\"): names starting with `amq.` are reserved",
        "arguments.x-message-ttl = \"60s\" must be a whole number ≥ 0 (no quotes)",
        "arguments.x-max-length = -1 must be a whole number ≥ 0",
        "arguments.x-overflow = \"drop-tail\" must be one of",
        "binding #1: the exchange \"nowhere\" is not declared",
        "binding #2: the default exchange \"\" cannot be bound",
        "queue #2 (\"q\") is declared twice",
        "a quorum queue is always durable",
        "the name is 256 bytes long",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in:\n{msg}");
    }
    assert!(e
        .each()
        .iter()
        .all(|e| e.key().is_some_and(|k| k.starts_with("topology."))));
}

/// The source of a binding may be the configured exchange, the DLX or a broker
/// default; the configured exchange declared again must keep its type.
#[test]
fn binding_sources_and_the_configured_exchange() {
    let ok = r##"
[rabbitmq]
dead_letter_exchange = "dlx"
[[topology.queue]]
name = "q"
bindings = [{ exchange = "outbox" }, { exchange = "dlx" }, { exchange = "amq.topic", routing_key = "#" }]
"##;
    load_toml(ok).unwrap();
    let clash = r#"
[[topology.exchange]]
name = "outbox"
type = "fanout"
"#;
    let msg = err_about(load_toml(clash), "topology.exchange");
    assert!(
        msg.contains("declared as topic (rabbitmq.exchange_type) but here as fanout"),
        "{msg}"
    );
}

/// Environment variables cannot express arrays of tables: one that tries is refused
/// with the reason, not as a typo.
#[test]
fn topology_is_file_only() {
    let msg = err_about(
        load_env(&[("OUTBOX_RELAY_TOPOLOGY_QUEUE", "[{name = \"q\"}]")]),
        "topology",
    );
    assert!(msg.contains("configuration file only"), "{msg}");
    let c = load_env(&[("OUTBOX_RELAY_RABBITMQ_DECLARE_TOPOLOGY", "true")]).unwrap();
    assert!(c.rabbitmq.declare_topology);
}

#[test]
fn unknown_topology_keys_are_refused() {
    let e = load_toml("[[topology.queue]]\nname = \"q\"\ndurabel = true\n").expect_err("accepted");
    assert!(e.to_string().contains("durabel"), "{e}");
    let e = load_toml("[[topology.queue]]\nname = \"q\"\ntype = \"lazy\"\n").expect_err("accepted");
    assert!(e.to_string().contains("classic, quorum, stream"), "{e}");
}

/// A value of the wrong kind in a topology table says what the key takes.
#[test]
fn wrong_kinds_in_topology_tables_say_what_the_key_takes() {
    for (toml, key, expected) in [
        (
            "[[topology.queue]]\nname = \"q\"\ndurable = \"yes\"\n",
            "topology.queue.0.durable",
            "true or false",
        ),
        (
            "[[topology.queue]]\nname = \"q\"\nbindings = { exchange = \"x\" }\n",
            "topology.queue.0.bindings",
            "a list of tables",
        ),
        (
            "[topology]\nqueue = 5\n",
            "topology.queue",
            "[[topology.queue]]",
        ),
    ] {
        let e = load_toml(toml).expect_err("accepted");
        assert_eq!(e.key(), Some(key), "{e}");
        assert!(e.to_string().contains(expected), "{e}");
    }
    let e = load_toml("[[topology.queue]]\nname = \"q\"\narguments = { x-expires = 2019-01-01 }\n")
        .expect_err("accepted");
    assert!(e.to_string().contains("is a date or time"), "{e}");
}
