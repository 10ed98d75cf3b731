//! The example consumer continues the trace (docs/tracing.md): a delivery whose
//! `traceparent` header names the relay's span gets a `process` span (kind
//! CONSUMER) that is its child, exported over OTLP/HTTP to a receiver built on the
//! OTLP protobuf definitions (testkit::otlp).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use inbox_consumer::{connect_postgres, init_schema, run, Config, Stats};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use testkit::amqp::TestBroker;
use testkit::otlp::Receiver;
use testkit::TestDb;

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const RELAY_SPAN: &str = "b7ad6b7169203331";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_span_is_the_child_of_the_messages_traceparent() {
    let receiver = Receiver::start().await.unwrap();
    // The only test of this binary: the process-wide variables are its own.
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint());
    std::env::set_var("OTEL_SERVICE_NAME", "inbox-under-test");
    let provider = inbox_consumer::trace::init_otlp()
        .unwrap()
        .expect("the endpoint is set");

    let db = TestDb::new("inbox_trace");
    init_schema(&connect_postgres(&db.url()).await.unwrap())
        .await
        .unwrap();
    let mut broker = TestBroker::connect().await;
    let exchange = broker.exchange_name("outbox");
    broker.declare_exchange(&exchange, "topic").await;
    let queue = broker.queue_bound(&exchange, "#").await;
    let channel = broker.connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(LongString::from(format!("00-{TRACE}-{RELAY_SPAN}-01"))),
    );
    let id = uuid::Uuid::new_v4().to_string();
    channel
        .basic_publish(
            exchange.as_str().into(),
            "order.placed".into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let config = Config {
        amqp_url: testkit::amqp_url(),
        queue: queue.clone(),
        postgres_url: db.url(),
        consumer_name: "trace".into(),
        prefetch: 10,
        declare: None,
        init: false,
        exit_after_commit: None,
        exit_when_idle: Some(Duration::from_millis(1500)),
    };
    let stats = Arc::new(Stats::default());
    tokio::time::timeout(
        Duration::from_secs(60),
        run(&config, stats.clone(), std::future::pending()),
    )
    .await
    .expect("the consumer returns once the queue is idle")
    .unwrap();
    // Sends what the batch processor holds.
    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .unwrap()
        .unwrap();

    let spans = receiver
        .wait_for(Duration::from_secs(30), |s| !s.is_empty())
        .await;
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let span = &spans[0];
    assert_eq!(span.name, format!("process {queue}"));
    assert_eq!(span.kind, 5, "CONSUMER");
    assert_eq!(span.trace_id, TRACE);
    assert_eq!(span.parent_span_id, RELAY_SPAN);
    assert_eq!(span.service_name, "inbox-under-test");
    assert_eq!(span.attributes["messaging.message.id"], id);
    broker.cleanup().await;
}
