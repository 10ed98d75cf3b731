//! OpenTelemetry spans with the stream target (docs/tracing.md): the real binary
//! publishing into a stream and exporting to an OTLP/HTTP receiver built on the OTLP
//! protobuf definitions (`testkit::otlp`).

use std::collections::HashMap;
use std::time::Duration;

use support::stream::{read_stream, stream_url};
use support::*;
use testkit::otlp::{Receiver, Span};

const WAIT: Duration = Duration::from_secs(90);
const QUIET: Duration = Duration::from_secs(2);

const PARENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// One `publish <stream>` span per event, ended at the stream's confirm: the child
/// of the row's `traceparent` when it has one, else a new trace; the message in the
/// stream carries the span's own context (and the row's `tracestate`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_into_a_stream_gets_a_publish_span_its_message_carries() {
    let receiver = Receiver::start().await.unwrap();
    let mut env = Env::new().await;
    env.extra = format!("[tracing]\nendpoint = {:?}\n", receiver.endpoint());
    let stream = testkit::unique_name("traced");
    env.create_slot();
    let relay = env.start_env(
        &[],
        &[
            ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.as_str()),
            ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url().as_str()),
        ],
    );
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('00000000-0000-0000-0000-0000000000d1', 'order', 'o-1', 'created', '{{}}',
            '{{\"traceparent\": \"00-{PARENT_TRACE}-{PARENT_SPAN}-01\", \"tracestate\": \"vendor=1\"}}'),
           ('00000000-0000-0000-0000-0000000000d2', 'order', 'o-1', 'paid', '{{}}', NULL)"
    ));
    let msgs = read_stream(&stream, 2, QUIET, WAIT).await;
    assert_eq!(msgs.len(), 2, "{}", relay.log_text());
    let spans = receiver
        .wait_for(WAIT, |s| {
            s.iter().filter(|s| s.name.starts_with("publish ")).count() >= 2
        })
        .await;
    assert_eq!(spans.len(), 2, "{spans:#?}\n{}", relay.log_text());
    let by_id: HashMap<String, &Span> = spans
        .iter()
        .map(|s| (s.attributes["messaging.message.id"].clone(), s))
        .collect();
    for m in &msgs {
        let id = m.message_id.clone().unwrap();
        let span = by_id[&id];
        assert_eq!(span.name, format!("publish {stream}"));
        assert_eq!(span.kind, 4, "PRODUCER");
        assert_eq!(span.attributes["messaging.system"], "rabbitmq");
        assert_eq!(span.attributes["messaging.destination.name"], stream);
        assert!(
            !span
                .attributes
                .contains_key("messaging.rabbitmq.destination.routing_key"),
            "{span:#?}"
        );
        assert_eq!(
            span.attributes["outbox.commit_lsn"],
            m.prop("commit_lsn").unwrap()
        );
        assert!(span.end_unix_nanos >= span.start_unix_nanos);
        assert_eq!(
            m.prop("traceparent").unwrap(),
            format!("00-{}-{}-01", span.trace_id, span.span_id),
            "message {id}"
        );
    }
    let child = by_id["00000000-0000-0000-0000-0000000000d1"];
    assert_eq!(child.trace_id, PARENT_TRACE);
    assert_eq!(child.parent_span_id, PARENT_SPAN);
    assert_eq!(msgs[0].prop("tracestate"), Some("vendor=1"));
    let root = by_id["00000000-0000-0000-0000-0000000000d2"];
    assert_eq!(root.parent_span_id, "");
    assert_ne!(root.trace_id, PARENT_TRACE);

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    support::stream::delete_stream(&stream).await;
    env.cleanup().await;
}
