//! The CloudEvents format (`[message] format = "cloudevents"`, binary mode): its
//! attributes beside the native format, with NULL columns and the builder's caches.

use super::*;
use crate::message::cloudevents::{CloudEventsFormat, DEFAULT_SOURCE};

fn ce_builder(prefix: &str) -> MessageBuilder {
    let format = CloudEventsFormat::new(DEFAULT_SOURCE, "app", prefix).unwrap();
    MessageBuilder::new("{aggregate_type}.{event_type}", &[])
        .unwrap()
        .with_format(&MessageFormat::CloudEvents(format))
}

#[test]
fn native_is_the_default_and_adds_no_attribute() {
    assert_eq!(MessageFormat::default(), MessageFormat::Native);
    assert_eq!(MessageFormat::Native.name(), "native");
    let mut b = MessageBuilder::new("k", &[])
        .unwrap()
        .with_format(&MessageFormat::Native);
    let m = b.build(&event(JSON, Some(b"{}")));
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    assert!(
        h.keys().all(|k| !k.as_str().starts_with("cloudEvents")),
        "{h:?}"
    );
}

#[test]
fn cloudevents_attributes_in_binary_mode() {
    let mut b = ce_builder("com.example.");
    let mut e = event(JSON, Some(br#"{"a": 1}"#));
    e.headers = Some(Bytes::from_static(
        br#"{"cloudEvents:id":"spoof","cloudEvents_type":"spoof","cloudEvents:traceparent":"00-1-2-01","tenant":"t"}"#,
    ));
    let m = b.build(&e);
    // The body stays the payload, datacontenttype is the content-type property.
    assert_eq!(m.body.as_ref(), br#"{"a": 1}"#);
    assert_eq!(
        b.properties_of(&m)
            .content_type()
            .as_ref()
            .unwrap()
            .as_str(),
        "application/json"
    );
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    assert_eq!(text(h.get("cloudEvents:specversion")), "1.0");
    assert_eq!(
        text(h.get("cloudEvents:id")),
        "6f1c2a4e-0000-4000-8000-000000000001"
    );
    assert_eq!(
        text(h.get("cloudEvents:source")),
        "/outbox-relay/app/public.outbox"
    );
    assert_eq!(text(h.get("cloudEvents:type")), "com.example.created");
    assert_eq!(
        text(h.get("cloudEvents:time")),
        "2023-11-14T22:13:20.123456Z"
    );
    assert_eq!(text(h.get("cloudEvents:subject")), "42");
    // A headers-column key for an attribute the relay sets is dropped; another
    // `cloudEvents:` key is an extension attribute and kept.
    assert!(h.get("cloudEvents_type").is_none());
    assert_eq!(text(h.get("cloudEvents:traceparent")), "00-1-2-01");
    assert_eq!(text(h.get("tenant")), "t");
    // The native headers and properties stay (operations and existing consumers).
    assert_eq!(text(h.get("event_type")), "created");
    assert_eq!(text(h.get("commit_lsn")), "1/A0");
    assert_eq!(h.get("tx_index"), Some(&AMQPValue::LongLongInt(3)));
    assert_eq!(h.len(), 7 + 2 + 6);
    assert_eq!(
        b.properties_of(&m).message_id().as_ref().unwrap().as_str(),
        "6f1c2a4e-0000-4000-8000-000000000001"
    );
    assert_eq!(returned_key(&b.properties_of(&m)), Some(m.key()));
}

#[test]
fn cloudevents_null_columns_and_caches() {
    let mut b = ce_builder("");
    let mut e = event(BINARY, None);
    e.id = None;
    e.aggregate_id = None;
    e.headers = None;
    let m = b.build(&e);
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    // No id column value: the event's position, stable across publishes.
    assert_eq!(text(h.get("cloudEvents:id")), "1/A0:3");
    assert_eq!(text(h.get("cloudEvents:type")), "created");
    assert!(h.get("cloudEvents:subject").is_none());

    // Another table and commit time: the cached source and time are not reused.
    let mut other = event(JSON, None);
    other.table = Arc::new(OutboxTable {
        qualified_name: "billing.outbox".into(),
        ..(*table(JSON)).clone()
    });
    other.commit_time_micros += 1;
    let m = b.build(&other);
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    assert_eq!(
        text(h.get("cloudEvents:source")),
        "/outbox-relay/app/billing.outbox"
    );
    assert_eq!(
        text(h.get("cloudEvents:time")),
        "2023-11-14T22:13:20.123457Z"
    );
    let m = b.build(&e);
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    assert_eq!(
        text(h.get("cloudEvents:source")),
        "/outbox-relay/app/public.outbox"
    );
    assert_eq!(
        text(h.get("cloudEvents:time")),
        "2023-11-14T22:13:20.123456Z"
    );
}
