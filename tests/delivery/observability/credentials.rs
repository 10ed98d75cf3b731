//! No password in any log line at trace level.

use super::*;

/// A Postgres login role with REPLICATION and a SCRAM password (member of
/// `outbox_auth_scram`, which pg_hba.conf makes authenticate with SCRAM over TCP);
/// dropped on drop.
struct PgRole {
    name: String,
    password: String,
    db: String,
}

impl PgRole {
    fn new(db: &testkit::TestDb) -> PgRole {
        let name = unique_name("obs");
        let password = unique_name("pgsecret");
        testkit::psql(
            "postgres",
            &format!(
                "SET password_encryption = 'scram-sha-256';
                 CREATE ROLE {name} LOGIN REPLICATION PASSWORD '{password}';
                 GRANT outbox_auth_scram TO {name};"
            ),
        );
        db.psql(&format!("GRANT SELECT ON outbox TO {name}"));
        PgRole {
            name,
            password,
            db: db.name.clone(),
        }
    }
}

impl Drop for PgRole {
    fn drop(&mut self) {
        let psql = |db: &str, sql: &str| {
            let _ = testkit::try_psql(testkit::pg_port(), db, sql);
        };
        psql(
            &self.db,
            &format!("REVOKE ALL ON outbox FROM {}", self.name),
        );
        psql("postgres", &format!("DROP ROLE IF EXISTS {}", self.name));
    }
}

/// A RabbitMQ user with a password of its own (full permissions on `/`); deleted on
/// drop. Adding a user does not disturb other tests.
struct AmqpUser {
    name: String,
    password: String,
}

impl AmqpUser {
    fn new() -> AmqpUser {
        let name = unique_name("obs");
        let password = unique_name("mqsecret");
        let ctl = |args: &[&str]| {
            let out = testkit::rabbitmqctl_command().args(args).output().unwrap();
            assert!(
                out.status.success(),
                "rabbitmqctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ctl(&["add_user", &name, &password]);
        let user = AmqpUser { name, password };
        ctl(&["set_permissions", "-p", "/", &user.name, ".*", ".*", ".*"]);
        user
    }
}

impl Drop for AmqpUser {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command()
            .args(["delete_user", &self.name])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_in_any_log_line_at_trace_level() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let role = PgRole::new(&env.db);
    let user = AmqpUser::new();
    let pg = format!(
        "postgresql://{}:{}@127.0.0.1:{}/{}?sslmode=disable",
        role.name,
        role.password,
        testkit::pg_port(),
        env.db.name
    );
    let amqp = format!(
        "amqp://{}:{}@{}/%2f",
        user.name,
        user.password,
        amqp_target()
    );
    let addr = free_addr();
    let config = env.config_file("secret.toml", &pg, &amqp, &addr);
    let secrets = [role.password.as_str(), user.password.as_str()];
    let assert_clean = |what: &str, text: &str| {
        for s in secrets {
            let leaks: Vec<&str> = text.lines().filter(|l| l.contains(s)).take(3).collect();
            assert!(leaks.is_empty(), "{what} shows a password: {leaks:#?}");
        }
    };

    // One-shot commands at trace level, text and JSON logs.
    for args in [
        &["check"][..],
        &["status"],
        &["peek"],
        &["--log-format", "json", "check"],
    ] {
        let out = env.cli_with(&config, "trace", args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_clean(&format!("{args:?} stdout"), &stdout(&out));
        assert_clean(&format!("{args:?} stderr"), &stderr(&out));
    }

    // The relay at trace level through a publish, a broker reconnect and a stop.
    for format in ["text", "json"] {
        let relay = env.start_with(&config, "trace", &["--log-format", format]);
        wait_ready(&addr, 200, &relay).await;
        let before = got.len();
        env.insert_seq(before + 1, 5, 5);
        got.wait_for(before + 5, WAIT).await;
        let (code, log) = relay.terminate();
        assert_eq!(code, Some(0), "{log}");
        assert!(log.contains("TRACE"), "trace logging was not on:\n{log}");
        // The log does quote the broker URL (redacted): the test can fail.
        assert!(
            log.contains(&format!("{}:***@", user.name)),
            "the log never shows the broker URL (redacted):\n{log}"
        );
        assert_clean(&format!("relay log ({format})"), &log);
    }

    // A failed login prints neither the wrong nor the right password.
    let bad = pg.replace(&role.password, "wrong-password-xyz");
    let bad_config = env.config_file("bad.toml", &bad, &amqp, "");
    let out = env.cli_with(&bad_config, "trace", &["status"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("wrong-password-xyz"),
        "{}",
        stderr(&out)
    );
    assert_clean("failed login", &stderr(&out));
    drop(user);
    drop(role);
    env.cleanup().await;
}
