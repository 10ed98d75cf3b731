#![allow(clippy::unwrap_used)]
use super::*;
use opentelemetry_sdk::trace::SpanData;
use outbox_event::{Lsn, OutboxTable};
use proptest::prelude::*;

/// A span processor that keeps the ended spans.
#[derive(Debug, Clone, Default)]
struct Collect(Arc<Mutex<Vec<SpanData>>>);

impl opentelemetry_sdk::trace::SpanProcessor for Collect {
    fn on_start(&self, _: &mut Span, _: &Context) {}
    fn on_end(&self, span: SpanData) {
        self.0.lock().unwrap().push(span);
    }
    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(
        &self,
        _: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
}

fn event() -> OutboxEvent {
    OutboxEvent {
        table: Arc::new(OutboxTable {
            qualified_name: "public.outbox".into(),
            schema: "public".into(),
            name: "outbox".into(),
            payload_type: 0,
            headers_type: None,
            content_type: "application/json",
        }),
        xid: 4242,
        commit_lsn: Lsn(0x1_0000_00A0),
        commit_time_micros: 1_700_000_000_123_456,
        index: 3,
        id: Some(Bytes::from_static(b"6f1c2a4e-0000-4000-8000-000000000001")),
        aggregate_type: Some(Bytes::from_static(b"order")),
        aggregate_id: Some(Bytes::from_static(b"42")),
        event_type: Some(Bytes::from_static(b"created")),
        payload: None,
        body: Bytes::new(),
        headers: None,
        correlation_id: None,
        exchange: None,
        properties: Vec::new(),
        malformed: None,
    }
}

const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[test]
fn a_valid_traceparent_round_trips() {
    let p = TraceParent::parse(VALID).expect("valid");
    assert_eq!(
        p.trace_id,
        TraceId::from(0x4bf92f3577b34da6a3ce929d0e0e4736u128)
    );
    assert_eq!(p.span_id, SpanId::from(0x00f067aa0ba902b7u64));
    assert!(p.flags.is_sampled());
    assert_eq!(p.format(), VALID);
    let unsampled = "00-0000000000000000000000000000000a-000000000000000b-00";
    assert_eq!(
        TraceParent::parse(unsampled).expect("valid").format(),
        unsampled
    );
}

#[test]
fn malformed_traceparents_are_ignored() {
    for bad in [
        "",
        "00",
        "00-abc-def-01",
        // upper-case hex
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        // all-zero trace id, all-zero span id
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        // version ff, version 00 with extra fields, bad separators
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
        "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473z-00f067aa0ba902b7-01",
        // a multi-byte character where a digit should be
        "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
    ] {
        assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
    }
    // A later version may add fields after a dash.
    assert!(TraceParent::parse(&format!("01{}-extra", &VALID[2..])).is_some());
}

#[test]
fn the_row_parent_comes_from_the_headers_column() {
    let headers = |s: &str| Bytes::from(s.to_string());
    let (p, state) = row_parent(Some(&headers(&format!(
        r#"{{"a":1,"traceparent":"{VALID}","tracestate":"vendor=x"}}"#
    ))))
    .expect("parent");
    assert_eq!(p.format(), VALID);
    assert_eq!(state.as_deref(), Some("vendor=x"));
    // Malformed: no parent (the span starts a new trace), never a failure.
    for bad in [
        r#"{"traceparent":"00-abc-def-01"}"#,
        r#"{"traceparent":5}"#,
        r#"["not an object"]"#,
        "not json",
        r#"{"tracestate":"vendor=x"}"#,
    ] {
        assert!(row_parent(Some(&headers(bad))).is_none(), "{bad}");
    }
    assert!(row_parent(None).is_none());
    // A tracestate that is not printable ASCII is not carried on.
    let (_, state) = row_parent(Some(&headers(&format!(
        r#"{{"traceparent":"{VALID}","tracestate":"a=\n"}}"#
    ))))
    .expect("parent");
    assert_eq!(state, None);
}

proptest! {
    #[test]
    fn any_text_parses_without_panicking(s in "\\PC{0,80}") {
        let _ = TraceParent::parse(&s);
        let _ = row_parent(Some(&Bytes::from(format!(r#"{{"traceparent":{}}}"#, serde_json::Value::String(s)))));
    }

    #[test]
    fn any_valid_context_round_trips(t in 1u128.., s in 1u64.., f in any::<u8>()) {
        let p = TraceParent { trace_id: TraceId::from(t), span_id: SpanId::from(s), flags: TraceFlags::new(f) };
        prop_assert_eq!(TraceParent::parse(&p.format()), Some(p));
    }
}

/// The span of an event: its parent from the row, its context in the message.
#[test]
fn an_event_span_is_the_child_of_the_rows_traceparent() {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    let exporter = Collect::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(exporter.clone())
        .build();
    let mut tracer = EventTracer::new(provider.tracer("test"));
    let mut event = event();
    event.headers = Some(Bytes::from(format!(r#"{{"traceparent":"{VALID}"}}"#)));
    let span = tracer.start(&event, "orders", Some("order.created"));
    let own = TraceParent::parse(span.traceparent()).expect("own context");
    assert_eq!(format!("{:032x}", own.trace_id), &VALID[3..35]);
    assert_ne!(format!("{:016x}", own.span_id), &VALID[36..52]);
    span.published();
    span.published();
    span.end();
    let spans = exporter.0.lock().expect("lock").clone();
    assert_eq!(spans.len(), 1);
    let s = &spans[0];
    assert_eq!(s.name, "publish orders");
    assert_eq!(s.span_kind, SpanKind::Producer);
    assert_eq!(format!("{:016x}", s.parent_span_id), &VALID[36..52]);
    assert_eq!(s.span_context.span_id(), own.span_id);
    assert_eq!(s.events.events.len(), 1, "one retry");
    // Without a traceparent: a new trace (no parent).
    event.headers = None;
    let root = tracer.start(&event, "orders", None);
    root.end();
    let spans = exporter.0.lock().expect("lock").clone();
    assert_eq!(spans[1].parent_span_id, SpanId::INVALID);
    assert_ne!(
        spans[1].span_context.trace_id(),
        TraceId::from(0x4bf92f3577b34da6a3ce929d0e0e4736u128)
    );
}

/// The values one span shares with the last (name, destination, table, commit LSN)
/// follow each event: a change of any of them shows in the next span.
#[test]
fn each_span_names_its_own_destination_table_and_transaction() {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    let exporter = Collect::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(exporter.clone())
        .build();
    let mut tracer = EventTracer::new(provider.tracer("test"));
    let first = event();
    let mut other = event();
    other.commit_lsn = outbox_event::Lsn(first.commit_lsn.0 + 0x100);
    other.table = Arc::new(OutboxTable {
        qualified_name: "billing.outbox".into(),
        ..(*first.table).clone()
    });
    let cases = [
        (&first, "orders"),
        (&first, "orders"),
        (&other, "orders"),
        (&other, "billing"),
        (&first, "orders"),
    ];
    for (event, to) in cases {
        tracer.start(event, to, None).end();
    }
    let spans = exporter.0.lock().expect("lock").clone();
    assert_eq!(spans.len(), cases.len());
    for (span, (event, to)) in spans.iter().zip(cases) {
        let attribute = |key: &str| {
            span.attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(span.name, format!("publish {to}"));
        assert_eq!(attribute(attributes::DESTINATION).as_deref(), Some(to));
        assert_eq!(
            attribute(attributes::TABLE),
            Some(event.table.qualified_name.clone())
        );
        assert_eq!(
            attribute(attributes::COMMIT_LSN),
            Some(event.commit_lsn.to_string())
        );
    }
}

/// A tracer exporting to `exporter`, with `options`.
fn tracer_with(exporter: &Collect, options: TraceOptions) -> EventTracer {
    use opentelemetry::trace::TracerProvider as _;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_span_processor(exporter.clone())
        .build();
    EventTracer::new(provider.tracer("test")).with_options(options)
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// `attributes = "minimal"`: no message id, no routing key, and a destination a
/// row chose is not named (the span is `publish`, with the configured template);
/// one the configuration names still is. `full` names everything.
#[test]
fn minimal_attributes_leave_out_what_rows_choose() {
    let exporter = Collect::default();
    let mut tracer = tracer_with(
        &exporter,
        TraceOptions {
            attributes: AttributeSet::Minimal,
            configured_destinations: vec!["dlx".into()],
            destination_template: Some("events.{aggregate_type}".into()),
            ..TraceOptions::default()
        },
    );
    tracer
        .start(&event(), "events.customer-42", Some("order.42"))
        .end();
    tracer.start(&event(), "dlx", Some("order.42")).end();
    let spans = exporter.0.lock().unwrap().clone();
    let row_chosen = &spans[0];
    assert_eq!(row_chosen.name, "publish");
    assert_eq!(attribute(row_chosen, attributes::DESTINATION), None);
    assert_eq!(
        attribute(row_chosen, attributes::DESTINATION_TEMPLATE).as_deref(),
        Some("events.{aggregate_type}")
    );
    assert_eq!(spans[1].name, "publish dlx");
    assert_eq!(
        attribute(&spans[1], attributes::DESTINATION).as_deref(),
        Some("dlx")
    );
    for span in &spans {
        assert_eq!(attribute(span, attributes::MESSAGE_ID), None);
        assert_eq!(attribute(span, attributes::ROUTING_KEY), None);
        let text = format!("{:?}", span.attributes);
        assert!(!text.contains("42") && !text.contains("6f1c2a4e"), "{text}");
        assert!(attribute(span, attributes::COMMIT_LSN).is_some());
    }
    // Full (the default): the same event names all of them.
    let exporter = Collect::default();
    let mut tracer = tracer_with(&exporter, TraceOptions::default());
    tracer
        .start(&event(), "events.customer-42", Some("order.42"))
        .end();
    let spans = exporter.0.lock().unwrap().clone();
    assert_eq!(spans[0].name, "publish events.customer-42");
    assert_eq!(
        attribute(&spans[0], attributes::ROUTING_KEY).as_deref(),
        Some("order.42")
    );
    assert!(attribute(&spans[0], attributes::MESSAGE_ID).is_some());
}

/// Every attribute value is at most 255 bytes, cut at a character boundary: the
/// message id (which the AMQP property cuts there too), the destination and the
/// span name made of it, the routing key, the table, an event's attributes.
#[test]
fn attribute_values_are_bounded_at_a_character_boundary() {
    let exporter = Collect::default();
    let mut tracer = tracer_with(&exporter, TraceOptions::default());
    let long = "é".repeat(200); // 400 bytes, two per character
    let mut e = event();
    e.id = Some(Bytes::from(format!("x{long}")));
    e.table = Arc::new(OutboxTable {
        qualified_name: format!("s.{long}"),
        ..(*e.table).clone()
    });
    let span = tracer.start(&e, &format!("x{long}"), Some(&format!("k{long}")));
    span.event(
        "dead_lettered",
        vec![KeyValue::new("exchange", format!("x{long}"))],
    );
    span.end();
    let spans = exporter.0.lock().unwrap().clone();
    let s = &spans[0];
    let mut values: Vec<String> = s.attributes.iter().map(|kv| kv.value.to_string()).collect();
    values.extend(
        s.events.events[0]
            .attributes
            .iter()
            .map(|kv| kv.value.to_string()),
    );
    for value in &values {
        assert!(value.len() <= MAX_ATTRIBUTE_BYTES, "{} bytes", value.len());
    }
    for key in [
        attributes::MESSAGE_ID,
        attributes::DESTINATION,
        attributes::ROUTING_KEY,
        attributes::TABLE,
    ] {
        let value = attribute(s, key).unwrap();
        assert!(
            value.len() >= MAX_ATTRIBUTE_BYTES - 1,
            "{key}: cut too short"
        );
    }
    assert_eq!(s.name.len(), "publish ".len() + MAX_ATTRIBUTE_BYTES);
}

/// `respect_parent_sampled`: on (the default), a row's sampled flag is followed
/// whatever `sampling_ratio` says; off, the ratio decides for every event, so a
/// row can neither force an export nor prevent one.
#[test]
fn respect_parent_sampled_off_applies_the_ratio_to_every_event() {
    let sampled = format!(r#"{{"traceparent":"{VALID}"}}"#);
    let unsampled = format!(r#"{{"traceparent":"{}00"}}"#, &VALID[..53]);
    let run = |respect: bool, ratio: f64, headers: &str| {
        let exporter = Collect::default();
        let mut tracer = tracer_with(
            &exporter,
            TraceOptions {
                respect_parent_sampled: respect,
                sampling_ratio: ratio,
                ..TraceOptions::default()
            },
        );
        let mut e = event();
        e.headers = Some(Bytes::from(headers.to_string()));
        let span = tracer.start(&e, "orders", None);
        let carried = span.traceparent().to_string();
        span.end();
        let exported = exporter.0.lock().unwrap().len();
        (exported, carried)
    };
    // Followed: exported at ratio 0, not exported at ratio 1.
    assert_eq!(run(true, 0.0, &sampled).0, 1);
    assert_eq!(run(true, 1.0, &unsampled).0, 0);
    // Not followed: the ratio decides; the span stays in the row's trace.
    let (exported, carried) = run(false, 0.0, &sampled);
    assert_eq!(exported, 0);
    assert!(carried.starts_with(&VALID[..36]) && carried.ends_with("-00"));
    let (exported, carried) = run(false, 1.0, &unsampled);
    assert_eq!(exported, 1);
    assert!(carried.ends_with("-01"), "{carried}");
    assert!(TraceOptions::default().respect_parent_sampled);
}
