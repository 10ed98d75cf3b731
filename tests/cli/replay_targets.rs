//! Replays that reach only the consumer that needs them (docs/recovery.md, "Replay to
//! one consumer"): `--where` filters on the mapped columns, `--exchange` /
//! `--routing-key` / `--stream` overrides, and `--dry-run`, for `replay --from-table`
//! and `replay --from-lsn`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::scenarios::{confirmed, is_replay, lsn, lsn_text, poll, WAIT, WINDOW_ENV};
use support::stream::{read_stream, StreamMsg};
use support::*;
use testkit::amqp::Msg;
use testkit::stream::TestStream;

/// Time for a message that should not arrive to arrive anyway.
const QUIET: Duration = Duration::from_secs(2);

fn ids(msgs: &[Msg]) -> Vec<(String, String)> {
    msgs.iter()
        .map(|m| {
            (
                m.header("aggregate_id").unwrap_or_default(),
                m.header("event_type").unwrap_or_default(),
            )
        })
        .collect()
}

/// Rows of two aggregates and two types: a dry run counts the selected rows and
/// publishes nothing; the replay sends exactly them to one queue through the default
/// exchange, and nothing to the queue bound to the relay's exchange.
#[tokio::test]
async fn from_table_to_one_queue() {
    let mut env = Env::new().await;
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("order", "o-1", "paid", "{}"),
        ("order", "o-2", "created", "{}"),
        ("customer", "c-1", "registered", "{}"),
    ]);
    let everything = env.consumer().await;
    let exchange = env.exchange.clone();
    let billing = env
        .broker
        .queue_bound(&exchange, "no.event.has.this.key")
        .await;
    let billing_got = env.broker.consume(&billing).await;

    let filter = [
        "replay",
        "--from-table",
        "--where",
        "aggregate_type=order",
        "--where",
        "aggregate_id=o-1",
    ];
    let mut dry = filter.to_vec();
    dry.push("--dry-run");
    let out = env.cli(&dry);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out).lines().last().unwrap(),
        format!("dry run: 2 rows from public.outbox matching aggregate_type=order, aggregate_id=o-1 would be replayed to exchange \"{exchange}\" with routing key {{aggregate_type}}.{{event_type}}; nothing was published")
    );

    let mut to_queue = filter.to_vec();
    to_queue.extend(["--exchange", "", "--routing-key", &billing]);
    let out = env.cli(&to_queue);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out).lines().last().unwrap(),
        format!("replayed 2 rows from public.outbox matching aggregate_type=order, aggregate_id=o-1 to exchange \"\" with routing key {billing} with header replay = true")
    );
    let got = billing_got.wait_for(2, WAIT).await;
    tokio::time::sleep(QUIET).await;
    let got_all = billing_got.snapshot();
    assert_eq!(got.len(), got_all.len(), "more than the selection arrived");
    // One transaction: one created_at, so the (created_at, id) order is the ids'.
    let mut got_ids = ids(&got_all);
    got_ids.sort();
    assert_eq!(
        got_ids,
        [
            ("o-1".into(), "created".into()),
            ("o-1".into(), "paid".into())
        ]
    );
    assert!(got_all.iter().all(is_replay));
    assert!(
        everything.is_empty(),
        "the relay's exchange got copies: {:?}",
        ids(&everything.snapshot())
    );

    // Other fields: the table (by its qualified name) and the event type.
    let out = env.cli(&[
        "replay",
        "--from-table",
        "--where",
        "table=public.outbox",
        "--where",
        "event_type=registered",
        "--where",
        "event_type=paid",
        "--dry-run",
    ]);
    assert!(
        stdout(&out).starts_with("dry run: 2 rows from public.outbox matching table=public.outbox, event_type=registered, event_type=paid"),
        "{}",
        stdout(&out)
    );
    let out = env.cli(&["replay", "--from-table", "--where", "colour=red"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("\"colour\" is not a field replay can filter on: use one of aggregate_type, aggregate_id, event_type, table, message_id"),
        "{}",
        stderr(&out)
    );
    env.cleanup().await;
}

/// From the replay window: the dry run counts the selected events of the range; the
/// replay puts exactly them into a stream of the operator's, flagged as replays, then
/// one aggregate's into one queue through the default exchange (`--exchange ""
/// --routing-key`), while the relay's exchange gets no copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_lsn_filtered_into_a_stream() {
    let mut env = Env::new().await;
    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_env(&[], &window);
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("order", "o-1", "paid", "{}"),
    ]);
    env.insert_tx(&[("order", "o-2", "paid", "{}")]);
    env.insert_tx(&[("customer", "c-1", "registered", "{}")]);
    let live = got.wait_for(4, WAIT).await;
    let first = lsn(&live[0].header("commit_lsn").unwrap());
    let last = lsn(&live[3].header("commit_lsn").unwrap());
    poll("the live slot to pass the last event", || {
        confirmed(&env, &env.slot).unwrap() > last
    })
    .await;

    let from = lsn_text(first);
    let args = ["replay", "--from-lsn", &from, "--where", "event_type=paid"];
    let mut dry = args.to_vec();
    dry.push("--dry-run");
    let out = env.cli_env(&dry, &window);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let line = stdout(&out).lines().last().unwrap().to_string();
    assert!(
        line.starts_with(&format!("dry run: 2 events committed from {from} to before "))
            && line.ends_with(&format!(" matching event_type=paid would be replayed to exchange \"{}\" with routing key {{aggregate_type}}.{{event_type}}; nothing was published", env.exchange)),
        "{line}"
    );

    let stream = TestStream::create("replay_to").await;
    let mut to_stream = args.to_vec();
    to_stream.extend(["--stream", &stream.name]);
    let out = env.cli_env(&to_stream, &window);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            " matching event_type=paid to stream {} with header replay = true (2 confirmed by the broker)",
            stream.name
        )),
        "{}",
        stdout(&out)
    );
    let msgs: Vec<StreamMsg> = read_stream(&stream.name, 2, QUIET, WAIT).await;
    let shown: Vec<(&str, &str, &str)> = msgs
        .iter()
        .map(|m| {
            (
                m.prop("aggregate_id").unwrap_or(""),
                m.prop("event_type").unwrap_or(""),
                m.prop("replay").unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(shown, [("o-1", "paid", "true"), ("o-2", "paid", "true")]);

    // The same range to one queue, through the default exchange by its name.
    let exchange = env.exchange.clone();
    let queue = env
        .broker
        .queue_bound(&exchange, "no.event.has.this.key")
        .await;
    let queue_got = env.broker.consume(&queue).await;
    let out = env.cli_env(
        &[
            "replay",
            "--from-lsn",
            &from,
            "--where",
            "aggregate_id=o-2",
            "--exchange",
            "",
            "--routing-key",
            &queue,
        ],
        &window,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let one = queue_got.wait_for(1, WAIT).await;
    assert_eq!(ids(&one), [("o-2".to_string(), "paid".to_string())]);
    assert!(one.iter().all(is_replay));
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        queue_got.len(),
        1,
        "more than the selection reached the queue"
    );
    assert_eq!(got.len(), 4, "copies reached the relay's exchange");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    stream.delete().await;
    env.cleanup().await;
}

/// A replay to a queue that does not exist (`--exchange "" --routing-key <queue>`,
/// the runbook's form, with a typo): the broker returns every copy; the replay ends
/// with a sentence that says so and names the fix, and the AMQP library's dump of
/// each returned message (headers and payload bytes) is not in the log.
#[tokio::test]
async fn a_replay_to_a_missing_queue_names_the_mistake() {
    let env = Env::new().await;
    env.insert_tx(&[("order", "o-9", "created", "{}")]);
    let missing = testkit::unique_name("no_such_queue");
    let out = env.cli_env(
        &[
            "replay",
            "--from-table",
            "--where",
            "aggregate_id=o-9",
            "--exchange",
            "",
            "--routing-key",
            &missing,
        ],
        &[("OUTBOX_RELAY_RELAY_SHUTDOWN_TIMEOUT_MS", "2000")],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "error: 1 replayed messages were returned unroutable by exchange \"\" with routing key {missing}: declare or bind the queue they are meant for, or correct --exchange / --routing-key, then run the same replay again"
        )),
        "{err}"
    );
    assert!(
        !err.contains("BasicReturnMessage") && !err.contains("returned us a message"),
        "lapin's dump of the returned message is in the log: {err}"
    );
    env.cleanup().await;
}
