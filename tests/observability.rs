//! Operating the relay (docs/design.md §6, §8): `/metrics` against what a consumer received,
//! `/readyz` and `/healthz` across a broker cut, `status` and `peek` on a known slot,
//! and no password in any log line at trace level.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use testkit::proxy::Proxy;
use testkit::unique_name;

const WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------
// helpers

/// A port on 127.0.0.1 free right now (the relay binds it moments later).
fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// The value of a sample `name` (exact name, `labels` e.g. `side="rabbitmq"` or
/// "") in Prometheus text. Histogram bodies with chunked encoding are never split
/// inside a line by axum for bodies this small, but be lenient anyway.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let rest = if labels.is_empty() {
            rest.strip_prefix(' ')?
        } else {
            rest.strip_prefix('{')?
                .strip_prefix(labels)?
                .strip_prefix("} ")?
        };
        rest.trim().parse().ok()
    })
}

/// Polls `/metrics` until `pred` holds; panics with the last scrape after `WAIT`.
async fn scrape_until(addr: &str, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        if let Some((200, body)) = http_get(addr, "/metrics").await {
            if pred(&body) {
                return body;
            }
            last = body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; last scrape:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `/readyz` until it answers `want`, asserting `/healthz` answers 200 at every
/// step; panics with the relay's log after `WAIT`.
async fn wait_ready(addr: &str, want: u16, relay: &Relay) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        // /readyz first: once the server answered, /healthz must answer 200.
        let ready = http_get(addr, "/readyz").await.map(|(s, _)| s);
        let health = http_get(addr, "/healthz").await.map(|(s, _)| s);
        if ready.is_some() {
            assert_eq!(health, Some(200), "/healthz while /readyz is {ready:?}");
        }
        if ready == Some(want) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz is {ready:?}, not {want}, after {WAIT:?}; log:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn amqp_target() -> SocketAddr {
    let url = testkit::amqp_url();
    let host = url.split('@').nth(1).unwrap().split('/').next().unwrap();
    host.parse().unwrap()
}

// ---------------------------------------------------------------------------------
// /metrics

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_what_the_consumer_received() {
    const N: usize = 500;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("metrics.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    let relay = env.start_with(&config, "info", &[]);
    wait_ready(&addr, 200, &relay).await;

    // Before any event: every counter is exported, at 0.
    let body = http_get(&addr, "/metrics").await.unwrap().1;
    for name in [
        "outbox_relay_events_published_total",
        "outbox_relay_events_acked_total",
        "outbox_relay_events_nacked_total",
        "outbox_relay_events_returned_total",
        "outbox_relay_events_dead_lettered_total",
        "outbox_relay_publish_retries_total",
    ] {
        assert_eq!(sample(&body, name, ""), Some(0.0), "{name} in\n{body}");
    }
    assert_eq!(
        sample(&body, "outbox_relay_reconnects_total", "side=\"rabbitmq\""),
        Some(0.0),
        "{body}"
    );

    env.insert_seq(1, N, 50);
    let msgs = got.wait_for(N, WAIT).await;
    assert_eq!(
        check_sequence(&msgs, N),
        0,
        "no duplicates without failures"
    );

    let body = scrape_until(&addr, "all acked, nothing in flight", |b| {
        sample(b, "outbox_relay_events_acked_total", "") == Some(N as f64)
            && sample(b, "outbox_relay_in_flight", "") == Some(0.0)
            && sample(b, "outbox_relay_outbox_lag_seconds", "") == Some(0.0)
            && sample(b, "outbox_relay_slot_retained_wal_bytes", "").is_some()
    })
    .await;
    eprintln!("/metrics after {N} events:\n{body}");
    let received = got.len() as f64;
    assert_eq!(received, N as f64, "nothing more arrived");
    let v = |name: &str| sample(&body, name, "").unwrap_or_else(|| panic!("{name} in\n{body}"));
    assert_eq!(v("outbox_relay_events_published_total"), received);
    assert_eq!(v("outbox_relay_events_acked_total"), received);
    assert_eq!(v("outbox_relay_publish_latency_seconds_count"), received);
    assert!(v("outbox_relay_publish_latency_seconds_sum") > 0.0);
    assert_eq!(
        sample(
            &body,
            "outbox_relay_publish_latency_seconds_bucket",
            "le=\"+Inf\""
        ),
        Some(received),
        "{body}"
    );
    for zero in [
        "outbox_relay_events_nacked_total",
        "outbox_relay_events_returned_total",
        "outbox_relay_events_dead_lettered_total",
        "outbox_relay_publish_retries_total",
    ] {
        assert_eq!(v(zero), 0.0, "{zero}");
    }
    assert_eq!(v("outbox_relay_ready"), 1.0);
    assert!(v("outbox_relay_acked_lsn") > 0.0);
    assert!(v("outbox_relay_slot_retained_wal_bytes") > 0.0);
    assert!(v("outbox_relay_slot_pending_wal_bytes") >= 0.0);
    // The acked watermark reaches Postgres: the confirmed LSN follows it.
    scrape_until(&addr, "confirmed LSN at the acked LSN", |b| {
        let acked = sample(b, "outbox_relay_acked_lsn", "");
        acked.is_some() && sample(b, "outbox_relay_confirmed_lsn", "") >= acked
    })
    .await;
    assert_eq!(http_get(&addr, "/healthz").await.map(|r| r.0), Some(200));

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// /readyz and /healthz across a broker cut

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_fails_while_the_broker_is_cut_and_recovers() {
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let proxy = Proxy::start(amqp_target()).await;
    let amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let addr = free_addr();
    let config = env.config_file("readyz.toml", &env.db.url(), &amqp, &addr);
    let relay = env.start_with(&config, "info", &[]);

    wait_ready(&addr, 200, &relay).await;
    env.insert_seq(1, 10, 5);
    got.wait_for(10, WAIT).await;

    proxy.cut();
    wait_ready(&addr, 503, &relay).await;
    let body = http_get(&addr, "/readyz").await.unwrap().1;
    assert_eq!(body.trim(), "not ready");
    scrape_until(&addr, "ready gauge at 0", |b| {
        sample(b, "outbox_relay_ready", "") == Some(0.0)
    })
    .await;
    // Events committed during the outage wait, and the outbox lag (docs/design.md §7: age of
    // the oldest unacked event) grows meanwhile, although the publisher takes no
    // input while it reconnects: the reader tracks what it read until it is acked.
    env.insert_seq(11, 10, 5);
    scrape_until(&addr, "a positive outbox lag during the outage", |b| {
        sample(b, "outbox_relay_outbox_lag_seconds", "").unwrap_or(0.0) > 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        http_get(&addr, "/readyz").await.map(|r| r.0),
        Some(503),
        "still cut"
    );

    proxy.restore();
    wait_ready(&addr, 200, &relay).await;
    let msgs = got.wait_for(20, WAIT).await;
    check_sequence(&msgs, 20);
    let body = scrape_until(
        &addr,
        "a rabbitmq reconnect counted, nothing in flight",
        |b| {
            sample(b, "outbox_relay_reconnects_total", "side=\"rabbitmq\"").unwrap_or(0.0) >= 1.0
                && sample(b, "outbox_relay_ready", "") == Some(1.0)
                && sample(b, "outbox_relay_in_flight", "") == Some(0.0)
                && sample(b, "outbox_relay_outbox_lag_seconds", "") == Some(0.0)
        },
    )
    .await;
    assert_eq!(
        sample(&body, "outbox_relay_reconnects_total", "side=\"postgres\""),
        Some(0.0),
        "the Postgres side was not disturbed"
    );

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    drop(proxy);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// status and peek

const ID1: &str = "00000000-0000-0000-0000-0000000000a1";
const ID2: &str = "00000000-0000-0000-0000-0000000000a2";
const ID3: &str = "00000000-0000-0000-0000-0000000000a3";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_peek_show_a_known_slot_without_consuming_it() {
    let mut env = Env::new().await;
    env.create_slot();
    let long = format!("{{\"text\": \"{}\"}}", "y".repeat(400));
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('{ID1}', 'order', 'o-1', 'created', '{{\"total\": 1}}', '{{\"tenant\": \"acme\"}}'),
           ('{ID2}', 'order', 'o-1', 'paid', '{long}', NULL)"
    ));
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                VALUES ('order', 'o-9', 'rolled_back', '{}'); ROLLBACK;",
    );
    env.db
        .psql("UPDATE outbox SET event_type = 'ignored' WHERE false");
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID3}', 'customer', 'c-7', 'renamed', '\"x\"')"
    ));

    // status, text and JSON, on a slot no relay streams from.
    let out = env.cli(&["status"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    eprintln!("status:\n{text}");
    assert!(
        text.contains(&format!("slot:                {}", env.slot)),
        "{text}"
    );
    assert!(text.contains("active:              no"), "{text}");
    assert!(text.contains("wal_status:          reserved"), "{text}");
    assert!(
        text.contains("warning: no relay is streaming from slot"),
        "{text}"
    );
    let out = env.cli(&["status", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    eprintln!("status --json:\n{v:#}");
    assert_eq!(v["slot"], env.slot.as_str());
    assert_eq!(v["plugin"], "pgoutput");
    assert_eq!(v["database"], env.db.name.as_str());
    assert_eq!(v["active"], false);
    assert!(v["pending_wal_bytes"].as_i64().unwrap() > 0, "{v}");
    assert!(v["retained_wal_bytes"].as_i64().unwrap() > 0, "{v}");
    assert!(
        v["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("no relay is streaming")),
        "{v}"
    );
    let confirmed_before = v["confirmed_flush_lsn"].as_str().unwrap().to_string();

    // peek, text: one line per event, in commit and insert order.
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    eprintln!("peek:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (line, (id, kind, aggregate, key)) in lines.iter().zip([
        (ID1, "created", "order/o-1", "order.created"),
        (ID2, "paid", "order/o-1", "order.paid"),
        (ID3, "renamed", "customer/c-7", "customer.renamed"),
    ]) {
        assert!(line.contains(&format!("id={id} ")), "{line}");
        assert!(line.contains(&format!("type={kind} ")), "{line}");
        assert!(line.contains(&format!("aggregate={aggregate} ")), "{line}");
        assert!(line.contains(&format!("routing_key={key} ")), "{line}");
        assert!(line.contains(" public.outbox "), "{line}");
    }
    assert!(lines[0].ends_with("payload={\"total\": 1}"), "{}", lines[0]);
    assert!(
        lines[1].ends_with('…') && lines[1].len() < 500,
        "{}",
        lines[1]
    );
    let out = env.cli(&["peek", "--limit", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().collect::<Vec<_>>(), &lines[..2]);

    // peek, JSON: every field, the payload in full.
    let out = env.cli(&["peek", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let arr: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    eprintln!("peek --json (first):\n{:#}", arr[0]);
    assert_eq!(arr.len(), 3);
    let ids: Vec<&str> = arr
        .iter()
        .map(|e| e["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [ID1, ID2, ID3]);
    assert_eq!(
        arr[0]["commit_lsn"], arr[1]["commit_lsn"],
        "one transaction"
    );
    assert_eq!(arr[0]["xid"], arr[1]["xid"]);
    assert_ne!(arr[1]["commit_lsn"], arr[2]["commit_lsn"]);
    assert_eq!(arr[0]["table"], "public.outbox");
    assert_eq!(arr[0]["aggregate_type"], "order");
    assert_eq!(arr[0]["aggregate_id"], "o-1");
    assert_eq!(arr[0]["event_type"], "created");
    assert_eq!(arr[0]["routing_key"], "order.created");
    assert_eq!(arr[0]["headers"], "{\"tenant\": \"acme\"}");
    assert_eq!(arr[0]["content_type"], "application/json");
    assert_eq!(arr[1]["payload"].as_str().unwrap(), long.as_str());
    assert!(arr[1]["headers"].is_null());
    assert!(arr[2]["commit_time"].as_str().unwrap().ends_with('Z'));

    // Peeking consumed nothing: the slot did not move, and a relay publishes all three.
    let again = env.cli(&["peek"]);
    assert_eq!(stdout(&again), text);
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&env.cli(&["status", "--json"]))).unwrap();
    assert_eq!(v["confirmed_flush_lsn"].as_str().unwrap(), confirmed_before);

    let got = env.consumer().await;
    let relay = env.start(&[]);
    let msgs = got.wait_for(3, WAIT).await;
    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(ids, [ID1, ID2, ID3]);

    // While the relay streams, peek refuses with the fix (an unmet precondition: 2).
    let deadline = tokio::time::Instant::now() + WAIT;
    let out = loop {
        let out = env.cli(&["peek"]);
        if !out.status.success() || tokio::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    eprintln!("peek on an active slot: {err}");
    assert!(err.contains("is in use by pid"), "{err}");
    assert!(
        err.contains("stop that relay") && err.contains("status"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let out = env.cli(&["status"]);
    let text = stdout(&out);
    eprintln!("status while running:\n{text}");
    assert!(text.contains("active:              yes (pid "), "{text}");
    assert!(!text.contains("no relay is streaming"), "{text}");

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");

    // Everything published and confirmed: nothing pending.
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "no pending events");
    let out = env.cli(&["peek", "--json"]);
    assert_eq!(stdout(&out).trim(), "[]");
    env.cleanup().await;
}

/// A publication that also publishes updates (an operator's choice): changes that
/// are not events come first, and `peek --limit 1` reads further until it finds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_reads_past_changes_that_are_not_events() {
    let env = Env::new().await;
    env.db.psql(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert, update')",
        env.publication
    ));
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID1}', 'order', 'o-1', 'created', '{{}}')"
    ));
    env.create_slot();
    // 300 transactions of one update each (about 900 changes), then two events.
    let updates: String = (0..300)
        .map(|i| format!("BEGIN; UPDATE outbox SET headers = '{{\"n\": {i}}}'; COMMIT; "))
        .collect();
    env.db.psql(&updates);
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('{ID2}', 'order', 'o-1', 'paid', '{{}}'), ('{ID3}', 'order', 'o-1', 'shipped', '{{}}')"
    ));
    let out = env.cli(&["peek", "--limit", "1", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let arr: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    let ids: Vec<&str> = arr
        .iter()
        .map(|e| e["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [ID2]);
    let out = env.cli(&["peek"]);
    assert_eq!(stdout(&out).lines().count(), 2, "{}", stdout(&out));
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// credentials

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
            let _ = std::process::Command::new("psql")
                .args(["-XAtq", "-h", "127.0.0.1", "-U", "postgres", "-d", db])
                .args(["-p", &testkit::pg_port().to_string(), "-c", sql])
                .output();
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
            let out = std::process::Command::new("rabbitmqctl")
                .args(args)
                .output()
                .unwrap();
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
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_in_any_log_line_at_trace_level() {
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

// ---------------------------------------------------------------------------------
// a message RabbitMQ refuses

/// A row whose message the broker refuses (larger than `max_message_size`), with no
/// dead-letter exchange: the relay holds the slot before it and says so — an ERROR
/// line naming the message, the poison gauge, /readyz 503, `status` — and goes on
/// once the operator fixes the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_rabbitmq_refuses_holds_the_slot_and_is_reported() {
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("poison.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    // Only messages over the limit notice: the other tests here publish small ones.
    let limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let relay = env.start_with(&config, "info", &[]);
    wait_ready(&addr, 200, &relay).await;
    env.insert_seq(1, 3, 3);
    got.wait_for(3, WAIT).await;

    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('seq', '4', 'tick', jsonb_build_object('pad', repeat('x', 200000)))",
    );
    let big_id = env
        .db
        .psql("SELECT id FROM outbox WHERE aggregate_id = '4'")
        .trim()
        .to_string();
    env.insert_seq(5, 2, 2);

    wait_ready(&addr, 503, &relay).await;
    let body = http_get(&addr, "/readyz").await.unwrap().1;
    assert!(
        body.contains("refuses message") && body.contains(&big_id),
        "/readyz body: {body}"
    );
    scrape_until(&addr, "the poison gauge at 1", |b| {
        sample(b, "outbox_relay_poison_messages", "") == Some(1.0)
    })
    .await;
    let out = env.cli_with(&config, "warn", &["status"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("stuck_message:") && stdout.contains(&big_id),
        "status does not show the stuck message:\n{stdout}"
    );
    let out = env.cli_with(&config, "warn", &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stuck_message"]["message_id"], big_id.as_str());
    assert_eq!(v["stuck_message"]["tx_index"], 0);
    // Nothing after it was published (the slot holds before it).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: std::collections::HashSet<String> =
        got.snapshot().iter().map(|m| m.message_id()).collect();
    assert_eq!(ids.len(), 3, "published past a refused message");
    assert!(relay.log_text().contains("rabbitmq refuses this message"));
    assert!(relay.log_text().contains(&big_id));

    // The operator raises the limit: everything arrives in order, ready again.
    drop(limit);
    got.wait_for(6, WAIT).await;
    wait_ready(&addr, 200, &relay).await;
    let msgs = got
        .wait_until(WAIT, |m| {
            m.iter()
                .map(|m| m.message_id())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= 6
        })
        .await;
    check_sequence(&msgs, 6);
    scrape_until(&addr, "the poison gauge back at 0", |b| {
        sample(b, "outbox_relay_poison_messages", "") == Some(0.0)
    })
    .await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
