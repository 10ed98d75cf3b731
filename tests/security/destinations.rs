//! Rows that pick destinations (issue 50, item 2; docs/routing.md, "Which names a row
//! may choose"): a row's exchange name is checked against `[rabbitmq]
//! allowed_exchanges` (by default the template's shape), RabbitMQ's own `amq.*`
//! exchanges and the dead-letter exchange are refused unless listed by name, and one
//! relay declares at most `max_declared_exchanges` names. What a row may not choose is
//! poison: a notice goes to the dead-letter exchange, nothing to the exchange it named.

use std::time::Duration;

use support::*;

const WAIT: Duration = Duration::from_secs(120);

/// The names of the broker's exchanges that start with `prefix`.
fn exchange_names(prefix: &str) -> Vec<String> {
    let out = testkit::rabbitmqctl_command()
        .args(["-q", "list_exchanges", "name"])
        .output()
        .expect("rabbitmqctl list_exchanges");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// 100,000 rows, each with an `aggregate_type` of its own, under `exchange =
/// "<prefix>.{aggregate_type}"` and `max_declared_exchanges = 25`: the relay declares
/// 25 exchanges and no more; every other row is named and dead-lettered (its notice
/// says `max_declared_exchanges`), and the relay goes on. It used to declare one
/// durable exchange per value, never deleted: 100,000 exchanges on the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_row_chosen_names_declare_no_more_than_the_bound() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let prefix = env.exchange.clone();
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&dlx, "fanout").await;
    let dead_q = env.broker.queue_bound(&dlx, "").await;
    let dead = env.broker.consume(&dead_q).await;
    let template = format!("{prefix}.{{aggregate_type}}");
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_EXCHANGE", template.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_DEAD_LETTER_EXCHANGE", dlx.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_MAX_DECLARED_EXCHANGES", "25"),
        ("OUTBOX_RELAY_RELAY_LOG_FILTER", "warn"),
    ];
    let relay = env.start_env(&[], &vars);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 't' || g, 'a', 'e', '{}' FROM generate_series(1, 100000) g",
    );
    // Every row ends in the dead-letter queue: the 25 declared exchanges have no
    // queue (their events come back unroutable), the rest are refused.
    let msgs = dead.wait_for(100_000, WAIT).await;
    let refused = msgs
        .iter()
        .filter(|m| {
            m.header("x-outbox-error")
                .is_some_and(|e| e.contains("max_declared_exchanges = 25"))
        })
        .count();
    let unroutable = msgs
        .iter()
        .filter(|m| m.header("x-outbox-error").as_deref() == Some("unroutable"))
        .count();
    assert_eq!(
        (unroutable, refused),
        (25, 99_975),
        "{} notices",
        msgs.len()
    );
    let declared = exchange_names(&format!("{prefix}.t"));
    assert_eq!(declared.len(), 25, "{declared:?}");
    let (_, log) = relay.terminate();
    assert!(
        log.contains("max_declared_exchanges = 25"),
        "the refusal is named in the log"
    );
    // Declared again as the relay did (idempotent): cleanup removes them.
    for name in &declared {
        env.broker.declare_exchange(name, "topic").await;
    }
    env.cleanup().await;
}

/// `[mapping] exchange` names a column: a row that names `amq.topic`, or the
/// dead-letter exchange itself (a forged "dead-letter" notice), is refused and
/// dead-lettered, and nothing reaches the exchange it named; listed by name in
/// `allowed_exchanges`, `amq.topic` is allowed. Both used to be published to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_cannot_choose_amq_topic_or_the_dead_letter_exchange() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::with_ddl(
        &format!("{}; ALTER TABLE outbox ADD COLUMN target text", OUTBOX_DDL),
        &["public.outbox"],
    )
    .await;
    env.create_slot();
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&dlx, "fanout").await;
    let dead_q = env.broker.queue_bound(&dlx, "").await;
    let dead = env.broker.consume(&dead_q).await;
    // What reaches amq.topic with this test's own routing keys.
    let kind = format!("k{}", std::process::id());
    let topic_q = env
        .broker
        .queue_bound("amq.topic", &format!("{kind}.#"))
        .await;
    let on_topic = env.broker.consume(&topic_q).await;
    let main = env.exchange.clone();
    env.broker.declare_exchange(&main, "topic").await;
    let main_q = env.broker.queue_bound(&main, "#").await;
    let on_main = env.broker.consume(&main_q).await;
    let vars = [
        ("OUTBOX_RELAY_MAPPING_EXCHANGE", "target"),
        ("OUTBOX_RELAY_RABBITMQ_DEAD_LETTER_EXCHANGE", dlx.as_str()),
    ];
    let relay = env.start_env(&[], &vars);
    env.db.psql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, target) VALUES
           ('{kind}', '1', 'to-topic', '{{}}', 'amq.topic'),
           ('{kind}', '2', 'to-dlx', '{{}}', '{dlx}'),
           ('{kind}', '3', 'to-main', '{{}}', NULL)"
    ));
    let delivered = on_main.wait_for(1, WAIT).await;
    assert_eq!(
        delivered[0].header("event_type").as_deref(),
        Some("to-main")
    );
    let notices = dead.wait_for(2, WAIT).await;
    let why = |t: &str| {
        notices
            .iter()
            .find(|m| m.header("event_type").as_deref() == Some(t))
            .and_then(|m| m.header("x-outbox-error"))
            .unwrap_or_default()
    };
    assert!(why("to-topic").contains("amq.*"), "{}", why("to-topic"));
    assert!(
        why("to-dlx").contains("dead-letter exchange"),
        "{}",
        why("to-dlx")
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(on_topic.is_empty(), "a row published to amq.topic");
    let (_, _) = relay.terminate();

    // Listed by name, amq.topic may be chosen.
    let vars = [
        ("OUTBOX_RELAY_MAPPING_EXCHANGE", "target"),
        ("OUTBOX_RELAY_RABBITMQ_DEAD_LETTER_EXCHANGE", dlx.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_ALLOWED_EXCHANGES", "amq.topic"),
    ];
    let relay = env.start_env(&[], &vars);
    env.db.psql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, target)
         VALUES ('{kind}', '4', 'listed', '{{}}', 'amq.topic')"
    ));
    let got = on_topic.wait_for(1, WAIT).await;
    assert_eq!(got[0].header("event_type").as_deref(), Some("listed"));
    let (_, _) = relay.terminate();
    env.cleanup().await;
}
