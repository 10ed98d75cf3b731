//! Mixed transactions in commit order, with the message's fields.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_mixed_transactions_in_commit_order_with_the_message_fields() {
    init_logs();
    let stream = TestStream::create("s_order").await;
    let input = input("orders", 5000);
    let mut cfg = config(&stream.name, Some("relay-order"));
    cfg.extra_properties = vec![("origin".into(), "test".into())];
    let started = std::time::Instant::now();
    let (report, watermark) = publish_all(cfg, &input).await;
    let elapsed = started.elapsed();
    eprintln!(
        "5000 events in {elapsed:?} ({:.0}/s)",
        5000.0 / elapsed.as_secs_f64()
    );
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(report.watermark, watermark);
    assert_eq!(report.published, 5000);
    assert_eq!(report.acked, 5000);
    assert_eq!(report.abandoned, 0);

    let messages = stream.read_all().await;
    assert_eq!(messages.len(), 5000);
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    for (k, (m, e)) in messages.iter().zip(&input.events).enumerate() {
        assert_eq!(m.offset, k as u64);
        assert_eq!(m.body, e.body.to_vec());
        assert_eq!(m.content_type.as_deref(), Some(JSON));
        assert_eq!(m.creation_time_ms, Some(e.commit_time_micros / 1000));
        assert_eq!(m.text("aggregate_type"), Some("order"));
        assert_eq!(m.text("aggregate_id"), Some(format!("{}", k % 7).as_str()));
        assert_eq!(m.text("event_type"), Some("created"));
        assert_eq!(m.text("table"), Some("public.orders"));
        assert_eq!(
            m.text("commit_lsn"),
            Some(e.commit_lsn.to_string().as_str())
        );
        assert_eq!(m.number("tx_index"), Some(e.index));
        assert_eq!(m.number("xid"), Some(u64::from(e.xid)));
        // The headers column's keys: a JSON number as its text.
        assert_eq!(m.text("seq"), Some(k.to_string().as_str()));
        assert_eq!(m.text("traceparent"), Some(format!("00-t-{k}-01").as_str()));
        assert_eq!(m.text("origin"), Some("test"));
        assert_eq!(m.text("x-outbox-producer"), Some("relay-order/tl1"));
        assert_eq!(
            m.number("x-outbox-publishing-id"),
            Some(publishing_id(e.commit_lsn, e.index).unwrap())
        );
        assert_eq!(m.text("x-outbox-source"), Some("test/relay-order"));
        assert_eq!(m.number("x-outbox-timeline"), Some(1));
        assert_eq!(m.application_properties.len(), 14, "{m:?}");
    }
    stream.delete().await;
}
