//! OpenTelemetry spans per event (docs/tracing.md): the real binary exporting to an
//! OTLP/HTTP receiver built on the OTLP protobuf definitions (`testkit::otlp`).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use support::*;
use testkit::otlp::{Receiver, Span};

const WAIT: Duration = Duration::from_secs(90);

const PARENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// One span per event; its parent is the row's `traceparent` when the row has a
/// valid one, else it starts a trace; the delivered message's `traceparent` is the
/// span's own context; the attributes follow the messaging conventions.
#[tokio::test]
async fn each_event_gets_a_publish_span_whose_context_the_message_carries() {
    let _shared = testkit::BROKER.read().await;
    let receiver = Receiver::start().await.unwrap();
    let mut env = Env::new().await;
    env.extra = format!("[tracing]\nendpoint = {:?}\n", receiver.endpoint());
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &[("OTEL_SERVICE_NAME", "relay-under-test")]);

    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('00000000-0000-0000-0000-00000000000a', 'order', 'o-1', 'created', '{{}}',
            '{{\"traceparent\": \"00-{PARENT_TRACE}-{PARENT_SPAN}-01\", \"tracestate\": \"vendor=1\", \"tenant\": \"acme\"}}'),
           ('00000000-0000-0000-0000-00000000000b', 'order', 'o-1', 'paid', '{{}}', NULL),
           ('00000000-0000-0000-0000-00000000000c', 'order', 'o-1', 'shipped', '{{}}',
            '{{\"traceparent\": \"00-not-a-trace-01\"}}')"
    ));
    let msgs = got.wait_for(3, WAIT).await;
    let spans = receiver
        .wait_for(WAIT, |s| {
            s.iter().filter(|s| s.name.starts_with("publish ")).count() >= 3
        })
        .await;
    let by_id: HashMap<String, &Span> = spans
        .iter()
        .map(|s| (s.attributes["messaging.message.id"].clone(), s))
        .collect();
    assert_eq!(
        spans.len(),
        3,
        "one span per event: {spans:#?}\n{}",
        relay.log_text()
    );
    assert_eq!(by_id.len(), 3, "{spans:#?}");

    for m in &msgs {
        let id = m.message_id();
        let span = by_id[&id];
        assert_eq!(span.name, format!("publish {}", env.exchange));
        assert_eq!(span.kind, 4, "PRODUCER");
        assert_eq!(span.service_name, "relay-under-test");
        let a = &span.attributes;
        assert_eq!(a["messaging.system"], "rabbitmq");
        assert_eq!(a["messaging.operation.name"], "publish");
        assert_eq!(a["messaging.destination.name"], env.exchange);
        assert_eq!(
            a["messaging.rabbitmq.destination.routing_key"],
            m.routing_key
        );
        assert_eq!(a["outbox.commit_lsn"], m.header("commit_lsn").unwrap());
        assert_eq!(a["outbox.table"], "public.outbox");
        assert!(span.end_unix_nanos >= span.start_unix_nanos);
        // The message carries the relay's span, sampled.
        assert_eq!(
            m.header("traceparent").unwrap(),
            format!("00-{}-{}-01", span.trace_id, span.span_id),
            "message {id}"
        );
    }
    let child = by_id["00000000-0000-0000-0000-00000000000a"];
    assert_eq!(child.trace_id, PARENT_TRACE);
    assert_eq!(child.parent_span_id, PARENT_SPAN);
    let a = msgs.iter().find(|m| m.message_id().ends_with('a')).unwrap();
    assert_eq!(a.header("tracestate").as_deref(), Some("vendor=1"));
    assert_eq!(a.header("tenant").as_deref(), Some("acme"));
    // Without a traceparent, or with a malformed one: a new trace each.
    let roots: Vec<&Span> = ["b", "c"]
        .iter()
        .map(|k| by_id[&format!("00000000-0000-0000-0000-00000000000{k}")])
        .collect();
    for root in &roots {
        assert_eq!(root.parent_span_id, "", "{root:#?}");
        assert_ne!(root.trace_id, PARENT_TRACE);
        assert_eq!(root.trace_id.len(), 32);
    }
    assert_ne!(roots[0].trace_id, roots[1].trace_id);

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

/// A receiver that accepts connections and never answers (each export waits 30 s
/// for it): every event is still delivered, promptly, while spans are dropped and
/// counted. A publisher that waited for the export queue would take minutes.
#[tokio::test]
async fn a_silent_receiver_costs_spans_not_events() {
    let _shared = testkit::BROKER.read().await;
    // Accepts and holds every connection without reading or answering.
    let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", sink.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = sink.accept().await {
            held.push(stream);
        }
    });
    let mut env = Env::new().await;
    env.extra = format!("[tracing]\nendpoint = {endpoint:?}\nmax_queue_size = 100\n");
    env.create_slot();
    let got = env.consumer().await;
    let metrics = testkit::free_addr();
    let relay = env.start_env(
        &[],
        &[
            ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", metrics.as_str()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "30000"),
        ],
    );

    let started = Instant::now();
    env.insert_seq(1, 3000, 100);
    let msgs = got.wait_for(3000, WAIT).await;
    check_sequence(&msgs, 3000);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "3000 events took {:?} with a silent receiver",
        started.elapsed()
    );
    let dropped = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("outbox_relay_trace_spans_dropped_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let body = http_get(&metrics, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        if dropped(&body) > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no span counted as dropped:\n{body}\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // While the export keeps failing, new events still go through at once.
    let started = Instant::now();
    env.insert_seq(3001, 200, 50);
    let msgs = got.wait_for(3200, WAIT).await;
    check_sequence(&msgs, 3200);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "200 events took {:?} with a silent receiver",
        started.elapsed()
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    hold.abort();
    env.cleanup().await;
}

/// `[tracing] attributes = "minimal"` and `respect_parent_sampled = false` through
/// the binary (docs/tracing.md): with `[rabbitmq] exchange` a template, a span
/// names no exchange a row chose (`publish`, with the template as
/// `messaging.destination.template`), and carries no message id and no routing
/// key; a row whose `traceparent` is not sampled is exported anyway, since
/// `sampling_ratio` (1.0) decides for every event, in the row's trace, and the
/// message's `traceparent` says sampled.
#[tokio::test]
async fn minimal_attributes_and_the_ratio_for_every_event() {
    let _shared = testkit::BROKER.read().await;
    let receiver = Receiver::start().await.unwrap();
    let mut env = Env::new().await;
    let template = format!("{}.{{aggregate_type}}", env.exchange);
    let exchange = format!("{}.order", env.exchange);
    env.extra = format!(
        "[tracing]\nendpoint = {:?}\nattributes = \"minimal\"\nrespect_parent_sampled = false\n",
        receiver.endpoint()
    );
    env.create_slot();
    env.broker.declare_exchange(&exchange, "topic").await;
    let queue = env.broker.queue_bound(&exchange, "#").await;
    let got = env.broker.consume(&queue).await;
    let relay = env.start_env(
        &[],
        &[("OUTBOX_RELAY_RABBITMQ_EXCHANGE", template.as_str())],
    );

    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('00000000-0000-0000-0000-00000000001a', 'order', 'customer-42', 'created', '{{}}',
            '{{\"traceparent\": \"00-{PARENT_TRACE}-{PARENT_SPAN}-00\"}}'),
           ('00000000-0000-0000-0000-00000000001b', 'order', 'customer-42', 'paid', '{{}}', NULL)"
    ));
    let msgs = got.wait_for(2, WAIT).await;
    let spans = receiver.wait_for(WAIT, |s| s.len() >= 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}\n{}", relay.log_text());
    for span in &spans {
        let a = &span.attributes;
        assert_eq!(span.name, "publish", "{span:#?}");
        assert_eq!(a["messaging.destination.template"], template);
        for key in [
            "messaging.destination.name",
            "messaging.message.id",
            "messaging.rabbitmq.destination.routing_key",
        ] {
            assert!(!a.contains_key(key), "{key} in {span:#?}");
        }
        let all = format!("{a:?}");
        assert!(
            !all.contains("customer-42") && !all.contains("0000001"),
            "{all}"
        );
        assert!(a.contains_key("outbox.commit_lsn"));
    }
    let child = spans.iter().find(|s| s.trace_id == PARENT_TRACE).unwrap();
    assert_eq!(child.parent_span_id, PARENT_SPAN);
    let m = msgs
        .iter()
        .find(|m| m.message_id().ends_with("1a"))
        .unwrap();
    assert_eq!(
        m.header("traceparent").unwrap(),
        format!("00-{PARENT_TRACE}-{}-01", child.span_id)
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
