//! Exactly once across publisher restarts, connection cuts and a second producer; copies without a producer reference.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_across_publisher_restarts_at_seeded_cut_points() {
    init_logs();
    let stream = TestStream::create("s_restart").await;
    let input = input("orders", 3000);
    let reference = "relay-restart";
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    // Transaction indices after whose commit the publisher is killed; index 6 is
    // just before a 700-event transaction, so the kill lands inside it.
    let mut cuts = vec![6usize];
    for _ in 0..4 {
        cuts.push(rng.gen_range(0..input.ends.len() - 1));
    }
    let mut stored_before = 0;
    for (round, &cut) in cuts.iter().enumerate() {
        let mut cfg = config(&stream.name, Some(reference));
        cfg.max_in_flight = [50, 200, 1000][rng.gen_range(0..3)];
        let mut run = start(cfg).await;
        // The slot re-delivers from an older position: the whole input again.
        let feeder = feed(run.input.clone(), input.batches.clone());
        wait_watermark(&mut run.watermark, input.ends[cut]).await;
        run.task.abort();
        feeder.abort();
        let _ = run.task.await;
        // What is in the stream is always a prefix of the input, each once.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = ids(&stream.read_all().await, Some(reference));
        let want = expected_ids(&input.events);
        assert!(
            got.len() <= want.len(),
            "round {round}: {} stored",
            got.len()
        );
        assert_eq!(got, want[..got.len()], "round {round}: not a prefix");
        let confirmed: usize = input.batches[..=cut]
            .iter()
            .flatten()
            .filter(|i| matches!(i, WalItem::Event(_)))
            .count();
        assert!(
            got.len() >= confirmed,
            "round {round}: confirmed events missing"
        );
        eprintln!(
            "round {round}: cut after transaction {cut} ({confirmed} confirmed), {} stored (before: {stored_before})",
            got.len()
        );
        stored_before = got.len();
    }
    // The last run completes.
    let (report, watermark) = publish_all(config(&stream.name, Some(reference)), &input).await;
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(report.abandoned, 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    let publishing_ids: Vec<u64> = messages
        .iter()
        .map(|m| m.number("x-outbox-publishing-id").unwrap())
        .collect();
    let want: Vec<u64> = input
        .events
        .iter()
        .map(|e| publishing_id(e.commit_lsn, e.index).unwrap())
        .collect();
    assert_eq!(publishing_ids, want);
    assert!(want.windows(2).all(|w| w[0] < w[1]));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_across_connection_cuts_within_a_session() {
    init_logs();
    let stream = TestStream::create("s_cut").await;
    let target = testkit::stream::stream_addr();
    let proxy = testkit::proxy::Proxy::start(target).await;
    let url = format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    );
    let input = input("orders", 5000);
    let mut cfg = config(&stream.name, Some("relay-cut"));
    cfg.urls = vec![url];
    cfg.max_in_flight = 500;
    let mut run = start(cfg).await;
    let feeder = feed(run.input.clone(), input.batches.clone());
    drop(run.input);
    for &k in &[3usize, 9, 14] {
        let reached =
            tokio::time::timeout(PATIENCE, run.watermark.wait_for(|v| *v >= input.ends[k]))
                .await
                .expect("watermark reached in time")
                .is_ok();
        if !reached {
            panic!("the publisher stopped: {:?}", run.task.await);
        }
        // Cut in the middle of the broker's confirms.
        proxy.cut_after(300);
        tokio::time::timeout(PATIENCE, async {
            while !proxy.is_cut() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("cut reached");
        tokio::time::sleep(Duration::from_millis(100)).await;
        proxy.restore();
    }
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    feeder.await.unwrap();
    assert!(report.reconnects >= 3, "{report:?}");
    assert_eq!(report.watermark, *input.ends.last().unwrap());
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_producer_does_not_affect_the_first() {
    init_logs();
    let stream = TestStream::create("s_two").await;
    // Producer A stores the first 1000 events of its input, then producer B writes
    // 6000 events after them, with the same commit LSNs (another source's WAL): the
    // same publishing ids under another reference.
    let a_input = input("a_orders", 1500);
    let mut a_first = input("a_orders", 1500);
    let cut = a_first
        .batches
        .iter()
        .scan(0, |n, b| {
            *n += b.iter().filter(|i| matches!(i, WalItem::Event(_))).count();
            Some(*n)
        })
        .position(|n| n >= 1000)
        .unwrap();
    a_first.batches.truncate(cut + 1);
    let a_stored: usize = a_first
        .batches
        .iter()
        .flatten()
        .filter(|i| matches!(i, WalItem::Event(_)))
        .count();
    publish_all(config(&stream.name, Some("relay-a")), &a_first).await;
    let b_input = input("b_orders", 6000);
    publish_all(config(&stream.name, Some("relay-b")), &b_input).await;
    // A restarts and gets its whole input again: it sends it all again (the broker's
    // last id may name writes a cut-off leader would lose), and the broker stores
    // only what it did not hold.
    let (report, _) = publish_all(config(&stream.name, Some("relay-a")), &a_input).await;
    assert_eq!(report.published, 1500);
    let messages = stream.read_all().await;
    assert_eq!(messages.len(), 1500 + 6000);
    assert_eq!(
        ids(&messages, Some("relay-a")),
        expected_ids(&a_input.events)
    );
    assert_eq!(
        ids(&messages, Some("relay-b")),
        expected_ids(&b_input.events)
    );
    // Stream order: A's first part, B, A's rest.
    let producers: Vec<&str> = messages
        .iter()
        .map(|m| m.text("x-outbox-producer").unwrap())
        .collect();
    assert!(producers[..a_stored].iter().all(|p| *p == "relay-a/tl1"));
    assert!(producers[a_stored..a_stored + 6000]
        .iter()
        .all(|p| *p == "relay-b/tl1"));
    assert!(producers[a_stored + 6000..]
        .iter()
        .all(|p| *p == "relay-a/tl1"));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_producer_reference_a_republish_adds_copies() {
    init_logs();
    let stream = TestStream::create("s_copies").await;
    let input = input("orders", 800);
    let mut cfg = config(&stream.name, None);
    cfg.extra_properties = vec![("replay".into(), "true".into())];
    publish_all(cfg.clone(), &input).await;
    publish_all(cfg, &input).await;
    let messages = read(&stream.name, 0).await;
    assert_eq!(messages.len(), 1600);
    let mut want = expected_ids(&input.events);
    want.extend(expected_ids(&input.events));
    assert_eq!(ids(&messages, None), want);
    assert!(messages.iter().all(|m| m.text("replay") == Some("true")
        && !m.application_properties.contains_key("x-outbox-producer")
        && !m
            .application_properties
            .contains_key("x-outbox-publishing-id")));
    assert!(messages.iter().all(
        |m| m.application_properties.get("aggregate_type") == Some(&Value::Str("order".into()))
    ));
    stream.delete().await;
}

/// A broker that goes silent without closing the connection (a paused node: the
/// proxy stops forwarding) is given up after two heartbeat intervals with confirms
/// outstanding, and the publisher goes on through the next URL, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_given_up_after_two_heartbeats() {
    init_logs();
    let stream = TestStream::create("s_silent").await;
    let target = testkit::stream::stream_addr();
    let (first, second) = (
        testkit::proxy::Proxy::start(target).await,
        testkit::proxy::Proxy::start(target).await,
    );
    let url = |p: &testkit::proxy::Proxy| {
        format!("rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f", p.port())
    };
    let input = input("orders", 3000);
    let mut cfg = config(&stream.name, Some("relay-silent"));
    cfg.urls = vec![url(&first), url(&second)];
    cfg.max_in_flight = 500;
    cfg.heartbeat = Duration::from_secs(1);
    let run = start(cfg).await;
    // Silent from the first event on: nothing is confirmed on this connection.
    first.stall();
    let stalled = std::time::Instant::now();
    let feeder = feed(run.input.clone(), input.batches.clone());
    drop(run.input);
    let report = tokio::time::timeout(Duration::from_secs(20), run.task)
        .await
        .expect("the publisher gave up the silent connection and finished")
        .unwrap()
        .unwrap();
    let took = stalled.elapsed();
    feeder.await.unwrap();
    eprintln!(
        "finished {:.1} s after the stall: {report:?}",
        took.as_secs_f64()
    );
    assert!(report.reconnects >= 1, "{report:?}");
    assert!(
        took >= Duration::from_secs(2),
        "gave up before two heartbeats: {took:?}"
    );
    assert_eq!(report.watermark, *input.ends.last().unwrap());
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    first.restore();
    stream.delete().await;
}
