#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::AMQPValue;
use bytes::Bytes;
use outbox_event::{Lsn, OutboxEvent, OutboxTable};

use super::*;
use crate::amqp::engine::{DeadLetterReason, EventKey};
use crate::amqp::message::*;

const JSON: &str = "application/json";
const BINARY: &str = "application/octet-stream";

/// The reader's table (the publisher reads only its name and content type).
fn table(content_type: &'static str) -> Arc<OutboxTable> {
    Arc::new(OutboxTable {
        qualified_name: "public.outbox".into(),
        schema: "public".into(),
        name: "outbox".into(),
        payload_type: 0,
        headers_type: None,
        content_type,
    })
}

fn event(content_type: &'static str, payload: Option<&'static [u8]>) -> OutboxEvent {
    OutboxEvent {
        table: table(content_type),
        xid: 4242,
        commit_lsn: Lsn(0x1_0000_00A0),
        commit_time_micros: 1_700_000_000_123_456,
        index: 3,
        id: Some(Bytes::from_static(b"6f1c2a4e-0000-4000-8000-000000000001")),
        aggregate_type: Some(Bytes::from_static(b"order")),
        aggregate_id: Some(Bytes::from_static(b"42")),
        event_type: Some(Bytes::from_static(b"created")),
        payload: payload.map(Bytes::from_static),
        body: payload.map(Bytes::from_static).unwrap_or_default(),
        headers: Some(Bytes::from_static(
            br#"{"traceparent":"00-abc-def-01","n":5,"o":{"a":[1,true]},"aggregate_type":"spoof"}"#,
        )),
        correlation_id: None,
        exchange: None,
        properties: Vec::new(),
        malformed: None,
    }
}

/// The properties of a dead-letter copy.
fn fixed(m: &OutboundMessage) -> &BasicProperties {
    m.fixed_properties
        .as_ref()
        .expect("a dead-letter copy has fixed properties")
}

fn text(v: Option<&AMQPValue>) -> String {
    match v {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("not a long string: {other:?}"),
    }
}

/// A message is published again after a failure with properties built again from its
/// event (nothing else is kept): every build must give the same properties, whatever
/// was built in between (the builder's caches key on the table and the commit time).
#[test]
fn properties_are_the_same_at_every_publish() {
    let other_table = |mut e: OutboxEvent| {
        e.table = Arc::new(OutboxTable {
            qualified_name: "billing.outbox".into(),
            ..(*e.table).clone()
        });
        e.commit_time_micros += 1_000_001;
        e.index += 1;
        e
    };
    let builders = [
        MessageBuilder::new("{aggregate_type}", &[("replay".into(), "true".into())]).unwrap(),
        MessageBuilder::new("k", &[])
            .unwrap()
            .with_headers(HeaderProfile::Minimal),
        MessageBuilder::new("k", &[])
            .unwrap()
            .with_format(&MessageFormat::CloudEvents(
                cloudevents::CloudEventsFormat::with_default_source("app", "com.example."),
            )),
    ];
    for mut b in builders {
        let cold = b.clone();
        let first = b.build(&event(JSON, Some(br#"{"a": 1}"#)));
        let before = b.properties_of(&first);
        let second = b.build(&other_table(event(BINARY, Some(b"\x00"))));
        let between = b.properties_of(&second);
        assert_ne!(before, between);
        assert_eq!(b.properties_of(&first), before);
        assert_eq!(cold.clone().properties_of(&second), between);
        assert_eq!(cold.clone().properties_of(&first), before);
        let copy = first.dead_letter_copy(
            before.clone(),
            "main",
            &DeadLetterReason::Unroutable {
                exchange: "main".into(),
                routing_key: "k".into(),
            },
        );
        let fixed = b.properties_of(&copy);
        assert_ne!(fixed, before);
        assert_eq!(b.properties_of(&copy), fixed);
    }
}

#[test]
fn routing_key_template() {
    let t = RoutingKeyTemplate::parse("{aggregate_type}.{event_type}").unwrap();
    assert_eq!(t.render(&event(JSON, None)), "order.created");
    let t = RoutingKeyTemplate::parse("x.{table}:{aggregate_id}-").unwrap();
    assert_eq!(t.render(&event(JSON, None)), "x.public.outbox:42-");
    let t = RoutingKeyTemplate::parse("fixed").unwrap();
    assert_eq!(t.render(&event(JSON, None)), "fixed");
    let mut e = event(JSON, None);
    e.aggregate_type = None;
    let t = RoutingKeyTemplate::parse("{aggregate_type}.{event_type}").unwrap();
    assert_eq!(t.render(&e), ".created");
    assert!(RoutingKeyTemplate::parse("{nope}").is_err());
    assert!(RoutingKeyTemplate::parse("a.{event_type").is_err());
    assert_eq!(
        RoutingKeyTemplate::parse("a}"),
        Err(RoutingKeyError::StrayClose)
    );
    assert_eq!(
        RoutingKeyTemplate::parse("{nope}"),
        Err(RoutingKeyError::Unknown("nope".into()))
    );
    let long = "é".repeat(200);
    let t = RoutingKeyTemplate::parse(&long).unwrap();
    let key = t.render(&e);
    assert!(key.len() <= 255 && key.len() >= 254);
}

#[test]
fn headers_and_properties() {
    let mut b = MessageBuilder::new(
        "{aggregate_type}.{event_type}",
        &[("replay".into(), "true".into())],
    )
    .unwrap();
    let mut e = event(JSON, Some(br#"{"a": 1}"#));
    e.correlation_id = Some(Bytes::from_static(b"corr-1"));
    let m = b.build(&e);
    assert_eq!(m.routing_key.as_str(), "order.created");
    assert_eq!(m.body.as_ref(), br#"{"a": 1}"#);
    let p = &b.properties_of(&m);
    assert_eq!(
        p.message_id().as_ref().unwrap().as_str(),
        "6f1c2a4e-0000-4000-8000-000000000001"
    );
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    assert_eq!(*p.timestamp(), Some(1_700_000_000));
    assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
    assert_eq!(p.correlation_id().as_ref().unwrap().as_str(), "corr-1");
    let h = p.headers().as_ref().unwrap().inner();
    assert_eq!(text(h.get("aggregate_type")), "order");
    assert_eq!(text(h.get("aggregate_id")), "42");
    assert_eq!(text(h.get("event_type")), "created");
    assert_eq!(text(h.get("outbox_table")), "public.outbox");
    assert_eq!(text(h.get("commit_lsn")), "1/A0");
    assert_eq!(h.get("xid"), Some(&AMQPValue::LongLongInt(4242)));
    assert_eq!(text(h.get("traceparent")), "00-abc-def-01");
    assert_eq!(text(h.get("n")), "5");
    assert_eq!(text(h.get("o")), r#"{"a":[1,true]}"#);
    assert_eq!(text(h.get("replay")), "true");
    assert_eq!(h.get("tx_index"), Some(&AMQPValue::LongLongInt(3)));
    assert_eq!(h.len(), 11);
    assert_eq!(
        returned_key(p),
        Some(EventKey {
            commit_lsn: Lsn(0x1_0000_00A0),
            index: 3
        })
    );

    // Cached table value is reused and still right for another table.
    let mut other = event(BINARY, None);
    other.table = Arc::new(OutboxTable {
        qualified_name: "s.t".into(),
        ..(*table(BINARY)).clone()
    });
    other.headers = Some(Bytes::from_static(b"not json"));
    let m = b.build(&other);
    let mp = b.properties_of(&m);
    let h = mp.headers().as_ref().unwrap().inner();
    assert_eq!(text(h.get("outbox_table")), "s.t");
    assert_eq!(h.len(), 8);
    assert!(b.properties_of(&m).correlation_id().is_none());
    assert_eq!(
        b.properties_of(&m)
            .content_type()
            .as_ref()
            .unwrap()
            .as_str(),
        "application/octet-stream"
    );
    assert!(m.body.is_empty());
}

#[test]
fn minimal_headers_keep_what_the_relay_and_consumers_need() {
    let mut b = MessageBuilder::new(
        "{aggregate_type}.{event_type}",
        &[("replay".into(), "true".into())],
    )
    .unwrap()
    .with_headers(HeaderProfile::Minimal);
    let mut e = event(JSON, Some(b"{}"));
    e.headers = Some(Bytes::from_static(br#"{"traceparent":"00-abc-def-01"}"#));
    let m = b.build(&e);
    // The routing key and the properties do not depend on the profile.
    assert_eq!(m.routing_key.as_str(), "order.created");
    let p = &b.properties_of(&m);
    assert_eq!(
        p.message_id().as_ref().unwrap().as_str(),
        "6f1c2a4e-0000-4000-8000-000000000001"
    );
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
    assert_eq!(*p.timestamp(), Some(1_700_000_000));
    let h = p.headers().as_ref().unwrap().inner();
    let mut keys: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "commit_lsn",
            "event_type",
            "replay",
            "traceparent",
            "tx_index"
        ]
    );
    assert_eq!(text(h.get("commit_lsn")), "1/A0");
    // A returned copy is still matched to its event.
    assert_eq!(
        returned_key(p),
        Some(EventKey {
            commit_lsn: Lsn(0x1_0000_00A0),
            index: 3
        })
    );
    // A refused message's notice keeps the headers the message had.
    let notice = m.dead_letter_copy(
        b.properties_of(&m),
        "dlx",
        &DeadLetterReason::Refused {
            reason: "too large".into(),
        },
    );
    let h = fixed(&notice).headers().as_ref().unwrap().inner();
    for key in ["commit_lsn", "tx_index", "event_type", "replay"] {
        assert!(h.contains_key(key), "{key} missing from {h:?}");
    }
    assert!(!h.contains_key("traceparent"));
    assert_eq!(HeaderProfile::Minimal.name(), "minimal");
    assert_eq!(HeaderProfile::default(), HeaderProfile::Full);
}

mod reserved_tests {
    use super::*;

    fn event(headers: &'static [u8]) -> OutboxEvent {
        OutboxEvent {
            table: Arc::new(OutboxTable {
                qualified_name: "public.outbox".into(),
                schema: "public".into(),
                name: "outbox".into(),
                payload_type: 0,
                headers_type: None,
                content_type: "application/json",
            }),
            xid: 7,
            commit_lsn: Lsn(0x10),
            commit_time_micros: 0,
            index: 0,
            id: Some(Bytes::from_static(b"id-1")),
            aggregate_type: Some(Bytes::from_static(b"order")),
            aggregate_id: Some(Bytes::from_static(b"1")),
            event_type: Some(Bytes::from_static(b"created")),
            payload: Some(Bytes::from_static(b"{}")),
            body: Bytes::from_static(b"{}"),
            headers: Some(Bytes::from_static(headers)),
            correlation_id: None,
            exchange: None,
            properties: Vec::new(),
            malformed: None,
        }
    }

    #[test]
    fn reserved_keys_of_the_headers_column_are_dropped() {
        let mut b = MessageBuilder::new("k", &[]).unwrap();
        let m = b.build(&event(
        br#"{"CC":"x","BCC":["y"],"x-death":1,"x-first-death-queue":"q","x-outbox-error":"spoof","x-original-exchange":"e","cc":"kept","x-delay":5}"#,
    ));
        let mp = b.properties_of(&m);
        let h = mp.headers().as_ref().unwrap().inner();
        for key in [
            "CC",
            "BCC",
            "x-death",
            "x-first-death-queue",
            "x-outbox-error",
            "x-original-exchange",
        ] {
            assert!(h.get(key).is_none(), "{key} was copied");
        }
        assert!(h.get("cc").is_some());
        assert!(h.get("x-delay").is_some());
    }

    /// The relay's own headers are reserved in every header mode: with
    /// `headers = "minimal"` the relay does not write `aggregate_type`,
    /// `aggregate_id`, `outbox_table` or `xid`, and a row's headers column must not
    /// either (a consumer would take them for the relay's); with `full` the
    /// relay's own values stand.
    #[test]
    fn a_row_never_sets_the_relays_own_headers_in_any_mode() {
        let row = br#"{"aggregate_type":"forged","aggregate_id":"forged","outbox_table":"forged","xid":1,"event_type":"forged","commit_lsn":"forged","tx_index":99,"tenant":"a"}"#;
        for profile in [HeaderProfile::Minimal, HeaderProfile::Full] {
            let mut b = MessageBuilder::new("k", &[]).unwrap().with_headers(profile);
            let m = b.build(&event(row));
            let p = b.properties_of(&m);
            let h = p.headers().as_ref().unwrap().inner();
            assert_eq!(text(h.get("tenant")), "a");
            for (key, value) in h {
                let forged = match value {
                    AMQPValue::LongString(s) => s.as_bytes() == b"forged",
                    AMQPValue::LongLongInt(n) => key.as_str() == "tx_index" && *n == 99,
                    _ => false,
                };
                assert!(!forged, "{profile:?}: the row set {key}");
            }
            let descriptive = ["aggregate_type", "aggregate_id", "outbox_table", "xid"];
            for key in descriptive {
                let written = h.contains_key(key);
                assert_eq!(
                    written,
                    profile == HeaderProfile::Full,
                    "{profile:?}: {key}"
                );
            }
            assert_eq!(text(h.get("event_type")), "created");
            assert_eq!(text(h.get("commit_lsn")), "0/10");
        }
    }

    /// A property key spelled with JSON escapes is the property: refused (poison,
    /// named) when its value is invalid, and never copied as a header.
    #[test]
    fn an_escaped_property_key_is_checked_and_not_a_header() {
        let bad = event(br#"{"pri\u006frity": 300}"#);
        let e = MessageBuilder::check_row_properties(&bad).expect_err("priority 300 passed");
        assert!(e.contains("\"priority\""), "{e}");
        let mut b = MessageBuilder::new("k", &[]).unwrap();
        let m = b.build(&event(br#"{"pri\u006frity": 4, "tenant": "a"}"#));
        let p = b.properties_of(&m);
        assert_eq!(*p.priority(), Some(4));
        let h = p.headers().as_ref().unwrap().inner();
        assert!(
            !h.contains_key("priority") && h.contains_key("tenant"),
            "{h:?}"
        );
    }

    #[test]
    fn dead_letter_copies() {
        let mut b = MessageBuilder::new("k", &[("replay".into(), "true".into())]).unwrap();
        let m = b.build(&event(br#"{"tenant":"a"}"#));
        let text = |m: &OutboundMessage, k: &str| match fixed(m)
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .get(k)
        {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k}: {other:?}"),
        };
        let copy = m.dead_letter_copy(
            b.properties_of(&m),
            "main",
            &DeadLetterReason::Unroutable {
                exchange: "main".into(),
                routing_key: "k".into(),
            },
        );
        assert_eq!(copy.body, m.body);
        assert_eq!(text(&copy, "x-outbox-error"), "unroutable");
        assert_eq!(text(&copy, "x-original-routing-key"), "k");
        assert_eq!(text(&copy, "tenant"), "a");
        assert_eq!(returned_key(fixed(&copy)), Some(m.key()));

        let notice = m.dead_letter_copy(
            b.properties_of(&m),
            "main",
            &DeadLetterReason::Refused {
                reason: "too large".into(),
            },
        );
        assert!(notice.body.is_empty());
        assert!(text(&notice, "x-outbox-error").contains("too large"));
        assert_eq!(text(&notice, "replay"), "true");
        let h = fixed(&notice).headers().as_ref().unwrap().inner();
        assert!(h.get("tenant").is_none());
        assert_eq!(
            h.get("x-outbox-body-bytes"),
            Some(&AMQPValue::LongLongInt(2))
        );
        assert_eq!(
            fixed(&notice).message_id().as_ref().unwrap().as_str(),
            "id-1"
        );
        assert_eq!(returned_key(fixed(&notice)), Some(m.key()));
    }
}

mod cloudevents_tests;

/// A dead-letter notice that cannot be framed (a 200 KB aggregate id copied into its
/// headers) is cut down until it fits (issue 49): level 1 cuts every header value to
/// 255 bytes, level 2 keeps only what names the event and says why; both keep the
/// message id and say `x-outbox-truncated`. It used to be held as poison even with a
/// dead-letter exchange.
#[test]
fn a_notice_too_large_to_frame_is_cut_down_and_still_names_the_event() {
    let mut e = event(JSON, Some(b"{}"));
    e.aggregate_id = Some(Bytes::from("i".repeat(200_000)));
    let mut b = MessageBuilder::new(DEFAULT_ROUTING_KEY, &[]).unwrap();
    let m = b.build_owned(e);
    let notice = m.dead_letter_copy(
        b.properties_of(&m),
        "outbox",
        &DeadLetterReason::Refused {
            reason: "its headers take a frame of 200,300 bytes".into(),
        },
    );
    let size = |m: &OutboundMessage| {
        let mut out = Vec::new();
        let header = amq_protocol::frame::AMQPFrame::Header(
            1,
            amq_protocol::frame::AMQPContentHeader {
                class_id: 60,
                body_size: m.body.len() as u64,
                properties: fixed(m).clone(),
            },
        );
        crate::amqp::connection::frame::encode(&mut out, &header).unwrap();
        out.len()
    };
    assert!(
        size(&notice) > 131_072,
        "the notice as it was is over any frame"
    );
    for level in [1, 2] {
        let small = notice.shrunk(level);
        assert!(size(&small) < 4096, "level {level}: {} bytes", size(&small));
        let p = fixed(&small);
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str()),
            Some("6f1c2a4e-0000-4000-8000-000000000001")
        );
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(h.get("x-outbox-truncated"), Some(&AMQPValue::Boolean(true)));
        assert!(text(h.get("x-outbox-error")).contains("200,300 bytes"));
        assert_eq!(text(h.get("commit_lsn")), "1/A0");
    }
    let h1 = fixed(&notice.shrunk(1)).headers().clone().unwrap();
    assert_eq!(
        text(h1.inner().get("aggregate_id")).len(),
        255,
        "cut, not dropped, at level 1"
    );
}
