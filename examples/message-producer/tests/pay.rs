//! The example producer against the test Postgres cluster, with
//! sql/outbox_messages.sql applied: what it commits is one business UPDATE and one
//! transactional `outbox` message in the same transaction, as a pgoutput slot (the
//! relay's view, `messages 'true'`) decodes them; what it refuses leaves nothing.
//!
//! Needs the test services (scripts/test-services.sh).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use message_producer::{init, pay_order, AGGREGATE_TYPE, EVENT_TYPE};
use testkit::{pg_port, unique_name, TestDb};
use tokio_postgres::{Client, NoTls};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../sql/outbox_messages.sql");

/// Drops the test's roles (cluster-wide) on the way out, also when it fails.
struct Roles {
    db: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        for role in &self.names {
            let _ = testkit::try_psql(pg_port(), &self.db, &format!("DROP OWNED BY {role}"));
            let _ = testkit::try_psql(
                pg_port(),
                "postgres",
                &format!("DROP ROLE IF EXISTS {role}"),
            );
        }
    }
}

/// A database with the script applied (unique role names), the orders table with
/// open orders 1 and 2, an application role that may update orders and is a member
/// of the writer role, and a pgoutput slot on a publication of `orders`.
struct World {
    _roles: Roles,
    db: TestDb,
    app: String,
    slot: String,
    publication: String,
}

impl World {
    async fn new() -> World {
        let db = TestDb::new("producer");
        let (emitter, writer, app) = (
            unique_name("emitter"),
            unique_name("writer"),
            unique_name("app"),
        );
        let roles = Roles {
            db: db.name.clone(),
            names: vec![app.clone(), writer.clone(), emitter.clone()],
        };
        testkit::psql_file_at(
            pg_port(),
            &db.name,
            SCRIPT,
            &[("emitter_role", &emitter), ("writer_role", &writer)],
        );
        testkit::psql(
            "postgres",
            &format!("CREATE ROLE {app} LOGIN; GRANT {writer} TO {app};"),
        );
        let admin = db.client().await;
        init(&admin, 1, 1999).await.unwrap();
        init(&admin, 2, 500).await.unwrap();
        db.psql(&format!("GRANT SELECT, UPDATE ON orders TO {app}"));
        let (slot, publication) = (unique_name("slot"), unique_name("pub"));
        db.psql(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE orders"
        ));
        db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
        World {
            _roles: roles,
            db,
            app,
            slot,
            publication,
        }
    }

    fn app_conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user={} dbname={}",
            pg_port(),
            self.app,
            self.db.name
        )
    }

    async fn app_client(&self) -> Client {
        let (client, conn) = tokio_postgres::connect(&self.app_conninfo(), NoTls)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    /// The slot's pending pgoutput messages (peeked): each one's type byte and, for
    /// an `M`, its prefix and content.
    async fn peek(&self) -> Vec<(char, Option<(String, serde_json::Value)>)> {
        let admin = self.db.client().await;
        admin
            .query(
                "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                     'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
                &[&self.slot, &self.publication],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| {
                let data: Vec<u8> = row.get(0);
                (data[0] as char, message(&data))
            })
            .collect()
    }
}

/// pgoutput's Message (protocol 1): 'M', flags, LSN, prefix\0, length, content.
/// Only transactional ones (flags 1) are expected here.
fn message(data: &[u8]) -> Option<(String, serde_json::Value)> {
    if data[0] != b'M' {
        return None;
    }
    assert_eq!(data[1], 1, "a transactional message");
    let rest = &data[1 + 1 + 8..];
    let nul = rest.iter().position(|&b| b == 0).unwrap();
    let prefix = String::from_utf8(rest[..nul].to_vec()).unwrap();
    let rest = &rest[nul + 1..];
    let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
    Some((prefix, serde_json::from_slice(&rest[4..4 + len]).unwrap()))
}

/// The pgoutput message kinds, leaving out transactions with nothing published
/// (Postgres 14 sends those, e.g. for an autoanalyze).
fn kinds(changes: &[(char, Option<(String, serde_json::Value)>)]) -> String {
    let all: String = changes.iter().map(|(k, _)| *k).collect();
    all.replace("BC", "")
}

/// `pay_order` commits the UPDATE and the event together: Begin, Relation, Update,
/// Message, Commit, the message carrying the returned id and the order's fields.
/// Paying the same order again fails and adds nothing to the WAL.
#[tokio::test]
async fn the_update_and_its_event_commit_together() {
    let w = World::new().await;
    let mut app = w.app_client().await;

    let paid = pay_order(
        &mut app,
        1,
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    )
    .await
    .unwrap();
    assert_eq!(paid.amount_cents, 1999);

    let err = pay_order(&mut app, 1, None).await.expect_err("paid twice");
    assert!(format!("{err:#}").contains("not open"), "{err:#}");

    let changes = w.peek().await;
    assert_eq!(
        kinds(&changes),
        "BRUMC",
        "one transaction: the UPDATE, then the event"
    );
    let (prefix, content) = changes.iter().find_map(|(_, m)| m.clone()).unwrap();
    assert_eq!(prefix, "outbox");
    assert_eq!(
        content,
        serde_json::json!({
            "id": paid.event_id,
            "aggregate_type": AGGREGATE_TYPE,
            "aggregate_id": "1",
            "event_type": EVENT_TYPE,
            "payload": {"order_id": 1, "amount_cents": 1999},
            "headers": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        })
    );
    let status = w.db.psql("SELECT status FROM orders WHERE id = 1");
    assert_eq!(status, "paid");
}

/// Without the writer role, `outbox_emit` is refused and the UPDATE before it is
/// rolled back with it: the order stays open and the slot holds nothing.
#[tokio::test]
async fn a_role_without_the_writer_role_changes_nothing() {
    let w = World::new().await;
    let outsider = unique_name("outsider");
    let _roles = Roles {
        db: w.db.name.clone(),
        names: vec![outsider.clone()],
    };
    testkit::psql("postgres", &format!("CREATE ROLE {outsider} LOGIN"));
    w.db.psql(&format!("GRANT SELECT, UPDATE ON orders TO {outsider}"));
    let conninfo = w.app_conninfo().replace(&w.app, &outsider);
    let (mut client, conn) = tokio_postgres::connect(&conninfo, NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });

    let err = pay_order(&mut client, 2, None)
        .await
        .expect_err("emitted without the writer role");
    assert!(format!("{err:#}").contains("permission denied"), "{err:#}");
    assert_eq!(w.db.psql("SELECT status FROM orders WHERE id = 2"), "open");
    assert_eq!(kinds(&w.peek().await), "", "nothing decoded");
}

/// The binary: `pay` prints the event id, and that id is the one in the WAL.
#[tokio::test]
async fn the_binary_prints_the_id_it_emitted() {
    let w = World::new().await;
    let out = Command::new(env!("CARGO_BIN_EXE_message-producer"))
        .args([
            "--postgres-url",
            &w.app_conninfo(),
            "pay",
            "--order-id",
            "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = stdout.trim().rsplit(' ').next().unwrap().to_string();
    let changes = w.peek().await;
    let (_, content) = changes.iter().find_map(|(_, m)| m.clone()).unwrap();
    assert_eq!(content["id"], printed.as_str(), "{stdout}");
    assert_eq!(content["payload"]["amount_cents"], 500);
}
