//! Size and rate: a large transaction, a 16 MB payload, many tiny transactions. The
//! heavy variants (1M rows, 30 s at 10k tx/s) are in bench/soak/large.sh.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::*;

/// One transaction of `n` rows, larger than `max_in_flight`: published whole and in
/// order, with no duplicates; the relay's peak RSS is reported.
async fn large_transaction(n: u64) {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let relay = w.start();
    w.insert(1, n, n).await;
    let report = w.verify(0).await;
    assert_eq!(report.distinct, n as usize);
    let hwm = vm_hwm_kb(relay.pid());
    eprintln!("relay peak RSS (VmHWM) after a {n}-row transaction: {hwm:?} kB");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_transaction_of_100k_rows() {
    large_transaction(100_000).await;
}

/// The 1M-row variant (bench/soak/large.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "heavy: run by bench/soak/large.sh"]
async fn heavy_transaction_of_1m_rows() {
    large_transaction(1_000_000).await;
}
/// A 16 MB payload between small ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_megabyte_payload() {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 100).await;
    let relay = w.start();
    w.insert(1, 10, 10).await;
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('seq', '11', 'big', jsonb_build_object('blob', repeat('x', 16 * 1024 * 1024)))",
    )
    .await;
    w.insert(12, 10, 10).await;
    let report = w.verify(0).await;
    assert!(report.max_body > 16 * 1024 * 1024, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// Single-row transactions from `clients` connections for `secs` seconds, at up to
/// `max_rate` tx/s in total (as fast as this machine can insert when it cannot reach
/// that); the rate reached is reported. Order is checked by commit LSN.
async fn tiny_transactions(secs: u64, clients: usize, max_rate: u64) {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let relay = w.start();
    let next = Arc::new(AtomicU64::new(1));
    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let client = w.env.db.client().await;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('seq', $1, 'tick', '{}')",
                )
                .await
                .unwrap();
            while Instant::now() < until {
                let n = next.fetch_add(1, Ordering::SeqCst);
                // Pace to max_rate overall.
                let due = start + Duration::from_secs_f64(n as f64 / max_rate as f64);
                tokio::time::sleep_until(due.into()).await;
                client.execute(&stmt, &[&n.to_string()]).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let inserted = next.load(Ordering::SeqCst) - 1;
    let rate = inserted as f64 / start.elapsed().as_secs_f64();
    eprintln!("inserted {inserted} single-row transactions in {secs} s with {clients} connections: {rate:.0} tx/s (target {max_rate})");
    let report = w.verify(0).await;
    assert_eq!(report.distinct as u64, inserted);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tiny_transactions() {
    tiny_transactions(10, 4, 10_000).await;
}

/// 30 s at up to 10k tx/s (bench/soak/large.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "heavy: run by bench/soak/large.sh"]
async fn heavy_tiny_transactions_30s() {
    tiny_transactions(30, 8, 10_000).await;
}
