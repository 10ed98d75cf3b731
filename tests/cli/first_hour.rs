//! The first hour with the binary (docs/operations.md, "Configuration and check"): no
//! connection on built-in defaults, a `check` that changes nothing, and
//! configuration errors in words, all at once. The error tests assert the exact
//! sentence.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use support::cli::{relay_in, TempDir};
use support::stream::{delete_stream, stream_exists, stream_url};
use support::*;

/// Runs the binary in `dir` (no config file unless the test writes one); 20 s to
/// finish, enough for a connection to fail.
fn relay(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    relay_in(dir, args, env, Duration::from_secs(20))
}

const UNREACHABLE_PG: &str = "postgresql://relay@127.0.0.1:1/app";

/// Every command that connects exits 2 without a file, `--config` or URL variable,
/// naming what it looked for; nothing is attempted (the default URLs would reach the
/// local servers). With the variables set, the same commands go on.
#[test]
fn commands_that_connect_refuse_the_built_in_defaults() {
    let dir = TempDir::new();
    let looked_for = dir.0.join("outbox-relay.toml");
    for (args, name, both) in [
        (&["check"][..], "check", true),
        (&["run"][..], "run", true),
        (&["replay", "--from-table"][..], "replay", true),
        (&["status"][..], "status", false),
        (&["peek"][..], "peek", false),
        (&["slot", "create"][..], "slot create", false),
        (
            &["slot", "skip", "some-id", "--yes"][..],
            "slot skip",
            false,
        ),
    ] {
        let out = relay(&dir.0, args, &[]);
        let (vars, verb, pronoun) = if both {
            (
                "OUTBOX_RELAY_POSTGRES_URL and OUTBOX_RELAY_RABBITMQ_URL",
                "are",
                "them",
            )
        } else {
            ("OUTBOX_RELAY_POSTGRES_URL", "is", "it")
        };
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert_eq!(
            stderr(&out),
            format!(
                "error: nothing says where to connect: {} does not exist, --config was not given, and {vars} {verb} not set; pass --config FILE (outbox-relay.example.toml shows every key) or set {pronoun}: `{name}` does not connect to built-in defaults\n",
                looked_for.display()
            ),
            "{args:?}"
        );
        assert_eq!(stdout(&out), "", "{args:?}: nothing may be checked");
    }
    // One variable of two: the other is named.
    let out = relay(
        &dir.0,
        &["check"],
        &[("OUTBOX_RELAY_POSTGRES_URL", UNREACHABLE_PG)],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("and OUTBOX_RELAY_RABBITMQ_URL is not set; pass --config FILE"),
        "{}",
        stderr(&out)
    );
    // A stream target needs the stream URL instead.
    let out = relay(
        &dir.0,
        &["check"],
        &[
            ("OUTBOX_RELAY_POSTGRES_URL", UNREACHABLE_PG),
            (
                "OUTBOX_RELAY_RABBITMQ_URL",
                "amqp://guest:guest@127.0.0.1:1/%2f",
            ),
            ("OUTBOX_RELAY_RABBITMQ_STREAM", "orders"),
        ],
    );
    assert!(
        stderr(&out).contains("and OUTBOX_RELAY_RABBITMQ_STREAM_URL is not set"),
        "{}",
        stderr(&out)
    );
    // Postgres named: `peek` goes on and fails to connect (exit 1), as before.
    let out = relay(
        &dir.0,
        &["peek"],
        &[("OUTBOX_RELAY_POSTGRES_URL", UNREACHABLE_PG)],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

/// A wrong type is said in words, naming the key, where it was set and what it
/// holds; every error of a file (and of the environment) is reported at once, one
/// line each.
#[test]
fn config_errors_are_sentences_and_all_of_them_at_once() {
    let dir = TempDir::new();
    let file = dir.file("relay.toml", "[rabbitmq]\nmax_in_flight = \"lots\"\n");
    let path = file.display().to_string();
    let out = relay(&dir.0, &["--config", &path, "check"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("error: `rabbitmq.max_in_flight` in {path} must be a whole number like 10000, not the string \"lots\"\n")
    );

    let file = dir.file(
        "several.toml",
        "[postgres]\nslot = \"Bad-Slot\"\n\n[rabbitmq]\nmax_in_flight = \"lots\"\ndeclare_exchange = \"yes\"\nexchange_type = \"topik\"\nroutng_key = \"x\"\n\n[relay]\nstatus_interval_ms = 10\n",
    );
    let path = file.display().to_string();
    let out = relay(
        &dir.0,
        &["--config", &path, "check"],
        &[("OUTBOX_RELAY_RELAY_METRICS_MAX_CONNECTIONS", "many")],
    );
    assert_eq!(out.status.code(), Some(2));
    let mut lines: Vec<String> = stderr(&out).lines().map(str::to_string).collect();
    lines.sort();
    let mut want = vec![
        "error: `relay.metrics_max_connections` in environment variable OUTBOX_RELAY_RELAY_METRICS_MAX_CONNECTIONS must be a whole number like 64, not \"many\"".to_string(),
        format!("error: `rabbitmq.max_in_flight` in {path} must be a whole number like 10000, not the string \"lots\""),
        format!("error: `rabbitmq.declare_exchange` in {path} must be true or false, not the string \"yes\""),
        format!("error: `rabbitmq.exchange_type` in {path} must be one of direct, fanout, topic, headers, not \"topik\""),
        format!("error: unknown key `rabbitmq.routng_key` in {path}: did you mean `routing_key`?"),
        format!("error: invalid `postgres.slot` in {path}: \"Bad-Slot\" is not a valid slot name: use only lower-case letters, digits and underscores"),
        format!("error: invalid `relay.status_interval_ms` in {path}: 10 is too small: use at least 100 (milliseconds)"),
    ];
    want.sort();
    assert_eq!(lines, want);
    assert_eq!(stdout(&out), "");
}

/// What the environment form takes, the file takes (`tables` as one string); RabbitMQ's
/// duration forms (`7D`) are durations; a `target_session_attrs` that would not be
/// honoured and an AMQP query parameter the client cannot read are refused at load
/// (exit 2), not at connect.
#[test]
fn config_values_as_operators_write_them() {
    let dir = TempDir::new();
    let file = dir.file(
        "relay.toml",
        &format!(
            "[postgres]\nurl = \"{UNREACHABLE_PG}?target_session_attrs=any\"\ntables = \"public.outbox, app.events\"\n\n[rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:1/%2f?heartbeat=30\"\nmax_age = \"7D\"\n\n[retention]\nkeep = \"1h\"\n\n[relay]\nreplay_window = \"2D\"\nmetrics_listen = \"\"\n"
        ),
    );
    let path = file.display().to_string();
    let out = relay(&dir.0, &["--config", &path, "check"], &[]);
    // Read; then Postgres cannot be reached (a runtime failure, exit 1).
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with(&format!("ok    config: {path}\nok    tracing: off: "))
            && stdout(&out).contains("\nFAIL  postgres connection: "),
        "{}",
        stdout(&out)
    );

    let file = dir.file(
        "heartbeat.toml",
        &format!("[postgres]\nurl = \"{UNREACHABLE_PG}\"\n\n[rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=abc\"\n"),
    );
    let path = file.display().to_string();
    let out = relay(&dir.0, &["--config", &path, "check"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("error: invalid `rabbitmq.url` in {path}: URL #1: the query parameter heartbeat must be a whole number of seconds from 0 to 65535\n")
    );
    assert_eq!(
        stdout(&out),
        "",
        "nothing connects before the config is valid"
    );

    let out = relay(
        &dir.0,
        &["--config", &path, "check"],
        &[(
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgresql://relay@db:5432/app?target_session_attrs=read-write",
        )],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines.contains(&"error: invalid `postgres.url` in environment variable OUTBOX_RELAY_POSTGRES_URL: target_session_attrs=read-write is not supported: the relay connects to the one host of the URL, which must be the primary, so remove the parameter (or set it to any)"),
        "{lines:?}"
    );
}

/// A dead-letter exchange is ignored with a stream target: `check` says so, and so
/// does the log of any other command.
#[test]
fn an_ignored_dead_letter_exchange_draws_a_warning() {
    let dir = TempDir::new();
    let file = dir.file(
        "relay.toml",
        &format!("[postgres]\nurl = \"{UNREACHABLE_PG}\"\n\n[rabbitmq]\nstream = \"orders\"\nstream_url = \"rabbitmq-stream://guest:guest@127.0.0.1:1/%2f\"\ndead_letter_exchange = \"dlx\"\n"),
    );
    let path = file.display().to_string();
    let warning = "[rabbitmq] dead_letter_exchange = \"dlx\" is ignored: events go to the stream orders, where nothing is unroutable; remove it, or set stream = \"\" to publish to the exchange";
    let out = relay(&dir.0, &["--config", &path, "check"], &[]);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[1], format!("warn  config: {warning}"), "{lines:?}");
    let out = relay(&dir.0, &["--config", &path, "peek"], &[]);
    assert!(stderr(&out).contains(warning), "{}", stderr(&out));
}

/// Whether `exchange` exists, asked passively on a channel of its own.
async fn exchange_exists(env: &Env, exchange: &str) -> bool {
    let channel = env.broker.connection.create_channel().await.unwrap();
    let options = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
        .is_ok()
}

/// Every line of `check` has its status in one column and its name right after.
fn assert_columns(out: &str) {
    for line in out.lines() {
        let (status, rest) = line.split_at(line.len().min(6));
        assert!(
            ["ok    ", "warn  ", "FAIL  "].contains(&status)
                && !rest.starts_with(' ')
                && rest.contains(": "),
            "a line out of its columns: {line:?}\n{out}"
        );
    }
}

/// `check` declares no exchange: it says `run` would; `check --declare` does. With
/// `declare_exchange = false` a missing exchange is a failure naming both fixes.
#[tokio::test]
async fn check_declares_no_exchange() {
    let env = Env::new().await;
    env.create_slot();
    let ex = env.exchange.clone();
    let out = env.cli(&["check"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.lines().any(|l| l == format!("ok    exchange {ex}: missing, run will declare it (declare_exchange = true); `check --declare` declares it now")),
        "{text}"
    );
    assert_columns(&text);
    assert!(!exchange_exists(&env, &ex).await, "check declared {ex}");

    let out = env.cli_env(
        &["check"],
        &[("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "false")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stdout(&out).lines().any(|l| l == format!("FAIL  exchange {ex}: missing, and run will not declare it (declare_exchange = false): declare it (topic exchange, durable) or set declare_exchange = true")),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        stderr(&out),
        format!("error: exchange {ex} does not exist and declare_exchange = false: declare it, or set [rabbitmq] declare_exchange = true\n")
    );

    let out = env.cli(&["check", "--declare"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l == format!("ok    exchange {ex}: exists or was declared (check --declare)")),
        "{}",
        stdout(&out)
    );
    assert!(exchange_exists(&env, &ex).await);
    let out = env.cli(&["check"]);
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l == format!("ok    exchange {ex}: exists")),
        "{}",
        stdout(&out)
    );
    env.cleanup().await;
}

/// The same for a stream target, and for the publication `slot create` would make.
#[tokio::test]
async fn check_declares_no_stream_and_no_publication() {
    let env = Env::new().await;
    let stream = testkit::unique_name("stream");
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
    ];
    let vars = as_refs(&vars);
    let publication_exists = || {
        env.db.psql(&format!(
            "SELECT count(*) FROM pg_publication WHERE pubname = '{}'",
            env.publication
        )) == "1"
    };

    let out = env.cli_env(&["check"], &vars);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("FAIL  publication {}: ", env.publication))),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == format!("ok    stream {stream}: missing, run will declare it (declare_stream = true); `check --declare` declares it now")),
        "{text}"
    );
    assert_columns(&text);
    assert!(!publication_exists(), "check created the publication");
    assert!(!stream_exists(&stream).await, "check declared the stream");

    let out = env.cli_env(&["check", "--declare"], &vars);
    let text = stdout(&out);
    // The slot is still missing: `slot create` makes it.
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.lines().any(|l| l
            == format!(
                "ok    publication {}: created (check --declare)",
                env.publication
            )),
        "{text}"
    );
    assert!(
        text.lines().any(
            |l| l == format!("ok    stream {stream}: exists or was declared (check --declare)")
        ),
        "{text}"
    );
    assert!(publication_exists());
    assert!(stream_exists(&stream).await);
    delete_stream(&stream).await;
    env.cleanup().await;
}
