//! `[rabbitmq] stream_filter_value` (docs/streams.md, "Filter values"): on RabbitMQ 4
//! each message carries its rendered filter value, a consumer filtering on one value is
//! sent only the chunks that may hold it, and exactly once holds as without it; on
//! RabbitMQ 3.10 the publisher refuses to start, naming the broker's version.

use super::*;
use publisher::message::RoutingKeyTemplate;

/// Transactions of one aggregate type each, alternating `order` and `invoice`.
fn two_types(name: &str, transactions: usize, size: usize) -> Input {
    let mut tx = Tx::new(table(name, JSON));
    let mut batches = Vec::new();
    for k in 0..transactions {
        let mut batch = tx.transaction(size);
        let kind: &'static [u8] = if k % 2 == 0 { b"order" } else { b"invoice" };
        for item in &mut batch {
            if let WalItem::Event(e) = item {
                e.aggregate_type = Some(bytes::Bytes::from_static(kind));
            }
        }
        batches.push(batch);
    }
    Input::of(batches, tx.ends)
}

fn filtered_config(stream: &str, reference: &str) -> StreamConfig {
    let mut c = config(stream, Some(reference));
    c.filter_value = Some(RoutingKeyTemplate::parse("{aggregate_type}").unwrap());
    c
}

fn aggregate_type(e: &OutboxEvent) -> String {
    String::from_utf8(e.aggregate_type.clone().unwrap().to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_values_let_a_consumer_filter_on_the_broker_exactly_once() {
    init_logs();
    let stream = TestStream::create("s_filter").await;
    let reference = "relay-filter";
    if testkit::broker_major() < 4 {
        // RabbitMQ 3.10 cannot store filter values: refused at connect, in one
        // sentence naming the version and the fix.
        let error = match StreamPublisher::connect(filtered_config(&stream.name, reference)).await {
            Ok(_) => panic!("a filter value was accepted by RabbitMQ 3.10"),
            Err(e) => e,
        };
        let text = error.to_string();
        assert!(
            matches!(
                error,
                PublishError::InvalidConfig {
                    key: "stream_filter_value",
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("RabbitMQ 3.10."), "{text}");
        assert!(
            text.contains(
                "upgrade the broker to RabbitMQ 3.13 or later, or remove stream_filter_value"
            ),
            "{text}"
        );
        assert!(!error.is_transient(), "{text}");
        // Nothing was published.
        assert!(stream.read_all().await.is_empty());
        stream.delete().await;
        return;
    }
    let input = two_types("orders", 8, 40);
    // One transaction at a time, each confirmed before the next: each lands in
    // chunks of its own, holding one aggregate type.
    let mut run = start(filtered_config(&stream.name, reference)).await;
    for (batch, end) in input.batches.iter().zip(&input.ends) {
        run.input.send(batch.clone()).await.unwrap();
        wait_watermark(&mut run.watermark, *end).await;
    }
    drop(run.input);
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    assert_eq!(report.watermark, *input.ends.last().unwrap());

    // Everything once, in order, with the producer's ids.
    let all = stream.read_all().await;
    assert_eq!(ids(&all, None), expected_ids(&input.events));
    let last = publishing_id(
        input.events.last().unwrap().commit_lsn,
        input.events.last().unwrap().index,
    )
    .unwrap();
    assert_eq!(
        testkit::stream::last_publishing_id(&format!("{reference}/tl1"), &stream.name).await,
        last
    );

    // A consumer filtering on "order": the broker sends no chunk of invoices only,
    // and after the client-side check it holds exactly the orders.
    let sent = testkit::stream::read_filtered(&stream.name, &["order"], false).await;
    let orders: Vec<OutboxEvent> = input
        .events
        .iter()
        .filter(|e| aggregate_type(e) == "order")
        .cloned()
        .collect();
    assert!(
        sent.len() < all.len(),
        "the broker filtered nothing: {} of {} messages sent",
        sent.len(),
        all.len()
    );
    let kept: Vec<StreamMessage> = sent
        .into_iter()
        .filter(|m| m.text("aggregate_type") == Some("order"))
        .collect();
    assert_eq!(ids(&kept, None), expected_ids(&orders));
    // A consumer filtering on a value no message has gets nothing.
    assert!(
        testkit::stream::read_filtered(&stream.name, &["payment"], false)
            .await
            .is_empty()
    );

    // The slot delivers everything again after a restart: the broker drops every
    // copy, with or without filter values.
    let (report, _) = publish_all(filtered_config(&stream.name, reference), &input).await;
    assert_eq!(report.abandoned, 0);
    let again = stream.read_all().await;
    assert_eq!(ids(&again, None), expected_ids(&input.events));
    assert_eq!(
        testkit::stream::last_publishing_id(&format!("{reference}/tl1"), &stream.name).await,
        last
    );
    stream.delete().await;
}
