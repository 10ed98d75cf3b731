//! Frames that cannot fit: an event whose content header frame is larger than the
//! negotiated `frame_max` is poison (issue 40, "Done when": named within seconds, the
//! rows behind it go on after `slot skip`), on the default broker (131,072) and on
//! the node with small frames (16,384, scripts/rabbitmq-cluster.sh node 4), where
//! bodies larger than a frame still arrive, split.

use testkit::free_addr;

use super::*;

/// The node with `frame_max = 16384` (scripts/rabbitmq-cluster.sh start-small-frames).
fn small_frame_url() -> String {
    std::env::var("OUTBOX_TEST_SMALL_FRAME_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@10.77.0.14:5672/%2f".into())
}

/// Rows 1–10, then row 11 whose headers column holds `header_bytes` (its header frame
/// over the broker's `frame_max`), then rows 12–31. Within [`SOON`] the relay names
/// row 11 as poison (ERROR line, `/poison`, `status`) and publishes nothing behind
/// it; stopped, `slot skip <its id> --yes`, started again, it delivers rows 12–31 in
/// order, and row 11 never.
async fn poison_held_then_skipped(w: World, header_bytes: usize) {
    let metrics = free_addr();
    let vars = [(METRICS, metrics.as_str())];
    let relay = w.start_env(&vars);
    w.insert(1, 10, 5).await;
    let poison = insert_with_big_header(&w, 11, header_bytes).await;
    w.insert(12, 20, 5).await;
    wait_named_as_poison(&w, &relay, &metrics, &poison, SOON).await;

    // Held: nothing behind it is published.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let recs = w.consumer.snapshot();
    let seqs: std::collections::BTreeSet<i64> = recs
        .iter()
        .filter(|r| r.marker.is_none())
        .map(|r| r.seq)
        .collect();
    assert_eq!(
        seqs,
        (1..=10).collect(),
        "while {poison} is held exactly rows 1-10 are delivered"
    );
    let (code, log) = relay.terminate();
    assert_eq!(
        code,
        Some(0),
        "the relay stops cleanly while holding poison:\n{log}"
    );

    let out = cli(&w, &["slot", "skip", &poison, "--yes"], &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "slot skip {poison}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let relay = w.start_env(&vars);
    let report = verify_within(&w, &relay, Some(&poison), SOON, w.max_in_flight).await;
    assert_eq!(report.distinct, 30);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The headline bug: a 200 KB headers column (over the default `frame_max`,
/// 131,072) on the test broker. Before issue 40 the broker closed the connection with
/// 501 `frame_too_large`, the relay logged one "publish failed … retrying" and then
/// nothing, and published nothing behind the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversized_headers_row_is_named_as_poison_and_skipped() {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    poison_held_then_skipped(w, 200_000).await;
}

/// The same row with a `dead_letter_exchange`: a notice of it (its message id and
/// `x-outbox-error`) goes there and the rows behind it flow without an operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversized_headers_row_goes_to_the_dead_letter_exchange() {
    let _broker = BROKER.read().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let dlx = w.env.broker.exchange_name("dlx");
    w.env.broker.declare_exchange(&dlx, "fanout").await;
    let dlq = w.env.broker.queue_bound(&dlx, "").await;
    let dead = Consumer::builder(dlq).headers().start();
    w.rabbitmq_extra = format!("dead_letter_exchange = {dlx:?}");
    let relay = w.start();
    w.insert(1, 10, 5).await;
    let poison = insert_with_big_header(&w, 11, 200_000).await;
    w.insert(12, 20, 5).await;

    let start = Instant::now();
    while dead.distinct() == 0 && start.elapsed() < SOON {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let notices = dead.snapshot();
    assert!(
        notices.iter().any(|n| n.id == poison),
        "no notice of {poison} on the dead-letter exchange within {SOON:?} ({} notices: {:?}); \
         {} distinct messages on the main queue; last log lines:\n{}",
        notices.len(),
        notices.iter().map(|n| &n.id).collect::<Vec<_>>(),
        w.consumer.distinct(),
        tail(&relay.log_text(), 15)
    );
    let notice = notices.iter().find(|n| n.id == poison).unwrap();
    assert!(
        notice.headers.contains_key("x-outbox-error"),
        "the notice says why: {:?}",
        notice.headers.keys().collect::<Vec<_>>()
    );
    assert_eq!(notices.len(), 1, "one notice, for {poison} only");
    let report = verify_within(&w, &relay, Some(&poison), SOON, 0).await;
    assert_eq!(report.distinct, 30);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    dead.stop();
    w.cleanup().await;
}

/// On the node with 16 KiB frames: payloads of 100 KB (each body split into frames
/// of the negotiated size) and 8 KB headers columns (a header frame that fits) are
/// delivered whole and in order among small rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_frames_split_large_bodies_and_keep_fitting_headers() {
    let _broker = BROKER.read().await;
    let w = World::on_broker(&small_frame_url(), Cluster::Test, 100).await;
    let relay = w.start();
    w.insert(1, 5, 5).await;
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         SELECT 'seq', s.n::text, 'big',
                jsonb_build_object('seq', s.n, 'blob', repeat(md5(s.n::text), 3200)),
                jsonb_build_object('pad', repeat('h', 8000))
           FROM generate_series(6, 15) AS s(n) ORDER BY s.n",
    )
    .await;
    w.insert(16, 5, 5).await;
    let report = verify_within(&w, &relay, None, SOON, 0).await;
    assert_eq!(report.distinct, 20);
    assert!(
        report.max_body > 100_000,
        "the 100 KB bodies arrived whole: {report:?}"
    );
    let log = relay.log_text();
    assert!(
        !log.contains("ERROR"),
        "no ERROR for rows that fit: {}",
        tail(&log, 15)
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// On the node with 16 KiB frames, a 20 KB headers column (valid on the default
/// broker) is poison as in [`oversized_headers_row_is_named_as_poison_and_skipped`].
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_frames_oversized_header_is_named_as_poison_and_skipped() {
    let _broker = BROKER.read().await;
    let w = World::on_broker(&small_frame_url(), Cluster::Test, 100).await;
    poison_held_then_skipped(w, 20_000).await;
}
