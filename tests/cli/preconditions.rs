//! Every unmet precondition stops `check` and `run` with exit code 2 and one sentence
//! that names the fix; secrets never appear in any output (docs/design.md §6, §8).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::*;
use testkit::{pg_port, unique_name};

/// Runs `run` and expects it to exit by itself with code 2.
fn run_expect_2(env: &Env) -> String {
    let mut relay = env.start(&[]);
    let code = relay.wait(Duration::from_secs(30));
    let log = relay.log_text();
    assert_eq!(code, Some(2), "run should exit 2: {log}");
    log
}

fn assert_one_error_line(out: &str, needle: &str) {
    let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "exactly one error line: {out}");
    assert!(
        errors[0].contains(needle),
        "{needle:?} not in {:?}",
        errors[0]
    );
}

#[tokio::test]
async fn check_passes_on_a_ready_setup() {
    let env = Env::new().await;
    env.create_slot();
    let out = env.cli(&["check"]);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    for line in [
        "ok    config",
        "wal_level",
        "publication",
        "slot",
        "rabbitmq",
    ] {
        assert!(t.contains(line), "{line:?} missing from {t}");
    }
    assert!(!t.contains("FAIL"), "{t}");
    // The tests connect as postgres: check says that is more than the relay needs.
    assert!(
        t.contains("warn  postgres role postgres: is a superuser") && t.contains("sql/role.sql"),
        "{t}"
    );
    env.cleanup().await;
}

/// The least-privileged role of sql/role.sql is enough for `slot create`, `check`
/// and `run`, and `check` does not call it a superuser.
#[tokio::test]
async fn the_role_of_role_sql_is_enough() {
    let mut env = Env::new().await;
    let role = unique_name("relay_least");
    let _drop = DropRole {
        role: role.clone(),
        db: env.db.name.clone(),
    };
    let role_sql = concat!(env!("CARGO_MANIFEST_DIR"), "/../sql/role.sql");
    testkit::psql_file_at(
        pg_port(),
        &env.db.name,
        role_sql,
        &[("relay_role", role.as_str())],
    );
    // An administrator creates the publication (sql/outbox.sql does); the role
    // cannot, and need not.
    env.db.psql(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert')",
        env.publication
    ));
    let url = env.db.url().replacen("postgres@", &format!("{role}@"), 1);
    let config = env.config_file("least.toml", &url, &testkit::amqp_url(), "");
    for args in [&["slot", "create"][..], &["check"][..]] {
        let out = env.cli_with(&config, "info", args);
        let t = output_text(&out);
        assert!(out.status.success(), "{args:?} as {role}: {t}");
        assert!(!t.contains("superuser"), "{args:?}: {t}");
    }
    let got = env.consumer().await;
    let relay = env.start_with(&config, "info", &[]);
    env.insert_seq(1, 50, 10);
    let msgs = got.wait_for(50, Duration::from_secs(30)).await;
    assert_eq!(check_sequence(&msgs, 50), 0, "no duplicates");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("superuser"), "{log}");
    // The stored position (docs/design.md) was written by the role.
    let stored = env.db.psql(&format!(
        "SELECT count(*) FROM outbox_relay_state WHERE slot_name = '{}'",
        env.slot
    ));
    assert_eq!(stored, "1");
    let out = env.cli_with(&config, "info", &["slot", "drop"]);
    assert!(out.status.success(), "{}", output_text(&out));
    env.cleanup().await;
}

#[tokio::test]
async fn missing_slot() {
    let env = Env::new().await;
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert_one_error_line(&output_text(&out), "outbox-relay slot create");
    let log = run_expect_2(&env);
    assert_one_error_line(&log, "outbox-relay slot create");
    env.cleanup().await;
}

#[tokio::test]
async fn missing_publication_and_table_not_in_it() {
    let env = Env::new().await;
    env.db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
        env.slot
    ));
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(2));
    assert_one_error_line(&output_text(&out), "publication");
    run_expect_2(&env);

    env.db.psql("CREATE TABLE other (id int primary key)");
    env.db.psql(&format!(
        "CREATE PUBLICATION {} FOR TABLE other",
        env.publication
    ));
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(2));
    assert_one_error_line(&output_text(&out), "ALTER PUBLICATION");
    let log = run_expect_2(&env);
    assert_one_error_line(&log, "ALTER PUBLICATION");
    env.cleanup().await;
}

#[tokio::test]
async fn missing_table_and_missing_mapped_column() {
    let mut env = Env::new().await;
    env.tables = vec!["public.nope".into()];
    let out = env.cli(&["slot", "create"]);
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert_one_error_line(&output_text(&out), "nope");

    env.tables = vec!["public.outbox".into()];
    env.create_slot();
    env.extra = "[mapping]\nevent_type = \"kind\"\n".into();
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(2));
    let t = output_text(&out);
    assert_one_error_line(&t, "kind");
    assert!(t.contains("event_type"), "{t}");
    run_expect_2(&env);
    env.cleanup().await;
}

#[tokio::test]
async fn wal_level_not_logical() {
    // The machine's own Postgres (5432) runs with wal_level=replica.
    let level = std::process::Command::new("psql")
        .args([
            "-XAtq",
            "-h",
            "127.0.0.1",
            "-p",
            "5432",
            "-U",
            "postgres",
            "-c",
            "show wal_level",
        ])
        .output()
        .unwrap();
    if String::from_utf8_lossy(&level.stdout).trim() == "logical" {
        eprintln!("skipping: the Postgres on 5432 has wal_level=logical");
        return;
    }
    let env = Env::new().await;
    let config = env.config_with("postgresql://postgres@127.0.0.1:5432/postgres");
    let out = std::process::Command::new(bin())
        .args(["--config", config.to_str().unwrap(), "check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_one_error_line(&output_text(&out), "wal_level");
    let out = std::process::Command::new(bin())
        .args(["--config", config.to_str().unwrap(), "slot", "create"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_one_error_line(&output_text(&out), "wal_level");
    env.cleanup().await;
}

#[tokio::test]
async fn wrong_passwords_exit_2_and_never_show_secrets() {
    let env = Env::new().await;
    env.create_slot();
    let role = unique_name("relayuser");
    testkit::psql(
        "postgres",
        &format!(
            "CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'right-pass-{role}'; GRANT outbox_auth_scram TO {role};"
        ),
    );
    let secret = "s3cr3t-Wrong-Pg";
    let url = format!(
        "postgresql://{role}:{secret}@127.0.0.1:{}/{}",
        pg_port(),
        env.db.name
    );
    let config = env.config_with(&url);
    for args in [
        &["check"][..],
        &["run"][..],
        &["status"][..],
        &["slot", "create"][..],
    ] {
        let out = std::process::Command::new(bin())
            .arg("--config")
            .arg(&config)
            .args(args)
            .env("RUST_LOG", "trace")
            .output()
            .unwrap();
        let t = output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains("password"), "{args:?}: {t}");
        assert!(!t.contains(secret), "{args:?} printed the password: {t}");
    }
    testkit::psql("postgres", &format!("DROP ROLE {role}"));

    // Wrong broker password: exit 2, not shown.
    let mq_secret = "Mq-s3cr3t-wrong";
    let toml = std::fs::read_to_string(env.config())
        .unwrap()
        .replace("guest:guest@", &format!("guest:{mq_secret}@"));
    let path = env.dir.join("badmq.toml");
    std::fs::write(&path, toml).unwrap();
    for args in [&["check"][..], &["run"][..]] {
        let out = std::process::Command::new(bin())
            .arg("--config")
            .arg(&path)
            .args(args)
            .env("RUST_LOG", "trace")
            .output()
            .unwrap();
        let t = output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(!t.contains(mq_secret), "{args:?} printed the password: {t}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn status_text_and_json_and_slot_drop() {
    let env = Env::new().await;
    env.create_slot();
    let out = env.cli(&["status"]);
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains(&format!("slot:                {}", env.slot)),
        "{t}"
    );
    assert!(t.contains("confirmed_flush_lsn: "), "{t}");
    assert!(t.contains("no relay is streaming"), "{t}");

    let out = env.cli(&["status", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["slot"], env.slot.as_str());
    assert_eq!(v["active"], false);
    assert!(v["confirmed_flush_lsn"].as_str().unwrap().contains('/'));

    // While a relay runs, the slot is active and `slot drop` refuses without --force.
    let mut broker_env = env;
    let _got = broker_env.consumer().await;
    let relay = broker_env.start(&[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = broker_env.cli(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if v["active"] == true {
            assert!(v["active_pid"].as_i64().unwrap() > 0);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "slot never became active: {}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = broker_env.cli(&["slot", "drop"]);
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("--force"),
        "{}",
        output_text(&out)
    );
    let out = broker_env.cli(&["slot", "drop", "--force"]);
    assert!(out.status.success(), "{}", output_text(&out));
    drop(relay);
    let out = broker_env.cli(&["slot", "drop", "--if-exists"]);
    assert!(out.status.success(), "{}", output_text(&out));
    broker_env.cleanup().await;
}
