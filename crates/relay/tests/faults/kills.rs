//! Relay process faults: SIGKILL at random points, and a standby taking over.

use std::time::Duration;

use crate::harness::*;

/// SPEC §1.1, §1.3: kill -9 the relay at random points of a 100k-event stream,
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

/// SPEC §7 HA: a second relay on the same slot stands by while the slot is in use
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
