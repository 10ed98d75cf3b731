//! End-to-end: the real binary between the test Postgres cluster and RabbitMQ, with a
//! consumer asserting what arrived (docs/design.md §1, §3, §5, §6).
#![allow(clippy::unwrap_used)]

use support::scenarios;

use std::time::Duration;

use support::*;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn publishes_committed_inserts_exactly_as_specified() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.db.psql("CREATE TABLE unrelated (id int primary key)");
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);

    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('00000000-0000-0000-0000-000000000001', 'order', 'o-1', 'created',
            '{\"total\": 12.50, \"items\": [1, 2]}', '{\"tenant\": \"acme\", \"priority\": 5, \"traceparent\": \"00-abc-def-01\"}'),
           ('00000000-0000-0000-0000-000000000002', 'order', 'o-1', 'paid', '{\"ok\": true}', NULL)",
    );
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                VALUES ('order', 'o-2', 'rolled_back', '{}'); ROLLBACK;",
    );
    // Insert-then-delete in one transaction: published.
    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('00000000-0000-0000-0000-000000000003', 'customer', 'c-9', 'renamed', '\"x\"');
         DELETE FROM outbox WHERE id = '00000000-0000-0000-0000-000000000003';",
    );
    // Updates, deletes and other tables: ignored.
    env.db.psql("UPDATE outbox SET event_type = 'updated'");
    env.db.psql("DELETE FROM outbox WHERE aggregate_id = 'o-1'");
    env.db.psql("INSERT INTO unrelated VALUES (1)");
    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('00000000-0000-0000-0000-000000000004', 'order', 'o-3', 'shipped', '[]')",
    );

    let msgs = got.wait_for(4, WAIT).await;
    // Nothing else trickles in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs_after = got.snapshot();
    assert_eq!(msgs_after.len(), 4, "{msgs_after:#?}");

    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(
        ids,
        [
            "00000000-0000-0000-0000-000000000001",
            "00000000-0000-0000-0000-000000000002",
            "00000000-0000-0000-0000-000000000003",
            "00000000-0000-0000-0000-000000000004"
        ]
    );
    let m = &msgs[0];
    assert_eq!(m.text(), "{\"items\": [1, 2], \"total\": 12.50}");
    assert_eq!(m.routing_key, "order.created");
    assert_eq!(m.exchange, env.exchange);
    let p = &m.properties;
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
    let ts = p.timestamp().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(ts <= now && ts + 120 > now, "timestamp {ts} vs now {now}");
    assert_eq!(m.header("aggregate_type").unwrap(), "order");
    assert_eq!(m.header("aggregate_id").unwrap(), "o-1");
    assert_eq!(m.header("event_type").unwrap(), "created");
    assert_eq!(m.header("outbox_table").unwrap(), "public.outbox");
    assert!(m.header("commit_lsn").unwrap().contains('/'));
    assert!(m.header("xid").unwrap().parse::<u64>().unwrap() > 0);
    assert_eq!(m.header("tenant").unwrap(), "acme");
    // `priority` sets the property, not a header (docs/routing.md).
    assert_eq!(m.header("priority"), None);
    assert_eq!(*m.properties.priority(), Some(5));
    assert_eq!(m.header("traceparent").unwrap(), "00-abc-def-01");
    // Same transaction: same commit LSN and xid.
    assert_eq!(msgs[1].header("commit_lsn"), m.header("commit_lsn"));
    assert_eq!(msgs[1].header("xid"), m.header("xid"));
    assert_eq!(msgs[1].header("tenant"), None);
    assert_eq!(msgs[2].routing_key, "customer.renamed");
    assert_eq!(msgs[2].text(), "\"x\"");
    assert_eq!(msgs[3].text(), "[]");

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

#[tokio::test]
async fn two_outbox_tables_and_a_custom_mapping() {
    let _shared = testkit::BROKER.read().await;
    let ddl = "CREATE SCHEMA billing;
        CREATE TABLE events (
            event_id text PRIMARY KEY, stream text NOT NULL, stream_id text NOT NULL,
            name text NOT NULL, body bytea, meta jsonb, trace text);
        CREATE TABLE billing.events (LIKE events INCLUDING ALL);";
    let mut env = Env::with_ddl(ddl, &["public.events", "billing.events"]).await;
    env.extra = "[mapping]\nid = \"event_id\"\naggregate_type = \"stream\"\naggregate_id = \"stream_id\"\n\
                 event_type = \"name\"\npayload = \"body\"\nheaders = \"meta\"\ncorrelation_id = \"trace\"\n"
        .into();
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.db.psql(
        "INSERT INTO events VALUES ('e1', 'invoice', 'i-1', 'issued', '\\x00ff10'::bytea, '{\"a\": \"b\"}', 'trace-1');
         INSERT INTO billing.events VALUES ('e2', 'invoice', 'i-1', 'paid', NULL, NULL, NULL);",
    );
    let msgs = got.wait_for(2, WAIT).await;
    assert_eq!(msgs[0].message_id(), "e1");
    assert_eq!(msgs[0].body, vec![0x00, 0xff, 0x10]);
    assert_eq!(
        msgs[0].properties.content_type().as_ref().unwrap().as_str(),
        "application/octet-stream"
    );
    assert_eq!(
        msgs[0]
            .properties
            .correlation_id()
            .as_ref()
            .unwrap()
            .as_str(),
        "trace-1"
    );
    assert_eq!(msgs[0].header("outbox_table").unwrap(), "public.events");
    assert_eq!(msgs[0].header("a").unwrap(), "b");
    assert_eq!(msgs[0].routing_key, "invoice.issued");
    assert_eq!(msgs[1].message_id(), "e2");
    assert_eq!(msgs[1].header("outbox_table").unwrap(), "billing.events");
    assert!(msgs[1].body.is_empty(), "a NULL payload is an empty body");
    assert!(msgs[1].properties.correlation_id().is_none());
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

#[tokio::test]
async fn sigterm_then_restart_publishes_no_duplicates() {
    let _shared = testkit::BROKER.read().await;
    scenarios::clean_stop(testkit::pg_port()).await;
}

#[tokio::test]
async fn sigkill_mid_stream_loses_nothing_and_duplicates_stay_bounded() {
    let _shared = testkit::BROKER.read().await;
    scenarios::sigkill_restart(testkit::pg_port()).await;
}

#[tokio::test]
async fn idle_slot_follows_the_server_despite_other_traffic() {
    let _shared = testkit::BROKER.read().await;
    scenarios::idle_wal(testkit::pg_port()).await;
}

/// With `[message] headers = "minimal"` the relay does not write `aggregate_type`,
/// `aggregate_id`, `outbox_table` and `xid`, and a row's headers column may not
/// either: a consumer would take them for the relay's. They are dropped (and
/// logged) in every header mode; the row's other keys arrive.
#[tokio::test]
async fn a_row_cannot_set_the_relays_own_headers_under_minimal() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.extra = "[message]\nheaders = \"minimal\"\n".into();
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
           VALUES ('order', 'o-1', 'created', '{}',
                   '{\"aggregate_type\": \"forged\", \"aggregate_id\": \"forged\",
                     \"outbox_table\": \"forged\", \"xid\": \"forged\", \"tenant\": \"acme\"}')",
    );
    let msgs = got.wait_for(1, WAIT).await;
    let m = &msgs[0];
    for key in ["aggregate_type", "aggregate_id", "outbox_table", "xid"] {
        assert_eq!(m.header(key), None, "the row set {key}");
    }
    assert_eq!(m.header("tenant").as_deref(), Some("acme"));
    assert_eq!(m.header("event_type").as_deref(), Some("created"));
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("reserved header key"), "{log}");
    env.cleanup().await;
}
