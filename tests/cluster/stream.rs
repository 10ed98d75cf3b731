//! The 3-replica stream through node faults, and its leader: the relay publishes on
//! the leader's node even when its first URL is a follower, and a leader killed while
//! the relay starts costs nothing.
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
        let (node, pause, before, after) = inject(&w, &relay, &loader, fault).await;
        // The liveness check (two heartbeat intervals, HEARTBEAT_SECS) gives the paused
        // node up well within PAUSE: the relay must have moved on to another node.
        if fault == Fault::PauseConnected {
            assert_ne!(
                after,
                before,
                "the relay waited for the paused node {before} instead of reconnecting: {}",
                tail(&relay.log_text())
            );
        }
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
    check_stream(&w, last, 10).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The stream, read whole, holds rows `1..=last` exactly once in commit order, and
/// no sampled confirmed position (more than `min_samples` of them) was past what the
/// broker had stored.
async fn check_stream(w: &World, last: u64, min_samples: usize) {
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
    assert!(checked > min_samples, "{checked} samples checked");
}

/// The stream's leader is node 3 (declared there) and the relay's first URL node 1:
/// the relay asks for the stream's metadata and publishes on node 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_relay_publishes_on_the_leaders_node() {
    let _one = CLUSTER.lock().await;
    let _restore = Restore::take().await;
    let w = World::new(Target::Stream).await;
    let leader = w.leader().await;
    assert_ne!(leader, 1, "the stream was declared through node 3");
    let loader = Loader::start(&w.db);
    let relay = w.start();
    loader.wait_more(1000).await;
    w.wait_caught_up(&relay).await;
    let connected = wait_connected(&relay, w.port()).await;
    assert_eq!(
        connected,
        leader,
        "the relay publishes on node {connected}, not on the leader's node {leader}: {}",
        tail(&relay.log_text())
    );
    let last = loader.finish().await;
    w.wait_caught_up(&relay).await;
    check_stream(&w, last, 3).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The leader is killed while the relay starts: as soon as the relay has its first
/// stream connection (to node 1, before it moves to the leader and declares its
/// producer), node 3 dies. The relay goes on with the new leader; every row arrives
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_leader_killed_while_the_relay_starts() {
    let _one = CLUSTER.lock().await;
    let _restore = Restore::take().await;
    let w = World::new(Target::Stream).await;
    let leader = w.leader().await;
    let loader = Loader::start(&w.db);
    loader.wait_more(2000).await;
    let relay = w.start();
    let started = Instant::now();
    while connected_node(relay.pid(), w.port()).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no stream connection: {}",
            tail(&relay.log_text())
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cluster(&["kill", &leader.to_string()]).await;
    eprintln!(
        "killed the leader, node {leader}, {:.2} s after the relay started",
        started.elapsed().as_secs_f64()
    );
    loader.wait_more(1000).await;
    w.wait_caught_up(&relay).await;
    let after = wait_connected(&relay, w.port()).await;
    eprintln!(
        "the relay is now on node {after}, node {} leads; pause {:.1} s",
        w.leader().await,
        w.watch
            .as_ref()
            .unwrap()
            .longest_stall(started)
            .as_secs_f64()
    );
    tokio::task::spawn_blocking(restore).await.unwrap();
    loader.wait_more(500).await;
    let last = loader.finish().await;
    w.wait_caught_up(&relay).await;
    check_stream(&w, last, 3).await;
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
