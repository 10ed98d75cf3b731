//! The stream target against a broker that refuses, enforces its frame maximum,
//! serves other writers and truncates (docs/streams.md, docs/design.md §4), through
//! the binary, on the test Postgres cluster:
//!
//! - a refusal of a publish frame whose later frames the broker stores: the relay
//!   stops with exit code 2 and the runbook step, and confirms nothing past the
//!   refused events;
//! - `replay --from-table` writing into the stream while the relay restarts: the
//!   relay starts and stops (SIGTERM) while the replay still writes;
//! - events of 700 to 900 KiB among small ones, through a broker that enforces a
//!   1 MiB frame maximum; then one over a lowered maximum is held as a poison
//!   message (`/poison`, the metric, `status`, the log) until the limit is raised;
//! - the relay's last messages removed by retention while it was stopped: it starts
//!   again and goes on.
//!
//! Each was seen failing on a relay that searched the stream for its tail and cut
//! publish frames by an estimate.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use support::stream::{assert_tag_exactly_once, delete_stream, read_stream, stream_url};
use support::*;
use testkit::free_port;
use testkit::stream_proxy::{AfterRefusal, StreamProxy};

const WAIT: Duration = Duration::from_secs(120);
const QUIET: Duration = Duration::from_secs(2);

fn stream_env(stream: &str, url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.to_string()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", url.to_string()),
    ]
}

fn broker() -> std::net::SocketAddr {
    let url = stream_url();
    url.split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or("127.0.0.1:5552")
        .parse()
        .unwrap()
}

fn proxied(proxy: &StreamProxy) -> String {
    format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_frame_followed_by_stored_ones_stops_the_relay() {
    let env = Env::new().await;
    env.create_slot();
    let proxy = StreamProxy::start(broker()).await;
    let stream = testkit::unique_name("refused");
    let mut vars = stream_env(&stream, &proxied(&proxy));
    vars.push(("OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT", "5000".into()));
    let vars = as_refs(&vars);
    let mut relay = env.start_env(&[], &vars);
    env.insert_tagged("seq", 1, 500);
    read_stream(&stream, 500, Duration::ZERO, WAIT).await;
    // One transaction of 2,500 rows goes out as three publish frames back to back:
    // the first is refused, the two after it are stored.
    proxy.refuse_next_publish(AfterRefusal::Pass);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'seq', s.n::text, 'tick', '{}' FROM generate_series(501, 3000) AS s(n) ORDER BY s.n",
    );
    let code = relay.wait(WAIT);
    let log = relay.log_text();
    assert_eq!(code, Some(2), "the relay must stop with exit code 2: {log}");
    assert!(
        log.contains("stopped publishing into stream") && log.contains("outbox-relay replay"),
        "{log}"
    );
    assert_eq!(proxy.refused_frames(), 1);
    // A restarted relay (a supervisor's) stops too: the mark in the state table.
    let mut again = env.start_env(&[], &vars);
    let code = again.wait(WAIT);
    let log = again.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("a previous run stopped publishing"), "{log}");
    // The slot is not past the refused events: the first row missing from the
    // stream is still pending (peek reads the slot without consuming).
    let msgs = read_stream(&stream, 0, QUIET, WAIT).await;
    let stored: std::collections::HashSet<u64> =
        support::stream::tagged(&msgs, "seq").into_iter().collect();
    let first_missing = (1..=3000u64).find(|i| !stored.contains(i)).unwrap();
    let out = env.cli_env(&["peek", "--json", "--limit", "100000"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let pending: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pending: Vec<String> = pending
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["aggregate_id"].as_str().map(str::to_string))
        .collect();
    assert!(
        pending.contains(&first_missing.to_string()),
        "row {first_missing} was refused but the slot moved past it"
    );
    delete_stream(&stream).await;
    env.cleanup().await;
}

/// Rows for a replay, committed before the slot exists (the relay never reads them).
fn rows_for_replay(env: &Env, n: usize) {
    env.db.psql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'old', s.n::text, 'tick', '{{}}' FROM generate_series(1, {n}) AS s(n)"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_writing_into_the_stream_does_not_hold_a_restarting_relay() {
    let env = Env::new().await;
    rows_for_replay(&env, 200_000);
    env.create_slot();
    let stream = testkit::unique_name("busy");
    let vars = stream_env(&stream, &stream_url());
    let vars = as_refs(&vars);
    let relay = env.start_env(&[], &vars);
    env.insert_tagged("seq", 1, 300);
    read_stream(&stream, 300, Duration::ZERO, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    // Another writer on the stream: the replay of the whole table.
    let replay_log = env.dir.join("replay.log");
    let mut replay = std::process::Command::new(bin())
        .arg("--config")
        .arg(env.config())
        .args(["replay", "--from-table"])
        .envs(vars.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&replay_log).unwrap())
        .spawn()
        .unwrap();
    assert!(testkit::stream::wait_offset(&stream, 2_000, WAIT).await);
    // The relay starts while the replay writes, and stops on SIGTERM, both before
    // the replay is done.
    let mut relay = env.start_env(&[], &vars);
    env.insert_tagged("seq", 301, 100);
    let started = std::time::Instant::now();
    while !relay.log_text().contains("replication started")
        || !relay
            .log_text()
            .contains("connected to the rabbitmq stream")
    {
        assert!(
            started.elapsed() < WAIT,
            "the relay did not start: {}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        replay.try_wait().unwrap().is_none(),
        "the relay did not start while the replay wrote into the stream (it waited {:?}, until the replay ended)\n{}",
        started.elapsed(),
        relay.log_text()
    );
    relay.signal("TERM");
    let code = relay.wait(WAIT);
    assert_eq!(code, Some(0), "{}", relay.log_text());
    assert!(
        replay.try_wait().unwrap().is_none(),
        "the relay stopped only after the replay ended"
    );
    // What the replay writes is tested elsewhere (tests/stream/stream.rs); stop it here.
    let _ = replay.kill();
    let _ = replay.wait();
    delete_stream(&stream).await;
    env.cleanup().await;
}

/// For each size, a small row, a row whose payload is that many KiB, and a small row,
/// all in one transaction (so that the relay gets them at once).
fn big_rows(env: &Env, tag: &str, from: usize, sizes_kib: &[usize]) {
    let mut sql = String::from("BEGIN;");
    for (k, kib) in sizes_kib.iter().enumerate() {
        let at = from + k * 3;
        sql.push_str(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('{tag}', '{}', 'tick', '{{}}'),
                      ('{tag}', '{}', 'tick', jsonb_build_object('pad', repeat('x', {}))),
                      ('{tag}', '{}', 'tick', '{{}}');",
            at,
            at + 1,
            kib * 1024,
            at + 2
        ));
    }
    sql.push_str("COMMIT;");
    env.db.psql(&sql);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_near_the_frame_maximum_and_over_a_lowered_one() {
    let env = Env::new().await;
    let metrics = format!("127.0.0.1:{}", free_port());
    env.create_slot();
    let proxy = StreamProxy::start(broker()).await;
    proxy.set_frame_max(Some(1 << 20));
    let stream = testkit::unique_name("frames");
    let vars = stream_env(&stream, &proxied(&proxy));
    let vars = as_refs(&vars);
    let config = env.config_file("frames.toml", &env.db.url(), &testkit::amqp_url(), &metrics);
    let relay = env.start_with_env(&config, "info", &vars);
    // 700 to 900 KiB events, each between two small ones, some after one just under
    // half the maximum (a frame cut by an estimate at 512 KiB takes the next one too):
    // 36 rows in one transaction.
    big_rows(
        &env,
        "seq",
        1,
        &[700, 480, 900, 800, 500, 900, 700, 450, 880, 850, 490, 750],
    );
    let msgs = read_stream(&stream, 36, QUIET, WAIT).await;
    assert_tag_exactly_once(&msgs, "seq", 1, 36);
    assert_eq!(
        proxy.oversized(),
        0,
        "a publish frame went over the maximum"
    );
    assert_eq!(
        proxy.agreed_frame_max(),
        1 << 20,
        "the proxy enforced the maximum"
    );
    let log = relay.kill();
    assert!(!log.contains("reconnecting"), "{log}");
    // The broker's limit lowered below a 700 KiB event: it holds the relay.
    proxy.set_frame_max(Some(512 << 10));
    let relay = env.start_with_env(&config, "info", &vars);
    big_rows(&env, "seq", 37, &[700]);
    env.insert_tagged("seq", 40, 20);
    let started = std::time::Instant::now();
    let body = loop {
        if let Some((_, body)) = http_get(&metrics, "/poison").await {
            if body.contains("message_id") {
                break body;
            }
        }
        assert!(
            started.elapsed() < WAIT,
            "no poison message reported: {}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(body.contains("frame_max"), "{body}");
    let (_, scrape) = http_get(&metrics, "/metrics").await.unwrap();
    assert!(
        scrape.contains("outbox_relay_poison_messages 1"),
        "{scrape}"
    );
    let out = env.cli_with(&config, "info", &["status"]);
    assert!(
        stdout(&out).contains("refuses message") || stdout(&out).contains("poison"),
        "{}",
        stdout(&out)
    );
    assert!(relay
        .log_text()
        .contains("larger than the stream's frame maximum"));
    // Nothing after it is in the stream.
    let before = read_stream(&stream, 0, Duration::ZERO, WAIT).await;
    assert_eq!(support::stream::tagged(&before, "seq").len(), 37);
    // The operator raises the limit: everything goes on, once each.
    proxy.set_frame_max(Some(1 << 20));
    let msgs = read_stream(&stream, 59, QUIET, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert_tag_exactly_once(&msgs, "seq", 1, 59);
    assert_eq!(proxy.oversized(), 0);
    delete_stream(&stream).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_messages_removed_by_retention_do_not_stop_it() {
    let env = Env::new().await;
    env.create_slot();
    // Small segments and a small size limit: retention removes whole old segments.
    let mut args = HashMap::new();
    args.insert("max-length-bytes".to_string(), "2000000".to_string());
    args.insert(
        "stream-max-segment-size-bytes".to_string(),
        "200000".to_string(),
    );
    let stream = testkit::stream::TestStream::create_with("retained", args).await;
    let mut vars = stream_env(&stream.name, &stream_url());
    vars.push(("OUTBOX_RELAY_RABBITMQ_DECLARE_STREAM", "false".into()));
    let vars = as_refs(&vars);
    let relay = env.start_env(&[], &vars);
    env.insert_tagged("seq", 1, 300);
    read_stream(&stream.name, 300, Duration::ZERO, WAIT).await;
    let producer = {
        let msgs = read_stream(&stream.name, 300, Duration::ZERO, WAIT).await;
        msgs[0]
            .prop("x-outbox-producer")
            .unwrap_or_default()
            .to_string()
    };
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    // Other writers fill the stream past its limit: the relay's messages are gone.
    testkit::stream::publish_foreign(&stream.name, 3000, 2000).await;
    let left = read_stream(&stream.name, 0, Duration::ZERO, WAIT).await;
    assert!(
        support::stream::tagged(&left, "seq").is_empty(),
        "retention did not remove the relay's messages"
    );
    // The broker still knows the producer's last id (it keeps the writers' state
    // in every segment).
    assert!(testkit::stream::last_publishing_id(&producer, &stream.name).await > 0);
    env.insert_tagged("seq", 301, 300);
    let relay = env.start_env(&[], &vars);
    let msgs = read_stream(&stream.name, left.len() + 300, QUIET, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert_tag_exactly_once(&msgs, "seq", 301, 300);
    stream.delete().await;
    env.cleanup().await;
}
