//! Frame maxima, and a refusal below a stored id.

use super::*;

/// Transactions of small events with some of `big` bytes among them.
fn mixed_input(name: &str, transactions: usize, big: &[usize]) -> Input {
    let mut tx = Tx::new(table(name, JSON));
    let mut batches = Vec::new();
    let mut k = 0;
    for t in 0..transactions {
        let mut items = Vec::new();
        for i in 0..(t % 5 + 1) {
            let size = if (t + i) % 3 == 0 {
                big[k % big.len()]
            } else {
                100
            };
            k += 1;
            let payload = format!("{{\"pad\": \"{}\"}}", "x".repeat(size));
            items.push(WalItem::Event(tx.event(Some(bytes::Bytes::from(payload)))));
        }
        batches.push(tx.commit(items));
    }
    Input::of(batches, tx.ends)
}

fn stream_target() -> std::net::SocketAddr {
    testkit::stream::stream_addr()
}

/// Events of 700 to 900 KiB among small ones through a broker that enforces a 1 MiB
/// frame maximum: every publish frame fits (none is refused by the broker), every
/// event is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_stay_within_an_enforced_frame_maximum() {
    init_logs();
    let stream = TestStream::create("s_frames").await;
    let proxy = StreamProxy::start(stream_target()).await;
    proxy.set_frame_max(Some(1 << 20));
    let input = mixed_input("big", 30, &[700 << 10, 800 << 10, 900 << 10]);
    let mut cfg = config(&stream.name, Some("relay-frames"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    let (report, watermark) = publish_all(cfg, &input).await;
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(proxy.oversized(), 0, "a frame went over the maximum");
    assert_eq!(
        proxy.agreed_frame_max(),
        1 << 20,
        "the proxy enforced the maximum"
    );
    assert_eq!(report.reconnects, 0, "{report:?}");
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

/// An event larger than the frame maximum holds the publisher as a poison message
/// (reported in its status) until the broker's limit is raised; then everything is
/// stored once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_frame_maximum_waits_until_the_limit_is_raised() {
    init_logs();
    let stream = TestStream::create("s_poison").await;
    let proxy = StreamProxy::start(stream_target()).await;
    proxy.set_frame_max(Some(300 << 10));
    let input = mixed_input("poison", 12, &[500 << 10]);
    let mut cfg = config(&stream.name, Some("relay-poison"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.backoff_max = Duration::from_millis(300);
    let publisher = StreamPublisher::connect(cfg).await.unwrap();
    let status = publisher.status();
    let (tx, rx) = mpsc::channel(64);
    let (wtx, _watermark) = watch::channel(Lsn::ZERO);
    let task = tokio::spawn(publisher.run(rx, wtx, None));
    let feeder = feed(tx, input.batches.clone());
    let poison = tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(p) = status.poison() {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the big event is reported");
    let first_big = input
        .events
        .iter()
        .find(|e| e.body.len() > 300 << 10)
        .unwrap();
    assert_eq!(poison.message_id, id_of(first_big));
    assert_eq!(poison.commit_lsn, first_big.commit_lsn);
    assert!(poison.reason.contains("frame_max"), "{poison:?}");
    assert!(!status.ready());
    // Nothing after it is stored while it waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = stream.read_all().await;
    let k = input
        .events
        .iter()
        .position(|e| e.id == first_big.id)
        .unwrap();
    assert_eq!(ids(&before, None), expected_ids(&input.events[..k]));
    proxy.set_frame_max(Some(1 << 20));
    let report = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    feeder.await.unwrap();
    assert_eq!(report.abandoned, 0, "{report:?}");
    assert_eq!(status.poison(), None);
    assert_eq!(proxy.oversized(), 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

/// The broker refuses a publish frame and stores the ones after it: the refused
/// events can no longer be stored under the producer, so the publisher stops with
/// a definite error instead of retrying (which would skip them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_below_a_stored_id_halts() {
    init_logs();
    let stream = TestStream::create("s_refuse").await;
    let proxy = StreamProxy::start(stream_target()).await;
    let input = input("refuse", 3000);
    let mut cfg = config(&stream.name, Some("relay-refuse"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.max_in_flight = 400;
    let mut run = start(cfg).await;
    feed(run.input.clone(), input.batches[..4].to_vec())
        .await
        .unwrap();
    wait_watermark(&mut run.watermark, input.ends[3]).await;
    // Armed before the rest comes, so that a frame is refused and later ones follow.
    proxy.refuse_next_publish(AfterRefusal::Pass);
    let feeder = feed(run.input.clone(), input.batches[4..].to_vec());
    let result = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher stopped in time")
        .unwrap();
    feeder.abort();
    let e = result.expect_err("a halt");
    assert!(e.is_halt(), "{e}");
    assert!(e.to_string().contains("outbox-relay replay"), "{e}");
    assert_eq!(proxy.refused_frames(), 1);
    stream.delete().await;
}

/// A refused frame with nothing stored after it (the connection ends) is sent again
/// and stored; the refusal is then forgotten: later reconnects raise no alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_then_a_resend_goes_on_exactly_once() {
    init_logs();
    let stream = TestStream::create("s_resend").await;
    let proxy = StreamProxy::start(stream_target()).await;
    let input = input("resend", 4000);
    let mut cfg = config(&stream.name, Some("relay-resend"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.max_in_flight = 300;
    let mut run = start(cfg).await;
    let feeder = feed(run.input.clone(), input.batches.clone());
    drop(run.input);
    for (n, k) in [3usize, 9].into_iter().enumerate() {
        wait_watermark(&mut run.watermark, input.ends[k]).await;
        proxy.refuse_next_publish(AfterRefusal::Cut);
        while proxy.refused_frames() <= n as u64 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .expect("no halt");
    feeder.await.unwrap();
    assert!(report.reconnects >= 2, "{report:?}");
    assert_eq!(report.abandoned, 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}
