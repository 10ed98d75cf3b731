//! The built binary's command line, configuration errors and exit codes (docs/design.md §6).
//! No services needed: everything here fails or finishes before connecting.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use support::cli::{relay_in, TempDir};
use support::{stderr, stdout};

const SECRET: &str = "hunter2-s3cret";

/// [`support::cli::relay_in`] with 3 s to finish.
fn relay(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    relay_in(cwd, args, env, Duration::from_secs(3))
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../outbox-relay.example.toml")
}

#[test]
fn help_lists_every_command() {
    let dir = TempDir::new();
    let out = relay(&dir.0, &["--help"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    for word in [
        "run",
        "slot",
        "status",
        "peek",
        "replay",
        "check",
        "--config",
        "--log-format",
    ] {
        assert!(text.contains(word), "--help lacks {word}: {text}");
    }
    let out = relay(&dir.0, &["slot", "--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("create") && stdout(&out).contains("drop"));
}

#[test]
fn bad_usage_exits_2() {
    let dir = TempDir::new();
    for args in [
        &[][..],
        &["bogus"][..],
        &["replay"][..],
        &["replay", "--from-lsn", "0/1", "--from-table"][..],
        &["replay", "--from-lsn", "not-an-lsn"][..],
        &["replay", "--from-table", "--since", "last tuesday"][..],
        &["run", "--start-lsn", "1/2/3"][..],
        &["peek", "--limit", "0"][..],
        &["--log-format", "xml", "check"][..],
        &["slot", "drop", "--failover"][..],
    ] {
        let out = relay(&dir.0, args, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        // clap prints the usage alone (no "error:") when the command is missing.
        let err = stderr(&out);
        assert!(
            err.contains("error:") || err.contains("Usage:"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn replay_range_in_wrong_order_exits_2() {
    let dir = TempDir::new();
    let out = relay(
        &dir.0,
        &["replay", "--from-lsn", "0/20", "--to-lsn", "0/10"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--to-lsn"), "{}", stderr(&out));
}

#[test]
fn check_accepts_the_example_config() {
    let dir = TempDir::new();
    let example = example();
    let out = relay(
        &dir.0,
        &["--config", example.to_str().unwrap(), "check"],
        &[],
    );
    assert!(
        stdout(&out).starts_with("ok    config: ")
            && stdout(&out).contains("outbox-relay.example.toml"),
        "{}",
        stdout(&out)
    );
    // The example's database (app on db.example.internal) need not exist: whatever the
    // later checks find, none of them is about the configuration.
    assert!(
        !stderr(&out).contains("outbox-relay.example.toml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_reads_the_default_file_in_the_working_directory() {
    let dir = TempDir::new();
    dir.file("outbox-relay.toml", "[rabbitmq]\nmax_in_flight = 0\n");
    let out = relay(&dir.0, &["check"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("`rabbitmq.max_in_flight` in outbox-relay.toml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_with_a_bad_config_exits_2_naming_the_key() {
    let dir = TempDir::new();
    let cases = [
        ("[rabbitmq]\nmax_inflight = 5\n", "`rabbitmq.max_inflight`"),
        (
            "[rabbitmq]\nexchange_type = \"topik\"\n",
            "`rabbitmq.exchange_type`",
        ),
        (
            "[rabbitmq]\nrouting_key = \"{tenant}.{event_type}\"\n",
            "`{tenant}`",
        ),
        (
            "[relay]\nstatus_interval_ms = 10\n",
            "`relay.status_interval_ms`",
        ),
        (
            "[relay]\nreplay_window = \"forever\"\n",
            "`relay.replay_window`",
        ),
        ("[postgres]\ntables = [\"a.b.c\"]\n", "`postgres.tables`"),
        ("[retention]\nkeep = 7\n", "`retention.keep`"),
    ];
    for (toml, needle) in cases {
        let file = dir.file("relay.toml", toml);
        let out = relay(&dir.0, &["--config", file.to_str().unwrap(), "check"], &[]);
        assert_eq!(out.status.code(), Some(2), "{toml:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{toml:?}: {err}"
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{toml:?}: not one line: {err}"
        );
        assert!(!stdout(&out).contains("ok"), "{toml:?}: {}", stdout(&out));
    }
}

#[test]
fn env_errors_exit_2_naming_the_variable() {
    let dir = TempDir::new();
    let out = relay(
        &dir.0,
        &["check"],
        &[("OUTBOX_RELAY_RABBITMQ_MAX_INFLIGHT", "5")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT"),
        "{}",
        stderr(&out)
    );
    let out = relay(
        &dir.0,
        &["check"],
        &[("OUTBOX_RELAY_RELAY_STATUS_INTERVAL_MS", "fast")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("OUTBOX_RELAY_RELAY_STATUS_INTERVAL_MS"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn missing_config_file_exits_2() {
    let dir = TempDir::new();
    let out = relay(&dir.0, &["--config", "nope.toml", "check"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("nope.toml"), "{}", stderr(&out));
}

#[test]
fn unreachable_postgres_is_a_runtime_failure() {
    let dir = TempDir::new();
    let url = (
        "OUTBOX_RELAY_POSTGRES_URL",
        "postgresql://postgres@127.0.0.1:1/app",
    );
    let out = relay(&dir.0, &["peek"], &[url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).starts_with("error: "), "{}", stderr(&out));
}

/// Passwords from the file or the environment never reach stdout or stderr: not in
/// errors about other keys, not in errors about the URL itself, not in TOML syntax
/// errors, not in debug logs.
#[test]
fn passwords_never_appear_in_output() {
    let dir = TempDir::new();
    let pg = format!("postgresql://relay:{SECRET}@db:5432/app");
    let amqp = format!("amqp://relay:{SECRET}@mq:5672/%2f");
    let amqp_list = format!("[\"{amqp}\", \"amqps://relay:{SECRET}@mq2/%2f\"]");
    let conninfo = format!("host=db user=relay password='{SECRET}' dbname=app");
    let files = [
        format!("[postgres]\nurl = \"{pg}\"\nslot = \"BAD\"\n"),
        format!("[postgres]\nurl = \"mysql://relay:{SECRET}@db/app\"\n"),
        format!("[postgres]\nurl = \"{pg}\n"), // unterminated string: syntax error
        format!("[rabbitmq]\nurl = [\"{amqp}\", \"http://relay:{SECRET}@x/\"]\n"),
        format!("[rabbitmq]\nurl = {{ node = \"{amqp}\" }}\n"),
        format!("[postgres]\nurl = \"{pg}\"\n[rabbitmq]\nurl = \"{amqp}\"\n"),
    ];
    let envs: [Vec<(&str, &str)>; 4] = [
        vec![
            ("OUTBOX_RELAY_POSTGRES_URL", pg.as_str()),
            ("OUTBOX_RELAY_RABBITMQ_URL", amqp_list.as_str()),
        ],
        vec![("OUTBOX_RELAY_POSTGRES_URL", conninfo.as_str())],
        vec![(
            "OUTBOX_RELAY_RABBITMQ_URL",
            "[\"amqp://relay:hunter2-s3cret@mq/\", x]",
        )],
        vec![
            ("OUTBOX_RELAY_POSTGRES_URL", pg.as_str()),
            ("OUTBOX_RELAY_MAPPING_PAYLOAD", ""),
        ],
    ];
    let mut runs = Vec::new();
    for (i, contents) in files.iter().enumerate() {
        let file = dir.file(&format!("c{i}.toml"), contents);
        let file = file.to_str().unwrap().to_string();
        for command in ["check", "run"] {
            runs.push((
                vec!["--config".to_string(), file.clone(), command.to_string()],
                vec![],
            ));
        }
    }
    for env in &envs {
        for command in ["check", "run"] {
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            runs.push((vec![command.to_string()], env));
        }
    }
    for (args, env) in runs {
        for format in ["text", "json"] {
            let mut all: Vec<&str> = vec!["--log-format", format];
            all.extend(args.iter().map(String::as_str));
            let mut env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            env.push(("RUST_LOG", "trace"));
            let out = relay(&dir.0, &all, &env);
            let (o, e) = (stdout(&out), stderr(&out));
            assert!(
                !o.contains(SECRET) && !e.contains(SECRET),
                "{all:?} {env:?} leaked:\nstdout: {o}\nstderr: {e}"
            );
            // The test is only meaningful if the command did produce output.
            assert!(!(o.is_empty() && e.is_empty()), "{all:?}: no output");
        }
    }
}
