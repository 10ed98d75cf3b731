//! The fault suite under `[rabbitmq] ordering = "aggregate"` with 4 channels
//! (docs/design.md §4, "Per-aggregate order on N channels"): rows of 97 aggregates
//! (`aggregate_id = 'g' || seq % 97`), the relay killed, the broker stopped, nacks
//! and unroutable messages with and without a dead-letter exchange. What a consumer
//! received is checked per aggregate (first occurrences in commit order within each
//! aggregate; across aggregates the channels interleave), with no loss, duplicates
//! within `max_in_flight`, and the slot never confirmed past an unacked message.

use std::collections::HashSet;
use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::types::{AMQPValue, FieldTable};

use crate::harness::*;

const AGGREGATES: u64 = 97;
const AGGREGATE_ORDERING: &str = "ordering = \"aggregate\"\nchannels = 4";

/// The aggregate of a received row (its number, from the body, modulo 97).
fn aggregate_of(r: &Rec) -> u64 {
    r.seq as u64 % AGGREGATES
}

/// Rows `from..=to` of type `kind`, each in aggregate `g<seq % 97>`.
fn aggregated_sql(kind: &str, from: u64, to: u64) -> String {
    aggregated_sql_where(kind, from, to, "")
}

/// [`aggregated_sql`] with a `WHERE` clause on the generated rows.
fn aggregated_sql_where(kind: &str, from: u64, to: u64, filter: &str) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT '{kind}', 'g' || (s.n % {AGGREGATES}), 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {to}) AS s(n) {filter} ORDER BY s.n"
    )
}

/// Inserts rows `from..from+n` in transactions of `per_tx`, `pause` after each.
async fn insert_aggregated(w: &World, from: u64, n: u64, per_tx: u64, pause: Duration) {
    let mut i = from;
    while i < from + n {
        let end = (i + per_tx - 1).min(from + n - 1);
        w.sql(&aggregated_sql("seq", i, end)).await;
        i = end + 1;
        tokio::time::sleep(pause).await;
    }
}

/// Rows `1..=n` as `World::load` inserts them (in the background, retried, each
/// transaction guarded against a retry), each in aggregate `g<seq % 97>`.
fn load_aggregated(w: &World, n: u64, per_tx: u64, pause: Duration) -> tokio::task::JoinHandle<()> {
    w.load_with(1, n, per_tx, pause, |i, end| {
        let guard =
            format!("WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE payload->>'seq' = '{i}')");
        aggregated_sql_where("seq", i, end, &guard)
    })
}

/// A world whose relay publishes on 4 channels, per aggregate.
async fn aggregate_world(proxies: Proxies, max_in_flight: usize, keys: &[&str]) -> World {
    let mut w = World::with_binding(Cluster::Test, proxies, max_in_flight, keys).await;
    w.rabbitmq_extra = AGGREGATE_ORDERING.to_string();
    w
}

/// Waits for every row, then checks per aggregate; `dup_bound` as in `World::verify`.
async fn verify_per_aggregate(w: &World, dup_bound: usize, by_last: bool) -> Report {
    let report = w.verify_grouped(dup_bound, by_last, &aggregate_of).await;
    let recs = w.consumer.snapshot();
    assert!(
        recs.iter().all(|r| r.marker.is_some() || r.seq > 0),
        "a message without its row number"
    );
    report
}

/// SIGKILL with 4 channels: 20,000 rows in transactions of 50, killed when a third
/// arrived, restarted: every row, per-aggregate order, duplicates ≤ max_in_flight
/// (the channels share it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_with_aggregate_ordering_on_4_channels() {
    let _broker = BROKER.read().await;
    const N: u64 = 20_000;
    const MAX_IN_FLIGHT: usize = 1000;
    let w = aggregate_world(Proxies::default(), MAX_IN_FLIGHT, &["#"]).await;
    insert_aggregated(&w, 1, N, 50, Duration::ZERO).await;
    let mut relay = w.start();
    w.wait_distinct(N as usize / 3, WAIT).await;
    relay.kill();
    let at_kill = w.confirmed().await;
    relay = w.start();
    let report = verify_per_aggregate(&w, MAX_IN_FLIGHT, false).await;
    assert_eq!(report.distinct, N as usize);
    assert!(
        at_kill < w.confirmed().await,
        "the relay had finished before it was killed"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("publishing per aggregate on 4 channels"),
        "the relay did not publish on 4 channels: {log}"
    );
    w.cleanup().await;
}

/// `rabbitmqctl stop_app` for 20 s with 4 channels publishing: every channel
/// reconnects on its own; nothing lost, per-aggregate order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_app_stopped_with_aggregate_ordering_on_4_channels() {
    let _broker = BROKER.write().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = aggregate_world(Proxies::default(), MAX_IN_FLIGHT, &["#"]).await;
    let relay = w.start();
    let load = load_aggregated(&w, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    {
        let _stopped = BrokerStopped::stop();
        tokio::time::sleep(Duration::from_secs(20)).await;
    }
    load.await.unwrap();
    verify_per_aggregate(&w, 2 * MAX_IN_FLIGHT, false).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup_after_broker_restart().await;
}

/// Nacks and unroutable messages on some channels while the others flow, without a
/// dead-letter exchange: rows of type `odd` have no binding until one is added, rows
/// of type `nack` go to a queue that rejects every publish until it is deleted. The
/// failing channels retry in order; no aggregate is reordered (checked on last
/// occurrences, as the single-channel test does: a retry republishes a channel's
/// window from its oldest unacked message).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nacks_and_unroutables_with_aggregate_ordering_on_4_channels() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 200;
    let mut w = aggregate_world(Proxies::default(), MAX_IN_FLIGHT, &["seq.#", "nack.#"]).await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let exchange = w.env.exchange.clone();
    let rejecting = w
        .env
        .broker
        .queue_bound_with(&exchange, "nack.#", args)
        .await;
    let relay = w.start();
    insert_aggregated(&w, 1, 500, 50, Duration::ZERO).await;
    w.sql(&aggregated_sql("odd", 501, 501)).await;
    insert_aggregated(&w, 502, 200, 50, Duration::ZERO).await;
    w.sql(&aggregated_sql("nack", 702, 702)).await;
    insert_aggregated(&w, 703, 300, 50, Duration::ZERO).await;
    assert!(
        World::wait_log(&relay, "unroutable", Duration::from_secs(30)).await
            || World::wait_log(&relay, "returned", Duration::from_secs(1)).await,
        "the relay reports the unroutable message: {}",
        relay.log_text()
    );
    w.bind("odd.#").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.env
        .broker
        .channel
        .queue_delete(rejecting.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let report = verify_per_aggregate(&w, usize::MAX, true).await;
    eprintln!("retries published {} duplicates", report.duplicates);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The mixed shape with a dead-letter exchange: unroutable rows of some aggregates
/// go to the dead-letter queue while the other rows flow to the main queue; the main
/// queue gets every routable row, per-aggregate order, and the dead-letter queue
/// every unroutable one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_rows_dead_lettered_with_aggregate_ordering_on_4_channels() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 400;
    let mut w = aggregate_world(Proxies::default(), MAX_IN_FLIGHT, &["seq.#"]).await;
    let dlx = w.env.broker.exchange_name("dlx");
    w.env.broker.declare_exchange(&dlx, "fanout").await;
    let dead = w.env.broker.queue_bound(&dlx, "").await;
    w.rabbitmq_extra = format!("{AGGREGATE_ORDERING}\ndead_letter_exchange = {dlx:?}");
    let relay = w.start();
    // Every seventh row is unroutable (type `odd`, no binding).
    let mut unroutable = 0u64;
    let mut i = 1;
    while i <= 3_000 {
        let end = i + 29;
        let sql: Vec<String> = (i..=end)
            .map(|n| {
                let kind = if n % 7 == 0 { "odd" } else { "seq" };
                unroutable += u64::from(n % 7 == 0);
                aggregated_sql(kind, n, n)
            })
            .collect();
        w.sql(&format!("BEGIN; {}; COMMIT;", sql.join("; "))).await;
        i = end + 1;
    }
    let routable: HashSet<String> = w
        .sql("SELECT id::text FROM outbox WHERE aggregate_type = 'seq'")
        .await
        .lines()
        .map(str::to_string)
        .collect();
    let dead_consumer = Consumer::start(dead.clone());
    let deadline = std::time::Instant::now() + WAIT;
    while (w.consumer.distinct() < routable.len() || dead_consumer.distinct() < unroutable as usize)
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let samples = w.sampler.as_ref().map(|s| s.samples()).unwrap_or_default();
    let report = check_grouped(
        &w.consumer.snapshot(),
        &routable,
        &samples,
        false,
        &aggregate_of,
    );
    assert_eq!(report.distinct, routable.len());
    assert_eq!(report.duplicates, 0, "nothing was retried");
    let dead_recs = dead_consumer.snapshot();
    let dead_ids: HashSet<&str> = dead_recs.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        dead_ids.len(),
        unroutable as usize,
        "every unroutable row dead-lettered"
    );
    // The dead-lettered copies of one aggregate are in commit order too.
    let dead_all: HashSet<String> = dead_ids.iter().map(|s| s.to_string()).collect();
    check_grouped(&dead_recs, &dead_all, &[], false, &aggregate_of);
    dead_consumer.stop();
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// Transactions larger than a channel's share of `max_in_flight` (200 over 4
/// channels: 50 each) among small ones: the relay holds the others back while such a
/// transaction is in flight (design.md §4, the gate), and nothing stalls: every row,
/// per-aggregate order, and no duplicates without a fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactions_larger_than_a_channels_share_with_aggregate_ordering() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 200;
    let w = aggregate_world(Proxies::default(), MAX_IN_FLIGHT, &["#"]).await;
    let relay = w.start();
    insert_aggregated(&w, 1, 300, 10, Duration::ZERO).await;
    insert_aggregated(&w, 301, 1_000, 1_000, Duration::ZERO).await;
    insert_aggregated(&w, 1_301, 300, 10, Duration::ZERO).await;
    insert_aggregated(&w, 1_601, 5_000, 5_000, Duration::ZERO).await;
    insert_aggregated(&w, 6_601, 400, 1, Duration::ZERO).await;
    let report = verify_per_aggregate(&w, 0, false).await;
    assert_eq!(report.distinct, 7_000);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
