//! `[message] format = "cloudevents"` end to end (docs/cloudevents.md): the real binary
//! publishes outbox rows to an exchange and to a stream, and every message received
//! is turned into a CloudEvent by the CloudEvents Python SDK (PyPI `cloudevents`, its
//! AMQP binding in binary content mode; scripts/ce-consumer.py), which validates it.
//! Each attribute is asserted against the outbox row and, for `time`, against the
//! commit time that `peek` decodes from the same WAL commit record, read back by
//! Postgres itself.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use lapin::types::AMQPValue;
use serde_json::{json, Value};
use support::stream::{delete_stream, read_stream, stream_url, StreamMsg};
use support::*;
use testkit::amqp::Msg;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);

/// A second outbox table with a text payload (content type `text/plain`).
const BILLING_DDL: &str = "CREATE SCHEMA billing;
CREATE TABLE billing.outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload text NOT NULL,
    headers jsonb);";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SDK's reading of each message (scripts/ce-consumer.py), in order. One script
/// at a time: on a fresh machine the first run installs the SDK.
fn sdk_events(messages: &[Value]) -> Vec<Value> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ce-consumer.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs scripts/ce-consumer.py (the CloudEvents SDK consumer)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(Value::from(messages.to_vec()).to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "ce-consumer.py failed: {}",
        stderr(&out)
    );
    let events: Vec<Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("ce-consumer.py output ({e}): {}", stdout(&out)));
    assert_eq!(events.len(), messages.len());
    events
}

/// An exchange's message as the SDK's AMQP binding takes it: the headers as
/// application properties, the content type, the body.
fn from_amqp(m: &Msg) -> Value {
    let mut props = serde_json::Map::new();
    for (key, value) in m.properties.headers().as_ref().unwrap().inner() {
        let value = match value {
            AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
            AMQPValue::LongLongInt(i) => json!(i),
            other => panic!("unexpected header value {key}: {other:?}"),
        };
        props.insert(key.as_str().to_string(), value);
    }
    json!({
        "content_type": m.properties.content_type().as_ref().map(|c| c.as_str()),
        "properties": props,
        "body_hex": hex(&m.body),
    })
}

/// A stream's message as the SDK's AMQP binding takes it.
fn from_stream(m: &StreamMsg) -> Value {
    json!({
        "content_type": m.content_type,
        "properties": m.props,
        "body_hex": hex(&m.body),
    })
}

/// µs since the epoch of an RFC 3339 time, as Postgres reads it.
fn pg_micros(env: &Env, rfc3339: &str) -> i64 {
    env.db
        .psql(&format!(
            "SELECT (extract(epoch FROM '{rfc3339}'::timestamptz) * 1000000)::bigint"
        ))
        .trim()
        .parse()
        .unwrap()
}

fn pg_now_micros(env: &Env) -> i64 {
    env.db
        .psql("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
        .trim()
        .parse()
        .unwrap()
}

/// `peek --json`'s events by message id (run while no relay holds the slot).
fn peeked(env: &Env, vars: &[(&str, &str)], n: usize) -> BTreeMap<String, Value> {
    let out = env.cli_env(&["peek", "--json", "--limit", "10"], vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.len(), n, "{list:?}");
    list.into_iter()
        .map(|v| (v["message_id"].as_str().unwrap().to_string(), v))
        .collect()
}

/// What one row's event must be.
struct Expected {
    id: &'static str,
    source: String,
    kind: &'static str,
    subject: &'static str,
    content_type: &'static str,
    body: &'static str,
    data: Value,
    extensions: Value,
}

/// Asserts the SDK's event `e` attribute by attribute, its time against `peek`'s
/// commit time (read by Postgres) and the bounds taken around the inserts.
fn assert_event(
    env: &Env,
    e: &Value,
    want: &Expected,
    peek: &BTreeMap<String, Value>,
    bounds: (i64, i64),
) {
    assert_eq!(e["ok"], true, "the SDK refused the message: {e}");
    let a = &e["attributes"];
    assert_eq!(a["specversion"], "1.0", "{e}");
    assert_eq!(a["id"], want.id, "{e}");
    assert_eq!(a["source"], want.source.as_str(), "{e}");
    assert_eq!(a["type"], want.kind, "{e}");
    assert_eq!(a["subject"], want.subject, "{e}");
    assert_eq!(a["datacontenttype"], want.content_type, "{e}");
    assert_eq!(
        a.as_object().unwrap().len(),
        7,
        "exactly the standard attributes the relay sets: {e}"
    );
    assert_eq!(e["extensions"], want.extensions, "{e}");
    assert_eq!(e["data_hex"], hex(want.body.as_bytes()), "{e}");
    assert_eq!(e["data_json"], want.data, "{e}");

    let p = &peek[want.id];
    let commit = pg_micros(env, p["commit_time"].as_str().unwrap());
    assert_eq!(e["time_micros"], commit, "time = the commit time: {e} {p}");
    assert!(
        bounds.0 < commit && commit < bounds.1,
        "commit time {commit} within the inserts' {bounds:?}"
    );
    // `peek` shows the attributes the message carries.
    let shown = &p["cloudevents"];
    assert_eq!(shown["id"], a["id"]);
    assert_eq!(shown["source"], a["source"]);
    assert_eq!(shown["type"], a["type"]);
    assert_eq!(shown["subject"], a["subject"]);
    assert_eq!(pg_micros(env, shown["time"].as_str().unwrap()), commit);
}

const A1: &str = "00000000-0000-0000-0000-0000000000a1";
const A2: &str = "00000000-0000-0000-0000-0000000000a2";
const B1: &str = "00000000-0000-0000-0000-0000000000b1";

/// Two transactions over two tables: the first with two rows (one with headers that
/// hold a CloudEvents extension and a spoofed attribute), the second a text payload.
fn insert_rows(env: &Env) {
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('{A1}', 'order', 'o-1', 'created', '{{\"total\": 12.50}}',
            '{{\"tenant\": \"acme\", \"cloudEvents:traceparent\": \"00-abc-def-01\", \"cloudEvents_id\": \"spoof\"}}'),
           ('{A2}', 'order', 'o-1', 'paid', '{{\"ok\": true}}', NULL)"
    ));
    env.db.psql(&format!(
        "INSERT INTO billing.outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{B1}', 'invoice', 'i-7', 'issued', 'plain text é')"
    ));
}

fn expected(source_of: impl Fn(&str) -> String, prefix: &str) -> Vec<Expected> {
    let kind = |t: &str| -> &'static str { Box::leak(format!("{prefix}{t}").into_boxed_str()) };
    vec![
        Expected {
            id: A1,
            source: source_of("public.outbox"),
            kind: kind("created"),
            subject: "o-1",
            content_type: "application/json",
            body: "{\"total\": 12.50}",
            data: json!({"total": 12.5}),
            extensions: json!({"traceparent": "00-abc-def-01"}),
        },
        Expected {
            id: A2,
            source: source_of("public.outbox"),
            kind: kind("paid"),
            subject: "o-1",
            content_type: "application/json",
            body: "{\"ok\": true}",
            data: json!({"ok": true}),
            extensions: json!({}),
        },
        Expected {
            id: B1,
            source: source_of("billing.outbox"),
            kind: kind("issued"),
            subject: "i-7",
            content_type: "text/plain",
            body: "plain text é",
            data: json!("plain text é"),
            extensions: json!({}),
        },
    ]
}

/// The exchange target, configured in the file: the default source, a type prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_messages_are_valid_cloudevents() {
    let _shared = testkit::BROKER.read().await;
    let ddl = format!("{OUTBOX_DDL}\n{BILLING_DDL}");
    let mut env = Env::with_ddl(&ddl, &["public.outbox", "billing.outbox"]).await;
    env.extra =
        "[message]\nformat = \"cloudevents\"\ncloudevents_type_prefix = \"com.example.\"\n".into();
    env.create_slot();
    let got = env.consumer().await;

    let before = pg_now_micros(&env);
    insert_rows(&env);
    let after = pg_now_micros(&env);
    let peek = peeked(&env, &[], 3);

    let relay = env.start(&[]);
    got.wait_for(3, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs = got.snapshot();
    assert_eq!(msgs.len(), 3, "{msgs:#?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    let db = env.db.name.clone();
    let want = expected(|t| format!("/outbox-relay/{db}/{t}"), "com.example.");
    let inputs: Vec<Value> = msgs.iter().map(from_amqp).collect();
    let events = sdk_events(&inputs);
    for ((m, e), w) in msgs.iter().zip(&events).zip(&want) {
        assert_event(&env, e, w, &peek, (before, after));
        // The native message stays: properties and the relay's own headers.
        assert_eq!(m.message_id(), w.id);
        assert_eq!(
            m.properties.content_type().as_ref().unwrap().as_str(),
            w.content_type
        );
        assert!(m.header("commit_lsn").unwrap().contains('/'));
        assert!(m.header("tx_index").is_some());
        assert_eq!(m.header("aggregate_id").as_deref(), Some(w.subject));
    }
    assert_eq!(msgs[0].header("tenant").as_deref(), Some("acme"));
    assert_eq!(
        msgs[0].header("cloudEvents_id"),
        None,
        "spoofed attribute dropped"
    );
    assert_eq!(msgs[0].routing_key, "order.created");

    // The SDK does validate: the same message without its source is refused.
    let mut broken = inputs[0].clone();
    broken["properties"]
        .as_object_mut()
        .unwrap()
        .remove("cloudEvents:source");
    let refused = sdk_events(&[broken]);
    assert_eq!(refused[0]["ok"], false, "{refused:?}");
    assert!(
        refused[0]["error"].as_str().unwrap().contains("source"),
        "{refused:?}"
    );

    env.cleanup().await;
}

/// The stream target, configured by environment variables: a source template and a
/// type prefix; the stream's AMQP 1.0 application properties carry the attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_messages_are_valid_cloudevents() {
    let _shared = testkit::BROKER.read().await;
    let ddl = format!("{OUTBOX_DDL}\n{BILLING_DDL}");
    let env = Env::with_ddl(&ddl, &["public.outbox", "billing.outbox"]).await;
    let stream = testkit::unique_name("ce_stream");
    let url = stream_url();
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", url.as_str()),
        ("OUTBOX_RELAY_MESSAGE_FORMAT", "cloudevents"),
        (
            "OUTBOX_RELAY_MESSAGE_CLOUDEVENTS_SOURCE",
            "urn:outbox:{database}:{table}",
        ),
        ("OUTBOX_RELAY_MESSAGE_CLOUDEVENTS_TYPE_PREFIX", "org.acme."),
    ];
    env.create_slot();
    // `check --declare` accepts the configuration and declares the stream (read below).
    let out = env.cli_env(&["check", "--declare"], &vars);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));

    let before = pg_now_micros(&env);
    insert_rows(&env);
    let after = pg_now_micros(&env);
    let peek = peeked(&env, &vars, 3);

    let relay = env.start_env(&[], &vars);
    let msgs = read_stream(&stream, 3, QUIET, WAIT).await;
    assert_eq!(msgs.len(), 3, "{msgs:#?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    let db = env.db.name.clone();
    let want = expected(|t| format!("urn:outbox:{db}:{t}"), "org.acme.");
    let inputs: Vec<Value> = msgs.iter().map(from_stream).collect();
    let events = sdk_events(&inputs);
    for ((m, e), w) in msgs.iter().zip(&events).zip(&want) {
        assert_event(&env, e, w, &peek, (before, after));
        assert_eq!(m.message_id.as_deref(), Some(w.id));
        assert!(m.prop("commit_lsn").unwrap().contains('/'));
        assert!(m.prop("x-outbox-publishing-id").is_some());
    }
    assert_eq!(msgs[0].prop("tenant"), Some("acme"));
    assert_eq!(msgs[0].prop("cloudEvents_id"), None);

    delete_stream(&stream).await;
    env.cleanup().await;
}
