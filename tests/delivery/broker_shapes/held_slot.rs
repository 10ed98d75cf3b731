//! Unroutable rows without a dead-letter exchange: the slot holds until a queue is bound.
//! size: one end-to-end scenario: held before the bind, drained after; its steps share one state

use super::*;

/// docs/design.md §5, no dead-letter exchange: an unroutable message is retried, never
/// dropped, and the slot never moves past it. 500 routable rows (10 transactions),
/// then 2,000 rows in transactions of 50 with every 9th row unroutable (the first at
/// seq 504). After ~10 s the slot must be past the routable prefix and before the
/// commit of the transaction holding seq 504, with every row before 504 received;
/// then a binding for `bad.tick` makes them routable and every row must arrive
/// (only unroutable ones may have been overtaken) and the slot reach the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_rows_without_a_dead_letter_exchange_hold_the_slot() {
    let _shared = testkit::BROKER.read().await;
    const WARMUP: u64 = 500;
    const N: u64 = 2_000;
    const PER_TX: u64 = 50;
    const EVERY: u64 = 9;
    const FIRST_BAD: i64 = 504;
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let main_q = env.broker.queue_bound(&exchange, "good.tick").await;
    let config = write_config(&env, 1000, "", "");
    create_slot(&env, &config);
    let main = recorder(&main_q, 2000, 0);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);

    // One connection: commit order is insert order.
    let loader = env.db.client().await;
    let mut i = 1;
    while i <= WARMUP + N {
        let to = i + PER_TX - 1;
        let every = if i > WARMUP { EVERY } else { 0 };
        loader
            .batch_execute(&mixed_sql(i, to, every))
            .await
            .unwrap();
        i = to + 1;
    }
    let inserted = Instant::now();
    let all = rows(&pg).await;
    assert_eq!(all.len(), (WARMUP + N) as usize);
    let ids: HashSet<String> = all.iter().map(|(id, _)| id.clone()).collect();
    let bad: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "bad")
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(bad.len(), (N / EVERY) as usize);

    // Everything before the first unroutable row arrives.
    let before_ok = wait_deliveries(
        &[&main],
        Duration::from_secs(30),
        Duration::from_secs(30),
        || {
            let got: HashSet<i64> = main.snapshot().iter().map(|d| d.seq).collect();
            (1..FIRST_BAD).all(|s| got.contains(&s))
        },
    )
    .await;
    // Give the relay ~10 s of retrying.
    let settle = Duration::from_secs(10).saturating_sub(inserted.elapsed());
    tokio::time::sleep(settle).await;
    let held = confirmed(&pg, &env.slot).await;
    let recs = main.snapshot();
    let commit_of = |seq: i64| recs.iter().find(|d| d.seq == seq).map(|d| d.commit_lsn);
    let warmup_commit = commit_of(WARMUP as i64);
    // Seq 501 is in the transaction of the first unroutable row (501..=550).
    let bad_tx_commit = commit_of(WARMUP as i64 + 1);
    let received_before: usize = recs
        .iter()
        .map(|d| d.seq)
        .filter(|s| (1..FIRST_BAD).contains(s))
        .collect::<HashSet<_>>()
        .len();
    let bad_before_bind = recs.iter().filter(|d| d.kind == "bad").count();
    eprintln!(
        "no DLX, after {:?} of retrying: {received_before} of {} rows before seq {FIRST_BAD} \
         received (all: {before_ok}); {} deliveries so far ({} distinct); slot {} \
         (warm-up commit {:?}, commit of the first transaction with an unroutable row {:?})",
        inserted.elapsed(),
        FIRST_BAD - 1,
        main.total(),
        main.distinct(),
        fmt_lsn(held),
        warmup_commit.map(fmt_lsn),
        bad_tx_commit.map(fmt_lsn),
    );
    assert_eq!(
        received_before,
        FIRST_BAD as usize - 1,
        "rows before the first unroutable one"
    );
    assert_eq!(
        bad_before_bind, 0,
        "unroutable rows delivered before the bind"
    );
    let (warmup_commit, bad_tx_commit) = (warmup_commit.unwrap(), bad_tx_commit.unwrap());
    assert!(
        held > warmup_commit,
        "the slot ({}) is not past the routable prefix (commit {})",
        fmt_lsn(held),
        fmt_lsn(warmup_commit)
    );
    assert!(
        held < bad_tx_commit,
        "the slot ({}) moved past the commit ({}) of a transaction whose unroutable row was \
         never published anywhere",
        fmt_lsn(held),
        fmt_lsn(bad_tx_commit)
    );

    // Make them routable: everything must arrive.
    bind(&env, &main_q, &exchange, "bad.tick").await;
    let bound = Instant::now();
    let complete = wait_deliveries(
        &[&main],
        Duration::from_secs(60),
        Duration::from_secs(15),
        || main.distinct() >= ids.len(),
    )
    .await;
    let arrived_after = bound.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recs = main.snapshot();
    let last_commit = recs.iter().map(|d| d.commit_lsn).max().unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;
    // Only a returned message (no DLX) may be overtaken by later ones on the wire.
    let t = tally(&recs, &ids, |d| d.kind == "bad");
    eprintln!(
        "after the bind: complete {complete} in {arrived_after:?}: {t:?}; slot {} vs last \
         commit {} (waited {slot_wait:?}); took {:?}",
        fmt_lsn(slot),
        fmt_lsn(last_commit),
        started.elapsed()
    );
    assert_eq!(t.missing, 0, "rows never arrived: {t:?}");
    assert_eq!(t.unexpected, 0, "{t:?}");
    assert_eq!(t.distinct, ids.len());
    assert_eq!(t.without_commit_lsn, 0, "{t:?}");
    assert_eq!(
        t.overtaken_not_allowed, 0,
        "routable rows out of commit order: {t:?}"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {})",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    main.stop();
    env.cleanup().await;
}
