//! Reloading a running relay (issue 44; docs/operations.md "Incident levers"):
//! SIGHUP and `ctl reload` reread the file. A rotated RabbitMQ password file is
//! used by the next connection and a new log filter applies at once; a changed
//! `slot` is reported as needing a restart and not applied; an invalid file keeps
//! the running configuration and every error is logged.
//!
//! Each test has its own broker user, database, slot and listener.

use std::time::Duration;

use support::*;

use crate::secret_file;
use testkit::hostile::{rabbitmqctl, BrokerUser};

const WAIT: Duration = Duration::from_secs(60);

/// SIGHUP after the broker user's password changed (in RabbitMQ and in the
/// password file) and `[relay] log_filter` was set to debug: the reload names the
/// filter as applied and the password file as reread; once the broker closes the
/// relay's connection, the relay connects with the new password and publishes on;
/// debug lines follow the reload (none before); no password is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_the_amqp_password_file_and_the_log_filter() {
    let mut env = Env::new().await;
    let user = BrokerUser::new("reload", "Pw-reload-first-7Qx");
    let file = secret_file(&env, "amqp-password", "Pw-reload-first-7Qx\n");
    let vars = vec![
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            format!("amqp://{}@127.0.0.1:{}/%2f", user.0, testkit::amqp_port()),
        ),
        ("OUTBOX_RELAY_RABBITMQ_PASSWORD_FILE", file.clone()),
    ];
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &as_refs(&vars));
    env.insert_seq(1, 10, 5);
    got.wait_for(10, WAIT).await;
    assert!(!relay.log_text().contains("DEBUG"), "{}", relay.log_text());

    rabbitmqctl(&["change_password", &user.0, "Pw-reload-second-7Qx"]);
    std::fs::write(&file, "Pw-reload-second-7Qx\n").unwrap();
    env.extra = "log_filter = \"debug\"\n".into();
    env.config();
    relay.signal("HUP");
    let log = relay
        .wait_log("configuration reloaded", Duration::from_secs(60))
        .await;
    let line = log
        .lines()
        .find(|l| l.contains("configuration reloaded"))
        .unwrap();
    assert!(
        line.contains("applied=[\"relay.log_filter\"]")
            && line.contains("rabbitmq.password_file")
            && line.contains("needs_restart=[]"),
        "{line}"
    );
    user.close_connections();
    env.insert_seq(11, 10, 5);
    got.wait_for(20, WAIT).await;
    assert_eq!(check_sequence(&got.snapshot(), 20), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let (before, after) = log.split_once("configuration reloaded").unwrap();
    assert!(!before.contains("DEBUG"), "{before}");
    assert!(after.contains("DEBUG"), "{after}");
    assert!(
        !log.contains("Pw-reload-first") && !log.contains("Pw-reload-second"),
        "{log}"
    );
    env.cleanup().await;
}

/// `ctl reload` after `slot` changed in the file: reported as needing a restart,
/// naming `postgres.slot`, and not applied (the relay streams on from its slot).
/// Then a file with two errors: `ctl reload` exits 2 naming both, SIGHUP has the
/// relay log both and keep running on its configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_reload_reports_a_changed_slot_and_refuses_an_invalid_file() {
    let mut env = Env::new().await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let vars = [("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str())];
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &vars);
    env.insert_seq(1, 10, 5);
    got.wait_for(10, WAIT).await;

    let slot = env.slot.clone();
    env.slot = testkit::unique_name("other_slot");
    let other = env.slot.clone();
    let out = env.cli_env(&["ctl", "reload"], &vars);
    env.slot = slot;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains("needs a restart (not applied): postgres.slot"),
        "{}",
        stdout(&out)
    );
    relay
        .wait_log(
            "postgres.slot changed and needs a restart",
            Duration::from_secs(30),
        )
        .await;
    env.insert_seq(11, 10, 5);
    got.wait_for(20, WAIT).await;
    let slots = env.db.psql(&format!(
        "SELECT slot_name || ':' || active FROM pg_replication_slots WHERE slot_name IN ('{}', '{other}')",
        env.slot
    ));
    assert_eq!(slots.trim(), format!("{}:true", env.slot));

    // `ctl reload` reaches the relay whatever else the file holds (issue 55): the
    // relay logs every error and answers them, and ctl exits 2 naming them. SIGHUP
    // has the relay read the file the same way.
    env.extra = "no_such_key = 1\nmetrics_read_timeout_ms = 5\n".into();
    let out = env.cli_env(&["ctl", "reload"], &vars);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{}{err}", stdout(&out));
    assert!(
        err.contains("the reload was refused")
            && err.contains("no_such_key")
            && err.contains("metrics_read_timeout_ms"),
        "{err}"
    );
    let log = relay
        .wait_log("reload refused", Duration::from_secs(30))
        .await;
    assert!(log.contains("no_such_key"), "{log}");
    relay.signal("HUP");
    env.extra = String::new();
    let log = relay
        .wait_log("reload refused", Duration::from_secs(30))
        .await;
    assert!(
        log.contains("no_such_key") && log.contains("metrics_read_timeout_ms"),
        "{log}"
    );
    env.insert_seq(21, 10, 5);
    got.wait_for(30, WAIT).await;
    assert_eq!(check_sequence(&got.snapshot(), 30), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
