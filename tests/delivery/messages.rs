//! Logical decoding messages as events (docs/messages.md), end to end: the real
//! binary with `[postgres] messages = ["outbox"]` between the test cluster and
//! RabbitMQ, and a consumer asserting what arrived.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::*;
use testkit::free_addr;

use crate::observability::{sample, scrape_until};

const WAIT: Duration = Duration::from_secs(60);
const MESSAGES: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_MESSAGES", "[\"outbox\"]");

/// `pg_logical_emit_message(true, 'outbox', …)` of an event of aggregate `order`.
fn emit(aggregate_id: &str, event_type: &str, extra: &str) -> String {
    format!(
        "SELECT pg_logical_emit_message(true, 'outbox', \
           '{{\"aggregate_type\":\"order\",\"aggregate_id\":\"{aggregate_id}\",\"event_type\":\"{event_type}\",\"payload\":{{\"e\":\"{event_type}\"}}{extra}}}')"
    )
}

fn insert(aggregate_id: &str, event_type: &str) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
           VALUES ('order', '{aggregate_id}', '{event_type}', '{{}}')"
    )
}

fn system_identifier(env: &Env) -> String {
    env.db
        .psql("SELECT system_identifier FROM pg_control_system()")
}

/// Rows and messages of one transaction arrive in the order written; a rolled-back
/// transaction's message never; a non-transactional message and another tool's are
/// not relayed and are counted; ids, headers, body and routing are as for rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_among_rows_in_written_order_and_the_rest_is_counted() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("m.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    let relay = env.start_with_env(&config, "info", &[MESSAGES]);

    env.db.psql(&format!(
        "BEGIN; {}; {}; {}; {}; COMMIT;",
        insert("1", "row-1"),
        emit("1", "message-2", r#","headers":{"tenant":"acme"}"#),
        insert("1", "row-3"),
        emit("1", "message-4", r#","id":"own-id-4""#),
    ));
    env.db.psql(&format!(
        "BEGIN; {}; ROLLBACK;",
        emit("2", "rolled-back", "")
    ));
    env.db.psql(
        "BEGIN; SELECT pg_logical_emit_message(false, 'outbox', '{}'); ROLLBACK;
         SELECT pg_logical_emit_message(true, 'other-tool', 'not ours');",
    );
    env.db.psql(&emit("3", "message-5", ""));

    let msgs = got.wait_for(5, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs = {
        let after = got.snapshot();
        assert_eq!(after.len(), 5, "nothing else arrives: {msgs:#?}");
        after
    };
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(
        types,
        ["row-1", "message-2", "row-3", "message-4", "message-5"]
    );
    let tx_index: Vec<String> = msgs[..4]
        .iter()
        .map(|m| m.header("tx_index").unwrap())
        .collect();
    assert_eq!(tx_index, ["0", "1", "2", "3"]);
    let commit = msgs[0].header("commit_lsn").unwrap();
    assert!(msgs[..4]
        .iter()
        .all(|m| m.header("commit_lsn").unwrap() == commit));

    let m = &msgs[1];
    assert_eq!(m.header("outbox_table").unwrap(), "message:outbox");
    assert_eq!(msgs[0].header("outbox_table").unwrap(), "public.outbox");
    assert_eq!(m.header("tenant").unwrap(), "acme");
    assert_eq!(m.routing_key, "order.message-2");
    assert_eq!(m.text(), r#"{"e":"message-2"}"#);
    assert_eq!(
        m.properties.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(m.properties.kind().as_ref().unwrap().as_str(), "message-2");
    // The derived id: system identifier, database, the message's own LSN.
    let prefix = format!("outbox-relay/{}/{}/", system_identifier(&env), env.db.name);
    let lsn = m.message_id().strip_prefix(&prefix).map(str::to_string);
    assert!(
        lsn.is_some(),
        "{} does not start with {prefix}",
        m.message_id()
    );
    assert_eq!(msgs[3].message_id(), "own-id-4");
    assert!(msgs[4].message_id().starts_with(&prefix));

    let body = scrape_until(&addr, "the ignored messages counted", |b| {
        sample(
            b,
            "outbox_relay_messages_ignored_total",
            "reason=\"non_transactional\"",
        ) == Some(1.0)
            && sample(
                b,
                "outbox_relay_messages_ignored_total",
                "reason=\"other_prefix\"",
            ) == Some(1.0)
    })
    .await;
    assert!(body.contains("outbox_relay_messages_ignored_total"));
    let log = relay.log_text();
    assert!(
        log.contains("non-transactional logical message"),
        "the non-transactional message is logged: {log}"
    );
    assert!(!log.contains("other-tool"), "other prefixes are not logged");
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// Malformed content holds the relay as poison naming it; the operator skips it by
/// its id with `slot skip`, and what follows it is delivered, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_poison_until_skipped_by_its_id() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &[MESSAGES]);
    env.db.psql(&emit("1", "before", ""));
    env.db.psql(
        "SELECT pg_logical_emit_message(true, 'outbox', '{\"event_type\": \"no aggregate\"}')",
    );
    env.db.psql(&emit("1", "after", ""));
    got.wait_for(1, WAIT).await;
    relay.wait_log("content is malformed", WAIT).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        got.len(),
        1,
        "nothing passes the poison: {:?}",
        got.snapshot()
    );
    let log = relay.log_text();
    assert!(log.contains("missing field `aggregate_type`"), "{log}");
    let (_, _) = relay.terminate();

    let prefix = format!("outbox-relay/{}/{}/", system_identifier(&env), env.db.name);
    let id = log
        .split(&prefix)
        .nth(1)
        .map(|rest| {
            format!(
                "{prefix}{}",
                rest.split(|c: char| !(c.is_ascii_hexdigit() || c == '/'))
                    .next()
                    .unwrap()
            )
        })
        .expect("the ERROR line names the message id");
    let out = env.cli_env(&["slot", "skip", &id, "--yes"], &[MESSAGES]);
    assert!(out.status.success(), "slot skip {id}: {}", stderr(&out));

    let relay = env.start_env(&[], &[MESSAGES]);
    let msgs = got.wait_for(2, WAIT).await;
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(types, ["before", "after"]);
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// With a dead-letter exchange, malformed content goes there as a notice carrying
/// the content and why, and the relay moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_goes_to_the_dead_letter_exchange_with_its_content() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&dlx, "fanout").await;
    let dlq = env.broker.queue_bound(&dlx, "").await;
    let dead = env.broker.consume(&dlq).await;
    let relay = env.start_env(
        &[],
        &[
            MESSAGES,
            ("OUTBOX_RELAY_RABBITMQ_DEAD_LETTER_EXCHANGE", dlx.as_str()),
        ],
    );
    env.db.psql(&format!(
        "BEGIN; {}; SELECT pg_logical_emit_message(true, 'outbox', 'not json'); {}; COMMIT;",
        emit("1", "before", ""),
        emit("1", "after", "")
    ));
    let msgs = got.wait_for(2, WAIT).await;
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(types, ["before", "after"]);
    let notice = dead.wait_for(1, WAIT).await.remove(0);
    assert_eq!(notice.text(), "not json");
    let error = notice.header("x-outbox-error").unwrap();
    assert!(error.starts_with("malformed: "), "{error}");
    assert_eq!(notice.header("tx_index").unwrap(), "1");
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// Messages only (`tables = []`): an outbox without a table, under per-aggregate
/// ordering on two channels and the CloudEvents format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_without_a_table_under_aggregate_order_and_cloudevents() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.tables = Vec::new();
    env.extra = "[message]\nformat = \"cloudevents\"\n".into();
    let out = env.cli_env(&["slot", "create"], &[MESSAGES]);
    assert!(out.status.success(), "slot create: {}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_env(
        &[],
        &[
            MESSAGES,
            ("OUTBOX_RELAY_RABBITMQ_ORDERING", "aggregate"),
            ("OUTBOX_RELAY_RABBITMQ_CHANNELS", "2"),
        ],
    );
    for i in 0..30 {
        env.db.psql(&format!(
            "BEGIN; {}; {}; COMMIT;",
            emit(&format!("a{}", i % 3), &format!("e{i}"), ""),
            emit(&format!("b{}", i % 2), &format!("f{i}"), "")
        ));
    }
    let msgs = got.wait_for(60, WAIT).await;
    for aggregate in ["a0", "a1", "a2", "b0", "b1"] {
        let seq: Vec<u32> = msgs
            .iter()
            .filter(|m| m.header("aggregate_id").as_deref() == Some(aggregate))
            .map(|m| m.header("event_type").unwrap()[1..].parse().unwrap())
            .collect();
        assert!(!seq.is_empty(), "{aggregate}");
        assert!(seq.windows(2).all(|w| w[0] < w[1]), "{aggregate}: {seq:?}");
    }
    let m = &msgs[0];
    assert_eq!(m.header("cloudEvents:id").unwrap(), m.message_id());
    assert!(m.header("cloudEvents:type").is_some());
    assert!(m.header("cloudEvents:source").is_some());
    let (_, _) = relay.terminate();
    env.cleanup().await;
}
