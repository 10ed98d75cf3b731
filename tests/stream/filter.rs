//! `[rabbitmq] stream_filter_value` end to end (docs/streams.md, "Filter values"): the
//! real binary on RabbitMQ 4 stores each row's rendered filter value, a consumer
//! filtering on one value is sent only chunks that may hold it, and every row is in the
//! stream once; on RabbitMQ 3.10 `check` and `run` refuse (exit 2) in one sentence naming
//! the broker's version and the fix.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::stream::{delete_stream, read_stream, stream_url};
use support::*;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);
const FIX: &str = "upgrade the broker to RabbitMQ 3.13 or later, or remove stream_filter_value";

fn filter_env(stream: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.to_string()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
        (
            "OUTBOX_RELAY_RABBITMQ_STREAM_FILTER_VALUE",
            "{aggregate_type}".to_string(),
        ),
    ]
}

/// Inserts `n` rows of `aggregate_type` in one transaction, numbered from `from`.
fn insert(env: &Env, aggregate_type: &str, from: usize, n: usize) {
    env.db.psql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT '{aggregate_type}', s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {}) AS s(n) ORDER BY s.n",
        from + n - 1
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_sends_filter_values_or_refuses_an_older_broker() {
    let env = Env::new().await;
    let stream = testkit::unique_name("stream");
    env.create_slot();
    let vars = filter_env(&stream);
    let vars = as_refs(&vars);
    if testkit::broker_major() < 4 {
        let out = env.cli_env(&["check"], &vars);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{}{}",
            stdout(&out),
            stderr(&out)
        );
        let text = stdout(&out);
        let line = text
            .lines()
            .find(|l| l.starts_with("FAIL  rabbitmq stream:"))
            .unwrap_or_else(|| panic!("no stream line: {text}"));
        assert!(
            line.contains("RabbitMQ 3.10.") && line.contains(FIX),
            "{line}"
        );
        let mut relay = env.start_env(&[], &vars);
        let code = relay.wait(Duration::from_secs(30));
        let log = relay.log_text();
        assert_eq!(code, Some(2), "run should exit 2: {log}");
        assert!(log.contains("RabbitMQ 3.10.") && log.contains(FIX), "{log}");
        env.cleanup().await;
        return;
    }
    let out = env.cli_env(&["check", "--declare"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let relay = env.start_env(&[], &vars);
    // Transactions of one type each, each stored before the next commits: chunks of
    // one type each.
    let mut stored = 0;
    for (k, kind) in ["order", "invoice", "order", "invoice", "order"]
        .iter()
        .enumerate()
    {
        insert(&env, kind, 1 + k * 30, 30);
        stored += 30;
        read_stream(&stream, stored, Duration::ZERO, WAIT).await;
    }
    let msgs = read_stream(&stream, stored, QUIET, WAIT).await;
    // Each row once, in commit order (the rows' `seq` counts up across the types).
    let seqs: Vec<u64> = msgs
        .iter()
        .map(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.body).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, (1..=stored as u64).collect::<Vec<_>>());
    let ids: std::collections::HashSet<_> = msgs.iter().map(|m| m.message_id.clone()).collect();
    assert_eq!(ids.len(), stored);
    let sent = testkit::stream::read_filtered(&stream, &["order"], false).await;
    assert!(sent.len() < msgs.len(), "the broker filtered nothing");
    let orders: Vec<_> = sent
        .iter()
        .filter(|m| m.text("aggregate_type") == Some("order"))
        .map(|m| m.message_id.clone().unwrap())
        .collect();
    let want: Vec<_> = msgs
        .iter()
        .filter(|m| m.prop("aggregate_type") == Some("order"))
        .map(|m| m.message_id.clone().unwrap())
        .collect();
    assert_eq!(want.len(), 90);
    assert_eq!(orders, want);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    delete_stream(&stream).await;
    env.cleanup().await;
}
