//! The stream target end to end (docs/streams.md, docs/design.md §4): the real binary
//! between the test Postgres cluster and a RabbitMQ stream, which the test reads
//! whole from its first offset.
//! size: one scenario on one stream: check, load, relay, restart, replay, each on the steps before
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::stream::{assert_exactly_once, delete_stream, read_stream, stream_exists, stream_url};
use support::*;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);

/// The environment that points the relay at `stream`.
fn stream_env(stream: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.to_string()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
    ]
}

/// Rows in transactions of mixed sizes, a rolled-back one, headers: the stream holds
/// each committed row once, in commit order, with the body and properties of
/// docs/streams.md; `check` verifies the stream endpoint, `peek` names the stream,
/// and `replay --from-table` appends flagged copies under no producer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_target_end_to_end() {
    let env = Env::new().await;
    let stream = testkit::unique_name("stream");
    let vars = stream_env(&stream);
    let vars = as_refs(&vars);
    env.create_slot();

    // check: the stream does not exist yet; `run` will declare it, `check` does not.
    let out = env.cli_env(&["check"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            "ok    stream {stream}: missing, run will declare it (declare_stream = true)"
        )),
        "{}",
        stdout(&out)
    );
    assert!(!stream_exists(&stream).await, "check declared the stream");
    // `check --declare` does, so that the reads below never find it missing.
    let out = env.cli_env(&["check", "--declare"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stream_exists(&stream).await,
        "check --declare declared the stream"
    );

    // One row with headers and a known id, then 1 + 7 + 60 + 200 rows in four
    // transactions (seq 1..=268), a rolled-back transaction in between.
    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('00000000-0000-0000-0000-0000000000a1', 'order', 'o-1', 'created',
            '{\"total\": 12.50}', '{\"tenant\": \"acme\", \"traceparent\": \"00-abc-def-01\"}')",
    );
    let mut next = 1;
    for (i, size) in [1usize, 7, 60, 200].into_iter().enumerate() {
        env.insert_seq(next, size, size);
        next += size;
        if i == 1 {
            env.db.psql(
                "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                        SELECT 'rolledback', s::text, 'tick', '{}' FROM generate_series(1, 50) s;
                 ROLLBACK;",
            );
        }
    }
    let total_seq = (next - 1) as u64;
    assert_eq!(total_seq, 268);

    // peek: the pending events as they would go to the stream.
    let out = env.cli_env(&["peek", "--limit", "3"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(
        lines[0].contains(&format!(" stream={stream} ")),
        "{lines:?}"
    );
    assert!(!lines[0].contains("routing_key="), "{lines:?}");
    let out = env.cli_env(&["peek", "--json", "--limit", "1"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["stream"], stream.as_str());
    assert!(v[0].get("routing_key").is_none(), "{v}");

    let relay = env.start_env(&[], &vars);
    let msgs = read_stream(&stream, 1 + total_seq as usize, QUIET, WAIT).await;
    assert_eq!(
        msgs.len() as u64,
        1 + total_seq,
        "one message per committed row"
    );

    // The first message: body and properties (docs/streams.md).
    let m = &msgs[0];
    assert_eq!(m.text(), "{\"total\": 12.50}");
    assert_eq!(
        m.message_id.as_deref(),
        Some("00000000-0000-0000-0000-0000000000a1")
    );
    assert_eq!(m.content_type.as_deref(), Some("application/json"));
    assert!(m.has_creation_time, "{m:?}");
    assert_eq!(m.prop("aggregate_type"), Some("order"));
    assert_eq!(m.prop("aggregate_id"), Some("o-1"));
    assert_eq!(m.prop("event_type"), Some("created"));
    assert_eq!(m.prop("table"), Some("public.outbox"));
    assert_eq!(m.prop("tenant"), Some("acme"));
    assert_eq!(m.prop("traceparent"), Some("00-abc-def-01"));
    assert_eq!(m.prop("tx_index"), Some("0"));
    assert!(m.prop("commit_lsn").unwrap().contains('/'), "{m:?}");
    assert!(m.prop("xid").unwrap().parse::<u64>().unwrap() > 0);
    // The producer names the source: system identifier, database, slot, timeline.
    let system_id = env
        .db
        .psql("SELECT system_identifier FROM pg_control_system()");
    let source = format!("{}/{}/{}", system_id.trim(), env.db.name, env.slot);
    let producer = format!("outbox-relay/{source}/tl1");
    assert_eq!(m.prop("x-outbox-producer"), Some(producer.as_str()));
    assert_eq!(m.prop("x-outbox-source"), Some(source.as_str()));
    assert_eq!(m.prop("x-outbox-timeline"), Some("1"));
    assert_eq!(m.prop("replay"), None);
    // Publishing ids derived from each event's commit LSN and index, increasing in
    // stream order.
    let mut previous = 0;
    for m in &msgs {
        let id: u64 = m.prop("x-outbox-publishing-id").unwrap().parse().unwrap();
        assert_eq!(id, m.expected_publishing_id(), "{m:?}");
        assert!(id > previous, "{m:?}");
        previous = id;
        assert_eq!(m.prop("x-outbox-producer"), Some(producer.as_str()));
    }
    // The rest: seq 1..=268 exactly once, in commit order; a transaction's rows share
    // its commit LSN and count tx_index from 0.
    assert_eq!(assert_exactly_once(&msgs[1..], total_seq), 0);
    let last_tx: Vec<_> = msgs[msgs.len() - 200..]
        .iter()
        .map(|m| m.order_key())
        .collect();
    assert!(
        last_tx.iter().all(|k| k.0 == last_tx[0].0),
        "one commit LSN"
    );
    assert_eq!(
        last_tx.iter().map(|k| k.1).collect::<Vec<_>>(),
        (0..200).collect::<Vec<u64>>()
    );
    assert_ne!(
        msgs[1].order_key().0,
        msgs[2].order_key().0,
        "separate transactions"
    );

    // `check` and `status` name the producer and what the broker holds of it.
    let out = env.cli_env(&["check"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let last_id = msgs.last().unwrap().prop("x-outbox-publishing-id").unwrap();
    assert!(
        stdout(&out).contains(&format!(
            "rabbitmq stream producer: {producer} (last stored publishing id {last_id}: commit "
        )),
        "{}",
        stdout(&out)
    );
    let out = env.cli_env(&["status", "--json"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stream_producer"], producer.as_str(), "{v}");
    assert_eq!(v["system_identifier"], system_id.trim(), "{v}");
    assert_eq!(v["timeline"], 1, "{v}");

    // A clean stop and a restart publish nothing again.
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("stream target"), "{log}");
    let relay = env.start_env(&[], &vars);
    env.insert_seq(next, 3, 3);
    let msgs = read_stream(&stream, 1 + total_seq as usize + 3, QUIET, WAIT).await;
    assert_exactly_once(&msgs[1..], total_seq + 3);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    // replay --from-table: a flagged copy of every row, under no producer.
    let out = env.cli_env(&["replay", "--from-table"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let all = read_stream(&stream, 2 * (1 + total_seq as usize + 3), QUIET, WAIT).await;
    assert_eq!(
        all.len(),
        2 * (1 + total_seq as usize + 3),
        "the copies appended"
    );
    let (live, copies) = all.split_at(1 + total_seq as usize + 3);
    assert!(live.iter().all(|m| m.prop("replay").is_none()));
    assert!(
        copies.iter().all(|m| m.prop("replay") == Some("true")),
        "{:?}",
        copies[0]
    );
    assert!(
        copies.iter().all(|m| m.prop("x-outbox-producer").is_none()),
        "{:?}",
        copies[0]
    );
    let mut live_ids: Vec<_> = live.iter().map(|m| m.message_id.clone().unwrap()).collect();
    let mut copy_ids: Vec<_> = copies
        .iter()
        .map(|m| m.message_id.clone().unwrap())
        .collect();
    live_ids.sort();
    copy_ids.sort();
    assert_eq!(live_ids, copy_ids);

    delete_stream(&stream).await;
    env.cleanup().await;
}

/// `[message] headers = "minimal"` on the stream target (docs/design.md §5): the
/// lean profile keeps `commit_lsn`, `tx_index` and the producer's properties. A SIGKILL while rows are committed, then the slot
/// rewound to its start (a copy made at creation put back under its name, the
/// stored position deleted), so that the restarted relay reads every event again:
/// it must skip all that the stream holds and store every row exactly once, in
/// commit order; and the messages carry only the lean profile's properties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_headers_on_a_stream_exactly_once_through_a_kill() {
    const N: usize = 3_000;
    let env = Env::new().await;
    let stream = testkit::unique_name("stream");
    let mut vars = stream_env(&stream);
    vars.push(("OUTBOX_RELAY_MESSAGE_HEADERS", "minimal".to_string()));
    let vars = as_refs(&vars);
    env.create_slot();
    let rewind = format!("{}_rewind", env.slot);
    env.db.psql(&format!(
        "SELECT pg_copy_logical_replication_slot('{}', '{rewind}')",
        env.slot
    ));
    // `check --declare` declares the stream, so the reads below never find it missing.
    let out = env.cli_env(&["check", "--declare"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    env.insert_seq(1, 500, 50);
    let relay = env.start_env(&[], &vars);
    read_stream(&stream, 500, Duration::ZERO, WAIT).await;
    // Commits go on while the relay is killed: 2,000 rows in transactions of 1 to 40.
    let client = env.db.client().await;
    let loader = tokio::spawn(async move {
        let mut next = 501;
        let mut size = 1;
        while next <= 2_500 {
            let end = (next + size - 1).min(2_500);
            client
                .batch_execute(&format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                       FROM generate_series({next}, {end}) AS s(n) ORDER BY s.n"
                ))
                .await
                .unwrap();
            next = end + 1;
            size = size % 40 + 7;
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill();
    loader.await.unwrap();
    let stored = read_stream(&stream, 0, Duration::ZERO, WAIT).await.len();
    assert!(
        stored >= 500,
        "{stored} messages in the stream before the kill"
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
    env.insert_seq(2_501, 500, 100);
    let msgs = read_stream(&stream, N, QUIET, WAIT).await;
    assert_exactly_once(&msgs, N as u64);
    for m in &msgs {
        for key in [
            "event_type",
            "commit_lsn",
            "tx_index",
            "x-outbox-producer",
            "x-outbox-source",
            "x-outbox-timeline",
        ] {
            assert!(m.prop(key).is_some(), "{key} missing: {m:?}");
        }
        for key in ["aggregate_type", "aggregate_id", "table", "xid"] {
            assert!(m.prop(key).is_none(), "{key} under minimal: {m:?}");
        }
        assert!(m.message_id.is_some(), "{m:?}");
    }
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("events the stream already held were sent again"),
        "the restarted relay did not find its stored events by their ids: {log}"
    );
    delete_stream(&stream).await;
    env.cleanup().await;
}

/// `check` with `declare_stream = false` and a missing stream fails, naming it.
#[tokio::test]
async fn check_fails_for_a_missing_stream_not_declared() {
    let env = Env::new().await;
    let stream = testkit::unique_name("stream");
    env.create_slot();
    let mut vars = stream_env(&stream);
    vars.push(("OUTBOX_RELAY_RABBITMQ_DECLARE_STREAM", "false".into()));
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(!out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            "FAIL  stream {stream}: missing, and run will not declare it"
        )),
        "{}",
        stdout(&out)
    );
    assert!(!stream_exists(&stream).await);
    env.cleanup().await;
}
