//! `check --routes` (issue #43, docs/routing.md "Checking routes before deploying"):
//! an event type that no binding routes is found before the relay publishes
//! anything, from the slot's pending events and the table's recent rows, through the
//! declared `[[topology.*]]` and through the broker's own bindings read from the
//! management API (`OUTBOX_TEST_MANAGEMENT_URL`, scripts/test-services.sh).
#![allow(clippy::unwrap_used)]

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;
use support::*;

const MESSAGES: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_MESSAGES", "[\"outbox\"]");

/// A variable scripts/test-services.sh writes (target/test-services.env).
fn service_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: run scripts/test-services.sh and source target/test-services.env"
        )
    })
}

/// The report's row of `aggregate/event`: its table line.
fn row<'a>(text: &'a str, aggregate: &str, event: &str) -> &'a str {
    text.lines()
        .find(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1] == aggregate && cols[2] == event
        })
        .unwrap_or_else(|| panic!("no row for {aggregate}/{event} in:\n{text}"))
}

/// Through the declared topology only: a queue bound to the relay's exchange, an
/// exchange bound to it with a queue of its own; a row's and a logical message's
/// event types that none of them routes are named (exit 2), before any publish;
/// once bound, the check passes.
#[tokio::test]
async fn check_routes_finds_an_unroutable_event_type_through_the_declared_topology() {
    let mut env = Env::new().await;
    // A row committed long ago (before the slot: not pending) is outside --since.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('ancient', 'a-1', 'gone', '{}', now() - interval '3 days')",
    );
    let out = env.cli_env(&["slot", "create"], &[MESSAGES]);
    assert!(out.status.success(), "{}", stderr(&out));
    let billing = testkit::unique_name("billing");
    let audit_x = testkit::unique_name("audit");
    let audit_q = testkit::unique_name("audit_q");
    let topology = format!(
        "[[topology.exchange]]\nname = {audit_x:?}\ntype = \"fanout\"\n\
         bindings = [{{ exchange = {x:?}, routing_key = \"invoice.#\" }}]\n\n\
         [[topology.queue]]\nname = {billing:?}\n\
         bindings = [{{ exchange = {x:?}, routing_key = \"order.*\" }}]\n\n\
         [[topology.queue]]\nname = {audit_q:?}\n\
         bindings = [{{ exchange = {audit_x:?} }}]\n",
        x = env.exchange
    );
    env.extra = topology.clone();
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("order", "o-2", "cancelled", "{}"),
        ("invoice", "i-1", "paid", "{}"),
        ("shipment", "s-1", "sent", "{}"),
    ]);
    env.db.psql(
        "SELECT pg_logical_emit_message(true, 'outbox', \
           '{\"aggregate_type\":\"parcel\",\"aggregate_id\":\"p-1\",\"event_type\":\"lost\",\"payload\":{}}')",
    );

    let out = env.cli_env(&["check", "--routes"], &[MESSAGES]);
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}\n{err}");
    assert!(row(&text, "order", "created").ends_with(&billing), "{text}");
    assert!(
        row(&text, "order", "cancelled").ends_with(&billing),
        "{text}"
    );
    assert!(row(&text, "invoice", "paid").ends_with(&audit_q), "{text}");
    assert!(row(&text, "shipment", "sent").contains("NONE"), "{text}");
    // The logical message, from the slot only.
    let parcel = row(&text, "parcel", "lost");
    assert!(
        parcel.starts_with("message:outbox")
            && parcel.contains("pending 1")
            && parcel.contains("NONE"),
        "{text}"
    );
    // Pending and recent rows both saw the row; --since (24h) leaves the old one out.
    assert!(
        row(&text, "order", "created").contains("pending 1, rows"),
        "{text}"
    );
    assert!(!text.contains("ancient"), "{text}");
    assert!(
        err.contains("2 (table, aggregate_type, event_type) reach no queue")
            && err.contains("shipment/sent")
            && err.contains("message:outbox parcel/lost"),
        "{err}"
    );
    // Nothing was published, nothing consumed: the events are still pending.
    let peek = env.cli_env(&["peek"], &[MESSAGES]);
    assert_eq!(stdout(&peek).lines().count(), 5, "{}", stdout(&peek));

    // A wider --since sees the old row too.
    let out = env.cli_env(&["check", "--routes", "--since", "7d"], &[MESSAGES]);
    assert!(row(&stdout(&out), "ancient", "gone").contains("NONE"));

    // Bound: every one reaches a queue.
    env.extra = format!(
        "{topology}\n[[topology.queue]]\nname = \"{billing}_rest\"\n\
         bindings = [{{ exchange = {x:?}, routing_key = \"shipment.*\" }}, {{ exchange = {x:?}, routing_key = \"parcel.#\" }}]\n",
        x = env.exchange
    );
    let out = env.cli_env(&["check", "--routes"], &[MESSAGES]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("ok    routes: every one of 5 reaches a queue"));
    env.cleanup().await;
}

/// Through the management API: the broker's own bindings (declared here, not in the
/// config) route one event type and not another; an x-consistent-hash exchange on
/// the way is "not evaluated", listed but neither routed nor counted; the
/// credentials given in the URL are never printed.
#[tokio::test]
async fn check_routes_finds_an_unroutable_event_type_through_the_management_api() {
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.exchange.clone();
    env.broker.declare_exchange(&x, "topic").await;
    let billing = env.broker.queue_bound(&x, "order.*").await;
    let hash = testkit::unique_name("hash");
    let ch = &env.broker.channel;
    ch.exchange_declare(
        hash.as_str().into(),
        ExchangeKind::Custom("x-consistent-hash".into()),
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_bind(
        hash.as_str().into(),
        x.as_str().into(),
        "shipment.#".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let shards = env.broker.queue_bound(&hash, "1").await;
    let with_password = management_url().replacen("://", "://guest:guest@", 1);
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("invoice", "i-1", "paid", "{}"),
        ("shipment", "s-1", "sent", "{}"),
    ]);

    let out = run(&env, &with_password);
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}\n{err}");
    assert!(text.contains("ok    management API: http://"), "{text}");
    assert!(
        !text.contains("guest:guest") && !err.contains("guest:guest"),
        "{text}\n{err}"
    );
    assert!(row(&text, "order", "created").ends_with(&billing), "{text}");
    assert!(row(&text, "invoice", "paid").contains("NONE"), "{text}");
    let shipment = row(&text, "shipment", "sent");
    assert!(
        shipment.contains("not evaluated") && shipment.contains("x-consistent-hash"),
        "{text}"
    );
    assert!(!shipment.contains(&shards), "{text}");
    assert!(
        err.contains("1 (table, aggregate_type, event_type) reach no queue")
            && err.contains("invoice/paid"),
        "{err}"
    );
    // Credentials from [rabbitmq] url when the management URL has none: same answer.
    let out = run(&env, &management_url());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(row(&stdout(&out), "invoice", "paid").contains("NONE"));

    // The broker gains a binding: the check passes.
    env.broker.queue_bound(&x, "invoice.*").await;
    let out = run(&env, &management_url());
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));

    let _ = env
        .broker
        .channel
        .exchange_delete(hash.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    env.cleanup().await;
}

fn run(env: &Env, management_url: &str) -> std::process::Output {
    env.cli_env(
        &["check", "--routes"],
        &[("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", management_url)],
    )
}

/// An exchange per aggregate type (`[rabbitmq] exchange = "<prefix>.{aggregate_type}"`):
/// each shape is matched on its own exchange; one the broker lacks is said to be
/// declared by run, without bindings, so its events reach no queue.
#[tokio::test]
async fn check_routes_follows_the_exchange_of_each_event() {
    let mut env = Env::new().await;
    let prefix = testkit::unique_name("ctx");
    let orders = format!("{prefix}.order");
    env.broker.declare_exchange(&orders, "topic").await;
    let q = env.broker.queue_bound(&orders, "order.#").await;
    env.create_slot();
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("invoice", "i-1", "paid", "{}"),
    ]);
    let template = format!("{prefix}.{{aggregate_type}}");
    let out = env.cli_env(
        &["check", "--routes"],
        &[
            ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", &management_url()),
            ("OUTBOX_RELAY_RABBITMQ_EXCHANGE", &template),
        ],
    );
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}\n{err}");
    let order = row(&text, "order", "created");
    assert!(order.contains(&orders) && order.ends_with(&q), "{text}");
    let invoice = row(&text, "invoice", "paid");
    assert!(
        invoice.contains(&format!("{prefix}.invoice")) && invoice.contains("NONE"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "warn  exchange {prefix}.invoice: missing on the broker; run declares it"
        )),
        "{text}"
    );
    env.cleanup().await;
}

fn rabbitmqctl(args: &[&str]) {
    let out = testkit::rabbitmqctl_command().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A policy made for one test; cleared on drop, even when the test fails.
struct Policy(String);

impl Drop for Policy {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command()
            .args(["clear_policy", &self.0])
            .output();
    }
}

/// An alternate exchange set by a policy, not by the exchange's arguments: the
/// event type no binding routes reaches the alternate exchange's queue (exit 0;
/// before policies were read, it was reported as reaching no queue).
#[tokio::test]
async fn check_routes_follows_an_alternate_exchange_set_by_a_policy() {
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.exchange.clone();
    env.broker.declare_exchange(&x, "topic").await;
    let billing = env.broker.queue_bound(&x, "order.*").await;
    let ae = format!("{x}.unrouted");
    env.broker.declare_exchange(&ae, "fanout").await;
    let unrouted = env.broker.queue_bound(&ae, "").await;
    let guard = Policy(testkit::unique_name("ae-policy"));
    let definition = format!(r#"{{"alternate-exchange":"{ae}"}}"#);
    rabbitmqctl(&[
        "set_policy",
        "--apply-to",
        "exchanges",
        &guard.0,
        &format!("^{}$", x.replace('.', "\\.")),
        &definition,
    ]);
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("invoice", "i-1", "paid", "{}"),
    ]);
    // The policy reaches the exchange a moment after it is set.
    let mut text = String::new();
    for _ in 0..50 {
        let out = run(&env, &management_url());
        text = stdout(&out);
        if out.status.success() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(row(&text, "order", "created").ends_with(&billing), "{text}");
    assert!(row(&text, "invoice", "paid").ends_with(&unrouted), "{text}");

    drop(guard);
    env.cleanup().await;
}

/// The management API over HTTPS (`OUTBOX_TEST_MANAGEMENT_TLS_URL`, the broker's
/// test CA): with `[rabbitmq] ca_file` the same answer as over HTTP; without it the
/// handshake is refused with an error that names `ca_file`, and no password is shown.
#[tokio::test]
async fn check_routes_reads_the_management_api_over_https() {
    let mut env = Env::new().await;
    env.create_slot();
    let x = env.exchange.clone();
    env.broker.declare_exchange(&x, "topic").await;
    let billing = env.broker.queue_bound(&x, "order.*").await;
    env.insert_tx(&[("order", "o-1", "created", "{}")]);
    let https = service_var("OUTBOX_TEST_MANAGEMENT_TLS_URL");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    let with_password = https.replacen("://", "://guest:guest@", 1);

    let out = env.cli_env(
        &["check", "--routes"],
        &[
            ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", &with_password),
            ("OUTBOX_RELAY_RABBITMQ_CA_FILE", &ca),
        ],
    );
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}\n{err}");
    assert!(text.contains("ok    management API: https://"), "{text}");
    assert!(row(&text, "order", "created").ends_with(&billing), "{text}");
    assert!(!text.contains("guest:guest") && !err.contains("guest:guest"));

    let out = env.cli_env(
        &["check", "--routes"],
        &[("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", &with_password)],
    );
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}\n{err}");
    assert!(err.contains("ca_file"), "{text}\n{err}");
    assert!(!text.contains("guest:guest") && !err.contains("guest:guest"));
    env.cleanup().await;
}
