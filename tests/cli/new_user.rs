//! What a new user hit following the docs (issue 55): `check` makes the tracing
//! checks `run` makes, renders a templated exchange for the pending events and
//! recent rows instead of looking the template up, gives `pause_alert_after` the
//! duration message (and a reload the same), and names the publication `slot
//! create` makes when there is no table (logical messages only).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::cli::{relay_in, TempDir};
use support::scenarios::{confirmed, MESSAGES_ENV, WAIT};
use support::*;

/// `check` and `run` side by side: `check` exits 2 naming what `run` refuses.
fn check_and_run_refuse(env: &Env, vars: &[(&str, &str)], needle: &str) {
    let out = env.cli_env(&["check"], vars);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(2), "{text}{}", stderr(&out));
    let line = text
        .lines()
        .find(|l| l.starts_with("FAIL  tracing: "))
        .unwrap_or_else(|| panic!("no FAIL tracing line: {text}"));
    assert!(line.contains(needle), "{line}");
    let mut relay = env.start_env(&[], vars);
    let code = relay.wait(Duration::from_secs(30));
    let log = relay.log_text();
    assert_eq!(code, Some(2), "run: {log}");
    assert!(log.contains(needle), "run: {log}");
}

/// Tracing off, on, and each way `run` refuses it: a headers file that does not
/// exist, and a protocol other than OTLP/HTTP.
#[tokio::test]
async fn check_validates_tracing_as_run_does() {
    let mut env = Env::new().await;
    env.create_slot();
    let _got = env.consumer().await;
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("ok    tracing: off"),
        "{}",
        stdout(&out)
    );

    let missing = env.dir.join("no-such-headers-file");
    env.extra = format!(
        "[tracing]\nendpoint = \"http://127.0.0.1:4318\"\nheaders_file = {:?}\n",
        missing.display().to_string()
    );
    check_and_run_refuse(&env, &[], "tracing.headers_file");

    env.extra = "[tracing]\nendpoint = \"http://127.0.0.1:4318\"\n".into();
    let grpc = [("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")];
    check_and_run_refuse(&env, &grpc, "OTEL_EXPORTER_OTLP_PROTOCOL = \"grpc\"");

    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("ok    tracing: on: a publish span per event over OTLP/HTTP"),
        "{}",
        stdout(&out)
    );
    env.cleanup().await;
}

/// The other check `run` makes before it connects: with a replay window, a slot name
/// too long for its anchor slot. `check` names it on a line of its own (no services:
/// the servers' lines fail, unreachable).
#[test]
fn check_names_the_anchor_slot_name_run_refuses() {
    let dir = TempDir::new();
    let slot = "s".repeat(60);
    dir.file(
        "outbox-relay.toml",
        &format!(
            "[postgres]\nurl = \"postgresql://postgres@127.0.0.1:1/app\"\nslot = \"{slot}\"\n\n\
             [rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:1/%2f\"\n\n\
             [relay]\nreplay_window = \"1h\"\nmetrics_listen = \"\"\n"
        ),
    );
    let needle = "with [relay] replay_window the anchor slot is named";
    let out = relay_in(&dir.0, &["check"], &[], Duration::from_secs(20));
    assert!(
        stdout(&out).contains(&format!("FAIL  config: {needle}")),
        "{}",
        stdout(&out)
    );
    let out = relay_in(&dir.0, &["run"], &[], Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(needle), "{}", stderr(&out));
}

/// `exchange = "<name>.{aggregate_type}"`: `check` says the exchange is chosen per
/// event and looks up the names rendered for the pending events (the slot is peeked,
/// not consumed) and the recent rows, instead of the template itself (with
/// `--declare` too); without `declare_exchange`, a missing one fails.
#[tokio::test]
async fn check_renders_a_templated_exchange() {
    let mut env = Env::new().await;
    env.create_slot();
    let template = format!("{}.{{aggregate_type}}", env.exchange);
    let order = format!("{}.order", env.exchange);
    let invoice = format!("{}.invoice", env.exchange);
    env.broker.declare_exchange(&order, "topic").await;
    env.insert_tx(&[
        ("order", "o-1", "created", "{}"),
        ("invoice", "i-1", "issued", "{}"),
    ]);
    let before = confirmed(&env, &env.slot);
    let vars = [("OUTBOX_RELAY_RABBITMQ_EXCHANGE", template.as_str())];

    let out = env.cli_env(&["check"], &vars);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    let line = |name: &str| {
        text.lines()
            .find(|l| {
                l.get(6..)
                    .is_some_and(|l| l.starts_with(&format!("exchange {name}: ")))
            })
            .unwrap_or_else(|| panic!("no line for exchange {name}: {text}"))
            .to_string()
    };
    let head = line(&template);
    assert!(
        head.starts_with("ok    ")
            && head.contains("a template: the exchange is chosen per event")
            && head.contains("2 names rendered from 2 pending events and 2 distinct rows"),
        "{head}"
    );
    assert!(!head.contains("missing"), "{head}");
    assert!(
        line(&order).starts_with(&format!(
            "ok    exchange {order}: exists (from pending 1, rows)"
        )),
        "{text}"
    );
    assert!(
        line(&invoice).starts_with(&format!(
            "ok    exchange {invoice}: missing, run will declare it"
        )),
        "{text}"
    );
    assert_eq!(
        confirmed(&env, &env.slot),
        before,
        "check consumed the slot"
    );

    // `check --declare` declares no exchange named like the template either.
    let out = env.cli_env(&["check", "--declare"], &vars);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!(
            "ok    exchange {template}: a template: the exchange is chosen per event"
        )) && !text.contains("exists or was declared"),
        "{text}"
    );

    let vars = [vars[0], ("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "false")];
    let out = env.cli_env(&["check"], &vars);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains(&format!(
            "FAIL  exchange {invoice}: missing, and run will not declare it (declare_exchange = false)"
        )) && text.contains(&format!("ok    exchange {order}: exists")),
        "{text}"
    );
    assert!(stderr(&out).contains(&invoice), "{}", stderr(&out));
    env.cleanup().await;
}

const DURATION_MESSAGE: &str =
    "must be a duration in quotes like \"1h\", \"30min\" or \"7D\", or \"\" for none, not the string \"soon\"";

/// `pause_alert_after = "soon"` is refused as the other duration keys are, by
/// `check` and by a reload of the running relay (which keeps running).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_alert_after_is_a_duration_in_check_and_reload() {
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 1, 1);
    got.wait_for(1, WAIT).await;

    // The generated file's last section is [relay].
    env.extra = "pause_alert_after = \"soon\"\n".into();
    env.config();
    relay.signal("HUP");
    let log = relay
        .wait_log("reload refused", Duration::from_secs(30))
        .await;
    assert!(
        log.contains("relay.pause_alert_after") && log.contains(DURATION_MESSAGE),
        "{log}"
    );
    let out = env.cli(&["check"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(stderr(&out).contains(DURATION_MESSAGE), "{}", stderr(&out));
    assert!(!stderr(&out).contains("text in quotes"), "{}", stderr(&out));
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

/// Logical messages only (`tables = []`): a missing publication's fix is the
/// statement `slot create` runs, without a `FOR TABLE` that has no table to name.
#[tokio::test]
async fn a_missing_publication_without_tables_names_what_slot_create_runs() {
    let env = Env::with_ddl(OUTBOX_DDL, &[]).await;
    let out = env.cli_env(&["check"], &[MESSAGES_ENV]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    let statement = format!(
        "CREATE PUBLICATION \"{}\" WITH (publish = 'insert')",
        env.publication
    );
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("FAIL  publication {}: ", env.publication)))
        .unwrap_or_else(|| panic!("no publication line: {text}"));
    assert!(
        line.ends_with(&format!(
            "does not exist: run `outbox-relay slot create` (creates it) or {statement}"
        )),
        "{line}"
    );
    assert!(!text.contains("FOR TABLE"), "{text}");

    // `slot create` makes that publication: no table in it, and `check` is content.
    let out = env.cli_env(&["slot", "create"], &[MESSAGES_ENV]);
    assert!(out.status.success(), "{}", stderr(&out));
    let tables = env.db.psql(&format!(
        "SELECT count(*) FROM pg_publication_tables WHERE pubname = '{}'",
        env.publication
    ));
    assert_eq!(tables.trim(), "0");
    let out = env.cli_env(&["check"], &[MESSAGES_ENV]);
    assert!(
        stdout(&out).contains(&format!("ok    publication {}", env.publication)),
        "{}",
        stdout(&out)
    );
    env.cleanup().await;
}
