//! Around the relay, end to end with the real binary: outbox retention (docs/design.md §7),
//! trace correlation in the relay's own logs (§4, §5), a RabbitMQ URL list whose
//! first node is down (§4), and `slot create --failover` on a server without
//! failover slots (§7).
#![allow(clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;
use testkit::proxy::Proxy;
use testkit::unique_name;

const WAIT: Duration = Duration::from_secs(90);
const RETENTION_2S: &str = "[retention]\nkeep = \"2s\"\n";

/// `outbox-relay [global] run` with the environment's config, `RUST_LOG=info` and
/// then `vars` (which may override it or any `OUTBOX_RELAY_*` key).
fn start(env: &Env, global: &[&str], vars: &[(&str, &str)]) -> Relay {
    let config = env.config();
    let log = env.dir.join(format!("{}.log", unique_name("relay")));
    let child = Command::new(bin())
        .arg("--config")
        .arg(&config)
        .args(global)
        .arg("run")
        .current_dir(&env.dir)
        .env("RUST_LOG", "info")
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Relay { child, log }
}

/// Polls `cond` every 200 ms until it holds; panics with `what` and the relay's log
/// after `timeout`.
async fn eventually(relay: &Relay, timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for: {what}\nrelay log:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn count(env: &Env, where_clause: &str) -> i64 {
    env.db
        .psql(&format!("SELECT count(*) FROM outbox WHERE {where_clause}"))
        .parse()
        .unwrap()
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// GET `path` over plain HTTP/1.0; the body.
async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    Some(out)
}

/// `host:port` of the test broker's AMQP URL.
fn broker_host_port() -> String {
    let url = testkit::amqp_url();
    let after_at = url.rsplit_once('@').map_or(url.as_str(), |(_, h)| h);
    let after_scheme = after_at.split_once("://").map_or(after_at, |(_, h)| h);
    after_scheme.split('/').next().unwrap().to_string()
}

/// The test broker's URL with its host and port replaced by 127.0.0.1:`port`.
fn broker_url_via(port: u16) -> String {
    testkit::amqp_url().replacen(&broker_host_port(), &format!("127.0.0.1:{port}"), 1)
}

// ---------------------------------------------------------------------------------
// Retention (docs/design.md §7)
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn retention_deletes_old_confirmed_rows_in_batches_and_keeps_young_ones() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.extra = RETENTION_2S.into();
    env.create_slot();
    let got = env.consumer().await;
    let metrics_port = closed_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let relay = start(&env, &[], &[("OUTBOX_RELAY_RELAY_METRICS_LISTEN", &listen)]);

    // A row that is not old (created_at in the future), committed *before* the old
    // ones: every marker that lets the old rows go also covers it, so only its
    // created_at keeps it.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES ('young', 'y-1', 'kept', '{}', now() + interval '1 day')",
    );
    // 2 500 old rows: three batches of at most 1 000.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         SELECT 'old', n::text, 'gone', jsonb_build_object('seq', n), now() - interval '1 day'
           FROM generate_series(1, 2500) AS s(n)",
    );
    got.wait_until(WAIT, |m| {
        let ids: std::collections::HashSet<String> = m.iter().map(|m| m.message_id()).collect();
        ids.len() >= 2501
    })
    .await;

    eventually(&relay, WAIT, "the old rows to be deleted", || {
        count(&env, "aggregate_type = 'old'") == 0
    })
    .await;
    assert_eq!(
        count(&env, "aggregate_type = 'young'"),
        1,
        "the young row stays"
    );

    let want = "outbox_relay_retention_deleted_rows_total{table=\"public.outbox\"} 2500";
    let deadline = Instant::now() + WAIT;
    loop {
        let metrics = http_get(metrics_port, "/metrics").await.unwrap_or_default();
        if metrics.contains(want) {
            break;
        }
        assert!(Instant::now() < deadline, "no {want} in:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("retention deleted confirmed outbox rows"),
        "{log}"
    );
    // The per-message trace event is debug only.
    assert!(!log.contains("message published"), "{log}");
    env.cleanup().await;
}

/// A partitioned outbox (published through its root): ctids are unique only within
/// one partition, so the young rows of one partition sit at the same (page, item)
/// positions as the old rows of another. Retention must delete exactly the old ones.
#[tokio::test]
async fn retention_on_a_partitioned_outbox_deletes_only_the_old_rows_whose_ctids_young_rows_share()
{
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::with_ddl(
        "CREATE TABLE outbox (
            id uuid NOT NULL DEFAULT gen_random_uuid(),
            aggregate_type text NOT NULL,
            aggregate_id text NOT NULL,
            event_type text NOT NULL,
            payload jsonb NOT NULL,
            headers jsonb,
            created_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (id, created_at)
         ) PARTITION BY RANGE (created_at);
         CREATE TABLE outbox_2020 PARTITION OF outbox
           FOR VALUES FROM (MINVALUE) TO ('2021-01-01');
         CREATE TABLE outbox_2022 PARTITION OF outbox
           FOR VALUES FROM ('2021-01-01') TO ('2023-01-01');
         CREATE TABLE outbox_now PARTITION OF outbox
           FOR VALUES FROM ('2023-01-01') TO (MAXVALUE);",
        &["public.outbox"],
    )
    .await;
    env.extra = RETENTION_2S.into();
    env.create_slot();
    assert_eq!(
        env.db.psql(&format!(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = '{}'",
            env.publication
        )),
        "t",
        "slot create publishes a partitioned outbox via its root"
    );
    let got = env.consumer().await;
    let relay = start(&env, &[], &[]);

    // Rows of one fixed size, so that equal positions in different partitions hold
    // the same ctid. The young rows commit first: every marker that lets the old
    // rows go covers them too, only their created_at (a day ahead) keeps them.
    let insert = |kind: &str, from: i32, to: i32, at: &str| {
        env.db.psql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT '{kind}', lpad(n::text, 6, '0'), 'e', '{{}}', {at}
               FROM generate_series({from}, {to}) AS s(n) ORDER BY n"
        ));
    };
    insert("young", 1, 1500, "now() + interval '1 day'");
    insert("old2020", 1, 1200, "'2020-06-01T00:00:00Z'");
    insert("old2022", 1, 300, "'2022-06-01T00:00:00Z'");
    let collide = |old: &str| -> i64 {
        env.db
            .psql(&format!(
                "SELECT count(*) FROM outbox_now y JOIN {old} o ON o.ctid = y.ctid"
            ))
            .parse()
            .unwrap()
    };
    assert_eq!(
        collide("outbox_2020"),
        1200,
        "every old 2020 ctid has a young twin"
    );
    assert_eq!(
        collide("outbox_2022"),
        300,
        "every old 2022 ctid has a young twin"
    );

    let msgs = got
        .wait_until(WAIT, |m| {
            let ids: std::collections::HashSet<String> = m.iter().map(|m| m.message_id()).collect();
            ids.len() >= 3000
        })
        .await;
    assert!(
        msgs.iter()
            .all(|m| m.header("outbox_table").as_deref() == Some("public.outbox")),
        "events carry the root's name"
    );

    eventually(&relay, WAIT, "the old rows to be deleted", || {
        count(&env, "aggregate_type LIKE 'old%'") == 0
    })
    .await;
    // Another pass or two, in case a later batch takes young rows.
    const TICK: &str = "retention deleted confirmed outbox rows";
    eventually(&relay, WAIT, "the deletion to be logged", || {
        relay.log_text().contains(TICK)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        count(&env, "aggregate_type = 'young'"),
        1500,
        "young rows were deleted:\n{}",
        relay.log_text()
    );
    assert_eq!(
        env.db.psql(
            "SELECT count(DISTINCT aggregate_id) FROM outbox_now WHERE aggregate_type = 'young'"
        ),
        "1500"
    );
    assert_eq!(count(&env, "true"), 1500, "only young rows remain");

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let deleted: u64 = log
        .lines()
        .filter(|l| l.contains(TICK))
        .filter_map(|l| l.split("rows=").nth(1))
        .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(deleted, 1500, "rows the relay says it deleted:\n{log}");
    env.cleanup().await;
}

#[tokio::test]
async fn retention_keeps_an_old_row_until_it_is_published_and_confirmed() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.extra = RETENTION_2S.into();
    env.create_slot();
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    // Only "ok.*" is routable: a "held.*" message is returned, and without a
    // dead-letter exchange the relay retries it forever (docs/design.md §5).
    let q_ok = env.broker.queue_bound(&exchange, "ok.#").await;
    let got_ok = env.broker.consume(&q_ok).await;
    let relay = start(
        &env,
        &[],
        &[("RUST_LOG", "info,outbox_relay::retention=debug")],
    );

    // Retention is working: an old published row goes.
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES ('ok', 'p-1', 'published', '{}', now() - interval '1 day')",
    );
    got_ok.wait_for(1, WAIT).await;
    eventually(&relay, WAIT, "the published old row to be deleted", || {
        count(&env, "aggregate_type = 'ok'") == 0
    })
    .await;

    // An old row that cannot be published.
    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES ('00000000-0000-0000-0000-00000000a11d', 'held', 'h-1', 'stuck', '{}',
                 now() - interval '1 day')",
    );
    eventually(
        &relay,
        WAIT,
        "the relay to report the unroutable message",
        || relay.log_text().contains("unroutable"),
    )
    .await;
    // Several retention passes run while it is unpublished and delete nothing.
    const TICK: &str = "retention tick";
    let before = relay.log_text().matches(TICK).count();
    eventually(&relay, WAIT, "three retention passes", || {
        relay.log_text().matches(TICK).count() >= before + 3
    })
    .await;
    assert_eq!(
        count(&env, "aggregate_type = 'held'"),
        1,
        "an unpublished row was deleted:\n{}",
        relay.log_text()
    );

    // Make it routable: the relay's retry publishes it, the slot passes it, it goes.
    let q_held = env.broker.queue_bound(&exchange, "held.#").await;
    let got_held = env.broker.consume(&q_held).await;
    let msgs = got_held.wait_for(1, WAIT).await;
    assert_eq!(msgs[0].message_id(), "00000000-0000-0000-0000-00000000a11d");
    eventually(&relay, WAIT, "the now published row to be deleted", || {
        count(&env, "aggregate_type = 'held'") == 0
    })
    .await;

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

#[tokio::test]
async fn retention_without_a_created_at_column_is_refused_with_the_fix() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::with_ddl(
        "CREATE TABLE events (
            id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
            aggregate_type text NOT NULL,
            aggregate_id text NOT NULL,
            event_type text NOT NULL,
            payload jsonb NOT NULL,
            headers jsonb);",
        &["public.events"],
    )
    .await;
    env.create_slot();
    env.extra = "[retention]\nkeep = \"7d\"\n".into();

    let out = env.cli(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stdout.contains("FAIL  retention"), "{stdout}");
    assert!(
        stderr.contains("created_at column in outbox table public.events")
            && stderr.contains("ADD COLUMN created_at"),
        "{stderr}"
    );

    let mut relay = start(&env, &[], &[]);
    let code = relay.wait(WAIT);
    let log = relay.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("ADD COLUMN created_at"), "{log}");

    // Without retention the same table is fine.
    env.extra = String::new();
    let out = env.cli(&["check"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    env.cleanup().await;
}

#[tokio::test]
async fn retention_without_delete_privilege_is_refused_with_the_grant() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    env.extra = RETENTION_2S.into();
    let role = unique_name("relay_role");
    let _drop_role = DropRole {
        role: role.clone(),
        db: env.db.name.clone(),
    };
    env.db.psql(&format!(
        "CREATE ROLE {role} LOGIN REPLICATION;
         GRANT USAGE ON SCHEMA public TO {role};
         GRANT SELECT ON outbox TO {role};"
    ));
    let url = env.db.url().replacen("postgres@", &format!("{role}@"), 1);
    assert!(url.contains(&role), "{url}");
    let vars = [("OUTBOX_RELAY_POSTGRES_URL", url.as_str())];

    let mut relay = start(&env, &[], &vars);
    let code = relay.wait(WAIT);
    let log = relay.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!("GRANT DELETE ON \"public\".\"outbox\" TO {role}")),
        "{log}"
    );

    // With the grant it runs and deletes.
    env.db.psql(&format!("GRANT DELETE ON outbox TO {role}"));
    let got = env.consumer().await;
    let relay = start(&env, &[], &vars);
    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES ('old', 'o-1', 'gone', '{}', now() - interval '1 day')",
    );
    got.wait_for(1, WAIT).await;
    eventually(&relay, WAIT, "the old row to be deleted", || {
        count(&env, "true") == 0
    })
    .await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// Trace correlation (docs/design.md §6, §5)
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn debug_logs_carry_the_message_id_and_commit_lsn_of_each_published_message() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = start(
        &env,
        &["--log-format", "json"],
        &[("RUST_LOG", "info,publisher=debug")],
    );
    let id = "00000000-0000-0000-0000-0000000007ac";
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('{id}', 'order', 'o-1', 'created', '{{}}')"
    ));
    let msgs = got.wait_for(1, WAIT).await;
    let lsn = msgs[0].header("commit_lsn").unwrap();

    let field = |line: &serde_json::Value, key: &str| {
        line.get(key)
            .or_else(|| line.get("fields").and_then(|f| f.get(key)))
            .and_then(|v| v.as_str())
            .map(str::to_string)
    };
    let mut found = None;
    eventually(&relay, WAIT, "a log line with the message id", || {
        found = relay
            .log_text()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| field(l, "message_id").as_deref() == Some(id));
        found.is_some()
    })
    .await;
    let line = found.unwrap();
    assert_eq!(
        field(&line, "commit_lsn").as_deref(),
        Some(lsn.as_str()),
        "{line}"
    );
    assert_eq!(field(&line, "level").as_deref(), Some("DEBUG"), "{line}");

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// RabbitMQ cluster: a list of nodes (docs/design.md §6)
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn a_url_list_whose_first_node_is_down_connects_and_reconnects_to_the_next() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let target: SocketAddr = broker_host_port()
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(target).await;
    let dead = closed_port();
    let urls = format!(
        "[{:?}, {:?}]",
        broker_url_via(dead),
        broker_url_via(proxy.port())
    );
    let relay = start(&env, &[], &[("OUTBOX_RELAY_RABBITMQ_URL", &urls)]);

    env.insert_tx(&[("order", "o-1", "created", "{}")]);
    got.wait_for(1, WAIT).await;
    let node = format!("127.0.0.1:{}", proxy.port());
    let log = relay.log_text();
    let connected = log
        .lines()
        .find(|l| l.contains("connected to rabbitmq"))
        .unwrap_or_else(|| panic!("no connect line:\n{log}"));
    assert!(connected.contains(&node), "{connected}");

    // Lose the connection: the relay goes through the list again, skips the dead
    // node and says where it reconnected.
    proxy.cut();
    env.insert_tx(&[("order", "o-2", "created", "{}")]);
    eventually(
        &relay,
        WAIT,
        "the relay to notice the lost connection",
        || relay.log_text().contains("publish failed"),
    )
    .await;
    proxy.restore();
    eventually(&relay, WAIT, "the relay to reconnect", || {
        relay
            .log_text()
            .lines()
            .any(|l| l.contains("reconnected to rabbitmq") && l.contains(&node))
    })
    .await;
    got.wait_until(WAIT, |m| {
        m.iter()
            .any(|m| m.header("aggregate_id").as_deref() == Some("o-2"))
    })
    .await;

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        !log.contains("guest:guest"),
        "a password reached the log:\n{log}"
    );
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// Failover slots (docs/design.md §7)
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn slot_create_failover_needs_postgres_17() {
    let _shared = testkit::BROKER.read().await;
    let env = Env::new().await;
    let version: i32 = env.db.psql("SHOW server_version_num").parse().unwrap();
    let out = env.cli(&["slot", "create", "--failover"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let slots = || -> String {
        env.db.psql(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            env.slot
        ))
    };
    if version < 170000 {
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("failover slots need Postgres 17 or newer")
                && stderr.contains("without --failover"),
            "{stderr}"
        );
        assert_eq!(slots(), "0", "no slot is created");
    } else {
        assert!(out.status.success(), "{stderr}");
        let failover = env.db.psql(&format!(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = '{}'",
            env.slot
        ));
        assert_eq!(failover, "t");
    }
    env.cleanup().await;
}
