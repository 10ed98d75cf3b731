//! The quorum queue through node faults.
use super::*;

/// The queue test: all of `faults` in turn under one load; then every check.
pub(crate) async fn quorum_queue_through(faults: &[Fault]) {
    let _one = CLUSTER.lock().await;
    let _restore = Restore::take().await;
    let w = World::new(Target::QuorumQueue).await;
    let loader = Loader::start(&w.db);
    let relay = w.start();
    loader.wait_more(1000).await;
    w.wait_caught_up(&relay).await;
    let mut costs = Vec::new();
    let mut dups_before = w.queue_duplicates().await;
    for &fault in faults {
        let (node, pause, before, after) = inject(&w, &relay, &loader, fault).await;
        // AMQP heartbeats (HEARTBEAT_SECS) notice a paused node well within PAUSE: the
        // relay must have moved on to another node rather than wait for it.
        if fault == Fault::PauseConnected {
            assert_ne!(
                after,
                before,
                "the relay waited for the paused node {before} instead of reconnecting: {}",
                tail(&relay.log_text())
            );
        }
        let dups = w.queue_duplicates().await;
        costs.push(Cost {
            fault,
            node,
            pause,
            duplicates: dups - dups_before,
        });
        dups_before = dups;
    }
    let last = loader.finish().await;
    w.wait_caught_up(&relay).await;
    for c in &costs {
        eprintln!(
            "fault {:?} (node {}) on a quorum queue: publishing paused {:.1} s, {} duplicates",
            c.fault,
            c.node,
            c.pause.as_secs_f64(),
            c.duplicates
        );
    }
    // Every check of the fault suite, on the whole run.
    w.queue_duplicates().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: HashSet<String> = w
        .sql("SELECT id::text FROM outbox")
        .await
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(ids.len() as u64, last, "rows 1..={last} committed");
    let samples = w.sampler.as_ref().unwrap().samples();
    let report: Report = check_with(
        &w.consumer.as_ref().unwrap().snapshot(),
        &ids,
        &samples,
        false,
        true,
    );
    eprintln!("report: {report:?}");
    let bound = MAX_IN_FLIGHT * faults.len();
    assert!(
        report.duplicates <= bound,
        "{} duplicates exceed the bound {bound} (max_in_flight per fault)",
        report.duplicates
    );
    assert!(report.markers_checked > 10, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quorum_queue_through_node_faults() {
    quorum_queue_through(&[
        Fault::KillConnected,
        Fault::KillLeader,
        Fault::PauseConnected,
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "heavy: cargo test -p outbox-relay-tests --test cluster -- --ignored"]
async fn heavy_quorum_queue_rolling_restart_and_partition() {
    quorum_queue_through(&[Fault::RollingRestart, Fault::Partition]).await;
}
