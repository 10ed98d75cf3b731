//! Secrets from files, the way Kubernetes and Vault mount them (docs/security.md):
//! `[rabbitmq] password_file` and `stream_password_file` replace the URLs'
//! passwords and are read at every (re)connect, so a rotated password needs no
//! restart; the Postgres password file (`passfile`, libpq's) is read at every login.
//!
//! Needs the test services (scripts/test-services.sh).
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use support::*;

use crate::secret_file;
use testkit::hostile::{rabbitmqctl, BrokerUser};
use testkit::unique_name;

const WAIT: Duration = Duration::from_secs(60);

/// The AMQP URL names only the user; the password comes from `password_file`.
/// After the password is changed in the broker and in the file and the relay's
/// connection is closed, the relay reconnects with the new one and goes on
/// publishing; no password is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amqp_password_file_is_read_at_every_connect() {
    let mut env = Env::new().await;
    let user = BrokerUser::new("pwfile", "Pw-first-7Qx");
    let file = secret_file(&env, "amqp-password", "Pw-first-7Qx\n");
    let url = format!("amqp://{}@127.0.0.1:{}/%2f", user.0, testkit::amqp_port());
    env.create_slot();
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_URL", url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_PASSWORD_FILE", file.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // A wrong password in the file: refused, exit 2, not echoed.
    let wrong = secret_file(&env, "wrong", "Pw-wrong-7Qx\n");
    let mut bad = vars.clone();
    bad[1].1 = wrong;
    let out = env.cli_env(&["check"], &as_refs(&bad));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(!text.contains("Pw-wrong-7Qx"), "{text}");

    let got = env.consumer().await;
    let relay = env.start_env(&[], &as_refs(&vars));
    env.insert_seq(1, 10, 5);
    got.wait_for(10, WAIT).await;

    rabbitmqctl(&["change_password", &user.0, "Pw-second-7Qx"]);
    std::fs::write(&file, "Pw-second-7Qx\n").unwrap();
    user.close_connections();
    env.insert_seq(11, 10, 5);
    got.wait_for(20, WAIT).await;
    assert_eq!(check_sequence(&got.snapshot(), 20), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("reconnect") || log.contains("session ended"),
        "{log}"
    );
    assert!(
        !log.contains("Pw-first") && !log.contains("Pw-second"),
        "{log}"
    );
    env.cleanup().await;
}

/// `stream_password_file` for the stream target: the right password connects, a
/// wrong one is refused with exit 2 and not echoed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_password_file_replaces_the_urls_password() {
    let env = Env::new().await;
    let user = BrokerUser::new("pwfile", "Sp-first-7Qx");
    let stream = unique_name("stream_pwfile");
    env.create_slot();
    let file = secret_file(&env, "stream-password", "Sp-first-7Qx\n");
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        (
            "OUTBOX_RELAY_RABBITMQ_STREAM_URL",
            format!(
                "rabbitmq-stream://{}@127.0.0.1:{}/%2f",
                user.0,
                testkit::stream::stream_addr().port()
            ),
        ),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_PASSWORD_FILE", file.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    std::fs::write(&file, "Sp-wrong-7Qx\n").unwrap();
    let out = env.cli_env(&["check"], &as_refs(&vars));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        !text.contains("Sp-wrong") && !text.contains("Sp-first"),
        "{text}"
    );
    support::stream::delete_stream(&stream).await;
    env.cleanup().await;
}

/// libpq's `passfile` through the binary: the Postgres URL names no password and
/// every command logs in with the file's (a role that must use SCRAM over TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_passfile_logs_every_command_in() {
    let env = Env::new().await;
    let role = unique_name("pf");
    let _drop = DropRole {
        role: role.clone(),
        db: env.db.name.clone(),
    };
    testkit::psql(
        "postgres",
        &format!(
            "SET password_encryption = 'scram-sha-256'; \
             CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'Pf-secret-7Qx'; \
             GRANT outbox_auth_tls TO {role};"
        ),
    );
    env.db.psql(&format!(
        "GRANT ALL ON SCHEMA public TO {role}; GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}; \
         ALTER TABLE outbox OWNER TO {role}; GRANT CREATE ON DATABASE {} TO {role};",
        env.db.name
    ));
    let passfile = secret_file(
        &env,
        "pgpass",
        &format!("localhost:{}:*:{role}:Pf-secret-7Qx\n", testkit::pg_port()),
    );
    let url = format!(
        "postgresql://{role}@localhost:{}/{}?sslmode=require&passfile={passfile}",
        testkit::pg_port(),
        env.db.name
    );
    let cfg = env.config_with(&url);
    for args in [&["slot", "create"][..], &["check"][..], &["status"][..]] {
        let out = Command::new(bin())
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap();
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert!(out.status.success(), "{args:?}:\n{text}");
        assert!(!text.contains("Pf-secret"), "{text}");
    }
    env.cleanup().await;
}

/// Every secret file the relay reads is held to the key files' rule (libpq's for
/// `sslkey`): readable by its owner only (0600), or also by its group when root owns
/// it (0640). A file others may read is refused at load, by every command, with
/// exit 2 and a sentence naming the key and the chmod.
#[test]
fn secret_files_others_may_read_are_refused_naming_the_key() {
    use std::os::unix::fs::chown;
    let dir = support::cli::TempDir::new();
    let cfg = dir.file(
        "relay.toml",
        "[postgres]\nurl = \"postgresql://relay@127.0.0.1:1/app\"\n\
         [rabbitmq]\nurl = \"amqp://relay@127.0.0.1:1/%2f\"\n\
         [relay]\nmetrics_listen = \"127.0.0.1:0\"\n",
    );
    let cert = dir.file("cert.pem", "not read before the mode check\n");
    let keys = [
        ("rabbitmq", "password_file", vec![]),
        ("rabbitmq", "stream_password_file", vec![]),
        (
            "rabbitmq",
            "management_password_file",
            vec![("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_USER", "monitor")],
        ),
        ("tracing", "headers_file", vec![]),
        ("relay", "metrics_bearer_token_file", vec![]),
        (
            "relay",
            "metrics_basic_auth_password_file",
            vec![("OUTBOX_RELAY_RELAY_METRICS_BASIC_AUTH_USER", "prometheus")],
        ),
        (
            "relay",
            "metrics_tls_key_file",
            vec![(
                "OUTBOX_RELAY_RELAY_METRICS_TLS_CERT_FILE",
                cert.to_str().unwrap(),
            )],
        ),
    ];
    for (section, key, extra) in keys {
        let secret = dir.file(key, "S3cret-value-0123\n");
        let var = format!("OUTBOX_RELAY_{}_{}", section, key).to_uppercase();
        let check = |mode: u32, owner: u32| {
            chown(&secret, Some(owner), Some(owner)).unwrap();
            std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(mode)).unwrap();
            let out = Command::new(bin())
                .arg("--config")
                .arg(&cfg)
                .arg("check")
                .env(&var, &secret)
                .envs(extra.iter().copied())
                .env("RUST_LOG", "warn")
                .current_dir(&dir.0)
                .output()
                .unwrap();
            (
                out.status.code(),
                format!("{}{}", stdout(&out), stderr(&out)),
            )
        };
        for (mode, owner, refused) in [
            (0o644, 0, true),
            (0o604, 0, true),
            (0o640, 65534, true),
            (0o640, 0, false),
            (0o600, 65534, false),
        ] {
            let (code, text) = check(mode, owner);
            let named = text.contains(&format!("{section}.{key}"))
                && text.contains("group or world access")
                && text.contains("chmod 600");
            assert_eq!(
                named, refused,
                "{section}.{key} mode {mode:o} owner {owner}:\n{text}"
            );
            if refused {
                assert_eq!(code, Some(2), "{text}");
            }
            assert!(!text.contains("S3cret-value"), "{text}");
        }
    }
}

/// A password file that passes the mode check but cannot be read (a Kubernetes
/// secret volume's file, owned by root with mode 0600, read by the relay's own
/// user) is not dropped without a word: the relay says it cannot read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_passfile_is_reported() {
    use std::os::unix::process::CommandExt;
    let env = Env::new().await;
    let passfile = secret_file(&env, "pgpass", "*:*:*:*:Pf-unread-7Qx\n");
    let url = format!(
        "postgresql://outbox_nobody@127.0.0.1:{}/{}?passfile={passfile}",
        testkit::pg_port(),
        env.db.name
    );
    let cfg = env.config_with(&url);
    // The relay runs as nobody: it may read the directory and the configuration,
    // not the password file.
    for p in [&env.dir, &cfg] {
        let mode = if p.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let out = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .arg("check")
        .env("HOME", &env.dir)
        .env("RUST_LOG", "warn")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        text.contains(&format!("the password file {passfile} cannot be read")),
        "{text}"
    );
    assert!(!text.contains("Pf-unread"), "{text}");
    env.cleanup().await;
}
