//! `[topology]` (issue #43, part 3) against the real broker: declared from the
//! configuration by `check --declare` and by `run` (`declare_topology = true`, again
//! after a reconnect), compared by `check` (present, missing, or different with the
//! argument and the fix, exit 2, nothing changed on the broker), and a quorum queue
//! whose expired messages are dead-lettered by its own arguments. Every name is the
//! test's own (`unique_name`); the queues are deleted at the end.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use support::*;
use testkit::unique_name;

const WAIT: Duration = Duration::from_secs(60);

/// The line of `check`'s output about `name` (`queue q`, `exchange x`).
fn line_of<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| {
            l.get(6..)
                .is_some_and(|rest| rest.starts_with(&format!("{name}: ")))
        })
        .unwrap_or_else(|| panic!("no line for {name} in:\n{out}"))
}

/// An exchange bound to the relay's exchange, and a queue bound to it.
fn topology(exchange: &str, x: &str, q: &str, queue_type: &str, ttl: u64) -> String {
    format!(
        r##"
[[topology.exchange]]
name = "{x}"
type = "topic"
bindings = [{{ exchange = "{exchange}", routing_key = "order.#" }}]

[[topology.queue]]
name = "{q}"
type = "{queue_type}"
arguments = {{ x-message-ttl = {ttl}, x-max-length = 10000 }}
bindings = [{{ exchange = "{x}", routing_key = "order.*" }}]
"##
    )
}

/// Declares `q` with lapin (another client) with these arguments: Ok when the broker
/// has it so, Err when its arguments differ (the channel is lost; a new one is used).
async fn declared_as(env: &Env, q: &str, args: &[(&str, AMQPValue)]) -> Result<(), String> {
    let channel = env.broker.connection.create_channel().await.unwrap();
    let mut table = FieldTable::default();
    for (k, v) in args {
        table.insert(ShortString::from(*k), v.clone());
    }
    let declared = channel
        .queue_declare(
            q.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table,
        )
        .await;
    declared.map(|_| ()).map_err(|e| e.to_string())
}

/// Whether `q` exists (a passive declaration by lapin).
async fn exists(env: &Env, q: &str) -> bool {
    let channel = env.broker.connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            q.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok()
}

async fn wait_for_queue(env: &Env, q: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !exists(env, q).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue {q} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn str_arg(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Publishes `key` to `exchange` with lapin and gets one message from `q`
/// (routing through the declared bindings); `true` when it arrived.
async fn routes(env: &Env, exchange: &str, key: &str, q: &str) -> bool {
    let channel = env.broker.connection.create_channel().await.unwrap();
    channel
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            b"probe",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    for _ in 0..50 {
        let got = channel
            .basic_get(q.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if got.is_some() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn delete_queues(env: &Env, queues: &[&str]) {
    for q in queues {
        let _ = env
            .broker
            .channel
            .queue_delete((*q).into(), QueueDeleteOptions::default())
            .await;
    }
}

/// `check` reports the topology missing (FAIL: declare_topology = false), `check
/// --declare` declares it as configured (bindings included), `check` then finds it
/// present; changed to another x-message-ttl, then to a quorum queue, `check` names
/// the differing argument and the fix and exits 2, `check --declare` and `run` (with
/// `declare_topology`) refuse the same way with exit 2, and the broker's queue is left
/// as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_declare_declares_the_topology_and_check_names_each_difference() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.broker.exchange_name("tx");
    let q = unique_name("tq");
    env.extra = topology(&env.exchange, &x, &q, "classic", 60_000);

    let out = env.cli(&["check"]);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        line_of(&t, &format!("exchange {x}")).starts_with("FAIL"),
        "{t}"
    );
    let missing = line_of(&t, &format!("queue {q}"));
    assert!(
        missing.starts_with("FAIL") && missing.contains("missing, and run will not declare it"),
        "{t}"
    );
    assert!(!exists(&env, &q).await, "check created the queue");

    let out = env.cli(&["check", "--declare"]);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    assert!(line_of(&t, &format!("queue {q}")).starts_with("ok"), "{t}");
    // As configured: another client declaring it so is answered declare-ok.
    let classic = [
        ("x-queue-type", str_arg("classic")),
        ("x-message-ttl", AMQPValue::LongLongInt(60_000)),
        ("x-max-length", AMQPValue::LongLongInt(10_000)),
    ];
    declared_as(&env, &q, &classic).await.unwrap();
    // Bound through the topology's exchange-to-exchange and queue bindings.
    assert!(routes(&env, &env.exchange, "order.placed", &q).await);
    assert!(!routes(&env, &env.exchange, "invoice.sent", &q).await);

    let out = env.cli(&["check"]);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    assert_eq!(
        line_of(&t, &format!("queue {q}")),
        format!("ok    queue {q}: exists as configured")
    );
    assert!(
        line_of(&t, &format!("exchange {x}")).starts_with("ok"),
        "{t}"
    );

    // Another TTL: the broker's 406 names it.
    env.extra = topology(&env.exchange, &x, &q, "classic", 1_000);
    let out = env.cli(&["check"]);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    let different = line_of(&t, &format!("queue {q}"));
    assert!(
        different.starts_with("FAIL")
            && different.contains("differs from the configuration in x-message-ttl")
            && different.contains("received '1000' but current is '60000'")
            && different.contains(&format!("rabbitmqctl delete_queue {q}"))
            && different.contains("change its [[topology.queue]]"),
        "{t}"
    );
    // The exchange is unaffected and still says so.
    assert!(
        line_of(&t, &format!("exchange {x}")).starts_with("ok"),
        "{t}"
    );

    // Another type: a quorum queue where a classic one is.
    env.extra = topology(&env.exchange, &x, &q, "quorum", 60_000);
    let out = env.cli(&["check"]);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    let different = line_of(&t, &format!("queue {q}"));
    assert!(
        different.contains("differs from the configuration in x-queue-type")
            && different.contains("its type cannot change"),
        "{t}"
    );
    // `check --declare` refuses it the same way, exit 2, and changes nothing.
    let out = env.cli(&["check", "--declare"]);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains(&format!("queue \"{q}\" cannot be declared: (406)"))
            && t.contains("inequivalent arg 'x-queue-type'"),
        "{t}"
    );
    declared_as(&env, &q, &classic).await.unwrap();
    // `run` declaring it (declare_topology = true) stops at start with exit 2 and
    // the broker's words, publishing nothing.
    let vars = [("OUTBOX_RELAY_RABBITMQ_DECLARE_TOPOLOGY", "true")];
    let mut relay = env.start_env(&[], &vars);
    let code = relay.wait(Duration::from_secs(30));
    let log = relay.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!("queue \"{q}\" cannot be declared"))
            && log.contains("inequivalent arg 'x-queue-type'"),
        "{log}"
    );
    declared_as(&env, &q, &classic).await.unwrap();

    delete_queues(&env, &[&q]).await;
    env.cleanup().await;
}

/// With `declare_topology = true`, `run` declares the topology before it publishes,
/// events reach the topology's queue through its bindings, and after the broker
/// closed the relay's connection the topology is declared again (a queue deleted
/// meanwhile comes back). `check` then says the queue would be declared by run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_declares_the_topology_and_declares_it_again_after_a_reconnect() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.broker.exchange_name("tx");
    let q = unique_name("tq");
    env.extra = topology(&env.exchange, &x, &q, "quorum", 600_000);
    let vars = [("OUTBOX_RELAY_RABBITMQ_DECLARE_TOPOLOGY", "true")];

    let out = env.cli_env(&["check"], &vars);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        line_of(&t, &format!("queue {q}"))
            .contains("missing, run will declare it (declare_topology = true)"),
        "{t}"
    );
    assert!(!exists(&env, &q).await, "check created the queue");

    let relay = env.start_env(&[], &vars);
    wait_for_queue(&env, &q).await;
    let received = env.broker.consume(&q).await;
    env.insert_tx(&[
        ("order", "o1", "placed", "{}"),
        ("order", "o1", "paid", "{}"),
    ]);
    let msgs = tokio::time::timeout(WAIT, received.wait_for(2, WAIT * 2))
        .await
        .unwrap_or_else(|_| panic!("nothing arrived; the relay's log:\n{}", relay.log_text()));
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(types, ["placed", "paid"]);

    // The queue deleted under the running relay, then its connection closed: the
    // relay reconnects and declares the topology again before it publishes.
    delete_queues(&env, &[&q]).await;
    assert!(!exists(&env, &q).await, "the queue was not deleted");
    let name = format!("outbox-relay {}", env.slot);
    let conns = testkit::connections::named(&name);
    assert!(!conns.is_empty(), "the relay's connection is not listed");
    for c in &conns {
        testkit::connections::close(c, "closed by a test");
    }
    wait_for_queue(&env, &q).await;
    let received = env.broker.consume(&q).await;
    env.insert_tx(&[("order", "o2", "shipped", "{}")]);
    let msgs = tokio::time::timeout(WAIT, received.wait_for(1, WAIT * 2))
        .await
        .unwrap_or_else(|_| panic!("nothing arrived; the relay's log:\n{}", relay.log_text()));
    assert_eq!(msgs[0].header("event_type").as_deref(), Some("shipped"));

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    delete_queues(&env, &[&q]).await;
    env.cleanup().await;
}

/// A quorum queue with a dead-letter exchange, a delivery limit and a message TTL
/// of its own, declared by `check --declare` with its dead-letter exchange and
/// queue: an event the relay publishes expires there and is dead-lettered by the
/// broker to the dead-letter queue. A dead-letter policy on the queue is not an argument:
/// `check` still finds it as configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_dead_letters_by_its_own_arguments() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let dlx = env.broker.exchange_name("tdlx");
    let q = unique_name("tq");
    let dead = unique_name("tdead");
    env.extra = format!(
        r##"
[[topology.exchange]]
name = "{dlx}"
type = "fanout"

[[topology.queue]]
name = "{dead}"
bindings = [{{ exchange = "{dlx}" }}]

[[topology.queue]]
name = "{q}"
type = "quorum"
arguments = {{ x-dead-letter-exchange = "{dlx}", x-dead-letter-strategy = "at-most-once", x-delivery-limit = 3, x-message-ttl = 300 }}
bindings = [{{ exchange = "{exchange}", routing_key = "#" }}]
"##,
        exchange = env.exchange
    );
    let out = env.cli(&["check", "--declare"]);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    let policy = unique_name("tpol");
    let set = testkit::rabbitmqctl_command()
        .args([
            "-q",
            "set_policy",
            &policy,
            &format!("^{q}$"),
            &format!(r#"{{"dead-letter-exchange":"{dlx}","max-length":5000}}"#),
            "--apply-to",
            "queues",
        ])
        .output()
        .unwrap();
    assert!(set.status.success(), "{}", output_text(&set));
    let out = env.cli(&["check"]);
    let t = output_text(&out);
    let _ = testkit::rabbitmqctl_command()
        .args(["-q", "clear_policy", &policy])
        .output();
    assert!(out.status.success(), "{t}");
    assert!(
        line_of(&t, &format!("queue {q}")).ends_with("exists as configured"),
        "{t}"
    );

    // A quorum queue with its arguments: another client declaring it so is
    // answered declare-ok, as a classic queue it is refused.
    let quorum = [
        ("x-queue-type", str_arg("quorum")),
        ("x-dead-letter-exchange", str_arg(&dlx)),
        ("x-dead-letter-strategy", str_arg("at-most-once")),
        ("x-delivery-limit", AMQPValue::LongLongInt(3)),
        ("x-message-ttl", AMQPValue::LongLongInt(300)),
    ];
    declared_as(&env, &q, &quorum).await.unwrap();
    let mut classic = quorum.clone();
    classic[0].1 = str_arg("classic");
    assert!(declared_as(&env, &q, &classic).await.is_err());

    let received = env.broker.consume(&dead).await;
    let relay = env.start(&[]);
    env.insert_tx(&[("order", "o1", "placed", "{}")]);
    let msgs = received.wait_for(1, WAIT).await;
    assert_eq!(msgs[0].header("event_type").as_deref(), Some("placed"));
    assert_eq!(
        msgs[0].header("x-first-death-reason").as_deref(),
        Some("expired")
    );
    assert_eq!(
        msgs[0].header("x-first-death-queue").as_deref(),
        Some(q.as_str())
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    delete_queues(&env, &[&q, &dead]).await;
    env.cleanup().await;
}

/// An exchange named per event (`exchange = "<prefix>.{aggregate_type}"`) that
/// `[topology]` declares with arguments is declared as the topology says when its
/// first event comes, not plainly (which the broker would refuse as inequivalent):
/// its events are delivered, and one its bindings do not route goes to its
/// alternate exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_named_per_event_is_declared_as_the_topology_says() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let prefix = env.exchange.clone();
    let order_x = format!("{prefix}.order");
    let ae = env.broker.exchange_name("tae");
    let (q, unrouted) = (unique_name("tq"), unique_name("tunrouted"));
    env.extra = format!(
        r##"
[[topology.exchange]]
name = "{ae}"
type = "fanout"

[[topology.exchange]]
name = "{order_x}"
type = "topic"
arguments = {{ alternate-exchange = "{ae}" }}

[[topology.queue]]
name = "{unrouted}"
bindings = [{{ exchange = "{ae}" }}]

[[topology.queue]]
name = "{q}"
bindings = [{{ exchange = "{order_x}", routing_key = "order.placed" }}]
"##
    );
    let template = format!("{prefix}.{{aggregate_type}}");
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_EXCHANGE", template.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_DECLARE_TOPOLOGY", "true"),
    ];
    let relay = env.start_env(&[], &vars);
    wait_for_queue(&env, &q).await;
    wait_for_queue(&env, &unrouted).await;
    let placed = env.broker.consume(&q).await;
    let other = env.broker.consume(&unrouted).await;
    env.insert_tx(&[
        ("order", "o1", "placed", "{}"),
        ("order", "o1", "cancelled", "{}"),
    ]);
    let got = tokio::time::timeout(WAIT, placed.wait_for(1, WAIT * 2))
        .await
        .unwrap_or_else(|_| panic!("nothing arrived; the relay's log:\n{}", relay.log_text()));
    assert_eq!(got[0].header("event_type").as_deref(), Some("placed"));
    assert_eq!(got[0].exchange, order_x);
    let got = other.wait_for(1, WAIT).await;
    assert_eq!(got[0].header("event_type").as_deref(), Some("cancelled"));
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    delete_queues(&env, &[&q, &unrouted]).await;
    let _ = env
        .broker
        .channel
        .exchange_delete(order_x.as_str().into(), Default::default())
        .await;
    env.cleanup().await;
}

/// The relay's user without `configure` (the topology declared once by another
/// user): `check` still looks every object up (passive declarations need no
/// permission) and says it cannot compare the arguments of those that exist (a
/// `warn` naming the permission, exit 0); `check --declare` as that user is refused
/// with exit 2 and the permission named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_configure_check_looks_up_and_says_what_it_cannot_compare() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.broker.exchange_name("tx");
    let q = unique_name("tq");
    env.extra = topology(&env.exchange, &x, &q, "classic", 60_000);
    let out = env.cli(&["check", "--declare"]);
    assert!(out.status.success(), "{}", output_text(&out));

    let password = "Vt4pQ9wz";
    let user = testkit::hostile::BrokerUser::new("topo", password);
    testkit::hostile::rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &user.0,
        "^$",
        &format!("^{}$", env.exchange),
        "^$",
    ]);
    let url = testkit::amqp_url().replacen("guest:guest@", &format!("{}:{password}@", user.0), 1);
    assert_ne!(
        url,
        testkit::amqp_url(),
        "the test broker's URL logs in as guest"
    );
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_URL", url.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "false"),
    ];
    let out = env.cli_env(&["check"], &vars);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    for name in [format!("queue {q}"), format!("exchange {x}")] {
        let l = line_of(&t, &name);
        assert!(
            l.starts_with("warn")
                && l.contains("(403) ACCESS_REFUSED")
                && l.contains("needs `configure`"),
            "{t}"
        );
    }
    let out = env.cli_env(&["check", "--declare"], &vars);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains("cannot be declared: (403)") && t.contains("`configure`"),
        "{t}"
    );
    drop(user);
    delete_queues(&env, &[&q]).await;
    env.cleanup().await;
}

/// The relay's own exchange declared by `[topology]` with an alternate exchange: a
/// message neither routes is returned (mandatory) and retried on a new channel, and
/// each retry declares the exchange again as the topology says (a plain declaration
/// would be refused as inequivalent and stop the relay). Once a queue is bound to
/// the alternate exchange, the retry delivers there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_declare_the_relays_exchange_as_the_topology_says() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let ae = env.broker.exchange_name("tae");
    env.extra = format!(
        r##"
[[topology.exchange]]
name = "{ae}"
type = "fanout"

[[topology.exchange]]
name = "{exchange}"
type = "topic"
arguments = {{ alternate-exchange = "{ae}" }}
"##,
        exchange = env.exchange
    );
    let vars = [("OUTBOX_RELAY_RABBITMQ_DECLARE_TOPOLOGY", "true")];
    let mut relay = env.start_env(&[], &vars);
    env.insert_tx(&[("order", "o1", "cancelled", "{}")]);
    // Returned (no queue behind either exchange) and retried for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // (Looked at without waiting: `Relay::wait` kills a relay still running.)
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay stopped: {}",
        relay.log_text()
    );
    let parked = env.broker.queue_bound(&ae, "").await;
    let received = env.broker.consume(&parked).await;
    let msgs = tokio::time::timeout(WAIT, received.wait_for(1, WAIT * 2))
        .await
        .unwrap_or_else(|_| panic!("nothing arrived; the relay's log:\n{}", relay.log_text()));
    assert_eq!(msgs[0].header("event_type").as_deref(), Some("cancelled"));
    let log = relay.log_text();
    assert!(log.contains("unroutable"), "{log}");
    assert!(!log.contains("inequivalent"), "{log}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
