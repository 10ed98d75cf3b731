//! End-to-end scenarios parameterised by the Postgres cluster they run against (its
//! port): `delivery/e2e.rs` and `cli/replay.rs` run some of them on the tests' own
//! cluster, `compat/versions.rs` runs every one of them on each supported major
//! (docs/compatibility.md). Each scenario has its own database, slot and exchange.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use testkit::amqp::{Msg, Received};
use testkit::TestDb;

use crate::*;

pub const WAIT: Duration = Duration::from_secs(60);
pub const WINDOW_ENV: &str = "OUTBOX_RELAY_RELAY_REPLAY_WINDOW";

/// `X/Y` → u64, panicking on anything else.
pub fn lsn(text: &str) -> u64 {
    testkit::parse_lsn(text).unwrap_or_else(|| panic!("not an LSN: {text:?}"))
}

pub fn lsn_text(v: u64) -> String {
    format!("{:X}/{:X}", v >> 32, v & 0xFFFF_FFFF)
}

pub use crate::{stderr, stdout};

/// A slot's confirmed_flush_lsn, or None if the slot does not exist.
pub fn confirmed(env: &Env, slot: &str) -> Option<u64> {
    let v = env.db.psql(&format!(
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"
    ));
    (!v.trim().is_empty()).then(|| lsn(&v))
}

/// The temporary slots of `replay` still present.
pub fn replay_slots(env: &Env) -> Vec<String> {
    env.db
        .psql(&format!(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE '{}\\_replay\\_%'",
            env.slot
        ))
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}

/// The replay window's anchor slot.
pub fn anchor(env: &Env) -> String {
    format!("{}_anchor", env.slot)
}

/// Polls until `f` is true, panicking with `what` after WAIT.
pub async fn poll(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn is_replay(m: &Msg) -> bool {
    m.header("replay").as_deref() == Some("true")
}

/// Inserts one transaction of one row with aggregate_id `id`; returns nothing (the
/// commit LSN is read from the delivered message's header).
pub fn insert_one(env: &Env, id: &str) {
    env.insert_tx(&[("t", id, "e", "{}")]);
}

/// The `id` (and so the `message_id`) of row number `n` of [`insert_numbered`].
pub fn numbered_id(n: usize) -> String {
    format!("00000000-0000-0000-0000-{n:012}")
}

/// Inserts rows `from..from + n` in one transaction, in that order, with id
/// [`numbered_id`] and aggregate_id the number.
pub fn insert_numbered(env: &Env, from: usize, n: usize) {
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT ('00000000-0000-0000-0000-' || lpad(s.n::text, 12, '0'))::uuid,
                'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {}) AS s(n) ORDER BY s.n",
        from + n - 1
    ));
}

/// Waits until `n` distinct messages arrived, lets stray copies arrive, and returns
/// everything received.
pub async fn distinct(got: &Received, n: usize) -> Vec<Msg> {
    got.wait_until(WAIT, |m| {
        m.iter()
            .map(|x| x.message_id())
            .collect::<HashSet<_>>()
            .len()
            >= n
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    got.snapshot()
}

/// Stops the relay with SIGTERM and asserts it exits 0.
pub fn stop(relay: Relay) {
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "clean stop exits 0: {log}");
}

/// Transactions of 1 and 100 rows, a rolled-back one, one of 20,000 rows (more than
/// max_in_flight) and a last row: exactly those messages, in commit and insert
/// order, with the rows' ids as message ids and one commit LSN per transaction.
pub async fn happy_path(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    // (first row number, rows) of each committed transaction.
    let txs = [(1, 1), (2, 100), (102, 20_000), (20_102, 1)];
    insert_numbered(&env, 1, 1);
    insert_numbered(&env, 2, 100);
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                SELECT 'seq', 'rolled-back', 'tick', '{}' FROM generate_series(1, 10);
         ROLLBACK;",
    );
    insert_numbered(&env, 102, 20_000);
    insert_numbered(&env, 20_102, 1);
    let total = 20_102;
    got.wait_for(total, WAIT).await;
    // Nothing else trickles in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs = got.snapshot();
    assert_eq!(msgs.len(), total, "exactly the committed rows");
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.message_id(), numbered_id(i + 1), "message {i}");
        assert_eq!(m.header("aggregate_id"), Some((i + 1).to_string()));
    }
    let mut previous = 0;
    for (first, rows) in txs {
        let tx = &msgs[first - 1..first - 1 + rows];
        let commit = lsn(&tx[0].header("commit_lsn").unwrap());
        assert!(
            commit > previous,
            "commit LSNs increase across transactions"
        );
        assert!(
            tx.iter()
                .all(|m| m.header("commit_lsn") == tx[0].header("commit_lsn")
                    && m.header("xid") == tx[0].header("xid")),
            "one commit LSN and xid for the transaction starting at row {first}"
        );
        previous = commit;
    }
    stop(relay);
    env.cleanup().await;
}

/// SIGTERM while a backlog flows, then a restart: every row once, 0 duplicates.
pub async fn clean_stop(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 3000, 100);
    // Stop while the stream may still be flowing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop(relay);
    let before = got.len();

    let relay = env.start(&[]);
    env.insert_seq(3001, 1000, 100);
    let dups = check_sequence(&distinct(&got, 4000).await, 4000);
    assert_eq!(
        dups, 0,
        "a clean stop publishes nothing twice (first run delivered {before})"
    );
    stop(relay);
    env.cleanup().await;
}

/// SIGKILL mid-stream, then a restart: every row, first occurrences in order,
/// duplicates within max_in_flight (1000).
pub async fn sigkill_restart(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 5000, 50);
    // Kill once something has arrived but (likely) not everything.
    got.wait_for(100, WAIT).await;
    relay.kill();
    let relay = env.start(&[]);
    let dups = check_sequence(&distinct(&got, 5000).await, 5000);
    assert!(dups <= 1000, "duplicates {dups} exceed max_in_flight");
    stop(relay);
    env.cleanup().await;
}

/// With traffic only on an unpublished table and in another database, the slot's
/// confirmed_flush_lsn follows the server's WAL within seconds (docs/design.md §1.4).
pub async fn idle_wal(port: u16) {
    let mut env = Env::with_port(port).await;
    env.db
        .psql("CREATE TABLE busy (id serial primary key, v text)");
    env.create_slot();
    let _got = env.consumer().await;
    let relay = env.start(&[]);
    let other = TestDb::new_at(port, "other");
    other.psql("CREATE TABLE t (v text)");
    for _ in 0..5 {
        env.db
            .psql("INSERT INTO busy (v) SELECT repeat('x', 200) FROM generate_series(1, 2000)");
        other.psql("INSERT INTO t SELECT repeat('y', 200) FROM generate_series(1, 2000)");
    }
    // Within a few seconds the slot's confirmed position is close to the server's.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lag = env.slot_lag_bytes();
    while lag >= 1_000_000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        lag = env.slot_lag_bytes();
    }
    assert!(lag < 1_000_000, "slot lag {lag} bytes");
    stop(relay);
    env.cleanup().await;
}

/// `check`, `status --json` on a fresh and on an active slot, `slot create --failover` (refused
/// before Postgres 17 with the version named, a failover slot from 17 on), and
/// `slot drop`: refused while a relay streams, `--force`, `--if-exists`.
pub async fn slot_status_and_drop(port: u16, major: u32) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    // `check` accepts the version (Postgres 14+) and finds everything in place.
    let out = env.cli(&["check"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains(&format!("ok    server: Postgres {major}.")),
        "{}",
        stdout(&out)
    );
    let status = |env: &Env| -> serde_json::Value {
        let out = env.cli(&["status", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let v = status(&env);
    assert_eq!(v["slot"], env.slot.as_str(), "{v}");
    assert_eq!(v["plugin"], "pgoutput", "{v}");
    assert_eq!(v["database"], env.db.name.as_str(), "{v}");
    assert_eq!(v["active"], false, "{v}");
    assert_eq!(v["failover"], false, "{v}");
    assert_eq!(v["two_phase"], false, "{v}");
    let server_lsn = lsn(&env.db.psql("SELECT pg_current_wal_lsn()"));
    let slot_lsn = lsn(v["confirmed_flush_lsn"].as_str().unwrap());
    assert!(slot_lsn > 0 && slot_lsn <= server_lsn, "{v}");
    assert!(
        lsn(v["current_wal_lsn"].as_str().unwrap()) <= server_lsn,
        "{v}"
    );

    // Failover slots: Postgres 17+.
    let live_slot = std::mem::replace(&mut env.slot, testkit::unique_name("slot"));
    let out = env.cli(&["slot", "create", "--failover"]);
    if major < 17 {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("need Postgres 17 or newer"),
            "{}",
            stderr(&out)
        );
        assert!(confirmed(&env, &env.slot).is_none(), "no slot was created");
    } else {
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(status(&env)["failover"], true);
        let out = env.cli(&["slot", "drop"]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(confirmed(&env, &env.slot).is_none(), "slot dropped");
    }
    env.slot = live_slot;

    // While a relay runs, the slot is active and `slot drop` refuses without --force.
    let _got = env.consumer().await;
    let relay = env.start(&[]);
    poll("the slot to become active", || {
        status(&env)["active"] == true
    })
    .await;
    assert!(status(&env)["active_pid"].as_i64().unwrap() > 0);
    let out = env.cli(&["slot", "drop"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    let out = env.cli(&["slot", "drop", "--force"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(confirmed(&env, &env.slot).is_none(), "slot dropped");
    drop(relay);
    let out = env.cli(&["slot", "drop", "--if-exists"]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.cleanup().await;
}

/// `peek` shows pending events in order without consuming them; a relay then
/// publishes the same events, after which nothing is pending.
pub async fn peek(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    insert_numbered(&env, 1, 2);
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                VALUES ('seq', 'rolled-back', 'tick', '{}'); ROLLBACK;",
    );
    insert_numbered(&env, 3, 1);
    let before = confirmed(&env, &env.slot);
    let peeked = |env: &Env| -> Vec<serde_json::Value> {
        let out = env.cli(&["peek", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let arr = peeked(&env);
    let ids: Vec<&str> = arr
        .iter()
        .map(|e| e["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [numbered_id(1), numbered_id(2), numbered_id(3)]);
    assert_eq!(
        arr[0]["commit_lsn"], arr[1]["commit_lsn"],
        "one transaction"
    );
    assert_ne!(arr[1]["commit_lsn"], arr[2]["commit_lsn"]);
    assert_eq!(arr[0]["routing_key"], "seq.tick");
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 3, "{}", stdout(&out));
    // Peeking consumed nothing.
    assert_eq!(confirmed(&env, &env.slot), before);
    assert_eq!(peeked(&env), arr);

    let got = env.consumer().await;
    let relay = env.start(&[]);
    let msgs = got.wait_for(3, WAIT).await;
    let delivered: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(delivered, ids);
    stop(relay);
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "no pending events");
    env.cleanup().await;
}

/// `replay --from-lsn [--to-lsn]` through the replay window's anchor slot while the
/// live relay runs: exactly the range, flagged `replay`, with the original message
/// ids and commit LSNs, and no temporary slot left behind.
pub async fn replay_range(port: u16) {
    let mut env = Env::with_port(port).await;
    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_env(&[], &window);
    // Four transactions; the second has two rows.
    insert_one(&env, "t1");
    env.insert_tx(&[("t", "t2a", "e", "{}"), ("t", "t2b", "e", "{}")]);
    insert_one(&env, "t3");
    insert_one(&env, "t4");
    let live = got.wait_for(5, WAIT).await;
    assert!(live.iter().all(|m| !is_replay(m)));
    let commit_of = |id: &str| -> u64 {
        let m = live
            .iter()
            .find(|m| m.header("aggregate_id").as_deref() == Some(id))
            .unwrap();
        lsn(&m.header("commit_lsn").unwrap())
    };
    let (c2, c3) = (commit_of("t2a"), commit_of("t3"));
    poll("the live slot to pass t4", || {
        confirmed(&env, &env.slot).unwrap() > commit_of("t4")
    })
    .await;

    // --from-lsn c2 --to-lsn c3: exactly t2 and t3, with replay = true.
    let out = env.cli_env(
        &[
            "replay",
            "--from-lsn",
            &lsn_text(c2),
            "--to-lsn",
            &lsn_text(c3),
        ],
        &window,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("replayed 3 events"),
        "{}",
        stdout(&out)
    );
    // The live relay keeps going meanwhile.
    insert_one(&env, "t5");
    let msgs = got
        .wait_until(WAIT, |m| {
            m.iter().filter(|m| is_replay(m)).count() >= 3
                && m.iter()
                    .any(|m| m.header("aggregate_id").as_deref() == Some("t5"))
        })
        .await;
    let replayed: Vec<&Msg> = msgs.iter().filter(|m| is_replay(m)).collect();
    let ids: Vec<String> = replayed
        .iter()
        .map(|m| m.header("aggregate_id").unwrap())
        .collect();
    assert_eq!(ids, ["t2a", "t2b", "t3"]);
    for m in &replayed {
        let orig = live
            .iter()
            .find(|l| l.header("aggregate_id") == m.header("aggregate_id"))
            .unwrap();
        assert_eq!(m.message_id(), orig.message_id());
        assert_eq!(m.header("commit_lsn"), orig.header("commit_lsn"));
    }
    let t5 = msgs
        .iter()
        .find(|m| m.header("aggregate_id").as_deref() == Some("t5"))
        .unwrap();
    assert!(!is_replay(t5));

    // Without --to-lsn: up to the live slot's position (t3, t4, t5 once it is
    // confirmed).
    poll("the live slot to pass t5", || {
        confirmed(&env, &env.slot).unwrap() > lsn(&t5.header("commit_lsn").unwrap())
    })
    .await;
    let before = got.len();
    let out = env.cli_env(&["replay", "--from-lsn", &lsn_text(c3)], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let msgs = got.wait_for(before + 3, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.len(), before + 3, "{:?}", got.snapshot());
    let ids: Vec<String> = msgs[before..]
        .iter()
        .map(|m| m.header("aggregate_id").unwrap())
        .collect();
    assert_eq!(ids, ["t3", "t4", "t5"]);
    assert!(msgs[before..].iter().all(is_replay));
    // No temporary slot is left behind.
    assert!(replay_slots(&env).is_empty(), "{:?}", replay_slots(&env));
    stop(relay);
    env.cleanup().await;
}

/// `[postgres] messages = ["outbox"]` (docs/messages.md), as the environment sets it.
pub const MESSAGES_ENV: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_MESSAGES", "[\"outbox\"]");

/// The value of the Prometheus sample `name{labels}` in a `/metrics` body.
pub fn metric(body: &str, name: &str, labels: &str) -> Option<f64> {
    body.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix('{')?
            .strip_prefix(labels)?
            .strip_prefix("} ")?
            .trim()
            .parse()
            .ok()
    })
}

/// The call `pg_logical_emit_message(transactional, prefix, content)`, the content a
/// JSON text literal written as is.
fn emit_call(transactional: bool, prefix: &str, content: &str) -> String {
    format!("pg_catalog.pg_logical_emit_message({transactional}, '{prefix}', '{content}'::text)")
}

/// An event's content for a logical message of `aggregate_type = 'order'`; `extra`
/// is appended inside the object (`,"id":…`, `,"headers":…`).
fn message_content(aggregate_id: &str, event_type: &str, extra: &str) -> String {
    format!(
        r#"{{"aggregate_type":"order","aggregate_id":"{aggregate_id}","event_type":"{event_type}","payload":{{"n":"{event_type}"}}{extra}}}"#
    )
}

/// Logical messages as events (docs/messages.md, issue 42) with `[postgres] messages
/// = ["outbox"]`: a transaction that mixes outbox rows, messages with a derived and
/// with their own id, a non-transactional message and one of another prefix arrives
/// as its rows and relayed messages, in the order written, with one commit LSN; a
/// rolled-back transaction's row and message never arrive (its non-transactional
/// message, which Postgres decodes all the same, neither); a transaction of one
/// message alone arrives. The ignored messages are counted on `/metrics`
/// (`outbox_relay_messages_ignored_total{reason}`: 2 non-transactional, 1 of another
/// prefix), and the non-transactional ones logged once (at most once a minute). The
/// derived id is `outbox-relay/<system identifier>/<database>/<LSN>` with the LSN
/// `pg_logical_emit_message` returned.
pub async fn logical_messages(port: u16) {
    let mut env = Env::with_port(port).await;
    let listen = testkit::free_addr();
    let vars = [
        MESSAGES_ENV,
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str()),
    ];
    let out = env.cli_env(&["slot", "create"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    // The LSNs pg_logical_emit_message returned, by event type (not published).
    env.db
        .psql("CREATE TABLE emitted (event_type text PRIMARY KEY, lsn pg_lsn NOT NULL)");
    let got = env.consumer().await;
    let relay = env.start_env(&[], &vars);
    let row = |n: usize| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{}', 'order', 'a', 'row-{n}', '{{\"n\": {n}}}')",
            numbered_id(n)
        )
    };
    let relayed = |event_type: &str, extra: &str| {
        format!(
            "INSERT INTO emitted SELECT '{event_type}', {}",
            emit_call(true, "outbox", &message_content("a", event_type, extra))
        )
    };
    let select = |transactional: bool, prefix: &str, aggregate_id: &str, event_type: &str| {
        format!(
            "SELECT {}",
            emit_call(
                transactional,
                prefix,
                &message_content(aggregate_id, event_type, "")
            )
        )
    };
    // Transaction A: rows and messages interleaved, and two that are no events.
    let other_prefix = select(true, "other-tool", "ot", "other-prefix");
    let non_transactional = select(false, "outbox", "nt", "non-transactional-1");
    env.db.psql(&format!(
        "BEGIN; {}; {}; {non_transactional}; {other_prefix}; {}; {}; {}; COMMIT;",
        row(1),
        relayed("message-2", r#","headers":{"tenant":"acme"}"#),
        row(3),
        relayed("message-4", r#","id":"own-id-4""#),
        row(5),
    ));
    // Transaction B, rolled back: a row, a message, and a non-transactional message.
    let message = select(true, "outbox", "rb", "rolled-back-message");
    let non_transactional = select(false, "outbox", "nt", "non-transactional-2");
    env.db.psql(&format!(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'rb', 'rolled-back-row', '{{}}');
         {message}; {non_transactional}; ROLLBACK;"
    ));
    // C: a transaction of one message alone; D: one row.
    env.db.psql(&relayed("message-6", ""));
    env.db.psql(&row(7));

    let msgs = got.wait_for(7, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs_after = got.snapshot();
    assert_eq!(msgs_after.len(), 7, "nothing else arrives: {msgs_after:#?}");
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap_or_default())
        .collect();
    assert_eq!(
        types,
        [
            "row-1",
            "message-2",
            "row-3",
            "message-4",
            "row-5",
            "message-6",
            "row-7"
        ],
        "in the order written"
    );
    // Transaction A: one commit LSN and xid, tx_index counting rows and messages.
    let a = &msgs[..5];
    let index: Vec<String> = a.iter().map(|m| m.header("tx_index").unwrap()).collect();
    assert_eq!(index, ["0", "1", "2", "3", "4"]);
    for m in a {
        assert_eq!(m.header("commit_lsn"), a[0].header("commit_lsn"), "{m:?}");
        assert_eq!(m.header("xid"), a[0].header("xid"), "{m:?}");
    }
    let commits: Vec<u64> = [0, 5, 6]
        .iter()
        .map(|&i| lsn(&msgs[i].header("commit_lsn").unwrap()))
        .collect();
    assert!(commits.windows(2).all(|w| w[0] < w[1]), "{commits:?}");
    // Ids: the rows', the derived ones (from the LSN the emit returned), the own one.
    let system_id = env
        .db
        .psql("SELECT system_identifier FROM pg_control_system()");
    let emitted = |event_type: &str| {
        env.db.psql(&format!(
            "SELECT lsn FROM emitted WHERE event_type = '{event_type}'"
        ))
    };
    let derived = |event_type: &str| {
        format!(
            "outbox-relay/{}/{}/{}",
            system_id.trim(),
            env.db.name,
            emitted(event_type).trim()
        )
    };
    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(
        ids,
        [
            numbered_id(1),
            derived("message-2"),
            numbered_id(3),
            "own-id-4".to_string(),
            numbered_id(5),
            derived("message-6"),
            numbered_id(7),
        ]
    );
    // A message's event as a row's: table header, headers object, body, routing.
    let m = &msgs[1];
    assert_eq!(m.header("outbox_table").as_deref(), Some("message:outbox"));
    assert_eq!(
        msgs[0].header("outbox_table").as_deref(),
        Some("public.outbox")
    );
    assert_eq!(m.header("tenant").as_deref(), Some("acme"));
    assert_eq!(m.header("aggregate_type").as_deref(), Some("order"));
    assert_eq!(m.header("aggregate_id").as_deref(), Some("a"));
    assert_eq!(m.text(), r#"{"n":"message-2"}"#);
    assert_eq!(m.routing_key, "order.message-2");
    assert_eq!(
        m.properties.content_type().as_ref().map(|c| c.as_str()),
        Some("application/json")
    );

    // The ignored ones, counted by reason; the non-transactional ones logged once.
    let name = "outbox_relay_messages_ignored_total";
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        if let Some((200, body)) = http_get(&listen, "/metrics").await {
            let counts = (
                metric(&body, name, "reason=\"non_transactional\""),
                metric(&body, name, "reason=\"other_prefix\""),
            );
            if counts == (Some(2.0), Some(1.0)) {
                break;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: 2 non_transactional and 1 other_prefix expected; last scrape:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = relay.log_text();
    assert_eq!(
        log.matches("a non-transactional logical message with a relayed prefix was ignored")
            .count(),
        1,
        "logged once a minute: {log}"
    );
    assert!(
        !log.contains("other-tool"),
        "other prefixes are not logged: {log}"
    );
    stop(relay);
    env.cleanup().await;
}

/// A producer of events for the fault and stream tests (SQL to run once in the
/// test's database, which has the default outbox): `produce(a, b, with_rows)` writes
/// events `a..=b` in the calling transaction, each either an outbox row (with rows,
/// two of every three) or a transactional logical message of prefix `outbox` (every
/// fifth of those with an `id` of its own), in that order, `aggregate_type = 'seq'`
/// and `aggregate_id` the event's number. `produced` (no published table) records
/// each number and, for a message, the LSN `pg_logical_emit_message` returned and
/// its own id. Each call first emits a non-transactional message with the prefix
/// `outbox` and a transactional one of another prefix: neither is an event.
pub const MESSAGE_PRODUCER: &str = r#"
CREATE TABLE produced (seq bigint PRIMARY KEY, lsn pg_lsn, own_id text);
CREATE FUNCTION produce(a bigint, b bigint, with_rows boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  own text;
BEGIN
  PERFORM pg_catalog.pg_logical_emit_message(false, 'outbox',
    '{"aggregate_type":"nontx","aggregate_id":"0","event_type":"tick","payload":{}}'::text);
  PERFORM pg_catalog.pg_logical_emit_message(true, 'other-tool', 'not an event'::text);
  FOR s IN a..b LOOP
    IF with_rows AND s % 3 <> 0 THEN
      INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
      VALUES ('seq', s::text, 'tick', jsonb_build_object('seq', s));
      INSERT INTO produced (seq) VALUES (s);
    ELSE
      own := CASE WHEN s % 5 = 0 THEN 'own-' || s END;
      INSERT INTO produced (seq, lsn, own_id) VALUES (s,
        pg_catalog.pg_logical_emit_message(true, 'outbox', jsonb_strip_nulls(jsonb_build_object(
          'aggregate_type', 'seq', 'aggregate_id', s::text, 'event_type', 'tick',
          'payload', jsonb_build_object('seq', s), 'id', own))::text),
        own);
    END IF;
  END LOOP;
END $$;
"#;

/// One transaction of [`MESSAGE_PRODUCER`]: events `from..=to`, unless an earlier
/// attempt committed them (so that a retry after an unknown outcome cannot produce
/// them twice).
pub fn produce_sql(from: u64, to: u64, with_rows: bool) -> String {
    format!(
        "SELECT produce({from}, {to}, {with_rows})
          WHERE NOT EXISTS (SELECT 1 FROM produced WHERE seq = {from})"
    )
}

/// `seq|id` of every event [`MESSAGE_PRODUCER`] committed: a row's id, a message's
/// own id or the id the relay derives for it, `outbox-relay/<system
/// identifier>/<database>/<LSN of the message>` (docs/messages.md).
pub const PRODUCED_IDS: &str = "SELECT o.aggregate_id::bigint, o.id::text
       FROM outbox o JOIN produced p ON p.seq::text = o.aggregate_id AND p.lsn IS NULL
      WHERE o.aggregate_type = 'seq'
     UNION ALL
     SELECT seq, coalesce(own_id, 'outbox-relay/'
            || (SELECT system_identifier FROM pg_control_system()) || '/'
            || current_database() || '/' || lsn::text)
       FROM produced WHERE lsn IS NOT NULL";
