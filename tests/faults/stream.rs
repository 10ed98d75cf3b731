//! Exactly once into a RabbitMQ stream (docs/design.md §1 item 6, §4): the relay is
//! SIGKILLed and restarted, Postgres restarted fast and crashed, the broker's app
//! stopped and started, a standby takes over — and the stream, read whole from its
//! first offset, holds every committed row exactly once, in commit order.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::stream::{assert_exactly_once, delete_stream, read_stream, stream_url};
use support::Relay;

use crate::harness::*;

/// A loader of rows `1..=n` (aggregate_id = seq) in transactions of pseudo-random
/// sizes 1 … 500, never past `gate`, retrying through Postgres restarts (each
/// transaction is guarded by its first seq, so a retry after an unknown outcome
/// cannot insert it twice). `done` is the last seq committed.
struct Loader {
    gate: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<u64>,
}

impl Loader {
    fn start(w: &World, n: u64, pause: Duration) -> Loader {
        let gate = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicU64::new(0));
        let (port, db) = (w.env.db.port, w.env.db.name.clone());
        let (g, d) = (gate.clone(), done.clone());
        let task = tokio::task::spawn_blocking(move || {
            let mut x: u64 = 0x2545_F491_4F6C_DD1D ^ rand_below(u64::MAX);
            let mut transactions = 0;
            let mut i = 1;
            while i <= n {
                let limit = g.load(Ordering::SeqCst).min(n);
                if i > limit {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // A third of the transactions are single rows, the rest 2 … 500.
                let size = if x % 3 == 0 { 1 } else { 2 + (x >> 8) % 499 };
                let end = (i + size - 1).min(limit);
                let sql = format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                       FROM generate_series({i}, {end}) AS s(n)
                      WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{i}')
                      ORDER BY s.n"
                );
                while !psql_ok(port, &db, &sql) {
                    std::thread::sleep(Duration::from_millis(200));
                }
                transactions += 1;
                d.store(end, Ordering::SeqCst);
                i = end + 1;
                std::thread::sleep(pause);
            }
            transactions
        });
        Loader { gate, done, task }
    }

    /// Lets the loader go on up to `seq`.
    fn open_to(&self, seq: u64) {
        self.gate.store(seq, Ordering::SeqCst);
    }

    /// Waits until rows up to `seq` are committed.
    async fn wait_done(&self, seq: u64) {
        let deadline = Instant::now() + WAIT;
        while self.done.load(Ordering::SeqCst) < seq {
            assert!(
                Instant::now() < deadline,
                "the loader is stuck before {seq}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn psql_ok(port: u16, db: &str, sql: &str) -> bool {
    Command::new("psql")
        .args([
            "-XAtq",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
        ])
        .args(["-p", &port.to_string(), "-d", db, "-c", sql])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The broker's last publishing id for `producer` on `stream` (0: none yet).
async fn producer_sequence(stream: &str, producer: &str) -> u64 {
    let client = testkit::stream::client().await;
    let last = client
        .query_publisher_sequence(producer, stream)
        .await
        .unwrap_or(0);
    let _ = client.close().await;
    last
}

/// A world whose relay publishes to a fresh stream (its AMQP queue stays empty).
async fn stream_world(cluster: Cluster, max_in_flight: usize) -> (World, String) {
    let mut w = World::new(cluster, Proxies::default(), max_in_flight).await;
    let stream = testkit::unique_name("stream");
    w.rabbitmq_extra = format!("stream = {stream:?}\nstream_url = {:?}", stream_url());
    (w, stream)
}

/// Waits until the slot confirmed everything written so far: the relay published
/// (and the broker confirmed) every row committed before this call.
async fn wait_caught_up(w: &World) {
    let target = loop {
        let s = w.sql("SELECT pg_current_wal_lsn()").await;
        if let Some(l) = parse_lsn(&s) {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(c) = tokio::time::timeout(Duration::from_secs(10), w.confirmed()).await {
            if c >= target {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the relay did not catch up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads the whole stream once `n` rows are in and checks exactly once; returns the
/// number of messages read.
async fn verify_stream(stream: &str, n: u64) -> usize {
    let timeout = WAIT.max(Duration::from_millis(2 * n));
    let msgs = read_stream(stream, n as usize, Duration::from_secs(5), timeout).await;
    let dups = assert_exactly_once(&msgs, n);
    eprintln!(
        "stream {stream}: {} messages for {n} rows, {dups} duplicates",
        msgs.len()
    );
    msgs.len()
}

/// docs/design.md §1 item 6: ≥ 30,000 rows in transactions of 1 … 500 while the
/// relay is SIGKILLed twice, Postgres restarted fast and crashed (`-m immediate`)
/// and the broker's app stopped and started: zero duplicates, nothing lost, commit
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_exactly_once_through_kills_and_restarts() {
    let _broker = BROKER.write().await;
    let _pg = FAULT_PG.lock().await;
    const N: u64 = 30_000;
    const MAX_IN_FLIGHT: usize = 2000;
    let (w, stream) = stream_world(Cluster::Fault, MAX_IN_FLIGHT).await;
    w.rolled_back(100).await;
    let loader = Loader::start(&w, N, Duration::from_millis(30));
    let mut relay = w.start();
    // Each fault happens halfway into a stretch of load: rows are being committed
    // and published while it strikes, and go on being committed after it.
    let stretch = N / 6;
    let faults = ["kill", "restart fast", "kill", "crash", "broker"];
    let mut kills = 0;
    for (k, fault) in faults.iter().enumerate() {
        let start = k as u64 * stretch;
        loader.open_to(start + stretch);
        loader.wait_done(start + stretch / 2).await;
        match *fault {
            "kill" => {
                relay.kill();
                kills += 1;
                relay = w.start();
            }
            "restart fast" => Cluster::Fault.restart("fast").await,
            "crash" => Cluster::Fault.restart("immediate").await,
            "broker" => {
                let _stopped = BrokerStopped::stop();
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
            _ => unreachable!(),
        }
        eprintln!("{fault} at seq {}", loader.done.load(Ordering::SeqCst));
        loader.wait_done(start + stretch).await;
        wait_caught_up(&w).await;
        w.rolled_back(10).await;
    }
    loader.open_to(N);
    let transactions = loader.task.await.unwrap();
    w.rolled_back(100).await;
    wait_caught_up(&w).await;
    assert_eq!(kills, 2);
    assert!(transactions > 100, "{transactions} transactions");

    // A kill in the middle of one large transaction: part of it is in the stream and
    // none of it confirmed to Postgres, so the restarted relay reads all of it again
    // and must leave out, by the broker's last publishing id of its producer, exactly
    // what the broker holds. (The kills above may land where nothing is re-read; this
    // one cannot.)
    const BIG: u64 = 25_000;
    let system_id = w
        .sql("SELECT system_identifier FROM pg_control_system()")
        .await;
    let producer = format!(
        "outbox-relay/{}/{}/{}/tl1",
        system_id.trim(),
        w.env.db.name,
        w.env.slot
    );
    let before = producer_sequence(&stream, &producer).await;
    let (port, db) = (w.env.db.port, w.env.db.name.clone());
    let insert = tokio::task::spawn_blocking(move || {
        psql_ok(
            port,
            &db,
            &format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                   FROM generate_series({}, {}) AS s(n) ORDER BY s.n",
                N + 1,
                N + BIG
            ),
        )
    });
    assert!(
        insert.await.unwrap(),
        "the large transaction was not committed"
    );
    let deadline = Instant::now() + WAIT;
    while producer_sequence(&stream, &producer).await <= before {
        assert!(
            Instant::now() < deadline,
            "nothing of the large transaction was stored"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    relay.kill();
    let at_kill = producer_sequence(&stream, &producer).await;
    // A publishing id is the commit LSN's low bits above 20 bits of index in the
    // transaction (docs/design.md §4): the large transaction's stored part is the
    // index of the last id, plus one.
    let stored = (at_kill & ((1 << 20) - 1)) + 1;
    eprintln!("kill mid-transaction: {stored} of {BIG} stored");
    assert!(
        stored < BIG,
        "the kill came after the whole transaction was stored: nothing to leave out"
    );
    let relay = w.start();
    wait_caught_up(&w).await;
    assert_eq!(verify_stream(&stream, N + BIG).await, (N + BIG) as usize);
    let log = relay.log_text();
    assert!(
        log.contains("events the stream already held were sent again"),
        "the restarted relay found none of its events stored: {log}"
    );
    let (code, _) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    delete_stream(&stream).await;
    // The test broker's own connection died with the app: clean up on a new one.
    let queue = w.queue.clone();
    let exchange = w.env.exchange.clone();
    w.cleanup().await;
    let mut again = testkit::amqp::TestBroker::connect().await;
    again.declare_exchange(&exchange, "topic").await;
    let _ = again
        .channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    again.cleanup().await;
}

/// docs/design.md §4: a standby on the same slot takes over mid-stream when the
/// active relay is killed, under the same producer reference: still exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_exactly_once_through_standby_takeover() {
    let _broker = BROKER.read().await;
    const N: u64 = 12_000;
    let (w, stream) = stream_world(Cluster::Test, 1000).await;
    let loader = Loader::start(&w, N, Duration::from_millis(20));
    let active = w.start();
    loader.open_to(N / 3);
    loader.wait_done(N / 6).await;
    let standby = w.start();
    assert!(
        World::wait_log(&standby, "standing by", Duration::from_secs(30)).await,
        "the second relay stands by: {}",
        standby.log_text()
    );
    loader.wait_done(N / 3 - 500).await;
    loader.open_to(N);
    loader.wait_done(N / 2).await;
    active.kill();
    assert!(
        World::wait_log(&standby, "taking over", Duration::from_secs(60)).await,
        "the standby took over: {}",
        standby.log_text()
    );
    loader.task.await.unwrap();
    wait_caught_up(&w).await;
    assert_eq!(verify_stream(&stream, N).await, N as usize);
    let (code, log) = Relay::terminate(standby);
    assert_eq!(code, Some(0), "{log}");
    delete_stream(&stream).await;
    w.cleanup().await;
}
