//! The one-shot commands with logical messages (docs/messages.md): `peek` shows them
//! beside rows, `check` says whether PUBLIC can still emit, `replay --from-lsn`
//! replays them under their original ids, `replay --from-table` says why it cannot,
//! and `status` counts what the running relay ignored.
#![allow(clippy::unwrap_used)]

use support::scenarios;

use support::*;
use testkit::free_addr;

use scenarios::{confirmed, is_replay, lsn, lsn_text, poll, stderr, stdout, WAIT, WINDOW_ENV};

const MESSAGES: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_MESSAGES", "[\"outbox\"]");

fn emit(aggregate_id: &str) -> String {
    format!(
        "SELECT pg_logical_emit_message(true, 'outbox', \
           '{{\"aggregate_type\":\"order\",\"aggregate_id\":\"{aggregate_id}\",\"event_type\":\"created\",\"payload\":{{}}}}')"
    )
}

#[tokio::test]
async fn peek_shows_messages_beside_rows_and_check_says_who_may_emit() {
    let env = Env::new().await;
    let out = env.cli_env(&["slot", "create"], &[MESSAGES]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.db.psql(&format!(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', 'row-1', 'created', '{{}}'); {}; COMMIT;",
        emit("message-2")
    ));

    let out = env.cli_env(&["peek"], &[MESSAGES]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("public.outbox") && text.contains("message:outbox"),
        "{text}"
    );
    let system = env
        .db
        .psql("SELECT system_identifier FROM pg_control_system()");
    assert!(
        text.contains(&format!("outbox-relay/{system}/{}/", env.db.name)),
        "the derived id: {text}"
    );
    // Without the key, peek shows the row only.
    let text = stdout(&env.cli(&["peek"]));
    assert!(!text.contains("message:outbox"), "{text}");

    // Any role may emit on a fresh database: check warns, naming the fix.
    let out = env.cli_env(&["check"], &[MESSAGES]);
    let text = stdout(&out);
    assert!(
        text.contains("logical messages: prefixes \"outbox\" relayed"),
        "{text}"
    );
    assert!(
        text.contains("warn  pg_logical_emit_message: PUBLIC can still call")
            && text.contains("sql/outbox_messages.sql"),
        "{text}"
    );
    env.db.psql(
        "DO $$ DECLARE f regprocedure; BEGIN
           FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
             EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
           END LOOP; END $$",
    );
    let text = stdout(&env.cli_env(&["check"], &[MESSAGES]));
    assert!(
        text.contains("ok    pg_logical_emit_message: PUBLIC cannot call it"),
        "{text}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn replay_from_lsn_replays_messages_under_their_ids_and_from_table_explains() {
    let mut env = Env::new().await;
    let env_vars = [(WINDOW_ENV, "1h"), MESSAGES];
    let out = env.cli_env(&["slot", "create"], &env_vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("m.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    let relay = env.start_with_env(&config, "info", &env_vars);
    // Before the two events: counted by the time they are delivered.
    env.db
        .psql("SELECT pg_logical_emit_message(false, 'outbox', 'survives rollbacks')");
    env.db.psql(&emit("m1"));
    env.db.psql(&emit("m2"));
    let live = got.wait_for(2, WAIT).await;
    let first = lsn(&live[0].header("commit_lsn").unwrap());
    let last = lsn(&live[1].header("commit_lsn").unwrap());
    poll("the live slot to pass m2", || {
        confirmed(&env, &env.slot).unwrap() > last
    })
    .await;

    // status asks the running relay what it ignored.
    let out = std::process::Command::new(bin())
        .arg("--config")
        .arg(&config)
        .arg("status")
        .envs(env_vars)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(
        text.contains("messages_ignored:    1 non_transactional"),
        "{text}{}",
        stderr(&out)
    );

    let out = env.cli_env(&["replay", "--from-lsn", &lsn_text(first)], &env_vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let msgs = got
        .wait_until(WAIT, |m| m.iter().filter(|m| is_replay(m)).count() >= 2)
        .await;
    let replayed: Vec<String> = msgs
        .iter()
        .filter(|m| is_replay(m))
        .map(|m| m.message_id())
        .collect();
    let originals: Vec<String> = live.iter().map(|m| m.message_id()).collect();
    assert_eq!(
        replayed, originals,
        "a replay's copies carry the original ids"
    );

    // --from-table replays tables only, and says so.
    let out = env.cli_env(&["replay", "--from-table", "--dry-run"], &env_vars);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("logical messages (prefixes outbox) have no table")
            && err.contains("--from-lsn")
            && err.contains("replay_window"),
        "{err}"
    );
    // With no table at all, it is refused.
    env.tables = Vec::new();
    let out = env.cli_env(&["replay", "--from-table"], &env_vars);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--from-lsn"), "{}", stderr(&out));
    let (_, _) = relay.terminate();
    env.cleanup().await;
}
