use super::*;

#[test]
fn parses_stream_urls() {
    let e = Endpoint::parse("rabbitmq-stream://relay:p%40ss@mq1:5553/prod").expect("valid");
    assert_eq!(
        e,
        Endpoint {
            tls: false,
            user: "relay".into(),
            password: "p@ss".into(),
            host: "mq1".into(),
            port: 5553,
            vhost: "prod".into(),
        }
    );
    let e = Endpoint::parse("rabbitmq-stream+tls://mq1").expect("valid");
    assert!(e.tls);
    assert_eq!(e.port, 5551);
    assert_eq!(e.vhost, "/");
    assert_eq!(e.user, "guest");
    let e = Endpoint::parse("rabbitmq-stream://u:p@h:5552/%2f").expect("valid");
    assert_eq!(e.vhost, "/");
    let err = Endpoint::parse("amqp://u:secret@h/").expect_err("wrong scheme");
    let text = err.to_string();
    assert!(text.contains("--stream-url"), "{text}");
    assert!(!text.contains("secret"), "{text}");
    let err = Endpoint::parse("rabbitmq-stream://u:secret@h:port/").expect_err("port");
    assert!(!err.to_string().contains("secret"), "{err}");
}

#[test]
fn redacts_passwords() {
    assert_eq!(
        redact("rabbitmq-stream://guest:secret@127.0.0.1:5552/%2f"),
        "rabbitmq-stream://guest:***@127.0.0.1:5552/%2f"
    );
    assert_eq!(
        redact("host=db user=app password=hunter2 dbname=app"),
        "host=db user=app password=*** dbname=app"
    );
}

#[test]
fn starts_after_the_stored_offset() {
    assert!(matches!(start_at(None), OffsetSpecification::First));
    assert!(matches!(
        start_at(Some(41)),
        OffsetSpecification::Offset(42)
    ));
    assert!(matches!(start_at(Some(0)), OffsetSpecification::Offset(1)));
}

#[test]
fn reads_relay_messages() {
    let message = Message::builder()
        .body(br#"{"a":1}"#.to_vec())
        .properties()
        .message_id("00000000-0000-0000-0000-0000000000a1".to_string())
        .content_type("application/json")
        .message_builder()
        .application_properties()
        .insert("aggregate_type", "order")
        .insert("aggregate_id", "o-1")
        .insert("event_type", "created")
        .insert("table", "public.outbox")
        .insert("commit_lsn", "0/16B3748")
        .insert("tx_index", SimpleValue::from(3u64))
        .insert("xid", SimpleValue::from(750u64))
        .insert("tenant", "acme")
        .message_builder()
        .build();
    let e = Event::from_message(7, &message);
    assert_eq!(e.offset, 7);
    assert_eq!(
        e.message_id.as_deref(),
        Some("00000000-0000-0000-0000-0000000000a1")
    );
    assert_eq!(e.aggregate_type.as_deref(), Some("order"));
    assert_eq!(e.aggregate_id.as_deref(), Some("o-1"));
    assert_eq!(e.event_type.as_deref(), Some("created"));
    assert_eq!(e.table.as_deref(), Some("public.outbox"));
    assert_eq!(e.commit_lsn.as_deref(), Some("0/16B3748"));
    assert_eq!(e.tx_index, Some(3));
    assert_eq!(e.xid, Some(750));
    assert!(!e.replay);
    assert_eq!(e.payload, serde_json::json!({"a": 1}));

    let plain = Message::builder().body(b"plain".to_vec()).build();
    let e = Event::from_message(0, &plain);
    assert_eq!(e.message_id, None);
    assert_eq!(e.payload, serde_json::json!("plain"));
}

#[test]
fn backoff_grows_and_caps() {
    let mut b = Backoff(0);
    let waits: Vec<u64> = (0..10).map(|_| b.next().as_millis() as u64).collect();
    assert_eq!(waits[0], 100);
    assert_eq!(waits[1], 200);
    assert_eq!(*waits.last().expect("some"), 5_000);
}
