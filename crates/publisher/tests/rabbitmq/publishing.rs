//! Publishing in order with the spec's properties, nacks, unroutable messages.
//! size: the in-order test is one run: 10,000 events sent, then each delivery checked against them

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_every_message_in_order_with_spec_properties() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_all").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    let mut config = config(&exchange);
    config.max_in_flight = 1000;
    let mut running = start(config).await;

    let json = table("outbox", JSON);
    let bytea = table("outbox_bin", "application/octet-stream");
    let text = table("outbox_text", "text/plain");
    let mut stream = Stream::new(json.clone());
    // (body, content type) expected for each message, in order.
    let mut expected: Vec<(Vec<u8>, &str, String)> = Vec::new();
    let total = 10_000;
    let mut tx_size = 1;
    while (stream.events as usize) < total {
        let n = tx_size.min(total - stream.events as usize);
        let mut items = Vec::with_capacity(n + 1);
        for _ in 0..n {
            let k = stream.events;
            let mut event = match k % 100 {
                // bytea payload: the reader decoded Postgres' hex text to raw bytes.
                3 => {
                    let mut e =
                        stream.event(Some(Bytes::from(vec![0, 0xff, (k % 256) as u8, 0x0a])));
                    e.table = bytea.clone();
                    expected.push((
                        vec![0, 0xff, (k % 256) as u8, 0x0a],
                        "application/octet-stream",
                        "public.outbox_bin".into(),
                    ));
                    e
                }
                // NULL payload: empty body.
                5 => {
                    let e = stream.event(None);
                    expected.push((Vec::new(), "application/json", "public.outbox".into()));
                    e
                }
                7 => {
                    let mut e = stream.event(Some(Bytes::from(format!("plain \\x text {k}"))));
                    e.table = text.clone();
                    expected.push((
                        format!("plain \\x text {k}").into_bytes(),
                        "text/plain",
                        "public.outbox_text".into(),
                    ));
                    e
                }
                _ => {
                    let body = format!(r#"{{"n": {k}, "s": "ünïcode"}}"#);
                    let e = stream.event(Some(Bytes::from(body.clone())));
                    expected.push((
                        body.into_bytes(),
                        "application/json",
                        "public.outbox".into(),
                    ));
                    e
                }
            };
            if k % 50 == 0 {
                event.headers = None;
            }
            items.push(WalItem::Event(event));
        }
        running.send(stream.commit(items)).await;
        tx_size = tx_size % 97 + 13;
    }

    let deliveries = receive_fast(&mut consumer, total).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    running.assert_watermarks_valid(&stream.ends);
    // With nothing in flight, a keepalive position is acked at once.
    let keepalive = Lsn(last.0 + 0x5000);
    running.send(vec![WalItem::Keepalive(keepalive)]).await;
    running.wait_watermark(keepalive).await;
    assert_eq!(running.status.in_flight(), 0);
    assert_eq!(running.status.oldest_unacked_commit_micros(), None);
    let report = running.finish().await;
    assert_eq!(report.watermark, keepalive);
    assert_eq!(report.abandoned, 0);
    assert_eq!(report.acked, total as u64);
    assert_eq!(report.retries, 0);

    let mut previous: Option<(Lsn, i64)> = None;
    for (i, d) in deliveries.iter().enumerate() {
        let (body, content_type, table_name) = &expected[i];
        let p = &d.properties;
        assert_eq!(message_id(d), format!("id-{i:08}"), "order at {i}");
        assert_eq!(&d.data, body, "body of {i}");
        assert_eq!(d.routing_key.as_str(), "order.created");
        assert_eq!(d.exchange.as_str(), exchange);
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            *content_type,
            "content type of {i}"
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            *p.timestamp(),
            Some((COMMIT_TIME_MICROS / 1_000_000) as u64)
        );
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
        assert_eq!(
            p.correlation_id().as_ref().unwrap().to_string(),
            format!("corr-{i}")
        );
        assert_eq!(header_text(d, "aggregate_type"), "order");
        assert_eq!(header_text(d, "aggregate_id"), format!("{}", i % 7));
        assert_eq!(header_text(d, "event_type"), "created");
        assert_eq!(header_text(d, "outbox_table"), *table_name);
        let end = stream.end_of[&format!("id-{i:08}")];
        // The stream's commit LSN is 0x100 before the end LSN.
        assert_eq!(header_text(d, "commit_lsn"), Lsn(end.0 - 0x100).to_string());
        assert!(matches!(header(d, "xid"), Some(AMQPValue::LongLongInt(x)) if *x >= 1000));
        // tx_index: 0 for a transaction's first event, then +1 in insert order.
        let index = match header(d, "tx_index") {
            Some(AMQPValue::LongLongInt(x)) => *x,
            other => panic!("tx_index: {other:?}"),
        };
        let expected_index = match previous {
            Some((lsn, idx)) if lsn == end => idx + 1,
            _ => 0,
        };
        assert_eq!(index, expected_index, "tx_index of message {i}");
        previous = Some((end, index));
        let headers = p.headers().as_ref().unwrap().inner();
        if i % 50 == 0 {
            assert_eq!(headers.len(), 7, "no headers column: only the relay's own");
        } else {
            assert_eq!(header_text(d, "seq"), i.to_string());
            assert_eq!(header_text(d, "traceparent"), format!("00-t-{i}-01"));
            assert_eq!(headers.len(), 9);
        }
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_messages_are_retried_and_hold_the_watermark() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_nack").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(100));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let queue = broker.bound_queue("pub_nack", &exchange, args).await;

    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    let batches: Vec<_> = (0..30).map(|_| stream.transaction(10)).collect();
    // Fed from a task: while the publisher retries a nacked message it takes no
    // more input, so sending all 30 here would wait for the consumer below.
    let input = running.input.clone().unwrap();
    let feeder = tokio::spawn(async move {
        for batch in batches {
            input.send(batch).await.unwrap();
        }
    });
    // The queue takes at most 100 messages (ten transactions; the broker may nack
    // some earlier, and retries may fill it with copies of acked ones): the
    // watermark moves, and stays below the transactions that cannot fit.
    running.wait_watermark(stream.ends[0]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        *running.watermark.borrow() <= stream.ends[9],
        "watermark passed a nacked message"
    );
    // Everything not acked is in flight (what the publisher has not taken from its
    // input yet, while it retries, is not counted here).
    let in_flight = running.status.in_flight();
    assert!(in_flight > 0 && in_flight <= 200, "in flight: {in_flight}");

    // A consumer drains slowly; everything arrives.
    let mut consumer = broker.consumer(&queue, 1).await;
    let mut ids = std::collections::BTreeSet::new();
    while ids.len() < 300 {
        let batch = receive(&mut consumer, 1).await;
        ids.insert(message_id(&batch[0]));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    tokio::time::timeout(PATIENCE, feeder)
        .await
        .unwrap()
        .unwrap();
    running.assert_watermarks_valid(&stream.ends);
    let report = running.finish().await;
    assert_eq!(ids.len(), 300);
    assert!(report.nacked > 0, "{report:?}");
    assert!(report.retries > 0, "{report:?}");
    assert_eq!(report.watermark, last);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_goes_to_the_dead_letter_exchange() {
    let _shared = BROKER.read().await;
    let dlx = testkit::unique_name("pub_dlx_d");
    let queue = testkit::unique_name("pub_dlx_q");
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_dlx").await;
    broker.exchange(&dlx, ExchangeKind::Fanout).await;
    broker.queue(&queue, FieldTable::default()).await;
    broker.bind(&queue, &dlx, "").await;
    let mut consumer = broker.consumer(&queue, 100).await;

    let mut config = config(&exchange);
    config.dead_letter_exchange = Some(dlx.clone());
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    running.send(stream.transaction(2)).await;

    let deliveries = receive(&mut consumer, 5).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    for (i, d) in deliveries.iter().enumerate() {
        assert_eq!(message_id(d), format!("id-{i:08}"));
        assert_eq!(d.exchange.as_str(), dlx);
        assert_eq!(header_text(d, "x-outbox-error"), "unroutable");
        assert_eq!(header_text(d, "x-original-exchange"), exchange);
        assert_eq!(header_text(d, "x-original-routing-key"), "order.created");
        assert_eq!(header_text(d, "aggregate_type"), "order");
    }
    assert_eq!(report.returned, 5);
    assert_eq!(report.dead_lettered, 5);
    assert_eq!(report.retries, 0);
    assert_eq!(report.watermark, last);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_without_dead_letter_is_retried_until_routable() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_unr").await;

    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *running.watermark.borrow(),
        Lsn::ZERO,
        "watermark moved past unroutable messages"
    );
    assert_eq!(running.status.in_flight(), 3);

    let queue = broker
        .bound_queue("pub_unr", &exchange, FieldTable::default())
        .await;
    let mut consumer = broker.consumer(&queue, 100).await;
    let deliveries = receive(&mut consumer, 3).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    assert_eq!(ids, ["id-00000000", "id-00000001", "id-00000002"]);
    assert!(report.returned >= 3, "{report:?}");
    assert!(report.retries >= 1, "{report:?}");
    broker.cleanup().await;
}
