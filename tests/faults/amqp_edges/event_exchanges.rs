//! Exchanges chosen by events (`exchange = "<prefix>.{aggregate_type}"`) at the
//! broker's edges (issue 49, "Black-box tests"; SPEC §1 item 8): a destination an
//! event chose that the broker refuses or does not have is that event's problem,
//! never a stall of the relay.
//!
//! - an `aggregate_type` holding a newline (RabbitMQ takes CR and LF out of a
//!   declared name, not out of a published one): the event is dead-lettered within
//!   seconds, saying why, and the next row is delivered; without a dead-letter
//!   exchange it is named as poison (ERROR line with its message id and commit LSN,
//!   `/poison`, `status`), without a loop of WARN lines, until `slot skip`;
//! - an exchange deleted while the relay runs: declared again and both events behind
//!   it delivered; with `declare_exchange = false`, the event on it dead-lettered and
//!   the other delivered.
//!
//! Before issue 49 each of them stalled the relay: one WARN "publish failed …
//! retrying" and nothing delivered for 40 s. Each test uses its own exchanges and
//! queues (the world's lock for reading).

use lapin::options::{ExchangeDeleteOptions, QueueBindOptions};
use lapin::types::FieldTable;
use testkit::free_addr;

use super::*;

/// The exchanges of one test: `<prefix>.<aggregate_type>`, each declared by the
/// test (as the relay declares them: durable topic) and bound to the world's queue,
/// so that what the relay publishes there reaches the recording consumer.
pub(super) struct EventExchanges {
    prefix: String,
}

impl EventExchanges {
    /// Sets the world's `[rabbitmq] exchange` to `<prefix>.{aggregate_type}`, whose
    /// `allowed_exchanges` default is `<prefix>.*`.
    pub(super) fn new(w: &mut World) -> EventExchanges {
        let prefix = w.env.broker.exchange_name("ev");
        w.env.exchange = format!("{prefix}.{{aggregate_type}}");
        EventExchanges { prefix }
    }

    pub(super) fn name(&self, aggregate_type: &str) -> String {
        format!("{}.{aggregate_type}", self.prefix)
    }

    /// Declares `<prefix>.<aggregate_type>` and binds the world's queue to it.
    pub(super) async fn bound(&self, w: &mut World, aggregate_type: &str) -> String {
        let name = self.name(aggregate_type);
        w.env.broker.declare_exchange(&name, "topic").await;
        bind_queue(w, &name).await;
        name
    }
}

/// Binds the world's queue to `exchange` with `#`.
async fn bind_queue(w: &World, exchange: &str) {
    w.env
        .broker
        .channel
        .queue_bind(
            w.queue.as_str().into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the queue");
}

/// Inserts one row of `aggregate_type` (an SQL expression, e.g. `E'x\ny'`) with
/// aggregate id `seq` in a transaction of its own; returns its message id.
pub(super) async fn insert_event(w: &World, aggregate_type_sql: &str, seq: u64) -> String {
    w.sql(&format!(
        "WITH i AS (INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                    VALUES ({aggregate_type_sql}, '{seq}', 'tick', jsonb_build_object('seq', {seq}))
                    RETURNING id)
         SELECT id FROM i"
    ))
    .await
    .trim()
    .to_string()
}

/// A fanout dead-letter exchange with a queue and a consumer recording headers; the
/// world's relay is configured to use it.
async fn dead_letters(w: &mut World) -> Consumer {
    let dlx = w.env.broker.exchange_name("dlx");
    w.env.broker.declare_exchange(&dlx, "fanout").await;
    let dlq = w.env.broker.queue_bound(&dlx, "").await;
    w.rabbitmq_extra
        .push_str(&format!("\ndead_letter_exchange = {dlx:?}\n"));
    Consumer::builder(dlq).headers().start()
}

/// Waits (at most [`SOON`]) for the notice of `id` on the dead-letter queue and
/// returns its `x-outbox-error`; panics naming what arrived and the log's tail.
async fn notice_of(w: &World, relay: &Relay, dead: &Consumer, id: &str) -> String {
    let start = Instant::now();
    loop {
        let notices = dead.snapshot();
        if let Some(n) = notices.iter().find(|n| n.id == id) {
            eprintln!("notice of {id} after {:?}", start.elapsed());
            return n.headers.get("x-outbox-error").cloned().unwrap_or_default();
        }
        assert!(
            start.elapsed() < SOON,
            "no notice of {id} on the dead-letter exchange within {SOON:?} ({} notices: {:?}); \
             {} distinct messages on the main queue; last log lines:\n{}",
            notices.len(),
            notices.iter().map(|n| &n.id).collect::<Vec<_>>(),
            w.consumer.distinct(),
            tail(&relay.log_text(), 15)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// With a dead-letter exchange: row 1 to `good`, then row 2 whose `aggregate_type`
/// is `x<LF>y`, then row 3 to `good`, each in its own transaction. Row 2's notice
/// is on the dead-letter exchange within seconds, its `x-outbox-error` naming the
/// control character; rows 1 and 3 are delivered, in order. Caught: before issue 49
/// the declaration of `<prefix>.x\ny` succeeded (as `<prefix>.xy`), every publish
/// got 404, the relay logged one WARN and then nothing, and row 3 never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn newline_aggregate_type_is_dead_lettered_and_the_next_row_delivered() {
    let _broker = BROKER.read().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let ex = EventExchanges::new(&mut w);
    ex.bound(&mut w, "good").await;
    let dead = dead_letters(&mut w).await;
    let relay = w.start();
    insert_event(&w, "'good'", 1).await;
    w.wait_distinct(1, SOON).await;
    let bad = insert_event(&w, "E'x\\ny'", 2).await;
    insert_event(&w, "'good'", 3).await;

    let why = notice_of(&w, &relay, &dead, &bad).await;
    assert!(
        why.contains("control character"),
        "the notice says why {bad} was refused: x-outbox-error = {why:?}"
    );
    let report = verify_within(&w, &relay, Some(&bad), SOON, 0).await;
    assert_eq!(report.distinct, 2);
    assert_eq!(dead.distinct(), 1, "one notice, for {bad} only");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    dead.stop();
    // A relay of before issue 49 declared `<prefix>.xy`.
    let _ = w
        .env
        .broker
        .channel
        .exchange_delete(
            ex.name("xy").as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
    w.cleanup().await;
}

/// Without a dead-letter exchange: the same rows. Within seconds row 2 is named as
/// poison (an ERROR line with its message id and commit LSN, `/poison`, `status`),
/// the relay holds there without a loop of WARN lines (by design: nothing but a
/// dead-letter exchange or `slot skip` moves past poison), and after `slot skip`
/// row 3 is delivered. Caught: before issue 49 it was never named (one WARN
/// "publish failed … retrying", then silence).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn newline_aggregate_type_without_dead_letter_exchange_is_named_as_poison() {
    let _broker = BROKER.read().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let ex = EventExchanges::new(&mut w);
    ex.bound(&mut w, "good").await;
    let metrics = free_addr();
    let vars = [(METRICS, metrics.as_str())];
    let relay = w.start_env(&vars);
    insert_event(&w, "'good'", 1).await;
    w.wait_distinct(1, SOON).await;
    let before = parse_lsn(&w.sql("SELECT pg_current_wal_lsn()").await).unwrap();
    let bad = insert_event(&w, "E'x\\ny'", 2).await;
    let after = parse_lsn(&w.sql("SELECT pg_current_wal_lsn()").await).unwrap();
    insert_event(&w, "'good'", 3).await;
    let warns_before = count_lines(&relay.log_text(), "WARN");
    wait_named_as_poison(&w, &relay, &metrics, &bad, SOON).await;

    // The ERROR line names the commit LSN of the row's transaction.
    let log = relay.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("ERROR") && l.contains(&bad))
        .unwrap();
    let lsn = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("commit_lsn="))
        .and_then(parse_lsn)
        .unwrap_or_else(|| panic!("the ERROR line names the commit LSN: {line}"));
    assert!(
        before < lsn && lsn <= after,
        "the ERROR line's commit LSN {lsn:X} is the row's (between {before:X} and {after:X}): {line}"
    );
    // Held, and quiet: no loop of WARN lines while it holds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = relay.log_text();
    let warns = count_lines(&log, "WARN") - warns_before;
    assert!(
        warns <= 2,
        "{warns} WARN lines while holding poison {bad} (a retry loop?):\n{}",
        tail(&log, 15)
    );
    assert_eq!(
        w.consumer.distinct(),
        1,
        "held at {bad}: only row 1 delivered"
    );
    let (code, log) = relay.terminate();
    assert_eq!(
        code,
        Some(0),
        "the relay stops cleanly while holding poison:\n{log}"
    );

    let out = cli(&w, &["slot", "skip", &bad, "--yes"], &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "slot skip {bad}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let relay = w.start_env(&vars);
    let report = verify_within(&w, &relay, Some(&bad), SOON, 1).await;
    assert_eq!(report.distinct, 2);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The lines of `log` holding `level`.
fn count_lines(log: &str, level: &str) -> usize {
    log.lines().filter(|l| l.contains(level)).count()
}

/// Whether `exchange` exists (a passive declaration on a channel of its own: a
/// refusal closes that channel only).
async fn exchange_exists(w: &World, exchange: &str) -> bool {
    let Ok(channel) = w.env.broker.connection.create_channel().await else {
        return false;
    };
    let found = channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok();
    if found {
        let _ = channel.close(200, "checked".into()).await;
    }
    found
}

/// Deletes `exchange` as an operator would.
async fn delete_exchange(w: &World, exchange: &str) {
    w.env
        .broker
        .channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete the exchange");
}

/// Row 1 to `x` delivered; `<prefix>.x` deleted; row 2 to `x`, row 3 to `y`. The
/// relay declares `<prefix>.x` again (the test then binds its queue there again, as
/// the operator's topology would) and both rows are delivered within seconds, in
/// order. Caught: before issue 49 the relay kept publishing to the exchange it had
/// cached as declared, got 404 each time, and delivered nothing for 40 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exchange_deleted_mid_run_is_declared_again() {
    let _broker = BROKER.read().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let ex = EventExchanges::new(&mut w);
    let x = ex.bound(&mut w, "x").await;
    ex.bound(&mut w, "y").await;
    let relay = w.start();
    insert_event(&w, "'x'", 1).await;
    w.wait_distinct(1, SOON).await;

    delete_exchange(&w, &x).await;
    insert_event(&w, "'x'", 2).await;
    insert_event(&w, "'y'", 3).await;
    let start = Instant::now();
    while !exchange_exists(&w, &x).await {
        assert!(
            start.elapsed() < SOON,
            "the relay did not declare {x} again within {SOON:?}; {} distinct messages; last log lines:\n{}",
            w.consumer.distinct(),
            tail(&relay.log_text(), 15)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{x} declared again after {:?}", start.elapsed());
    bind_queue(&w, &x).await;
    let report = verify_within(&w, &relay, None, SOON, 1).await;
    assert_eq!(report.distinct, 3);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The same with `declare_exchange = false` and a dead-letter exchange: row 2's
/// exchange is gone and the relay may not declare it, so row 2's notice goes to the
/// dead-letter exchange (its `x-outbox-error` naming the 404) and row 3 is
/// delivered, within seconds. Caught: before issue 49 nothing moved for 40 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exchange_deleted_mid_run_without_declaring_is_dead_lettered() {
    let _broker = BROKER.read().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let ex = EventExchanges::new(&mut w);
    let x = ex.bound(&mut w, "x").await;
    ex.bound(&mut w, "y").await;
    let dead = dead_letters(&mut w).await;
    w.rabbitmq_extra.push_str("declare_exchange = false\n");
    let relay = w.start();
    insert_event(&w, "'x'", 1).await;
    w.wait_distinct(1, SOON).await;

    delete_exchange(&w, &x).await;
    let gone = insert_event(&w, "'x'", 2).await;
    insert_event(&w, "'y'", 3).await;
    let why = notice_of(&w, &relay, &dead, &gone).await;
    assert!(
        why.contains("404"),
        "the notice says why {gone} was refused: x-outbox-error = {why:?}"
    );
    let report = verify_within(&w, &relay, Some(&gone), SOON, 0).await;
    assert_eq!(report.distinct, 2);
    assert!(
        !exchange_exists(&w, &x).await,
        "{x} declared although declare_exchange = false"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    dead.stop();
    w.cleanup().await;
}
