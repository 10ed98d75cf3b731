//! Large transactions, reserved header keys, and messages the broker refuses.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_the_window_goes_through() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_big").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    let mut config = config(&exchange);
    config.max_in_flight = 10;
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    running.send(stream.transaction(250)).await;
    running.send(stream.transaction(3)).await;
    let deliveries = receive_fast(&mut consumer, 256).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    running.assert_watermarks_valid(&stream.ends);
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    let expected: Vec<String> = (0..256).map(|i| format!("id-{i:08}")).collect();
    assert_eq!(ids, expected);
    assert_eq!(report.retries, 0);
    broker.cleanup().await;
}

/// A transaction of three events whose middle one has a body of `big` bytes.
fn with_big_middle(stream: &mut Stream, big: usize) -> WalBatch {
    let items = vec![
        WalItem::Event(stream.event(Some(Bytes::from_static(b"{\"n\":1}")))),
        WalItem::Event(stream.event(Some(Bytes::from(format!(
            "{{\"pad\":\"{}\"}}",
            "x".repeat(big)
        ))))),
        WalItem::Event(stream.event(Some(Bytes::from_static(b"{\"n\":3}")))),
    ];
    stream.commit(items)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_header_keys_never_poison_the_relay() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_cc").await;
    let mut consumer = broker.consumer(&queue, 100).await;
    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    let mut items = Vec::new();
    for i in 0..5 {
        let mut e = stream.event(Some(Bytes::from_static(b"{}")));
        if i == 2 {
            // RabbitMQ routes by CC/BCC and closes the channel when they are not
            // arrays: from the headers column they must never reach the broker.
            e.headers = Some(Bytes::from_static(
                br#"{"CC":"not-an-array","BCC":7,"x-death":"x","tenant":"t1"}"#,
            ));
        }
        items.push(WalItem::Event(e));
    }
    running.send(stream.commit(items)).await;
    let deliveries = receive(&mut consumer, 5).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    let expected: Vec<String> = (0..5).map(|i| format!("id-{i:08}")).collect();
    assert_eq!(ids, expected);
    let third = &deliveries[2];
    assert_eq!(header_text(third, "tenant"), "t1");
    for key in ["CC", "BCC", "x-death"] {
        assert!(header(third, key).is_none(), "{key} reached the broker");
    }
    assert_eq!(report.retries, 0, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_goes_to_the_dead_letter_exchange_as_a_notice() {
    let _exclusive = BROKER.write().await;
    let _limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let dlx = testkit::unique_name("pub_psn_d");
    let dlq = testkit::unique_name("pub_psn_q");
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_psn").await;
    broker.exchange(&dlx, ExchangeKind::Fanout).await;
    broker.queue(&dlq, FieldTable::default()).await;
    broker.bind(&dlq, &dlx, "").await;
    let mut main = broker.consumer(&queue, 100).await;
    let mut dead = broker.consumer(&dlq, 100).await;

    let mut config = config(&exchange);
    config.dead_letter_exchange = Some(dlx.clone());
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(with_big_middle(&mut stream, 200 * 1024)).await;
    running.send(stream.transaction(2)).await;

    // First occurrences (a message acked before the refusal may come again).
    let mut ids: Vec<String> = Vec::new();
    while ids.len() < 4 {
        let id = message_id(&receive(&mut main, 1).await[0]);
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    let notice = receive(&mut dead, 1).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    assert_eq!(
        ids,
        ["id-00000000", "id-00000002", "id-00000003", "id-00000004"]
    );
    let n = &notice[0];
    assert_eq!(message_id(n), "id-00000001");
    assert!(n.data.is_empty(), "the refused body was sent again");
    assert!(
        header_text(n, "x-outbox-error").contains("refused"),
        "{}",
        header_text(n, "x-outbox-error")
    );
    assert_eq!(header_text(n, "x-original-exchange"), exchange);
    assert!(
        matches!(header(n, "x-outbox-body-bytes"), Some(AMQPValue::LongLongInt(b)) if *b > 200 * 1024)
    );
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert!(report.retries >= 1, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_without_dead_letter_exchange_holds_and_is_reported() {
    let _exclusive = BROKER.write().await;
    let limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_psn2").await;
    let mut main = broker.consumer(&queue, 100).await;
    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(with_big_middle(&mut stream, 200 * 1024)).await;
    let end = *stream.ends.last().unwrap();

    // The message before it arrives; the poison is reported and holds the watermark.
    let first = receive(&mut main, 1).await;
    assert_eq!(message_id(&first[0]), "id-00000000");
    let reported = tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(p) = running.status.poison() {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the poison message is reported");
    assert_eq!(reported.message_id, "id-00000001");
    assert_eq!(reported.tx_index, 1);
    assert!(reported.reason.contains("406"), "{}", reported.reason);
    assert!(
        !running.status.ready(),
        "ready while a poison message holds it"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        *running.watermark.borrow() < end,
        "watermark passed a refused message"
    );

    // The operator raises the limit: it goes through, in order, and the report clears.
    drop(limit);
    // The first may come again (it was acked before its transaction was): the
    // first occurrences are in order.
    let mut ids: Vec<String> = Vec::new();
    while !ids.iter().any(|i| i == "id-00000002") {
        let id = message_id(&receive(&mut main, 1).await[0]);
        if !ids.contains(&id) && id != "id-00000000" {
            ids.push(id);
        }
    }
    running.wait_watermark(end).await;
    assert_eq!(ids, ["id-00000001", "id-00000002"]);
    assert!(running.status.poison().is_none());
    let report = running.finish().await;
    assert!(report.retries >= 2, "{report:?}");
    broker.cleanup().await;
}
