//! Injecting one fault under load and measuring what it cost.
use super::*;

/// What one fault cost.
#[derive(Debug)]
pub(crate) struct Cost {
    pub(crate) fault: Fault,
    pub(crate) node: u8,
    pub(crate) pause: Duration,
    pub(crate) duplicates: usize,
}

/// Injects `fault` under load and waits until the relay confirmed everything
/// committed up to a few seconds after it; restores the cluster afterwards. Returns
/// the node the fault hit (0: all), the publishing pause, and the nodes the relay was
/// connected to before and after.
pub(crate) async fn inject(
    w: &World,
    relay: &Relay,
    loader: &Loader,
    fault: Fault,
) -> (u8, Duration, u8, u8) {
    let port = w.port();
    let connected = wait_connected(relay, port).await;
    // Rows being committed and published while the fault strikes.
    loader.wait_more(300).await;
    let from = Instant::now() - Duration::from_millis(500);
    let leader = w.leader().await;
    eprintln!("{fault:?}: the relay is connected to node {connected}, node {leader} leads");
    let node = match fault {
        Fault::KillConnected => {
            cluster(&["kill", &connected.to_string()]).await;
            connected
        }
        Fault::KillLeader => {
            cluster(&["kill", &leader.to_string()]).await;
            leader
        }
        Fault::PauseConnected => {
            cluster(&["pause", &connected.to_string()]).await;
            tokio::time::sleep(PAUSE).await;
            cluster(&["resume", &connected.to_string()]).await;
            connected
        }
        Fault::RollingRestart => {
            for n in ["1", "2", "3"] {
                cluster(&["restart", n]).await;
                loader.wait_more(200).await;
            }
            0
        }
        Fault::Partition => {
            cluster(&["partition", &connected.to_string()]).await;
            tokio::time::sleep(PARTITION).await;
            cluster(&["heal"]).await;
            connected
        }
    };
    // Publishing goes on: more rows, all confirmed.
    loader.wait_more(500).await;
    w.wait_caught_up(relay).await;
    let pause = w.watch.as_ref().unwrap().longest_stall(from);
    let after = wait_connected(relay, port).await;
    eprintln!(
        "{fault:?}: the relay is now connected to node {after}, node {} leads",
        w.leader().await
    );
    // Back to three healthy nodes before the next fault.
    tokio::task::spawn_blocking(restore).await.unwrap();
    if fault == Fault::KillConnected {
        assert_ne!(after, connected, "the relay is connected to a dead node?");
    }
    (node, pause, connected, after)
}
