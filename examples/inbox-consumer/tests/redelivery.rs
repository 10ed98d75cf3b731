//! The example consumer under redelivery, against the real RabbitMQ and the test
//! Postgres cluster: every side effect must happen exactly once.
//!
//! Why these tests would catch a consumer that is not idempotent: the `side_effects`
//! table has no unique key on message_id, so every time the side effect runs it adds
//! a row. Without the inbox check (performing the side effect even when the INSERT
//! into `inbox` affected 0 rows) scenario (a) ends with 300 rows instead of 100 and
//! scenario (b) with 51 instead of 50 — the assertions on row counts and on "each
//! message_id exactly once" fail. (Checked while developing by temporarily making
//! `handle_message` ignore the rows-affected count.) Acking before the commit would
//! instead lose message 10 in scenario (b) — 49 rows — and doing the inbox INSERT
//! outside the side effect's transaction would lose the failed deliveries of
//! scenario (c).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::process::Output;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use inbox_consumer::{connect_postgres, init_schema, run, Config, Inbox, Message, Outcome, Stats};
use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use testkit::amqp::TestBroker;
use testkit::TestDb;

const PATIENCE: Duration = Duration::from_secs(60);

/// One published test message.
#[derive(Clone)]
struct Event {
    id: String,
    aggregate_id: String,
    seq: usize,
}

fn events(n: usize) -> Vec<Event> {
    (0..n)
        .map(|seq| Event {
            id: uuid::Uuid::new_v4().to_string(),
            aggregate_id: format!("{}", seq % 7),
            seq,
        })
        .collect()
}

/// A channel in confirm mode, for publishing like the relay does.
async fn publisher(broker: &TestBroker) -> Channel {
    let channel = broker.connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    channel
}

/// Publishes `events` with the properties and headers outbox-relay sets (docs/design.md §5),
/// waiting for every broker confirm.
async fn publish(channel: &Channel, exchange: &str, events: &[Event]) {
    let mut confirms = Vec::new();
    for e in events {
        let mut headers = FieldTable::default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        headers.insert("aggregate_type".into(), text("order"));
        headers.insert("aggregate_id".into(), text(&e.aggregate_id));
        headers.insert("event_type".into(), text("order_paid"));
        headers.insert("outbox_table".into(), text("public.outbox"));
        headers.insert(
            "commit_lsn".into(),
            text(&format!("0/{:X}", 0x1000 + e.seq)),
        );
        headers.insert("xid".into(), AMQPValue::LongLongInt(700 + e.seq as i64));
        let properties = BasicProperties::default()
            .with_message_id(e.id.as_str().into())
            .with_type("order_paid".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_timestamp(1_700_000_000)
            .with_app_id("outbox-relay".into())
            .with_headers(headers);
        let body = format!(r#"{{"order_id": {}, "seq": {}}}"#, e.aggregate_id, e.seq);
        let confirm = channel
            .basic_publish(
                exchange.into(),
                "order.order_paid".into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body.as_bytes(),
                properties,
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for c in confirms {
        let confirmation = c.await.unwrap();
        assert!(confirmation.is_ack(), "broker nacked a test message");
        assert!(
            confirmation.take_message().is_none(),
            "a test message was unroutable"
        );
    }
}

/// A broker with a fresh topic exchange and a durable queue bound with `#`.
async fn setup() -> (TestBroker, String, String) {
    let mut broker = TestBroker::connect().await;
    let exchange = broker.exchange_name("outbox");
    broker.declare_exchange(&exchange, "topic").await;
    let queue = broker.queue_bound(&exchange, "#").await;
    (broker, exchange, queue)
}

fn config(db: &TestDb, queue: &str, consumer: &str) -> Config {
    Config {
        amqp_url: testkit::amqp_url(),
        queue: queue.to_string(),
        postgres_url: db.url(),
        consumer_name: consumer.to_string(),
        prefetch: 10,
        declare: None,
        init: false,
        exit_after_commit: None,
        exit_when_idle: Some(Duration::from_millis(1500)),
    }
}

/// Runs the library's consume loop until the queue is idle; returns its counters.
async fn consume(config: Config) -> Arc<Stats> {
    let stats = Arc::new(Stats::default());
    tokio::time::timeout(
        PATIENCE,
        run(&config, stats.clone(), std::future::pending()),
    )
    .await
    .expect("the consumer returns once the queue is idle")
    .expect("the consumer runs without error");
    stats
}

fn get(stats: &Stats) -> (u64, u64, u64, u64) {
    (
        stats.deliveries.load(Ordering::Relaxed),
        stats.processed.load(Ordering::Relaxed),
        stats.duplicates.load(Ordering::Relaxed),
        stats.failed.load(Ordering::Relaxed),
    )
}

/// message_id → number of side_effects rows for `consumer`.
fn side_effects(db: &TestDb, consumer: &str) -> HashMap<String, usize> {
    let out = db.psql(&format!(
        "SELECT message_id, count(*) FROM side_effects WHERE consumer = '{consumer}' \
         GROUP BY message_id"
    ));
    out.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (id, n) = l.split_once('|').unwrap();
            (id.to_string(), n.parse().unwrap())
        })
        .collect()
}

/// Asserts that every event's side effect exists exactly once and nothing else does.
fn assert_exactly_once(db: &TestDb, consumer: &str, events: &[Event]) {
    let effects = side_effects(db, consumer);
    for e in events {
        assert_eq!(
            effects.get(&e.id).copied().unwrap_or(0),
            1,
            "side effect of message {} (#{}) must exist exactly once; all: {effects:?}",
            e.id,
            e.seq
        );
    }
    assert_eq!(
        effects.len(),
        events.len(),
        "unexpected side effects: {effects:?}"
    );
    let total: usize = effects.values().sum();
    assert_eq!(total, events.len(), "side_effects rows for {consumer}");
    assert_eq!(
        db.psql(&format!(
            "SELECT count(*) FROM inbox WHERE consumer = '{consumer}'"
        )),
        events.len().to_string(),
        "inbox rows for {consumer}"
    );
}

async fn init(db: &TestDb) {
    let client = connect_postgres(&db.url()).await.unwrap();
    init_schema(&client).await.unwrap();
    // Applying the DDL twice is harmless (CREATE … IF NOT EXISTS).
    init_schema(&client).await.unwrap();
}

/// (a) Every message published twice, consumed by two consumers at once (so the two
/// copies are often handled concurrently), and later all of them replayed again:
/// 300 deliveries, 100 side effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_replays_produce_each_side_effect_once() {
    let db = TestDb::new("inbox_a");
    init(&db).await;
    let (broker, exchange, queue) = setup().await;
    let channel = publisher(&broker).await;
    let events = events(100);

    // Each message twice, back to back, as a relay crash followed by re-sending
    // would produce.
    let doubled: Vec<Event> = events.iter().flat_map(|e| [e.clone(), e.clone()]).collect();
    publish(&channel, &exchange, &doubled).await;
    let (s1, s2) = tokio::join!(
        consume(config(&db, &queue, "billing")),
        consume(config(&db, &queue, "billing")),
    );
    let (d1, p1, dup1, f1) = get(&s1);
    let (d2, p2, dup2, f2) = get(&s2);
    assert_eq!(d1 + d2, 200, "deliveries: {s1} / {s2}");
    assert_eq!(p1 + p2, 100, "new messages: {s1} / {s2}");
    assert_eq!(dup1 + dup2, 100, "duplicates: {s1} / {s2}");
    assert_eq!(f1 + f2, 0, "failures: {s1} / {s2}");
    assert_exactly_once(&db, "billing", &events);

    // Later: a replay of all 100 (e.g. `outbox-relay replay`).
    publish(&channel, &exchange, &events).await;
    let s = consume(config(&db, &queue, "billing")).await;
    assert_eq!(get(&s), (100, 0, 100, 0), "replay: {s}");
    assert_exactly_once(&db, "billing", &events);

    // The inbox is per consumer: another consumer of the same messages sharing the
    // table processes each once for itself.
    publish(&channel, &exchange, &events).await;
    let s = consume(config(&db, &queue, "audit")).await;
    assert_eq!(get(&s), (100, 100, 0, 0), "second consumer: {s}");
    assert_exactly_once(&db, "audit", &events);
    assert_exactly_once(&db, "billing", &events);

    broker.cleanup().await;
}

/// (c) Database errors roll back the inbox row together with the side effect, and
/// the delivery is requeued and processed later — not lost as a "duplicate".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_transactions_are_retried_not_lost() {
    let db = TestDb::new("inbox_c");
    init(&db).await;
    // The first 5 side effects fail after the inbox row was inserted (a sequence is
    // not transactional, so the budget is used up even though each attempt rolls back).
    db.psql(
        "CREATE SEQUENCE failures; \
         CREATE FUNCTION flaky() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF nextval('failures') <= 5 THEN RAISE EXCEPTION 'injected failure'; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER flaky BEFORE INSERT ON side_effects FOR EACH ROW EXECUTE FUNCTION flaky();",
    );
    let (broker, exchange, queue) = setup().await;
    let channel = publisher(&broker).await;
    let events = events(20);
    publish(&channel, &exchange, &events).await;

    let s = consume(config(&db, &queue, "billing")).await;
    let (deliveries, processed, duplicates, failed) = get(&s);
    assert_eq!(failed, 5, "{s}");
    assert_eq!(processed, 20, "{s}");
    assert_eq!(duplicates, 0, "a retried failure is not a duplicate: {s}");
    assert_eq!(deliveries, 25, "{s}");
    assert_exactly_once(&db, "billing", &events);
    broker.cleanup().await;
}

/// `Inbox::handle` directly: new, duplicate, and a message without message_id.
#[tokio::test]
async fn handle_reports_processed_duplicate_and_rejected() {
    let db = TestDb::new("inbox_h");
    init(&db).await;
    let mut inbox = Inbox::new(db.client().await, "billing");
    let message = Message {
        message_id: "m-1".into(),
        aggregate_id: Some("42".into()),
        event_type: Some("order_paid".into()),
        payload: serde_json::json!({"order_id": 42}),
    };
    assert_eq!(
        inbox.handle_message(&message).await.unwrap(),
        Outcome::Processed
    );
    assert_eq!(
        inbox.handle_message(&message).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        db.psql("SELECT message_id, consumer, aggregate_id, event_type, payload::text FROM side_effects"),
        r#"m-1|billing|42|order_paid|{"order_id": 42}"#
    );

    let mut delivery = Delivery::mock(1, "outbox".into(), "order.x".into(), false, b"{}".to_vec());
    delivery.properties = BasicProperties::default();
    match inbox.handle(&delivery).await.unwrap() {
        Outcome::Rejected(reason) => assert!(reason.contains("message_id"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    delivery.properties = BasicProperties::default().with_message_id("m-1".into());
    assert_eq!(inbox.handle(&delivery).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.psql("SELECT count(*) FROM side_effects"), "1");
}

/// Runs the real binary with `args` until it exits (bounded).
async fn run_binary(args: &[String]) -> Output {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_inbox-consumer"))
        .args(args)
        .env("RUST_LOG", "info")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(PATIENCE, child)
        .await
        .expect("inbox-consumer exits in time")
        .expect("inbox-consumer starts")
}

/// The `key=N` value of the summary line the binary prints to stdout.
fn summary(stdout: &str, key: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("inbox-consumer:"))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .parse()
        .unwrap()
}

/// (b) The real binary crashes after committing message 10 and before acking it;
/// RabbitMQ redelivers it (and the other unacked prefetched ones) to the restarted
/// consumer, whose inbox recognises message 10 as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_commit_and_ack_is_deduplicated_after_restart() {
    let db = TestDb::new("inbox_b");
    let (broker, exchange, queue) = setup().await;
    let channel = publisher(&broker).await;
    let events = events(50);
    publish(&channel, &exchange, &events).await;

    let common = vec![
        "--amqp-url".to_string(),
        testkit::amqp_url(),
        "--queue".into(),
        queue.clone(),
        "--postgres-url".into(),
        db.url(),
        "--consumer-name".into(),
        "billing".into(),
        "--prefetch".into(),
        "20".into(),
        "--exit-when-idle-ms".into(),
        "2000".into(),
    ];

    // First run: creates the tables, commits 10 messages, dies before the 10th ack.
    let mut args = common.clone();
    args.extend(["--init".into(), "--exit-after-commit".into(), "10".into()]);
    let out = run_binary(&args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the crash hook exits 1: {stderr}"
    );
    assert!(stderr.contains("exit-after-commit"), "{stderr}");
    assert!(
        !stderr.contains("guest:guest"),
        "the AMQP password must not be logged: {stderr}"
    );
    let effects = side_effects(&db, "billing");
    assert_eq!(effects.len(), 10, "committed before the crash: {effects:?}");
    for e in &events[..10] {
        assert_eq!(
            effects.get(&e.id),
            Some(&1),
            "message #{} committed once",
            e.seq
        );
    }

    // Second run: the redelivered message 10 is a duplicate; the rest are new.
    let out = run_binary(&common).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "second run: {stdout}\n{stderr}");
    let tenth = &events[9].id;
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("duplicate") && l.contains(tenth.as_str())),
        "message 10 ({tenth}) must be detected as a duplicate: {stderr}"
    );
    let processed = summary(&stdout, "processed");
    let duplicates = summary(&stdout, "duplicates");
    let deliveries = summary(&stdout, "deliveries");
    assert_eq!(processed, 40, "{stdout}");
    // Message 10 for certain; an earlier one too if its ack had not reached the broker
    // when the process died.
    assert!(duplicates >= 1, "{stdout}");
    assert_eq!(deliveries, processed + duplicates, "{stdout}");
    assert_eq!(summary(&stdout, "failed"), 0, "{stdout}");
    assert_exactly_once(&db, "billing", &events);

    broker.cleanup().await;
}
