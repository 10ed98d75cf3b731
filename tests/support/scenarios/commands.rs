//! The operator's commands on a live slot: `check`, `status`, `slot create|drop`,
//! `peek` and `replay`.

use super::*;

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
    // How long the slot outlives a stopped relay, read from this server: the
    // clusters keep max_slot_wal_keep_size at its default (-1), and Postgres 18 has an
    // idle timeout (default 0) that the others lack.
    let text = stdout(&out);
    let keep = text
        .lines()
        .find(|l| l.starts_with("warn  max_slot_wal_keep_size: "))
        .unwrap_or_else(|| panic!("no max_slot_wal_keep_size warning:\n{text}"));
    assert!(keep.contains("-1 (unbounded)"), "{text}");
    let idle = text
        .lines()
        .find(|l| l.contains("idle_replication_slot_timeout: "));
    match major {
        18.. => assert!(
            idle.is_some_and(|l| l.starts_with("ok    idle_replication_slot_timeout: 0:")),
            "{text}"
        ),
        _ => assert!(idle.is_none(), "{text}"),
    }
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
