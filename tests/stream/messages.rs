//! Logical messages as events (docs/messages.md, issue 42) into a RabbitMQ stream:
//! exactly once through a SIGKILL and a slot rewound to its start, as
//! `stream::minimal_headers_on_a_stream_exactly_once_through_a_kill` proves for rows.
//! The stream's deduplication keys on the publishing id (commit LSN and index in the
//! transaction), so a message must take its place among its transaction's rows; and
//! its `message-id` must be the same id on every redelivery (its own `id`, or the one
//! derived from the system identifier, database and its LSN).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use support::scenarios::{produce_sql, MESSAGES_ENV, MESSAGE_PRODUCER, PRODUCED_IDS};
use support::stream::{assert_exactly_once, delete_stream, read_stream, seq_of, stream_url};
use support::*;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);

/// Events `from..=to` of the producer in transactions of sizes cycling from 1 to 40,
/// `pause` after each.
async fn produce(
    client: &tokio_postgres::Client,
    from: u64,
    to: u64,
    with_rows: bool,
    pause: Duration,
) {
    let (mut next, mut size) = (from, 1);
    while next <= to {
        let end = (next + size - 1).min(to);
        client
            .batch_execute(&produce_sql(next, end, with_rows))
            .await
            .unwrap();
        next = end + 1;
        size = size % 40 + 7;
        tokio::time::sleep(pause).await;
    }
}

/// 3,000 events (rows and messages interleaved, or messages only with `tables = []`
/// and a publication of no table): 500 delivered, then a SIGKILL while 2,000 more are
/// committed, the slot rewound to its creation (a copy put back under its name, the
/// stored position deleted) so that the restarted relay reads every event again, 500
/// more. The stream holds each event exactly once, in commit order (rows and
/// messages of a transaction in the order written), each with its expected
/// `message-id`; the restarted relay found what the stream held; a rolled-back
/// transaction's message and the non-transactional and other-prefix messages of the
/// producer never arrive.
async fn exactly_once_through_a_kill(with_rows: bool) {
    const N: u64 = 3_000;
    let mut env = Env::new().await;
    let stream = testkit::unique_name("stream");
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
        (MESSAGES_ENV.0, MESSAGES_ENV.1.to_string()),
    ];
    if !with_rows {
        env.tables.clear();
    }
    let vars = as_refs(&vars);
    let out = env.cli_env(&["slot", "create"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let rewind = format!("{}_rewind", env.slot);
    env.db.psql(&format!(
        "SELECT pg_copy_logical_replication_slot('{}', '{rewind}')",
        env.slot
    ));
    // `check --declare` declares the stream, so the reads below never find it missing.
    let out = env.cli_env(&["check", "--declare"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    env.db.psql(MESSAGE_PRODUCER);
    let client = env.db.client().await;
    produce(&client, 1, 500, with_rows, Duration::ZERO).await;
    env.db.psql(
        "BEGIN;
         SELECT pg_catalog.pg_logical_emit_message(true, 'outbox',
           '{\"aggregate_type\":\"rolledback\",\"aggregate_id\":\"1\",\"event_type\":\"tick\",\"payload\":{}}'::text);
         ROLLBACK;",
    );
    let relay = env.start_env(&[], &vars);
    read_stream(&stream, 500, Duration::ZERO, WAIT).await;
    let loader = tokio::spawn(async move {
        // Slow enough that the kill lands while events are being published.
        produce(&client, 501, 2_500, with_rows, Duration::from_millis(10)).await;
        client
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill();
    let client = loader.await.unwrap();
    let stored = read_stream(&stream, 0, Duration::ZERO, WAIT).await.len();
    assert!(
        stored >= 500,
        "{stored} events in the stream before the kill"
    );
    // Rewind: the slot as it was created, no stored position (once the killed
    // relay's walsender has let the slot go).
    let slot = env.slot.clone();
    let active = format!("SELECT active FROM pg_replication_slots WHERE slot_name = '{slot}'");
    for _ in 0..100 {
        if env.db.psql(&active).trim() == "f" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for sql in [
        format!("SELECT pg_drop_replication_slot('{slot}')"),
        format!("SELECT pg_copy_logical_replication_slot('{rewind}', '{slot}')"),
        format!("SELECT pg_drop_replication_slot('{rewind}')"),
        format!("DELETE FROM public.outbox_relay_state WHERE slot_name = '{slot}'"),
    ] {
        env.db.psql(&sql);
    }
    let relay = env.start_env(&[], &vars);
    produce(&client, 2_501, N, with_rows, Duration::ZERO).await;
    let msgs = read_stream(&stream, N as usize, QUIET, WAIT).await;
    assert_exactly_once(&msgs, N);

    // Each event under its expected id: the row's, the message's own, or derived.
    let expected: HashMap<u64, String> = env
        .db
        .psql(PRODUCED_IDS)
        .lines()
        .map(|l| {
            let (seq, id) = l.split_once('|').unwrap();
            (seq.parse().unwrap(), id.to_string())
        })
        .collect();
    assert_eq!(expected.len(), N as usize);
    let mut messages = 0;
    for m in &msgs {
        let seq = seq_of(m).unwrap();
        assert_eq!(m.message_id.as_ref(), Some(&expected[&seq]), "{m:?}");
        let is_message = !with_rows || seq % 3 == 0;
        let table = if is_message {
            "message:outbox"
        } else {
            "public.outbox"
        };
        assert_eq!(m.prop("table"), Some(table), "{m:?}");
        messages += usize::from(is_message);
    }
    eprintln!(
        "{} events in the stream ({messages} messages), {stored} before the kill",
        msgs.len()
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("events the stream already held were sent again"),
        "the restarted relay did not find its stored events by their ids: {log}"
    );
    delete_stream(&stream).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_messages_exactly_once_into_a_stream_through_a_kill() {
    exactly_once_through_a_kill(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_only_exactly_once_into_a_stream_through_a_kill() {
    exactly_once_through_a_kill(false).await;
}
