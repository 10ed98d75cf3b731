//! `status` and `peek` on a known slot.
//! size: one scenario on one slot: status, peek, a relay, then both again, each on what came before

use super::*;

const ID1: &str = "00000000-0000-0000-0000-0000000000a1";
const ID2: &str = "00000000-0000-0000-0000-0000000000a2";
const ID3: &str = "00000000-0000-0000-0000-0000000000a3";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_peek_show_a_known_slot_without_consuming_it() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let long = format!("{{\"text\": \"{}\"}}", "y".repeat(400));
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('{ID1}', 'order', 'o-1', 'created', '{{\"total\": 1}}', '{{\"tenant\": \"acme\"}}'),
           ('{ID2}', 'order', 'o-1', 'paid', '{long}', NULL)"
    ));
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                VALUES ('order', 'o-9', 'rolled_back', '{}'); ROLLBACK;",
    );
    env.db
        .psql("UPDATE outbox SET event_type = 'ignored' WHERE false");
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID3}', 'customer', 'c-7', 'renamed', '\"x\"')"
    ));

    // status, text and JSON, on a slot no relay streams from.
    let out = env.cli(&["status"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    eprintln!("status:\n{text}");
    assert!(
        text.contains(&format!("slot:                {}", env.slot)),
        "{text}"
    );
    assert!(text.contains("active:              no"), "{text}");
    assert!(text.contains("wal_status:          reserved"), "{text}");
    assert!(
        text.contains("warning: no relay is streaming from slot"),
        "{text}"
    );
    let out = env.cli(&["status", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    eprintln!("status --json:\n{v:#}");
    assert_eq!(v["slot"], env.slot.as_str());
    assert_eq!(v["plugin"], "pgoutput");
    assert_eq!(v["database"], env.db.name.as_str());
    assert_eq!(v["active"], false);
    assert!(v["pending_wal_bytes"].as_i64().unwrap() > 0, "{v}");
    assert!(v["retained_wal_bytes"].as_i64().unwrap() > 0, "{v}");
    assert!(
        v["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("no relay is streaming")),
        "{v}"
    );
    let confirmed_before = v["confirmed_flush_lsn"].as_str().unwrap().to_string();

    // peek, text: one line per event, in commit and insert order.
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    eprintln!("peek:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (line, (id, kind, aggregate, key)) in lines.iter().zip([
        (ID1, "created", "order/o-1", "order.created"),
        (ID2, "paid", "order/o-1", "order.paid"),
        (ID3, "renamed", "customer/c-7", "customer.renamed"),
    ]) {
        assert!(line.contains(&format!("id={id} ")), "{line}");
        assert!(line.contains(&format!("type={kind} ")), "{line}");
        assert!(line.contains(&format!("aggregate={aggregate} ")), "{line}");
        assert!(line.contains(&format!("routing_key={key} ")), "{line}");
        assert!(line.contains(" public.outbox "), "{line}");
    }
    assert!(lines[0].ends_with("payload={\"total\": 1}"), "{}", lines[0]);
    assert!(
        lines[1].ends_with('…') && lines[1].len() < 500,
        "{}",
        lines[1]
    );
    let out = env.cli(&["peek", "--limit", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().collect::<Vec<_>>(), &lines[..2]);

    // peek, JSON: every field, the payload in full.
    let out = env.cli(&["peek", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let arr: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    eprintln!("peek --json (first):\n{:#}", arr[0]);
    assert_eq!(arr.len(), 3);
    let ids: Vec<&str> = arr
        .iter()
        .map(|e| e["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [ID1, ID2, ID3]);
    assert_eq!(
        arr[0]["commit_lsn"], arr[1]["commit_lsn"],
        "one transaction"
    );
    assert_eq!(arr[0]["xid"], arr[1]["xid"]);
    assert_ne!(arr[1]["commit_lsn"], arr[2]["commit_lsn"]);
    assert_eq!(arr[0]["table"], "public.outbox");
    assert_eq!(arr[0]["aggregate_type"], "order");
    assert_eq!(arr[0]["aggregate_id"], "o-1");
    assert_eq!(arr[0]["event_type"], "created");
    assert_eq!(arr[0]["routing_key"], "order.created");
    assert_eq!(arr[0]["headers"], "{\"tenant\": \"acme\"}");
    assert_eq!(arr[0]["content_type"], "application/json");
    assert_eq!(arr[1]["payload"].as_str().unwrap(), long.as_str());
    assert!(arr[1]["headers"].is_null());
    assert!(arr[2]["commit_time"].as_str().unwrap().ends_with('Z'));

    // Peeking consumed nothing: the slot did not move, and a relay publishes all three.
    let again = env.cli(&["peek"]);
    assert_eq!(stdout(&again), text);
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&env.cli(&["status", "--json"]))).unwrap();
    assert_eq!(v["confirmed_flush_lsn"].as_str().unwrap(), confirmed_before);

    let got = env.consumer().await;
    let relay = env.start(&[]);
    let msgs = got.wait_for(3, WAIT).await;
    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(ids, [ID1, ID2, ID3]);

    // While the relay streams, peek refuses with the fix (an unmet precondition: 2).
    let deadline = tokio::time::Instant::now() + WAIT;
    let out = loop {
        let out = env.cli(&["peek"]);
        if !out.status.success() || tokio::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    eprintln!("peek on an active slot: {err}");
    assert!(err.contains("is in use by pid"), "{err}");
    assert!(
        err.contains("stop that relay") && err.contains("status"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let out = env.cli(&["status"]);
    let text = stdout(&out);
    eprintln!("status while running:\n{text}");
    assert!(text.contains("active:              yes (pid "), "{text}");
    assert!(!text.contains("no relay is streaming"), "{text}");

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    // Everything published and confirmed: nothing pending.
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "no pending events");
    let out = env.cli(&["peek", "--json"]);
    assert_eq!(stdout(&out).trim(), "[]");
    env.cleanup().await;
}

/// A publication that also publishes updates (an operator's choice): changes that
/// are not events come first, and `peek --limit 1` reads further until it finds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_reads_past_changes_that_are_not_events() {
    let _shared = testkit::BROKER.read().await;
    let env = Env::new().await;
    env.db.psql(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert, update')",
        env.publication
    ));
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID1}', 'order', 'o-1', 'created', '{{}}')"
    ));
    env.create_slot();
    // 300 transactions of one update each (about 900 changes), then two events.
    let updates: String = (0..300)
        .map(|i| format!("BEGIN; UPDATE outbox SET headers = '{{\"n\": {i}}}'; COMMIT; "))
        .collect();
    env.db.psql(&updates);
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID2}', 'order', 'o-1', 'paid', '{{}}'), ('{ID3}', 'order', 'o-1', 'shipped', '{{}}')"
    ));
    let out = env.cli(&["peek", "--limit", "1", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let arr: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    let ids: Vec<&str> = arr
        .iter()
        .map(|e| e["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [ID2]);
    let out = env.cli(&["peek"]);
    assert_eq!(stdout(&out).lines().count(), 2, "{}", stdout(&out));
    env.cleanup().await;
}
