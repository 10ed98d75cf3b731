//! Postgres faults: restart, crash, a stalled replication connection, and a schema
//! change while streaming.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::unique_name;

use crate::harness::*;
use support::{bin, Relay};

#[path = "postgres/stored.rs"]
mod stored;

/// Restarts (`fast`) or crashes (`immediate`) the fault cluster mid-stream.
///
/// Postgres 15 persists the slot's `confirmed_flush_lsn` only at checkpoints (and
/// only when the slot is otherwise dirty), so after a restart the slot can go back
/// to its last saved position and redeliver. The test takes two CHECKPOINTs a moment
/// apart just before the fault (the first logs a running-xacts record the relay then
/// confirms past, making the slot dirty; the second saves it) and allows, as the
/// duplicate bound, every message committed at or after the position the slot had
/// before those checkpoints, plus `max_in_flight`.
async fn restart_mid_stream(mode: &str) {
    let _broker = BROKER.read().await;
    let _pg = FAULT_PG.lock().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Fault, Proxies::default(), MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(50));
    w.wait_distinct(1000, WAIT).await;
    let saved = w.confirmed().await;
    w.sql("CHECKPOINT").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    w.sql("CHECKPOINT").await;
    restart_fault_cluster(mode).await;
    let at_restart = w.consumer.distinct();
    load.await.unwrap();
    w.rolled_back(10).await;
    // Everything since the saved position may come again (see above).
    let recs = w.consumer.snapshot();
    let mut seen = std::collections::HashSet::new();
    let since_checkpoint = recs
        .iter()
        .filter(|r| r.marker.is_none() && r.commit_lsn >= saved && seen.insert(r.id.clone()))
        .count();
    w.wait_all(WAIT).await;
    let recs = w.consumer.snapshot();
    let mut seen = std::collections::HashSet::new();
    let since_checkpoint_all = recs
        .iter()
        .filter(|r| r.marker.is_none() && r.commit_lsn >= saved && seen.insert(r.id.clone()))
        .count();
    let _ = since_checkpoint;
    let report = w
        .verify(since_checkpoint_all.min(at_restart) + MAX_IN_FLIGHT)
        .await;
    eprintln!(
        "{mode}: {} duplicates; {at_restart} received before the restart",
        report.duplicates
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    // A server shutting down ends the stream with CommandComplete: a transient end,
    // not a failure worth an ERROR.
    assert!(!log.contains(" ERROR "), "{log}");
    w.cleanup().await;
}

/// docs/design.md §1.1: `pg_ctlcluster … restart -m fast` mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restarted_mid_stream() {
    restart_mid_stream("fast").await;
}

/// docs/design.md §1.1, §1.3: `pg_ctlcluster … restart -m immediate` (a crash) mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crashed_mid_stream() {
    restart_mid_stream("immediate").await;
}

/// The replication connection stalls (the proxy stops forwarding, nothing closes):
/// the relay notices the silence (`wal_sender_timeout` = 10 s on the test clusters)
/// and reconnects; once the network is back everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_side_network_stall() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let proxies = Proxies {
        postgres: true,
        amqp: false,
    };
    let w = World::new(Cluster::Test, proxies, MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    let mark = relay.log_text().len();
    w.pg_proxy.as_ref().unwrap().stall();
    let deadline = std::time::Instant::now() + Duration::from_secs(45);
    let mut noticed = false;
    while std::time::Instant::now() < deadline && !noticed {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let log = relay.log_text();
        noticed = log[mark.min(log.len())..].contains("session ended; reconnecting");
    }
    w.pg_proxy.as_ref().unwrap().restore();
    assert!(
        noticed,
        "the relay noticed the stalled replication connection: {}",
        relay.log_text()
    );
    load.await.unwrap();
    w.verify(2 * MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// A column added to the outbox while streaming (with and without a default, then
/// used): the relay follows the new relation and publishes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn column_added_mid_stream() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 5000, 50, Duration::from_millis(10));
    w.wait_distinct(500, WAIT).await;
    w.sql("ALTER TABLE outbox ADD COLUMN tenant text").await;
    w.sql("ALTER TABLE outbox ADD COLUMN version int NOT NULL DEFAULT 1")
        .await;
    load.await.unwrap();
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, tenant, version)
         SELECT 'seq', s.n::text, 'tick', '{}', 'acme', 2 FROM generate_series(5001, 5100) s(n) ORDER BY s.n",
    )
    .await;
    let report = w.verify(0).await;
    assert_eq!(report.distinct, 5100);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The relay binary to run: `BASELINE_RELAY_BIN` (an older build, to measure
/// what a change fixed) or this build.
fn relay_bin() -> String {
    std::env::var("BASELINE_RELAY_BIN").unwrap_or_else(|_| bin().display().to_string())
}

/// Starts `outbox-relay run <args>` with the world's config.
fn start_with_args(w: &World, args: &[&str]) -> Relay {
    let log = w.env.dir.join(format!("{}.log", unique_name("relay")));
    let child = Command::new(relay_bin())
        .arg("--config")
        .arg(w.config())
        .arg("run")
        .args(args)
        .current_dir(&w.env.dir)
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_TEST_RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Relay { child, log }
}

/// Waits until every row of the outbox arrived, failing at once if the relay exits.
async fn wait_all_running(w: &World, relay: &mut Relay) {
    let expected: usize = w.sql("SELECT count(*) FROM outbox").await.parse().unwrap();
    let deadline = Instant::now() + WAIT;
    while w.consumer.distinct() < expected {
        if let Some(status) = relay.child.try_wait().unwrap() {
            panic!(
                "the relay exited ({status}) with {} of {expected} rows delivered:\n{}",
                w.consumer.distinct(),
                relay.log_text()
            );
        }
        assert!(Instant::now() < deadline, "timed out: {}", relay.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the slot's confirmed position reaches `lsn` (all acked and confirmed).
async fn wait_confirmed(w: &World, lsn: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.confirmed().await < lsn {
        assert!(Instant::now() < deadline, "the slot did not reach {lsn:X}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `run --start-lsn L` applies to the first session only. Once the slot has moved past
/// L, a reconnect (here the walsender is terminated) must resume from the slot, not
/// ask for L again — Postgres cannot stream from before the slot's position, which the
/// relay reports as an unmet precondition (exit 2). Only this test's slot is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn start_lsn_applies_to_the_first_session_only() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let slot_query = format!(
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{}'",
        w.env.slot
    );
    let start = w.sql(&slot_query).await;
    let mut relay = start_with_args(&w, &["--start-lsn", start.trim()]);
    w.insert(1, 200, 20).await;
    let end = parse_lsn(&w.sql("SELECT pg_current_wal_lsn()").await).unwrap();
    w.wait_distinct(200, WAIT).await;
    wait_confirmed(&w, end).await;
    assert!(w.confirmed().await > parse_lsn(&start).unwrap());

    let killed = w
        .sql(&format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
              WHERE slot_name = '{}' AND active_pid IS NOT NULL",
            w.env.slot
        ))
        .await;
    assert_eq!(killed, "t", "the walsender was running");
    w.insert(201, 200, 20).await;
    wait_all_running(&w, &mut relay).await;
    w.verify(MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.matches("replication started").count() >= 2,
        "the relay reconnected: {log}"
    );
    w.cleanup().await;
}

/// The acked position survives a Postgres crash. Postgres 15 writes a slot's
/// confirmed position to disk only at checkpoints, so a crash without one brings the
/// slot back to an older position; the relay carries its acked watermark across
/// sessions and advances the slot to it before streaming again, so nothing the broker
/// acked before the crash is published twice (docs/reliability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crash_without_checkpoint_resends_nothing_acked() {
    let _broker = BROKER.read().await;
    let _pg = FAULT_PG.lock().await;
    const MAX_IN_FLIGHT: usize = 500;
    const N: u64 = 2000;
    let w = World::new(Cluster::Fault, Proxies::default(), MAX_IN_FLIGHT).await;
    let mut relay = w.start();
    w.insert(1, N, 50).await;
    let end = parse_lsn(&w.sql("SELECT pg_current_wal_lsn()").await).unwrap();
    w.wait_distinct(N as usize, WAIT).await;
    wait_confirmed(&w, end).await;

    // A crash with no CHECKPOINT before it: the slot's saved position is older.
    restart_fault_cluster("immediate").await;
    w.insert_retrying(N + 1, 500, 50).await;
    wait_all_running(&w, &mut relay).await;
    let report = w.verify(MAX_IN_FLIGHT).await;
    let recs = w.consumer.snapshot();
    let first_n = recs
        .iter()
        .filter(|r| r.marker.is_none() && r.seq >= 1 && r.seq as u64 <= N)
        .count();
    assert_eq!(
        first_n - N as usize,
        0,
        "rows acked before the crash were published again"
    );
    assert_eq!(report.duplicates, 0, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
