//! Recovery and replay (docs/design.md §7): `run --start-lsn`, the replay window's anchor slot,
//! `replay --from-lsn/--to-lsn`, `replay --from-table`, and restart safety.
//! size: the NULL created_at test is one scenario: each step's counts depend on the steps before
#![allow(clippy::unwrap_used)]

use support::scenarios;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;
use testkit::amqp::Msg;

use scenarios::{
    anchor, confirmed, insert_one, is_replay, lsn, lsn_text, poll, replay_slots, stderr, stdout,
    WAIT, WINDOW_ENV,
};

#[tokio::test]
async fn start_lsn_before_the_slot_exits_2_and_after_it_skips() {
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    insert_one(&env, "a");
    got.wait_for(1, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let slot_pos = confirmed(&env, &env.slot).unwrap();

    // Older than the slot: exit 2 naming the earliest replayable LSN.
    let mut old = env.start(&["--start-lsn", "0/1"]);
    let code = old.wait(WAIT);
    let log = old.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "the earliest LSN that can be replayed is {}",
            lsn_text(slot_pos)
        )),
        "{log}"
    );
    assert!(log.contains("replay --from-table"), "{log}");

    // Newer than the slot: what committed before it is skipped, with a warning.
    insert_one(&env, "skipped-1");
    insert_one(&env, "skipped-2");
    let start = env.db.psql("SELECT pg_current_wal_lsn()");
    insert_one(&env, "after-1");
    insert_one(&env, "after-2");
    let relay = env.start(&["--start-lsn", start.trim()]);
    let msgs = got
        .wait_until(WAIT, |m| {
            m.iter()
                .any(|m| m.header("aggregate_id").as_deref() == Some("after-2"))
        })
        .await;
    let ids: Vec<String> = msgs
        .iter()
        .map(|m| m.header("aggregate_id").unwrap())
        .collect();
    // Delivery is in commit order, so anything before "after-1" would be here by now.
    assert_eq!(ids, ["a", "after-1", "after-2"]);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("transactions committed before the start LSN are skipped"),
        "{log}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn start_lsn_error_names_the_replay_window() {
    let mut env = Env::new().await;
    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_env(&[], &window);
    insert_one(&env, "a");
    got.wait_for(1, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let start = confirmed(&env, &anchor(&env)).unwrap();
    let mut old = env.start_env(&["--start-lsn", "0/1"], &window);
    assert_eq!(old.wait(WAIT), Some(2), "{}", old.log_text());
    let log = old.log_text();
    assert!(
        log.contains(&format!("the replay window starts at {}", lsn_text(start))),
        "{log}"
    );
    env.cleanup().await;
}

/// Reads `/metrics` from `addr` (plain HTTP/1.0).
fn metrics_text(addr: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    // The endpoint answers only to its own names (421 otherwise, docs/security.md).
    let _ = s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes());
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

#[tokio::test]
async fn the_window_is_kept_and_trimmed_as_time_passes() {
    let mut env = Env::new().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    // A long window first: the anchor must stay where it was created.
    let long = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &long);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("created anchor slot"),
        "{}",
        stdout(&out)
    );
    let created_at = confirmed(&env, &anchor(&env)).unwrap();
    assert_eq!(
        Some(created_at),
        confirmed(&env, &env.slot),
        "anchor copies the slot"
    );
    let got = env.consumer().await;
    let relay = env.start_env(&[], &long);
    insert_one(&env, "a");
    let msgs = got.wait_for(1, WAIT).await;
    let commit = lsn(&msgs[0].header("commit_lsn").unwrap());
    poll("the live slot to pass the commit", || {
        confirmed(&env, &env.slot).unwrap() > commit
    })
    .await;
    // Several samples later (1h window: every 5 s), the anchor has not moved.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(confirmed(&env, &anchor(&env)), Some(created_at));
    let out = env.cli_env(&["status"], &long);
    let text = stdout(&out);
    assert!(
        text.contains(&format!("replay_window:       {} ..", lsn_text(created_at))),
        "{text}"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    // A 3 s window: the anchor follows the live slot about 3 s behind.
    let short = [
        (WINDOW_ENV, "3s"),
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str()),
    ];
    let relay = env.start_env(&[], &short);
    insert_one(&env, "b");
    got.wait_for(2, WAIT).await;
    poll("the anchor to pass the first commit", || {
        confirmed(&env, &anchor(&env)).unwrap() > commit
    })
    .await;
    assert!(confirmed(&env, &anchor(&env)).unwrap() <= confirmed(&env, &env.slot).unwrap());
    poll("the retained-WAL gauge", || {
        metrics_text(&listen).contains("outbox_relay_replay_window_retained_wal_bytes")
    })
    .await;
    let out = env.cli_env(&["status", "--json"], &short);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["replay_window"]["configured"], "3s", "{v}");
    assert!(v["replay_window"]["start_lsn"].is_string(), "{v}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    // slot drop takes the anchor with it.
    let out = env.cli(&["slot", "drop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(confirmed(&env, &anchor(&env)).is_none());
    env.cleanup().await;
}

#[tokio::test]
async fn replay_delivers_exactly_the_range_while_the_live_relay_runs() {
    scenarios::replay_range(testkit::pg_port()).await;
}

#[tokio::test]
async fn replay_outside_the_window_exits_2() {
    let env = Env::new().await;
    // Without a window there is nothing to replay from.
    env.create_slot();
    let out = env.cli(&["replay", "--from-lsn", "0/1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no replay window is kept"),
        "{}",
        stderr(&out)
    );

    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create", "--if-not-exists"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let start = confirmed(&env, &anchor(&env)).unwrap();
    let out = env.cli_env(&["replay", "--from-lsn", "0/1"], &window);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("outside the replay window {} ..", lsn_text(start))),
        "{err}"
    );
    // At the end of the window: nothing to do.
    let end = lsn_text(confirmed(&env, &env.slot).unwrap());
    let out = env.cli_env(&["replay", "--from-lsn", &end], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("nothing to replay"),
        "{}",
        stdout(&out)
    );
    // Past the live slot's position: outside too.
    let out = env.cli_env(&["replay", "--from-lsn", "FF/0"], &window);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(replay_slots(&env).is_empty());
    env.cleanup().await;
}

#[tokio::test]
async fn replay_from_table_with_since_and_until() {
    let mut env = Env::new().await;
    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at) VALUES
           ('00000000-0000-0000-0000-000000000001', 'o', 'r1', 'e', '{\"n\": 1}', NULL, '2024-01-01T00:00:00Z'),
           ('00000000-0000-0000-0000-000000000003', 'o', 'r3', 'e', '{\"n\": 3}', '{\"tenant\": \"acme\"}', '2024-01-02T00:00:00Z'),
           ('00000000-0000-0000-0000-000000000002', 'o', 'r2', 'e', '{\"n\": 2}', NULL, '2024-01-02T00:00:00Z'),
           ('00000000-0000-0000-0000-000000000004', 'o', 'r4', 'e', '{\"n\": 4}', NULL, '2024-01-03T00:00:00Z')",
    );
    // More than two batches at one instant: keyset pagination over the id.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         SELECT 'bulk', n::text, 'e', jsonb_build_object('n', n), '2024-02-01T00:00:00Z'
           FROM generate_series(1, 2500) n",
    );
    let got = env.consumer().await;
    let out = env.cli(&[
        "replay",
        "--from-table",
        "--since",
        "2024-01-02T00:00:00Z",
        "--until",
        "2024-01-03T00:00:00Z",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("replayed 2 rows"), "{}", stdout(&out));
    let msgs = got.wait_for(2, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.len(), 2);
    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(
        ids,
        [
            "00000000-0000-0000-0000-000000000002",
            "00000000-0000-0000-0000-000000000003"
        ]
    );
    assert!(msgs.iter().all(is_replay));
    assert_eq!(msgs[0].text(), "{\"n\": 2}");
    assert_eq!(msgs[0].routing_key, "o.e");
    assert_eq!(msgs[1].header("tenant").as_deref(), Some("acme"));
    assert_eq!(
        msgs[1].header("outbox_table").as_deref(),
        Some("public.outbox")
    );

    let out = env.cli(&["replay", "--from-table", "--since", "2024-02-01T00:00:00Z"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let msgs = got.wait_for(2 + 2500, WAIT).await;
    let bulk = &msgs[2..];
    let ids: Vec<String> = bulk.iter().map(|m| m.message_id()).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(ids, sorted, "in id order, no duplicates");
    assert!(bulk
        .iter()
        .all(|m| is_replay(m) && m.routing_key == "bulk.e"));
    env.cleanup().await;
}

/// Rows whose created_at is NULL cannot be placed in (created_at, id) order: they are
/// skipped and counted, never a panic, and every other row is replayed in order.
#[tokio::test]
async fn replay_from_table_skips_rows_with_a_null_created_at_and_counts_them() {
    let mut env = Env::with_ddl(
        &OUTBOX_DDL.replace(
            "created_at timestamptz NOT NULL DEFAULT now()",
            "created_at timestamptz",
        ),
        &["public.outbox"],
    )
    .await;
    let row = |n: u32, at: &str| {
        format!("('00000000-0000-0000-0000-{n:012}', 'o', 'r{n}', 'e', '{{\"n\": {n}}}', {at})")
    };
    // NULL rows first by id and in between, so that no order carries them along.
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at) VALUES {}",
        [
            row(1, "NULL"),
            row(2, "'2024-01-02T00:00:00Z'"),
            row(3, "'2024-01-01T00:00:00Z'"),
            row(4, "NULL"),
            row(5, "'2024-01-03T00:00:00Z'"),
            row(6, "NULL"),
        ]
        .join(", ")
    ));
    let skipped = |n: u32| {
        format!(
            "skipped {n} rows with NULL created_at (they cannot be ordered; re-publish them by id)"
        )
    };
    let ids_of = |msgs: &[Msg]| -> Vec<String> { msgs.iter().map(|m| m.message_id()).collect() };
    let small = [
        "00000000-0000-0000-0000-000000000003",
        "00000000-0000-0000-0000-000000000002",
        "00000000-0000-0000-0000-000000000005",
    ];
    let got = env.consumer().await;

    // One page holding rows with and without a time.
    let out = env.cli(&["replay", "--from-table"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("replayed 3 rows"), "{text}");
    assert!(text.contains(&skipped(3)), "{text}");
    let msgs = got.wait_for(3, WAIT).await;
    assert_eq!(ids_of(&msgs), small);
    assert!(msgs.iter().all(is_replay));

    // More than a page of rows with a time after those (keyset pagination past the
    // NULLs), and more than a page of NULL rows.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         SELECT 'bulk', n::text, 'e', jsonb_build_object('n', n),
                CASE WHEN n % 3 = 0 THEN NULL ELSE '2024-02-01T00:00:00Z'::timestamptz END
           FROM generate_series(1, 2400) n",
    );
    let mut seen = 3;
    let out = env.cli(&["replay", "--from-table"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("replayed 1603 rows"), "{text}");
    assert!(text.contains(&skipped(803)), "{text}");
    let msgs = got.wait_for(seen + 1603, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.len(), seen + 1603);
    let ids = ids_of(&msgs[seen..]);
    assert_eq!(ids[..3], small);
    let bulk = &msgs[seen + 3..];
    assert!(
        bulk.iter().all(|m| m.routing_key == "bulk.e"
            && m.header("aggregate_id").unwrap().parse::<u32>().unwrap() % 3 != 0),
        "a NULL row was published"
    );
    let mut sorted = ids[3..].to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        ids[3..],
        sorted,
        "same created_at: in id order, no duplicates"
    );
    seen += 1603;

    // --since/--until select by time; the NULL rows may belong to any window, so
    // they are reported as skipped there too.
    for (args, want) in [
        (
            &[
                "--since",
                "2024-01-02T00:00:00Z",
                "--until",
                "2024-02-01T00:00:00Z",
            ][..],
            2,
        ),
        (&["--since", "2024-02-01T00:00:00Z"][..], 1600),
        (&["--until", "2024-01-02T00:00:00Z"][..], 1),
    ] {
        let out = env.cli(&[&["replay", "--from-table"][..], args].concat());
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.contains(&format!(
                "replayed {want} {} ",
                if want == 1 { "row" } else { "rows" }
            )),
            "{args:?}: {text}"
        );
        assert!(text.contains(&skipped(803)), "{args:?}: {text}");
        let msgs = got.wait_for(seen + want, WAIT).await;
        let ids = ids_of(&msgs[seen..]);
        match want {
            2 => assert_eq!(ids, small[1..]),
            1 => assert_eq!(ids, small[..1]),
            _ => assert!(msgs[seen..].iter().all(|m| m.routing_key == "bulk.e")),
        }
        seen += want;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.len(), seen);

    // Without NULL rows, no such line.
    env.db.psql("DELETE FROM outbox WHERE created_at IS NULL");
    let out = env.cli(&["replay", "--from-table", "--until", "2024-01-02T00:00:00Z"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("replayed 1 row "), "{}", stdout(&out));
    assert!(!stdout(&out).contains("skipped"), "{}", stdout(&out));
    env.cleanup().await;
}

#[tokio::test]
async fn a_killed_replay_leaves_no_slot_after_the_next_command() {
    let mut env = Env::new().await;
    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let start = confirmed(&env, &anchor(&env)).unwrap();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &window);
    insert_one(&env, "a");
    got.wait_for(1, WAIT).await;
    poll("the live slot to move", || {
        confirmed(&env, &env.slot).unwrap() > start
    })
    .await;

    // A replay whose broker never answers: it holds its slot until killed.
    let proxy = testkit::proxy::Proxy::start(testkit::amqp_addr()).await;
    proxy.stall();
    let stalled_url = testkit::amqp_url().replace(
        &format!(":{}", testkit::amqp_port()),
        &format!(":{}", proxy.port()),
    );
    let config = std::fs::read_to_string(env.config())
        .unwrap()
        .replace(&testkit::amqp_url(), &stalled_url);
    let path = env.dir.join("stalled.toml");
    std::fs::write(&path, config).unwrap();
    let stalled = || {
        Command::new(bin())
            .arg("--config")
            .arg(&path)
            .args(["replay", "--from-lsn", &lsn_text(start)])
            .env(WINDOW_ENV, "1h")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };

    // SIGTERM: the replay drops its own slot and exits 1.
    let child = stalled();
    poll("the replay's slot", || !replay_slots(&env).is_empty()).await;
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("run it again"), "{}", stderr(&out));
    assert!(replay_slots(&env).is_empty(), "{:?}", replay_slots(&env));

    // SIGKILL: the slot stays behind until the next replay.
    let mut child = stalled();
    poll("the replay's slot", || !replay_slots(&env).is_empty()).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let left = replay_slots(&env);
    assert_eq!(left.len(), 1, "{left:?}");

    // The next replay cleans up, then does its work and leaves nothing behind.
    poll("the killed replay's walsender to exit", || {
        env.db
            .psql(&format!(
                "SELECT active FROM pg_replication_slots WHERE slot_name = '{}'",
                left[0]
            ))
            .trim()
            == "f"
    })
    .await;
    let out = env.cli_env(&["replay", "--from-lsn", &lsn_text(start)], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(replay_slots(&env).is_empty(), "{:?}", replay_slots(&env));
    got.wait_until(WAIT, |m| m.iter().any(is_replay)).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
