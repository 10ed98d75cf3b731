//! Skipping a poison event by its message id, not by LSN arithmetic (docs/recovery.md,
//! "Poison event"): `slot skip` on an exchange target stuck on an unroutable
//! message, and `run --skip-through` on a stream target stuck on an event larger
//! than the broker's frame maximum.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use support::scenarios::{confirmed, lsn, poll, WAIT};
use support::stream::{delete_stream, read_stream, stream_url};
use support::*;

const GOOD_1: &str = "00000000-0000-0000-0000-00000000a001";
const POISON: &str = "00000000-0000-0000-0000-00000000a002";
const GOOD_2: &str = "00000000-0000-0000-0000-00000000a003";

/// Inserts one row of `payload_sql` (an SQL expression) in its own transaction.
fn insert(env: &Env, id: &str, aggregate_type: &str, payload_sql: &str) {
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('{id}', '{aggregate_type}', 'a-{id}', 'happened', {payload_sql})"
    ));
}

/// The stored position of the test's slot.
fn stored(env: &Env) -> u64 {
    lsn(&env.db.psql(&format!(
        "SELECT acked_lsn FROM outbox_relay_state WHERE slot_name = '{}'",
        env.slot
    )))
}

/// Waits until the relay's log holds `needle`.
async fn log_says(relay: &Relay, needle: &str) {
    let deadline = Instant::now() + WAIT;
    while !relay.log_text().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "the log never said {needle:?}:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An unroutable event (no queue for its routing key, no dead-letter exchange)
/// holds the relay. `slot skip` refuses while the relay holds the slot, and without a
/// terminal to confirm on; with `--yes` it moves the slot and the stored position
/// past the poison transaction, and the relay goes on with the next event.
#[tokio::test]
async fn slot_skip_unblocks_an_exchange_target() {
    let mut env = Env::new().await;
    env.create_slot();
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let queue = env.broker.queue_bound(&exchange, "order.#").await;
    let got = env.broker.consume(&queue).await;
    insert(&env, GOOD_1, "order", "'{}'");
    insert(&env, POISON, "nobody", "'{}'");
    insert(&env, GOOD_2, "order", "'{}'");

    let relay = env.start(&[]);
    got.wait_for(1, WAIT).await;
    log_says(&relay, "nobody.happened").await;
    let out = env.cli(&["slot", "skip", POISON, "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with(&format!("error: replication slot \"{}\" is in use by pid ", env.slot))
            && err.ends_with(": stop the relay first (Postgres moves a slot only while nobody streams from it), then skip again and start the relay\n"),
        "{err}"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let before = confirmed(&env, &env.slot).unwrap();

    // No terminal and no --yes: listed, not skipped.
    let out = env.cli(&["slot", "skip", POISON]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert_eq!(
        stderr(&out).lines().last().unwrap(),
        "error: nothing was skipped: stdin is not a terminal to confirm on; pass --yes to skip the 1 event listed above"
    );
    assert!(
        stdout(&out).contains(&format!("id={POISON} ")),
        "{}",
        stdout(&out)
    );
    assert_eq!(confirmed(&env, &env.slot).unwrap(), before);

    let out = env.cli(&["slot", "skip", POISON, "--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let through = lines[0]
        .rsplit_once("ending at ")
        .map(|(_, l)| l.trim_end_matches("):").to_string())
        .unwrap();
    assert_eq!(
        lines[0],
        format!("1 event pending in slot {} will be skipped, never published (1 transaction through the commit ending at {through}):", env.slot)
    );
    assert!(lines[1].contains(&format!("id={POISON} ")), "{text}");
    assert_eq!(
        *lines.last().unwrap(),
        format!("skipped 1 event: slot {} and its stored position are at {through}; the relay resumes after it", env.slot)
    );
    assert!(
        stderr(&out).contains("skipped poison events"),
        "{}",
        stderr(&out)
    );
    assert_eq!(confirmed(&env, &env.slot).unwrap(), lsn(&through));
    assert_eq!(stored(&env), lsn(&through));

    // The relay goes on after the poison, which is never published. (GOOD_2 may come
    // twice: it overtook the refused poison on the wire, docs/design.md §1.)
    let relay = env.start(&[]);
    got.wait_until(WAIT, |m| {
        m.iter().filter(|m| m.message_id() == GOOD_2).count() >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut ids: Vec<String> = got.snapshot().iter().map(|m| m.message_id()).collect();
    ids.dedup();
    assert_eq!(ids, [GOOD_1, GOOD_2]);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

/// `/metrics` of the relay at `addr`, by curl.
fn scrape(addr: &str) -> String {
    let out = Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A stream target: an event over the broker's frame maximum holds the relay; `run
/// --skip-through <message_id> --yes` skips it before it starts, counts it, and
/// publishes what follows; the stream never holds the poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_skip_through_unblocks_a_stream_target() {
    let env = Env::new().await;
    env.create_slot();
    let stream = testkit::unique_name("skip");
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", metrics.clone()),
    ];
    let vars = as_refs(&vars);
    insert(&env, GOOD_1, "order", "'{}'");
    // 2 MB: over the stream protocol's frame maximum (1 MiB by default).
    insert(
        &env,
        POISON,
        "order",
        "jsonb_build_object('blob', repeat('x', 2000000))",
    );
    insert(&env, GOOD_2, "order", "'{}'");

    let relay = env.start_env(&[], &vars);
    log_says(&relay, "larger than the stream's frame maximum").await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    let relay = env.start_env(&["--skip-through", POISON, "--yes"], &vars);
    let msgs = read_stream(&stream, 2, Duration::from_secs(2), WAIT).await;
    let ids: Vec<&str> = msgs
        .iter()
        .map(|m| m.message_id.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(ids, [GOOD_1, GOOD_2]);
    poll("the skip to be counted", || {
        scrape(&metrics)
            .lines()
            .any(|l| l == "outbox_relay_skipped_events_total 1")
    })
    .await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("skipped poison events"), "{log}");
    delete_stream(&stream).await;
    env.cleanup().await;
}

/// An outbox whose ids are text with no unique key: an id may look like an LSN, and
/// the same id may occur twice.
const TEXT_IDS: &str = "CREATE TABLE outbox (
    id text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb,
    created_at timestamptz NOT NULL DEFAULT now());";

/// The pending events' message ids, oldest first, and their commit LSNs (`peek --json`).
fn pending(env: &Env) -> Vec<(String, String)> {
    let out = env.cli(&["peek", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let field = |k: &str| e[k].as_str().unwrap().to_string();
            (field("message_id"), field("commit_lsn"))
        })
        .collect()
}

/// `slot skip ID` takes ID as a message id even when it reads as an LSN, and skips
/// through its first occurrence only; an id that occurs in several pending
/// transactions is refused with the list of them, and an LSN is taken only with
/// `--lsn`.
#[tokio::test]
async fn slot_skip_takes_the_first_match_and_an_lsn_only_with_dash_dash_lsn() {
    let env = Env::with_ddl(TEXT_IDS, &["public.outbox"]).await;
    env.create_slot();
    for id in ["cafe/0001", "dup", "x", "dup", "y"] {
        insert(&env, id, "order", "'{}'");
    }
    let ids = |env: &Env| {
        pending(env)
            .into_iter()
            .map(|(id, _)| id)
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&env), ["cafe/0001", "dup", "x", "dup", "y"]);

    // Shaped like an LSN (CAFE/1, far ahead), yet an id: one event is skipped.
    let out = env.cli(&["slot", "skip", "cafe/0001", "--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("1 event pending"),
        "{}",
        stdout(&out)
    );
    assert_eq!(ids(&env), ["dup", "x", "dup", "y"]);

    // Twice pending: refused, naming both occurrences; nothing moves.
    let lsns: Vec<String> = pending(&env).into_iter().map(|(_, l)| l).collect();
    let before = confirmed(&env, &env.slot);
    let out = env.cli(&["slot", "skip", "dup", "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("message_id \"dup\" occurs in 2 pending transactions")
            && err.contains(&format!("commit_lsn {}", lsns[0]))
            && err.contains(&format!("commit_lsn {}", lsns[2]))
            && err.contains("--lsn"),
        "{err}"
    );
    assert_eq!(confirmed(&env, &env.slot), before);

    // --lsn: every pending transaction committed at or before it.
    let out = env.cli(&["slot", "skip", "--lsn", &lsns[1], "--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("2 events pending"),
        "{}",
        stdout(&out)
    );
    assert_eq!(ids(&env), ["dup", "y"]);
    // Now once pending: the id is enough, and only its transaction goes.
    let out = env.cli(&["slot", "skip", "dup", "--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(ids(&env), ["y"]);
    env.cleanup().await;
}
