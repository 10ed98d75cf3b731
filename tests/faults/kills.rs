//! Relay process faults: SIGKILL at random points, a standby taking over, and the
//! duplicate bound of one SIGKILL across transaction sizes.

use std::collections::HashSet;
use std::time::Duration;

use crate::harness::*;

/// docs/design.md §1.1, §1.3: kill -9 the relay at random points of a 100k-event stream,
/// several times in a row; nothing lost, order kept, at most `max_in_flight` (plus
/// the transaction straddling the window) published again per kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_at_random_points_of_a_100k_stream() {
    let _broker = BROKER.read().await;
    const N: u64 = 100_000;
    const PER_TX: u64 = 250;
    const MAX_IN_FLIGHT: usize = 500;
    const KILLS: usize = 4;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    w.rolled_back(100).await;
    let load = w.load(1, N, PER_TX, Duration::ZERO);
    let mut relay = w.start();
    // Random kill points, spread over the stream.
    let mut points: Vec<u64> = (0..KILLS as u64)
        .map(|k| k * N / KILLS as u64 + 1000 + rand_below(N / KILLS as u64 - 2000))
        .collect();
    points.sort();
    for p in &points {
        w.wait_distinct(*p as usize, WAIT).await;
        relay.kill();
        eprintln!(
            "killed at {} distinct / {} received",
            w.consumer.distinct(),
            w.consumer.total()
        );
        relay = w.start();
    }
    load.await.unwrap();
    w.rolled_back(100).await;
    let report = w.verify(KILLS * (MAX_IN_FLIGHT + PER_TX as usize)).await;
    assert_eq!(report.distinct, N as usize);
    assert!(
        report.markers_checked > 0,
        "the LSN sampler checked something"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// docs/design.md §7 HA: a second relay on the same slot stands by while the slot is in use
/// and takes over when the active one is killed; nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standby_takes_over_when_the_active_relay_is_killed() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 200;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let active = w.start();
    let load = w.load(1, 20_000, 100, Duration::from_millis(20));
    w.wait_distinct(1000, WAIT).await;
    let standby = w.start();
    assert!(
        World::wait_log(&standby, "standing by", Duration::from_secs(30)).await,
        "the second relay waits while the slot is in use: {}",
        standby.log_text()
    );
    let before = w.consumer.distinct();
    active.kill();
    let killed_at = std::time::Instant::now();
    assert!(
        World::wait_log(&standby, "taking over", Duration::from_secs(60)).await,
        "standby took over: {}",
        standby.log_text()
    );
    w.wait_distinct(before + 1000, WAIT).await;
    eprintln!("standby streaming {:?} after the kill", killed_at.elapsed());
    load.await.unwrap();
    w.verify(MAX_IN_FLIGHT + 100).await;
    let (code, log) = standby.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// docs/design.md §1.3, the duplicate bound of one relay crash: a message is in flight from its
/// publish until a position past it has been sent to Postgres as flushed, and at most
/// `max_in_flight` (1000) are in flight, or one transaction larger than that. 20,000
/// preloaded rows in transactions of `per_tx`; SIGKILL when the consumer has received
/// a third, restart, let it finish: everything arrives, first occurrences in commit
/// order, and duplicates ≤ max(1000, `per_tx`).
async fn one_sigkill_duplicate_bound(per_tx: u64) {
    let _broker = BROKER.read().await;
    const N: u64 = 20_000;
    const MAX_IN_FLIGHT: usize = 1000;
    let started = std::time::Instant::now();
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    if per_tx == 1 {
        // 20,000 single-row transactions in one round trip.
        w.sql(&format!(
            "DO $$ BEGIN FOR i IN 1..{N} LOOP
               INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('seq', i::text, 'tick', jsonb_build_object('seq', i));
               COMMIT;
             END LOOP; END $$"
        ))
        .await;
    } else {
        w.insert(1, N, per_tx).await;
    }
    let mut relay = w.start();
    w.wait_distinct(N as usize / 3, WAIT).await;
    relay.kill();
    let slot_at_kill = w.confirmed().await;
    let (distinct_at_kill, total_at_kill) = (w.consumer.distinct(), w.consumer.total());
    relay = w.start();
    w.wait_all(WAIT).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let ids: HashSet<String> = w
        .sql("SELECT id::text FROM outbox")
        .await
        .lines()
        .map(str::to_string)
        .collect();
    let samples = w.sampler.as_ref().map(|s| s.samples()).unwrap_or_default();
    let recs = w.consumer.snapshot();
    let report = check(&recs, &ids, &samples, false);
    // Rows whose transactions the slot had passed when the relay died.
    let confirmed_at_kill = recs
        .iter()
        .filter(|r| r.marker.is_none() && r.commit_lsn < slot_at_kill)
        .map(|r| r.id.as_str())
        .collect::<HashSet<_>>()
        .len();
    let bound = MAX_IN_FLIGHT.max(per_tx as usize);
    eprintln!(
        "SIGKILL, {per_tx}-row transactions: killed when the consumer had {distinct_at_kill} \
         distinct / {total_at_kill} received; the slot was at {:X}/{:X} ({confirmed_at_kill} \
         rows below it); {report:?}; duplicates {} (bound {bound}); took {:?}",
        slot_at_kill >> 32,
        slot_at_kill & 0xFFFF_FFFF,
        report.duplicates,
        started.elapsed()
    );
    assert_eq!(report.distinct, N as usize);
    assert!(
        confirmed_at_kill < N as usize,
        "the relay had finished before it was killed: nothing was in flight"
    );
    assert!(
        report.duplicates <= bound,
        "{} duplicates after one SIGKILL exceed the bound max(max_in_flight {MAX_IN_FLIGHT}, \
         transaction {per_tx}) = {bound}",
        report.duplicates
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_duplicate_bound_with_single_row_transactions() {
    one_sigkill_duplicate_bound(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_duplicate_bound_with_500_row_transactions() {
    one_sigkill_duplicate_bound(500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_duplicate_bound_with_5000_row_transactions() {
    one_sigkill_duplicate_bound(5_000).await;
}
