use super::*;

#[test]
fn redacts_passwords() {
    assert_eq!(
        redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
        "amqp://guest:***@127.0.0.1:5672/%2f"
    );
    assert_eq!(
        redact("postgresql://app:p%40ss@db:5432/app?sslmode=require"),
        "postgresql://app:***@db:5432/app?sslmode=require"
    );
    assert_eq!(
        redact("postgresql://postgres@127.0.0.1:5432/app"),
        "postgresql://postgres@127.0.0.1:5432/app"
    );
    assert_eq!(
        redact("host=db user=app password=hunter2 dbname=app"),
        "host=db user=app password=*** dbname=app"
    );
    assert_eq!(
        redact("postgresql://db/app?user=app&password=hunter2&sslmode=require"),
        "postgresql://db/app?user=app&password=***&sslmode=require"
    );
}

#[test]
fn reads_relay_messages() {
    let mut headers = FieldTable::default();
    headers.insert(
        "aggregate_id".into(),
        AMQPValue::LongString(LongString::from("42")),
    );
    headers.insert(
        "event_type".into(),
        AMQPValue::LongString(LongString::from("order_paid")),
    );
    headers.insert("xid".into(), AMQPValue::LongLongInt(7));
    let props = BasicProperties::default()
        .with_message_id("abc".into())
        .with_headers(headers);
    let m = Message::from_parts(&props, br#"{"a":1}"#).expect("valid");
    assert_eq!(m.message_id, "abc");
    assert_eq!(m.aggregate_id.as_deref(), Some("42"));
    assert_eq!(m.event_type.as_deref(), Some("order_paid"));
    assert_eq!(m.payload, serde_json::json!({"a": 1}));

    let m = Message::from_parts(&props, b"plain text").expect("valid");
    assert_eq!(m.payload, serde_json::json!("plain text"));

    let err = Message::from_parts(&BasicProperties::default(), b"{}").expect_err("no id");
    assert!(err.0.contains("message_id"), "{err}");
}

#[test]
fn backoff_grows_and_caps() {
    let mut b = Backoff(0);
    let waits: Vec<u64> = (0..10).map(|_| b.next().as_millis() as u64).collect();
    assert_eq!(waits[0], 100);
    assert_eq!(waits[1], 200);
    assert_eq!(*waits.last().expect("some"), 5_000);
}
