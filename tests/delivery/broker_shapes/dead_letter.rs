//! Routable and unroutable rows mixed, with a dead-letter exchange.
//! size: one end-to-end run whose final checks read the records and counts gathered along the way

use super::*;

/// docs/design.md §5, with `dead_letter_exchange`: 20,000 rows in transactions of 200 from two
/// connections (interleaved commits), every 9th row unroutable (aggregate_type
/// `bad`: nothing is bound to `bad.tick`). The main queue must receive exactly the
/// routable rows and the DLQ exactly the unroutable ones, each once, in commit order,
/// the DLQ copies with `x-outbox-error = "unroutable"`, `x-original-exchange` and
/// `x-original-routing-key`; then the slot must be past the last transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_unroutable_rows_go_to_the_dead_letter_exchange() {
    let _shared = testkit::BROKER.read().await;
    mixed_unroutable(20_000, "").await;
}

/// The same with `[message] headers = "minimal"` (docs/design.md §5): a returned
/// message is matched to its event by the `commit_lsn` and `tx_index` headers, which
/// the lean profile keeps, so the dead-lettering is as exact; and the messages carry
/// only the lean profile's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_unroutable_rows_under_minimal_headers() {
    let _shared = testkit::BROKER.read().await;
    mixed_unroutable(10_000, "\n[message]\nheaders = \"minimal\"").await;
}

/// `n` rows in transactions of 200 from two connections, every 9th unroutable, with
/// a dead-letter exchange; `extra` is appended to the `[rabbitmq]` section.
async fn mixed_unroutable(n: u64, extra: &str) {
    const PER_TX: u64 = 200;
    const EVERY: u64 = 9;
    assert_eq!(n % PER_TX, 0);
    let minimal = extra.contains("minimal");
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let main_q = env.broker.queue_bound(&exchange, "good.tick").await;
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&dlx, "fanout").await;
    let dlq = env.broker.queue_bound(&dlx, "").await;
    let config = write_config(
        &env,
        1000,
        &format!("dead_letter_exchange = {dlx:?}{extra}"),
        "",
    );
    create_slot(&env, &config);
    let main = recorder(&main_q, 2000, 0);
    let dead = recorder(&dlq, 2000, 0);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);

    // Two connections, alternating transactions, committing concurrently.
    let mut loaders = Vec::new();
    for c in 0..2u64 {
        let client = env.db.client().await;
        loaders.push(tokio::spawn(async move {
            let mut k = c;
            while k * PER_TX < n {
                let (from, to) = (k * PER_TX + 1, (k + 1) * PER_TX);
                client
                    .batch_execute(&mixed_sql(from, to, EVERY))
                    .await
                    .unwrap();
                k += 2;
            }
        }));
    }
    for l in loaders {
        l.await.unwrap();
    }
    let inserted = started.elapsed();
    let all = rows(&pg).await;
    assert_eq!(all.len(), n as usize);
    let good: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "good")
        .map(|(id, _)| id.clone())
        .collect();
    let bad: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "bad")
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(bad.len(), (n / EVERY) as usize);

    let complete = wait_deliveries(
        &[&main, &dead],
        Duration::from_secs(90),
        Duration::from_secs(8),
        || main.distinct() >= good.len() && dead.distinct() >= bad.len(),
    )
    .await;
    // Let stray duplicates arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let main_recs = main.snapshot();
    let dead_recs = dead.snapshot();
    let last_commit = main_recs
        .iter()
        .chain(&dead_recs)
        .map(|d| d.commit_lsn)
        .max()
        .unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;

    // Nothing is ever overtaken here: no message is refused for good.
    let m = tally(&main_recs, &good, |_| false);
    let d = tally(&dead_recs, &bad, |_| false);
    let main_ids: HashSet<&str> = main_recs.iter().map(|r| r.id.as_str()).collect();
    let dead_ids: HashSet<&str> = dead_recs.iter().map(|r| r.id.as_str()).collect();
    let in_neither = bad
        .iter()
        .filter(|id| !main_ids.contains(id.as_str()) && !dead_ids.contains(id.as_str()))
        .count();
    let in_both = dead_ids.intersection(&main_ids).count();
    let bad_headers = dead_recs
        .iter()
        .filter(|r| {
            r.headers.get("x-outbox-error").map(String::as_str) != Some("unroutable")
                || r.headers.get("x-original-exchange") != Some(&exchange)
                || r.headers.get("x-original-routing-key").map(String::as_str) != Some("bad.tick")
        })
        .count();
    eprintln!(
        "mixed with DLX: {} good / {} bad rows, inserted in {inserted:?}; complete: {complete} \
         after {:?}\n  main queue: {m:?}\n  DLQ: {d:?}\n  ids in both queues: {in_both}; \
         unroutable ids in neither: {in_neither}; DLQ copies with wrong x- headers: {bad_headers}\n  \
         slot {} vs last commit {} (waited {slot_wait:?})",
        good.len(),
        bad.len(),
        started.elapsed(),
        fmt_lsn(slot),
        fmt_lsn(last_commit),
    );
    let summary = format!("main {m:?}; DLQ {d:?}; in both {in_both}; in neither {in_neither}");
    assert_eq!(
        m.missing, 0,
        "routable rows missing from the main queue: {summary}"
    );
    assert_eq!(
        m.unexpected, 0,
        "unroutable rows in the main queue: {summary}"
    );
    assert_eq!(
        d.missing, 0,
        "unroutable rows missing from the DLQ: {summary}"
    );
    assert_eq!(d.unexpected, 0, "routable rows in the DLQ: {summary}");
    assert_eq!(m.distinct, good.len());
    assert_eq!(d.distinct, bad.len());
    assert_eq!(m.without_commit_lsn + d.without_commit_lsn, 0, "{summary}");
    assert_eq!(m.inversions, 0, "main queue out of commit order: {summary}");
    assert_eq!(d.inversions, 0, "DLQ out of commit order: {summary}");
    assert_eq!(
        bad_headers, 0,
        "DLQ copies without the x- headers: {summary}"
    );
    // The profile's headers, and only them, of the relay's own.
    let descriptive = ["aggregate_type", "aggregate_id", "outbox_table", "xid"];
    for r in main_recs.iter().chain(&dead_recs) {
        for key in ["event_type", "commit_lsn", "tx_index"] {
            assert!(r.headers.contains_key(key), "{key} missing: {r:?}");
        }
        for key in descriptive {
            assert_eq!(
                r.headers.contains_key(key),
                !minimal,
                "{key} with minimal={minimal}: {r:?}"
            );
        }
    }
    assert_eq!(
        m.duplicates + d.duplicates + in_both,
        0,
        "duplicates: {summary}"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {}) {slot_wait:?} after \
         everything arrived",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    main.stop();
    dead.stop();
    env.cleanup().await;
    eprintln!("took {:?}", started.elapsed());
}
