//! Logical decoding messages as events (docs/messages.md), against a real Postgres:
//! what a relay reading `[postgres] messages = ["outbox"]` receives.
#![allow(clippy::unwrap_used)]

mod support;

use outbox_event::{OutboxEvent, WalItem};
use support::*;

fn events(items: &[WalItem]) -> Vec<&OutboxEvent> {
    items
        .iter()
        .filter_map(|i| match i {
            WalItem::Event(e) => Some(e),
            _ => None,
        })
        .collect()
}

fn emit(kind: &str, id: u32) -> String {
    format!(
        "SELECT pg_logical_emit_message(true, 'outbox', \
           '{{\"aggregate_type\":\"order\",\"aggregate_id\":\"{id}\",\"event_type\":\"{kind}\",\"payload\":{{\"n\":{id}}}}}')"
    )
}

fn messages_config(f: &Fixture) -> wal_reader::ReaderConfig {
    let mut cfg = f.config();
    cfg.messages = vec!["outbox".into()];
    cfg
}

#[tokio::test]
async fn rows_and_messages_arrive_in_written_order_and_rolled_back_messages_never() {
    let f = Fixture::new();
    let mut r = spawn_reader(messages_config(&f)).await;
    f.db.psql(&format!(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '1', 'row-1', '{{}}');
         {};
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '3', 'row-3', '{{}}');
         {};
         COMMIT;",
        emit("message-2", 2),
        emit("message-4", 4)
    ));
    f.db.psql(&format!("BEGIN; {}; ROLLBACK;", emit("rolled-back", 5)));
    // Another tool's prefix and a non-transactional message: never events.
    f.db.psql("SELECT pg_logical_emit_message(true, 'other-tool', 'x')");
    f.db.psql("BEGIN; SELECT pg_logical_emit_message(false, 'outbox', '{}'); ROLLBACK;");
    f.db.psql(&emit("message-6", 6));

    let items = r
        .collect_until(|i| events(i).len() >= 5 && commits(i) >= 2)
        .await;
    let ev = events(&items);
    let types: Vec<String> = ev.iter().map(|e| text(&e.event_type)).collect();
    assert_eq!(
        types,
        ["row-1", "message-2", "row-3", "message-4", "message-6"]
    );
    let indexes: Vec<u64> = ev[..4].iter().map(|e| e.index).collect();
    assert_eq!(indexes, [0, 1, 2, 3], "one transaction, in written order");
    assert!(ev[..4].iter().all(|e| e.commit_lsn == ev[0].commit_lsn));
    assert_eq!(ev[1].table.qualified_name, "message:outbox");
    assert_eq!(ev[0].table.qualified_name, "public.outbox");
    assert_eq!(text(&ev[1].aggregate_id), "2");
    assert_eq!(&ev[1].body[..], br#"{"n":2}"#);
    assert_eq!(ev[1].table.content_type, "application/json");
    // The derived id: this server's system identifier, the database, the message's
    // own LSN (before its commit's).
    let system: String =
        f.db.psql("SELECT system_identifier FROM pg_control_system()");
    let id = text(&ev[1].id);
    let prefix = format!("outbox-relay/{system}/{}/", f.db.name);
    let lsn: outbox_event::Lsn = id.strip_prefix(&prefix).expect(&id).parse().unwrap();
    assert!(lsn < ev[1].commit_lsn);
    assert_ne!(text(&ev[1].id), text(&ev[3].id));
    assert!(ev.iter().all(|e| e.malformed.is_none()));
    r.stop().await;
}

#[tokio::test]
async fn malformed_content_arrives_marked_and_the_stream_goes_on() {
    let f = Fixture::new();
    let mut r = spawn_reader(messages_config(&f)).await;
    f.db.psql("SELECT pg_logical_emit_message(true, 'outbox', '{\"event_type\": \"x\"}')");
    f.db.psql(&emit("after", 1));
    let items = r.collect_until(|i| events(i).len() >= 2).await;
    let ev = events(&items);
    let why = ev[0].malformed.as_deref().expect("marked malformed");
    assert!(why.contains("missing field `aggregate_type`"), "{why}");
    assert!(why.contains("LSN"), "{why}");
    assert_eq!(&ev[0].body[..], br#"{"event_type": "x"}"#);
    assert!(ev[1].malformed.is_none());
    r.stop().await;
}

#[tokio::test]
async fn without_prefixes_messages_are_not_asked_for() {
    let f = Fixture::new();
    let mut r = spawn_reader(f.config()).await;
    f.db.psql(&emit("message", 1));
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '1', 'row', '{}')",
    );
    let items = r.collect_until(|i| !events(i).is_empty()).await;
    let types: Vec<String> = events(&items).iter().map(|e| text(&e.event_type)).collect();
    assert_eq!(types, ["row"]);
    r.stop().await;
}
