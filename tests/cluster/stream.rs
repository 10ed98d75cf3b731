//! The 3-replica stream through node faults.
use super::*;

/// The stream test: all of `faults` in turn under one load; then the stream, read
/// whole, holds every row exactly once in commit order, and no sampled position was
/// past what the broker had stored.
pub(crate) async fn stream_through(faults: &[Fault]) {
    let _one = CLUSTER.lock().await;
    let _restore = Restore::take().await;
    let w = World::new(Target::Stream).await;
    let loader = Loader::start(&w.db);
    let relay = w.start();
    loader.wait_more(1000).await;
    w.wait_caught_up(&relay).await;
    let mut costs = Vec::new();
    for &fault in faults {
        let (node, pause, _, _) = inject(&w, &relay, &loader, fault).await;
        costs.push(Cost {
            fault,
            node,
            pause,
            duplicates: 0,
        });
    }
    let last = loader.finish().await;
    w.wait_caught_up(&relay).await;
    for c in &costs {
        eprintln!(
            "fault {:?} (node {}) on a stream: publishing paused {:.1} s",
            c.fault,
            c.node,
            c.pause.as_secs_f64()
        );
    }
    let url = stream_urls()[0].clone();
    let msgs: Vec<StreamMsg> =
        read_stream_at(&url, &w.queue, last as usize, Duration::from_secs(3), WAIT).await;
    assert_exactly_once(&msgs, last);
    eprintln!(
        "stream {}: {} messages for {last} rows, 0 duplicates",
        w.queue,
        msgs.len()
    );
    // Nothing below a sampled confirmed position was beyond what the broker had stored.
    let samples = w.stream_sampler.as_ref().unwrap().samples();
    let mut checked = 0;
    for &(lsn, stored) in &samples {
        let id = msgs
            .iter()
            .filter(|m| m.order_key().0 < lsn)
            .map(StreamMsg::expected_publishing_id)
            .max();
        if let Some(id) = id {
            assert!(
                id <= stored,
                "slot confirmed {lsn:X} while the broker had stored only up to publishing id \
                 {stored} (a message below it has id {id})"
            );
            checked += 1;
        }
    }
    eprintln!("{checked} confirmed positions checked against the broker's stored ids");
    assert!(checked > 10, "{checked} samples checked");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_through_node_faults() {
    stream_through(&[
        Fault::KillConnected,
        Fault::KillLeader,
        Fault::PauseConnected,
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "heavy: cargo test -p outbox-relay-tests --test cluster -- --ignored"]
async fn heavy_stream_rolling_restart_and_partition() {
    stream_through(&[Fault::RollingRestart, Fault::Partition]).await;
}
