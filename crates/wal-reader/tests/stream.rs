//! The replication stream against a real Postgres (the test cluster, wal_level=logical).
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use outbox_event::{Lsn, WalItem};
use support::*;
use wal_reader::pgtype::oid;

fn events(items: &[WalItem]) -> Vec<&outbox_event::OutboxEvent> {
    items
        .iter()
        .filter_map(|i| match i {
            WalItem::Event(e) => Some(e),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn committed_inserts_arrive_in_order_with_commit_markers() {
    let f = Fixture::new();
    f.db.psql("CREATE TABLE other (id int primary key, v text)");
    f.db.psql(&format!(
        "ALTER PUBLICATION {} ADD TABLE other",
        f.publication
    ));
    let mut r = spawn_reader(f.config()).await;

    f.db.psql(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
           VALUES ('order', '1', 'created', '{\"n\": 1}', '{\"k\": \"v\"}');
         INSERT INTO other VALUES (1, 'x');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '1', 'paid', '{\"n\": 2}');
         COMMIT;",
    );
    // Rolled back: never arrives.
    f.db.psql(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '2', 'rolledback', '{}');
         ROLLBACK;",
    );
    // Insert-then-delete: the insert is relayed, the delete ignored.
    f.db.psql(
        "BEGIN;
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('00000000-0000-0000-0000-000000000003', 'order', '3', 'itd', '[1, 2]');
         DELETE FROM outbox WHERE id = '00000000-0000-0000-0000-000000000003';
         COMMIT;",
    );
    // Updates and deletes of the outbox are ignored (the publication publishes
    // inserts only, and the reader would skip them anyway).
    f.db.psql(
        "UPDATE outbox SET event_type = 'changed'; DELETE FROM outbox WHERE event_type = 'x';",
    );
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '4', 'last', '\"s\"');",
    );

    let items = r
        .collect_until(|i| events(i).len() >= 4 && commits(i) >= 3)
        .await;
    let ev = events(&items);
    let types: Vec<String> = ev.iter().map(|e| text(&e.event_type)).collect();
    assert_eq!(types, ["created", "paid", "itd", "last"]);
    assert_eq!(text(&ev[0].payload), "{\"n\": 1}");
    assert_eq!(text(&ev[0].headers), "{\"k\": \"v\"}");
    assert!(ev[1].headers.is_none());
    assert_eq!(text(&ev[2].id), "00000000-0000-0000-0000-000000000003");
    assert_eq!(ev[0].table.qualified_name, "public.outbox");
    assert_eq!(ev[0].table.payload_type, oid::JSONB);
    assert_eq!(ev[0].xid, ev[1].xid);
    assert_eq!(ev[0].commit_lsn, ev[1].commit_lsn);
    assert!(ev[2].commit_lsn > ev[0].commit_lsn);

    // Each transaction's events come before its commit marker, whose end LSN is
    // after its commit LSN.
    let mut seen_events = 0;
    let mut last_end = Lsn::ZERO;
    for item in &items {
        match item {
            WalItem::Event(e) => {
                seen_events += 1;
                assert!(e.commit_lsn > last_end || last_end == Lsn::ZERO);
            }
            WalItem::Commit(c) => {
                assert!(c.end_lsn > c.commit_lsn);
                assert!(c.end_lsn > last_end);
                last_end = c.end_lsn;
                if c.events > 0 {
                    assert!(seen_events > 0);
                }
            }
            WalItem::Keepalive(_) => {}
        }
    }

    // Confirm up to the last commit, stop cleanly: the slot is there now.
    r.acked.send(last_end).unwrap();
    let exit = r.stop().await;
    assert_eq!(exit.flushed, last_end);
    assert_eq!(f.confirmed_flush(), last_end);

    // A new session resumes after it: nothing of the above again.
    let mut r = spawn_reader(f.config()).await;
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', '5', 'after-restart', '{}');",
    );
    let items = r.collect_until(|i| !events(i).is_empty()).await;
    let ev = events(&items);
    assert_eq!(ev.len(), 1, "{items:#?}");
    assert_eq!(text(&ev[0].event_type), "after-restart");
    r.stop().await;
}

#[tokio::test]
async fn unacked_positions_are_never_confirmed() {
    let f = Fixture::new();
    let before = f.confirmed_flush();
    let mut r = spawn_reader(f.config()).await;
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('a', '1', 'e', '{}');",
    );
    r.collect_until(|i| commits(i) >= 1).await;
    // Nothing acked: the status updates (every 200 ms) must not move the slot.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(f.confirmed_flush(), before);
    let exit = r.stop().await;
    assert_eq!(exit.flushed, before);
    assert_eq!(f.confirmed_flush(), before);
}

/// The reader over a real walsender with the receive low-water mark in place
/// (docs/design.md §2, "Reading in batches"): a burst of 2,000 single-row
/// transactions arrives whole and in order, and so do lone small transactions after
/// it, far below the mark, each before the next is written. (Whether the burst makes
/// the stream count as busy depends on the build's speed; the lowering itself is
/// tested against a scripted peer in conn/mod.rs.)
#[tokio::test]
async fn small_transactions_arrive_below_the_receive_low_water_mark() {
    let f = Fixture::new();
    let mut r = spawn_reader(f.config()).await;
    // 2,000 single-row transactions of ~200 bytes: busy, and well above the mark.
    f.db.psql(
        "CREATE PROCEDURE burst() LANGUAGE plpgsql AS $$
         BEGIN FOR n IN 1..2000 LOOP
           INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', n::text, 'burst', jsonb_build_object('pad', repeat('x', 100)));
           COMMIT;
         END LOOP; END $$",
    );
    f.db.psql("CALL burst()");
    let items = r.collect_until(|items| commits(items) == 2000).await;
    let ids: Vec<String> = events(&items)
        .iter()
        .map(|e| {
            String::from_utf8_lossy(e.aggregate_id.as_deref().unwrap_or_default()).into_owned()
        })
        .collect();
    let want: Vec<String> = (1..=2000).map(|n| n.to_string()).collect();
    assert_eq!(ids, want);
    for i in 1..=3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        f.db.psql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('order', 'lone{i}', 'lone', '{{}}')"
        ));
        let items = r.collect_until(|items| commits(items) == 1).await;
        let got = events(&items);
        assert_eq!(got.len(), 1, "transaction {i}: {items:#?}");
        assert_eq!(
            got[0].aggregate_id.as_deref(),
            Some(format!("lone{i}").as_bytes())
        );
    }
    r.stop().await;
}

#[tokio::test]
async fn keepalives_let_an_idle_slot_follow_the_server() {
    let f = Fixture::new();
    // Traffic on a table that is not published moves the server's WAL only.
    f.db.psql("CREATE TABLE noise (id serial primary key, v text)");
    let mut r = spawn_reader(f.config()).await;
    f.db.psql("INSERT INTO noise (v) SELECT 'x' FROM generate_series(1, 1000)");
    let target: Lsn = f.db.psql("SELECT pg_current_wal_lsn()").parse().unwrap();
    // Echo every keepalive as acked (what the publisher does when nothing is in
    // flight) until one passes the target.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut best = Lsn::ZERO;
    while best < target {
        let batch = tokio::time::timeout_at(deadline, r.rx.recv())
            .await
            .expect("a keepalive past the noise arrives")
            .unwrap();
        for item in batch {
            match item {
                WalItem::Keepalive(l) => best = best.max(l),
                WalItem::Event(e) => panic!("unexpected event {e:?}"),
                WalItem::Commit(_) => {}
            }
        }
        r.acked.send(best).unwrap();
    }
    let exit = r.stop().await;
    assert!(exit.flushed >= target);
    assert!(f.confirmed_flush() >= target);
}

#[tokio::test]
async fn schema_change_mid_stream_is_honoured() {
    let f = Fixture::new();
    let mut r = spawn_reader(f.config()).await;
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('a', '1', 'before', '{}');",
    );
    r.collect_until(|i| commits(i) >= 1).await;
    // A new column before the mapped ones, and the headers column dropped.
    f.db.psql("ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 't1'; ALTER TABLE outbox DROP COLUMN headers;");
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('a', '2', 'after', '{\"x\": true}');",
    );
    let items = r.collect_until(|i| !events(i).is_empty()).await;
    let ev = events(&items);
    assert_eq!(text(&ev[0].event_type), "after");
    assert_eq!(text(&ev[0].aggregate_id), "2");
    assert_eq!(text(&ev[0].payload), "{\"x\": true}");
    assert!(ev[0].headers.is_none());
    r.stop().await;
}

#[tokio::test]
async fn renamed_mapped_column_stops_with_a_fix() {
    let f = Fixture::new();
    let mut r = spawn_reader(f.config()).await;
    f.db.psql("ALTER TABLE outbox RENAME COLUMN event_type TO kind");
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, kind, payload) VALUES ('a', '1', 'k', '{}');",
    );
    while r.rx.recv().await.is_some() {}
    let err = r.task.await.unwrap().unwrap_err();
    assert!(err.is_precondition(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("event_type") && msg.contains("[mapping]"),
        "{msg}"
    );
}

#[tokio::test]
async fn other_tables_and_unmapped_schemas_are_skipped() {
    let f = Fixture::with_ddl(
        &format!(
            "{OUTBOX_DDL} CREATE SCHEMA s2; CREATE TABLE s2.outbox (LIKE outbox INCLUDING ALL);"
        ),
        "public.outbox, s2.outbox",
    );
    let mut r = spawn_reader(f.config()).await;
    // Two transactions (psql -c runs its statements as one).
    f.db.psql(
        "INSERT INTO s2.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', '1', 'skip', '{}');",
    );
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', '1', 'keep', '{}');",
    );
    let items = r.collect_until(|i| commits(i) >= 2).await;
    let ev = events(&items);
    assert_eq!(ev.len(), 1);
    assert_eq!(text(&ev[0].event_type), "keep");
    let counts: Vec<u64> = items
        .iter()
        .filter_map(|i| match i {
            WalItem::Commit(c) => Some(c.events),
            _ => None,
        })
        .collect();
    assert_eq!(counts, [0, 1]);
    r.stop().await;
}
