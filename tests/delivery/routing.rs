//! An exchange per event (docs/routing.md): `[rabbitmq] exchange` as a template, or
//! `[mapping] exchange` naming a column; each exchange declared when first seen.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::*;

const WAIT: Duration = Duration::from_secs(60);

/// `exchange = "<prefix>.{aggregate_type}"`: three aggregate types, three exchanges
/// the relay declares itself, each event in order within its aggregate, and the
/// exchange's own consumer sees only its type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_publishes_to_an_exchange_per_aggregate_type_in_order() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    let prefix = env.exchange.clone();
    env.create_slot();
    let template = format!("{prefix}.{{aggregate_type}}");
    let vars = [("OUTBOX_RELAY_RABBITMQ_EXCHANGE", template.as_str())];
    // The relay declares the exchanges; the test binds its queues once they exist.
    let relay = env.start_env(&[], &vars);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT t, 'warmup', 'w', '{}' FROM unnest(ARRAY['order','invoice','shipment']) t",
    );
    let mut got = Vec::new();
    for t in ["order", "invoice", "shipment"] {
        let name = format!("{prefix}.{t}");
        wait_for_exchange(&name).await;
        // Declared again as the relay did (idempotent): cleanup removes it.
        env.broker.declare_exchange(&name, "topic").await;
        let q = env.broker.queue_bound(&name, "#").await;
        got.push((t, env.broker.consume(&q).await));
    }
    for i in 0..60 {
        let t = ["order", "invoice", "shipment"][i % 3];
        env.db.psql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{t}', 'a{}', 'e{i}', '{{}}')",
            i % 2
        ));
    }
    for (t, received) in &got {
        let msgs = received.wait_for(20, WAIT).await;
        assert!(
            msgs.iter()
                .all(|m| m.header("aggregate_type").as_deref() == Some(t)),
            "{t}"
        );
        assert!(msgs.iter().all(|m| m.exchange == format!("{prefix}.{t}")));
        for a in ["a0", "a1"] {
            let seq: Vec<u32> = msgs
                .iter()
                .filter(|m| m.header("aggregate_id").as_deref() == Some(a))
                .map(|m| m.header("event_type").unwrap()[1..].parse().unwrap())
                .collect();
            assert!(seq.windows(2).all(|w| w[0] < w[1]), "{t}/{a}: {seq:?}");
        }
    }
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// `[mapping] exchange` names a column; an empty value goes to `[rabbitmq] exchange`;
/// unroutable events of any exchange go to the dead-letter exchange; an exchange that
/// does not exist (declare_exchange = false) makes its event poison, and with the
/// dead-letter exchange a notice of it goes there: nothing is lost, nothing stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_column_with_unroutable_and_missing_exchanges_loses_nothing() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::with_ddl(
        &format!("{}; ALTER TABLE outbox ADD COLUMN target text", OUTBOX_DDL),
        &["public.outbox"],
    )
    .await;
    env.create_slot();
    let main = env.exchange.clone();
    let other = env.broker.exchange_name("other");
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&main, "topic").await;
    env.broker.declare_exchange(&other, "topic").await;
    env.broker.declare_exchange(&dlx, "fanout").await;
    let main_q = env.broker.queue_bound(&main, "good.#").await;
    let other_q = env.broker.queue_bound(&other, "good.#").await;
    let dead_q = env.broker.queue_bound(&dlx, "").await;
    let (to_main, to_other, dead) = (
        env.broker.consume(&main_q).await,
        env.broker.consume(&other_q).await,
        env.broker.consume(&dead_q).await,
    );
    let missing = format!("{other}-missing");
    let vars = [
        ("OUTBOX_RELAY_MAPPING_EXCHANGE", "target"),
        ("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "false"),
        ("OUTBOX_RELAY_RABBITMQ_DEAD_LETTER_EXCHANGE", dlx.as_str()),
    ];
    let relay = env.start_env(&[], &vars);
    // 90 events: by thirds to the main exchange (NULL or ''), the other one, and the
    // missing one; every fifth unroutable (aggregate_type bad).
    for tx in 0..9 {
        let rows: Vec<String> = (0..10)
            .map(|k| {
                let i = tx * 10 + k;
                let target = match i % 3 {
                    0 => "NULL".to_string(),
                    1 => format!("'{other}'"),
                    _ if i % 6 == 2 => "''".to_string(),
                    _ => format!("'{missing}'"),
                };
                let kind = if i % 5 == 0 { "bad" } else { "good" };
                format!("('{kind}', '{i}', 'e', '{{}}', {target})")
            })
            .collect();
        env.db.psql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, target) VALUES {}",
            rows.join(", ")
        ));
    }
    let expect = |pred: &dyn Fn(usize) -> bool| (0..90).filter(|&i| pred(i)).count();
    let to_missing = |i: usize| i % 3 == 2 && i % 6 != 2;
    let main_n = expect(&|i| i % 5 != 0 && (i % 3 == 0 || (i % 3 == 2 && !to_missing(i))));
    let other_n = expect(&|i| i % 5 != 0 && i % 3 == 1);
    let dead_n = expect(&|i| i % 5 == 0 || to_missing(i));
    let m = to_main.wait_for(main_n, WAIT).await;
    let o = to_other.wait_for(other_n, WAIT).await;
    let d = dead.wait_for(dead_n, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(to_main.len(), main_n);
    assert_eq!(to_other.len(), other_n);
    assert_eq!(
        dead.len(),
        dead_n,
        "{:#?}",
        d.iter()
            .map(|m| m.header("x-outbox-error"))
            .collect::<Vec<_>>()
    );
    let mut ids: Vec<usize> = m
        .iter()
        .chain(&o)
        .chain(&d)
        .map(|m| m.header("aggregate_id").unwrap().parse().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, (0..90).collect::<Vec<_>>(), "every event once");
    let refused: Vec<&testkit::amqp::Msg> = d
        .iter()
        .filter(|m| {
            let id: usize = m.header("aggregate_id").unwrap().parse().unwrap();
            to_missing(id) && id % 5 != 0
        })
        .collect();
    assert!(!refused.is_empty());
    for n in refused {
        let error = n.header("x-outbox-error").unwrap();
        assert!(error.contains(&missing) && error.contains("404"), "{error}");
        assert_eq!(n.header("x-original-exchange").unwrap(), missing);
    }
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// Waits until the broker has exchange `name`.
async fn wait_for_exchange(name: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let out = testkit::rabbitmqctl_command()
            .args(["list_exchanges", "name", "-q"])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim() == name)
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "exchange {name} never declared"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Properties per event (docs/routing.md): `priority` and `expiration` keys of the
/// headers column become the message's properties (not headers); a queue with
/// `x-max-priority` delivers by them, and a message whose TTL passes in a queue with
/// a dead-letter exchange is dead-lettered by the queue's own policy. An invalid
/// value is poison naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_and_priority_set_per_event_are_observed_by_the_broker() {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let exchange = env.exchange.clone();
    let expired_to = env.broker.exchange_name("expired");
    env.broker.declare_exchange(&exchange, "topic").await;
    env.broker.declare_exchange(&expired_to, "fanout").await;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-max-priority"),
        AMQPValue::ShortShortUInt(10),
    );
    let queue = env.broker.queue_bound_with(&exchange, "p.#", args).await;
    // A message expires at the head of its queue: the TTL one has its own.
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString(expired_to.as_str().into()),
    );
    env.broker.queue_bound_with(&exchange, "ttl.#", args).await;
    let expired_q = env.broker.queue_bound(&expired_to, "").await;
    let expired = env.broker.consume(&expired_q).await;
    let relay = env.start(&[]);
    // Published while nobody consumes: the queue orders them by priority.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('p', '1', 'low', '{}', '{\"priority\": 1}'),
           ('p', '2', 'high', '{}', '{\"priority\": \"9\", \"tenant\": \"t\"}'),
           ('p', '3', 'middle', '{}', '{\"priority\": 5}'),
           ('ttl', '4', 'short-lived', '{}', '{\"expiration\": \"100ms\"}')",
    );
    let ttl = expired.wait_for(1, WAIT).await;
    assert_eq!(ttl[0].header("event_type").as_deref(), Some("short-lived"));
    assert_eq!(
        ttl[0]
            .properties
            .expiration()
            .as_ref()
            .map(|e| e.to_string()),
        None,
        "RabbitMQ drops the expiration when it dead-letters"
    );
    assert!(ttl[0].header("x-death").is_some() || ttl[0].properties.headers().is_some());
    let got = env.broker.consume(&queue).await;
    let msgs = got.wait_for(3, WAIT).await;
    let order: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(order, ["high", "middle", "low"]);
    assert_eq!(*msgs[0].properties.priority(), Some(9));
    assert_eq!(msgs[0].header("tenant").as_deref(), Some("t"));
    assert!(
        msgs.iter().all(|m| m.header("priority").is_none()),
        "a property, not a header"
    );

    // An invalid priority holds the relay, naming the key.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
           VALUES ('p', '5', 'bad', '{}', '{\"priority\": 300}')",
    );
    relay.wait_log("header \"priority\" = 300", WAIT).await;
    let (_, _) = relay.terminate();
    env.cleanup().await;
}

/// `[mapping] priority` names a column: its value sets the property (and wins over
/// the headers column's key), a NULL leaves the key's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_priority_column_sets_the_property() {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::with_ddl(
        &format!("{OUTBOX_DDL}; ALTER TABLE outbox ADD COLUMN prio int"),
        &["public.outbox"],
    )
    .await;
    env.create_slot();
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-max-priority"),
        AMQPValue::ShortShortUInt(10),
    );
    let queue = env.broker.queue_bound_with(&exchange, "p.#", args).await;
    let relay = env.start_env(&[], &[("OUTBOX_RELAY_MAPPING_PRIORITY", "prio")]);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, prio) VALUES
           ('p', '1', 'low', '{}', NULL, 1),
           ('p', '2', 'high', '{}', '{\"priority\": 2}', 9),
           ('p', '3', 'middle', '{}', '{\"priority\": 5}', NULL)",
    );
    // All three published before anyone consumes: the queue orders them.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let q = env
            .broker
            .channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        if q.message_count() >= 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", relay.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let got = env.broker.consume(&queue).await;
    let msgs = got.wait_for(3, WAIT).await;
    let order: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap())
        .collect();
    assert_eq!(order, ["high", "middle", "low"]);
    let priorities: Vec<Option<u8>> = msgs.iter().map(|m| *m.properties.priority()).collect();
    assert_eq!(priorities, [Some(9), Some(5), Some(1)]);
    let (_, _) = relay.terminate();
    env.cleanup().await;
}
