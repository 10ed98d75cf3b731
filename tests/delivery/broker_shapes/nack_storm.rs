//! A nack storm from a full `reject-publish` queue drained slowly, then fast.

use super::*;

/// docs/design.md §5 nacks: the only queue bound to the exchange holds 50 messages and
/// rejects publishes beyond that (`x-overflow = reject-publish`), and its consumer
/// drains it slowly for 8 s (10 msgs/s), then fast. 1,000 rows in transactions of
/// 10, `max_in_flight = 100`. Every row must arrive, the slot must reach the end,
/// and `outbox_relay_events_nacked_total` must show the storm. Order: a nacked
/// message may be overtaken by later ones already on the wire (docs/design.md §1.2), never by
/// more than the window; the number of first occurrences out of order is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nack_storm_from_a_full_reject_publish_queue() {
    let _shared = testkit::BROKER.read().await;
    const N: u64 = 1_000;
    const PER_TX: u64 = 10;
    const MAX_IN_FLIGHT: usize = 100;
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(50));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let queue = env.broker.queue_bound_with(&exchange, "#", args).await;
    let addr = free_addr();
    let config = write_config(&env, MAX_IN_FLIGHT, "", &addr);
    create_slot(&env, &config);
    let consumer = recorder(&queue, 1, 100);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);
    let loader = env.db.client().await;
    let mut i = 1;
    while i <= N {
        let to = i + PER_TX - 1;
        loader.batch_execute(&mixed_sql(i, to, 0)).await.unwrap();
        i = to + 1;
    }
    let ids: HashSet<String> = rows(&pg).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), N as usize);
    tokio::time::sleep(Duration::from_secs(8).saturating_sub(started.elapsed())).await;
    let slow_phase = (consumer.total(), consumer.distinct());
    let nacked_slow = scrape(&addr)
        .await
        .and_then(|m| metric(&m, "outbox_relay_events_nacked_total"));
    consumer.set_ack_delay(0);
    let fast = Instant::now();
    let complete = wait_deliveries(
        &[&consumer],
        Duration::from_secs(60),
        Duration::from_secs(15),
        || consumer.distinct() >= ids.len(),
    )
    .await;
    let fast_took = fast.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recs = consumer.snapshot();
    let last_commit = recs.iter().map(|d| d.commit_lsn).max().unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;
    let body = scrape(&addr).await.unwrap_or_default();
    let nacked = metric(&body, "outbox_relay_events_nacked_total");
    let retries = metric(&body, "outbox_relay_publish_retries_total");
    // Every message may have been nacked here.
    let t = tally(&recs, &ids, |_| true);
    eprintln!(
        "nack storm: slow phase {} deliveries ({} distinct), nacked {nacked_slow:?}; fast \
         phase complete {complete} in {fast_took:?}: {t:?}; nacked_total {nacked:?}, \
         retries_total {retries:?}; slot {} vs last commit {} (waited {slot_wait:?}); took {:?}",
        slow_phase.0,
        slow_phase.1,
        fmt_lsn(slot),
        fmt_lsn(last_commit),
        started.elapsed()
    );
    assert_eq!(t.missing, 0, "rows never arrived: {t:?}");
    assert_eq!(t.unexpected, 0, "{t:?}");
    assert_eq!(t.distinct, ids.len());
    assert_eq!(t.without_commit_lsn, 0, "{t:?}");
    assert!(
        t.max_overtake < MAX_IN_FLIGHT,
        "a message was overtaken by one {} positions later, more than the window of \
         {MAX_IN_FLIGHT} can explain: {t:?}",
        t.max_overtake
    );
    assert!(
        nacked.unwrap_or(0.0) > 0.0,
        "outbox_relay_events_nacked_total is {nacked:?}: no nack storm happened"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {})",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    consumer.stop();
    env.cleanup().await;
}
