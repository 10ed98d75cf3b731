//! Logical messages as events (docs/messages.md, issue 42) through the relay's
//! faults: SIGKILL of the relay while the load interleaves outbox rows and
//! transactional `pg_logical_emit_message(true, 'outbox', …)` calls (and while it is
//! messages only, with `tables = []`), and a Postgres crash while such a backlog
//! drains. The consumer-side checks are the rows' (`harness::check`): every event
//! present, first occurrences in commit order and, inside a transaction, in the order
//! written (rows and messages number one sequence), duplicates within the bound, no
//! rolled-back event, and the slot never confirmed past an unacked message.
//!
//! The expected ids are the rows' and, for each message, its own `id` or the derived
//! `outbox-relay/<system identifier>/<database>/<LSN>` with the LSN that
//! `pg_logical_emit_message` returned: a derived id that changed on redelivery would
//! show up as a message that was never committed. Every load transaction also emits
//! a non-transactional message and one of another prefix, which must never arrive.
//!
//! Locks as in the rest of the binary: `BROKER` for reading; the crash tests use the
//! fault cluster and hold `FAULT_PG`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::harness::*;
use support::scenarios::{produce_sql, MESSAGES_ENV as MESSAGES, MESSAGE_PRODUCER, PRODUCED_IDS};
use support::Relay;

/// `[postgres] tables = []`: an outbox without a table.
const NO_TABLES: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_TABLES", "[]");

/// A fault world whose database has the producer.
async fn world(cluster: Cluster, max_in_flight: usize) -> World {
    let w = World::new(cluster, Proxies::default(), max_in_flight).await;
    w.sql(MESSAGE_PRODUCER).await;
    w
}

/// Background load of events `from..from + n` in transactions of `per_tx`, retrying
/// through Postgres restarts (a batch already committed is not produced again).
fn produce(
    w: &World,
    from: u64,
    n: u64,
    per_tx: u64,
    with_rows: bool,
) -> tokio::task::JoinHandle<()> {
    w.load_with(from, n, per_tx, Duration::ZERO, move |i, end| {
        produce_sql(i, end, with_rows)
    })
}

/// A rolled-back transaction with a message and a row: neither may arrive (the
/// checker refuses `aggregate_type = 'rolledback'`).
async fn rolled_back(w: &World) {
    w.sql(
        "BEGIN;
         SELECT pg_catalog.pg_logical_emit_message(true, 'outbox',
           '{\"aggregate_type\":\"rolledback\",\"aggregate_id\":\"1\",\"event_type\":\"tick\",\"payload\":{}}'::text);
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('rolledback', '2', 'tick', '{}');
         ROLLBACK;",
    )
    .await;
}

/// The ids of every committed event (`scenarios::PRODUCED_IDS`).
async fn committed_ids(w: &World) -> HashSet<String> {
    w.sql(PRODUCED_IDS)
        .await
        .lines()
        .map(|l| l.split_once('|').map_or(l, |(_, id)| id).to_string())
        .collect()
}

/// Starts the relay with `vars`.
fn start(w: &World, vars: &[(&str, &str)]) -> Relay {
    w.start_env(vars)
}

/// How long the delivered count may stand still before a wait fails (a relay that
/// drops messages fails in a minute, not after `WAIT`).
const STALL: Duration = Duration::from_secs(60);

/// Waits until `n` distinct events arrived, failing at once if the relay exits, and
/// when nothing new arrived for [`STALL`] or in all for `WAIT`.
async fn wait_events(w: &World, relay: &mut Relay, n: usize) {
    let deadline = Instant::now() + WAIT;
    let (mut last, mut moved) = (w.consumer.distinct(), Instant::now());
    while w.consumer.distinct() < n {
        let got = w.consumer.distinct();
        if got != last {
            (last, moved) = (got, Instant::now());
        }
        if let Some(status) = relay.child.try_wait().unwrap() {
            panic!(
                "the relay exited ({status}) with {got} of {n} events delivered:\n{}",
                relay.log_text()
            );
        }
        assert!(
            moved.elapsed() < STALL && Instant::now() < deadline,
            "stalled: {got} of {n} events delivered:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every produced event arrived at least once ([`wait_events`]), then
/// lets stray redeliveries and the last markers arrive, and checks everything.
async fn verify(w: &World, relay: &mut Relay) -> Report {
    let expected: usize = w
        .sql("SELECT count(*) FROM produced")
        .await
        .parse()
        .unwrap();
    wait_events(w, relay, expected).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let ids = committed_ids(w).await;
    assert_eq!(ids.len(), expected, "one id per produced event");
    let samples = w.sampler.as_ref().map(|s| s.samples()).unwrap_or_default();
    let report = check(&w.consumer.snapshot(), &ids, &samples, false);
    assert_eq!(report.distinct, expected, "{report:?}");
    report
}

/// kill -9 the relay at random points of a stream of `n` events in transactions of
/// `per_tx` (rows and messages, or messages only with `tables = []`; half of them
/// committed before the relay starts), `kills` times:
/// nothing lost, order kept, at most `max_in_flight` plus the transaction straddling
/// the window published again per kill (docs/design.md §1.1, §1.3).
async fn sigkill_at_random_points(n: u64, per_tx: u64, kills: usize, with_rows: bool) {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let started = Instant::now();
    let vars: &[(&str, &str)] = if with_rows {
        &[MESSAGES]
    } else {
        &[MESSAGES, NO_TABLES]
    };
    let w = world(Cluster::Test, MAX_IN_FLIGHT).await;
    rolled_back(&w).await;
    // Half a backlog, so that kills find events in flight, and the rest live.
    produce(&w, 1, n / 2, per_tx, with_rows).await.unwrap();
    let load = produce(&w, n / 2 + 1, n - n / 2, per_tx, with_rows);
    let mut relay = start(&w, vars);
    if !with_rows {
        // The table is still in the publication, but no longer configured: its rows
        // are not events (the checker refuses any id not produced).
        w.sql(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('unpublished', '1', 'tick', '{}')",
        )
        .await;
    }
    let mut points: Vec<u64> = (0..kills as u64)
        .map(|k| k * n / kills as u64 + 1000 + rand_below(n / kills as u64 - 2000))
        .collect();
    points.sort();
    for p in &points {
        wait_events(&w, &mut relay, *p as usize).await;
        relay.kill();
        eprintln!(
            "killed at {} distinct / {} received",
            w.consumer.distinct(),
            w.consumer.total()
        );
        relay = start(&w, vars);
    }
    load.await.unwrap();
    rolled_back(&w).await;
    let report = verify(&w, &mut relay).await;
    let bound = kills * (MAX_IN_FLIGHT + per_tx as usize);
    eprintln!(
        "{kills} SIGKILLs, {} events ({}): {report:?} (bound {bound}), took {:?}",
        n,
        if with_rows {
            "rows and messages"
        } else {
            "messages only"
        },
        started.elapsed()
    );
    assert!(
        report.duplicates <= bound,
        "{} duplicates exceed the bound {bound}",
        report.duplicates
    );
    assert!(
        report.markers_checked > 0,
        "the LSN sampler checked something"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// Rows and messages interleaved in transactions of 100, 30,000 events, three kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_while_rows_and_messages_interleave() {
    sigkill_at_random_points(30_000, 100, 3, true).await;
}

/// Messages only, `tables = []`: 20,000 messages in transactions of 50, two kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_with_messages_only_and_no_table() {
    sigkill_at_random_points(20_000, 50, 2, false).await;
}

const BACKLOG: u64 = 20_000;

/// 20,000 events (rows and messages) committed before the relay starts, from two
/// connections at once (so transactions interleave in the WAL), in transactions of
/// 100.
async fn preload(w: &World) {
    let a = produce(w, 1, BACKLOG / 2, 100, true);
    let b = produce(w, BACKLOG / 2 + 1, BACKLOG / 2, 100, true);
    a.await.unwrap();
    b.await.unwrap();
}

/// A Postgres crash (`pg_ctlcluster … restart -m immediate`) at about a third of a
/// 20,000-event backlog of rows and messages, with no CHECKPOINT since the slot was
/// created (Postgres 15 brings the slot back to its creation), then 500 more events:
/// nothing published again — with the stored acked position, messages as rows
/// (docs/design.md §1.5, "The stored position") — nothing missing, order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crash_during_a_backlog_of_rows_and_messages_resends_nothing() {
    let _pg = FAULT_PG.lock().await;
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = world(Cluster::Fault, MAX_IN_FLIGHT).await;
    preload(&w).await;
    rolled_back(&w).await;
    let mut relay = start(&w, &[MESSAGES]);
    wait_events(&w, &mut relay, BACKLOG as usize / 3).await;
    let at_fault = w.consumer.distinct();
    Cluster::Fault.restart("immediate").await;
    produce(&w, BACKLOG + 1, 500, 50, true).await.unwrap();
    let report = verify(&w, &mut relay).await;
    eprintln!(
        "crash during a {BACKLOG}-event backlog of rows and messages: {} duplicates \
         ({at_fault} received before the crash, {} distinct)",
        report.duplicates, report.distinct
    );
    assert_eq!(report.duplicates, 0, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains(" ERROR "), "{log}");
    w.cleanup().await;
}

/// The relay SIGKILLed and Postgres crashed together while a backlog of rows and
/// messages drains: the new relay process knows nothing; the stored position keeps
/// the duplicates within `max_in_flight` (the slot alone would send everything since
/// its creation again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_killed_and_postgres_crashed_together_with_messages() {
    let _pg = FAULT_PG.lock().await;
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = world(Cluster::Fault, MAX_IN_FLIGHT).await;
    preload(&w).await;
    let mut relay = start(&w, &[MESSAGES]);
    wait_events(&w, &mut relay, BACKLOG as usize / 3).await;
    relay.kill();
    let at_fault = w.consumer.distinct();
    Cluster::Fault.restart("immediate").await;
    let mut relay = start(&w, &[MESSAGES]);
    produce(&w, BACKLOG + 1, 500, 50, true).await.unwrap();
    let report = verify(&w, &mut relay).await;
    eprintln!(
        "relay SIGKILL + Postgres crash during a {BACKLOG}-event backlog of rows and \
         messages: {} duplicates ({at_fault} received before, max_in_flight {MAX_IN_FLIGHT})",
        report.duplicates
    );
    assert!(report.duplicates <= MAX_IN_FLIGHT, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
