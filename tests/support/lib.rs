//! End-to-end harness: a fresh database with an outbox, the real `outbox-relay`
//! binary run as a child process with its own config file, and a RabbitMQ consumer
//! recording what arrives. Shared by every black-box test of the binary in tests/.
#![allow(clippy::unwrap_used)]

pub mod cli;
pub mod clusters;
pub mod scenarios;
pub mod stream;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use testkit::amqp::{Msg, Received, TestBroker};
use testkit::{unique_name, TestDb};

/// The `outbox-relay` binary the tests run: `OUTBOX_TEST_RELAY_BIN` when set (e.g. a
/// release build), else the workspace's build of it, brought up to date once per
/// test process with `cargo build` (the same profile as the tests). The first call
/// blocks for that build: make it before opening connections (the constructors
/// here do), and scripts/test.sh builds the binary before the tests so that it is
/// a no-op there.
pub fn bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| match std::env::var_os("OUTBOX_TEST_RELAY_BIN") {
        Some(path) => PathBuf::from(path),
        None => build_relay(),
    })
}

fn build_relay() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "outbox-relay", "--bin", "outbox-relay"])
        .args([
            "--message-format=json-render-diagnostics",
            "--manifest-path",
        ])
        .arg(&manifest)
        .stderr(Stdio::inherit());
    let release = std::env::current_exe()
        .map(|exe| exe.components().any(|c| c.as_os_str() == "release"))
        .unwrap_or(false);
    if release {
        cmd.arg("--release");
    }
    let out = cmd
        .output()
        .expect("run cargo build for the outbox-relay binary");
    assert!(out.status.success(), "cargo build -p outbox-relay failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| {
            msg["reason"] == "compiler-artifact" && msg["target"]["name"] == "outbox-relay"
        })
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .expect("cargo build reported the outbox-relay executable")
}

pub const OUTBOX_DDL: &str = "CREATE TABLE outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb,
    created_at timestamptz NOT NULL DEFAULT now());";

/// One test's world: database, slot/publication names, exchange, queue, config.
pub struct Env {
    pub db: TestDb,
    pub slot: String,
    pub publication: String,
    pub exchange: String,
    pub broker: TestBroker,
    pub dir: PathBuf,
    /// Extra TOML appended to the generated config (sections and keys).
    pub extra: String,
    pub tables: Vec<String>,
}

impl Env {
    /// A database with the default outbox table; nothing created on the broker yet.
    pub async fn new() -> Env {
        Self::with_ddl(OUTBOX_DDL, &["public.outbox"]).await
    }

    pub async fn with_ddl(ddl: &str, tables: &[&str]) -> Env {
        Self::with_ddl_at(testkit::pg_port(), ddl, tables).await
    }

    /// [`Env::new`] on the cluster listening on `port` (e.g. one of the per-version
    /// clusters of `scripts/pg-versions.sh`).
    pub async fn with_port(port: u16) -> Env {
        Self::with_ddl_at(port, OUTBOX_DDL, &["public.outbox"]).await
    }

    /// [`Env::with_ddl`] on the cluster listening on `port`.
    pub async fn with_ddl_at(port: u16, ddl: &str, tables: &[&str]) -> Env {
        // Build the binary (once per process) before any connection is open: the
        // build blocks this test's runtime, which would starve AMQP heartbeats.
        bin();
        let db = TestDb::new_at(port, "e2e");
        db.psql(ddl);
        let mut broker = TestBroker::connect().await;
        let exchange = broker.exchange_name("ex");
        let dir = std::env::temp_dir().join(unique_name("relay"));
        std::fs::create_dir_all(&dir).unwrap();
        Env {
            db,
            slot: unique_name("slot"),
            publication: unique_name("pub"),
            exchange,
            broker,
            dir,
            extra: String::new(),
            tables: tables.iter().map(|t| t.to_string()).collect(),
        }
    }

    /// Writes the config file and returns its path.
    pub fn config(&self) -> PathBuf {
        self.config_with(&self.db.url())
    }

    /// The config file with another Postgres URL.
    pub fn config_with(&self, pg_url: &str) -> PathBuf {
        let tables: Vec<String> = self.tables.iter().map(|t| format!("{t:?}")).collect();
        let toml = format!(
            "[postgres]\nurl = {pg_url:?}\nslot = {:?}\npublication = {:?}\ntables = [{}]\n\n\
             [rabbitmq]\nurl = {:?}\nexchange = {:?}\nmax_in_flight = 1000\n\n\
             [relay]\nstatus_interval_ms = 200\nmetrics_listen = \"\"\nshutdown_timeout_ms = 10000\n\n{}\n",
            self.slot,
            self.publication,
            tables.join(", "),
            testkit::amqp_url(),
            self.exchange,
            self.extra,
        );
        let path = self.dir.join("outbox-relay.toml");
        testkit::write_atomic(&path, &toml);
        path
    }

    /// Runs a one-shot command (`slot create`, `check`, …) and returns its output.
    pub fn cli(&self, args: &[&str]) -> Output {
        let config = self.config();
        Command::new(bin())
            .arg("--config")
            .arg(&config)
            .args(args)
            .current_dir(&self.dir)
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    }

    /// `cli` with extra environment variables (e.g. `OUTBOX_RELAY_RELAY_REPLAY_WINDOW`).
    pub fn cli_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let config = self.config();
        Command::new(bin())
            .arg("--config")
            .arg(&config)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(&self.dir)
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    }

    /// `start` with extra environment variables.
    pub fn start_env(&self, extra_args: &[&str], env: &[(&str, &str)]) -> Relay {
        let config = self.config();
        let log = self.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(&config)
            .arg("run")
            .args(extra_args)
            .envs(env.iter().copied())
            .current_dir(&self.dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    /// `slot create`, asserting success.
    pub fn create_slot(&self) {
        let out = self.cli(&["slot", "create"]);
        assert!(
            out.status.success(),
            "slot create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Declares the exchange, binds a queue for everything and starts consuming.
    pub async fn consumer(&mut self) -> Received {
        self.broker
            .declare_exchange(&self.exchange.clone(), "topic")
            .await;
        let q = self.broker.queue_bound(&self.exchange.clone(), "#").await;
        self.broker.consume(&q).await
    }

    /// Starts `outbox-relay run` with stderr going to a log file.
    pub fn start(&self, extra_args: &[&str]) -> Relay {
        let config = self.config();
        let log = self.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(&config)
            .arg("run")
            .args(extra_args)
            .current_dir(&self.dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    /// Inserts one outbox row per `(aggregate_type, aggregate_id, event_type, payload)`
    /// in one transaction.
    pub fn insert_tx(&self, rows: &[(&str, &str, &str, &str)]) {
        let values: Vec<String> = rows
            .iter()
            .map(|(t, a, e, p)| format!("('{t}', '{a}', '{e}', '{p}')"))
            .collect();
        self.db.psql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES {}",
            values.join(", ")
        ));
    }

    /// Inserts `n` rows with ids `prefix-1..=n` (as aggregate_id; payload {"seq": i})
    /// in transactions of `per_tx` rows, using generate_series (fast).
    pub fn insert_seq(&self, from: usize, n: usize, per_tx: usize) {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx - 1).min(from + n - 1);
            self.db.psql(&format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                   FROM generate_series({i}, {end}) AS s(n) ORDER BY s.n"
            ));
            i = end + 1;
        }
    }

    /// The slot's confirmed_flush_lsn and the server's current WAL position, as
    /// the difference in bytes.
    pub fn slot_lag_bytes(&self) -> i64 {
        self.db
            .psql(&format!(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = '{}'",
                self.slot
            ))
            .parse()
            .unwrap()
    }

    /// Writes a config file named `name` with the given Postgres and AMQP URLs and
    /// `[relay] metrics_listen` (the rest as [`Env::config_with`]); returns its path.
    pub fn config_file(
        &self,
        name: &str,
        pg_url: &str,
        amqp_url: &str,
        metrics_listen: &str,
    ) -> PathBuf {
        let tables: Vec<String> = self.tables.iter().map(|t| format!("{t:?}")).collect();
        let toml = format!(
            "[postgres]\nurl = {pg_url:?}\nslot = {:?}\npublication = {:?}\ntables = [{}]\n\n\
             [rabbitmq]\nurl = {amqp_url:?}\nexchange = {:?}\nmax_in_flight = 1000\n\n\
             [relay]\nstatus_interval_ms = 200\nmetrics_listen = {metrics_listen:?}\nshutdown_timeout_ms = 10000\n\n{}\n",
            self.slot,
            self.publication,
            tables.join(", "),
            self.exchange,
            self.extra,
        );
        let path = self.dir.join(name);
        testkit::write_atomic(&path, &toml);
        path
    }

    /// Runs a one-shot command with `config` and `RUST_LOG=rust_log`.
    pub fn cli_with(&self, config: &std::path::Path, rust_log: &str, args: &[&str]) -> Output {
        Command::new(bin())
            .arg("--config")
            .arg(config)
            .args(args)
            .current_dir(&self.dir)
            .env("RUST_LOG", rust_log)
            .output()
            .unwrap()
    }

    /// Starts `outbox-relay [global_args] run` with `config` and `RUST_LOG=rust_log`,
    /// stderr going to a log file.
    pub fn start_with(
        &self,
        config: &std::path::Path,
        rust_log: &str,
        global_args: &[&str],
    ) -> Relay {
        let log = self.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(config)
            .args(global_args)
            .arg("run")
            .current_dir(&self.dir)
            .env("RUST_LOG", rust_log)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    /// [`Env::start_with`] with extra environment variables.
    pub fn start_with_env(
        &self,
        config: &std::path::Path,
        rust_log: &str,
        env: &[(&str, &str)],
    ) -> Relay {
        let log = self.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(config)
            .arg("run")
            .envs(env.iter().copied())
            .current_dir(&self.dir)
            .env("RUST_LOG", rust_log)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    /// Inserts rows `from..from + n` with `aggregate_type = tag` and the row's number
    /// as `aggregate_id` (payload `{"seq": i}`), in transactions whose sizes cycle
    /// through 1, 7 and 40 rows.
    pub fn insert_tagged(&self, tag: &str, from: usize, n: usize) {
        let mut i = from;
        let sizes = [1usize, 7, 40];
        let mut k = 0;
        while i < from + n {
            let end = (i + sizes[k % sizes.len()] - 1).min(from + n - 1);
            self.db.psql(&format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT '{tag}', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                   FROM generate_series({i}, {end}) AS s(n) ORDER BY s.n"
            ));
            i = end + 1;
            k += 1;
        }
    }

    pub async fn cleanup(self) {
        self.broker.cleanup().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running relay process.
pub struct Relay {
    pub child: Child,
    pub log: PathBuf,
}

impl Relay {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGTERM, then waits (bounded) for the exit code.
    pub fn terminate(mut self) -> (Option<i32>, String) {
        self.signal("TERM");
        let code = self.wait(Duration::from_secs(40));
        (code, self.log_text())
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) -> String {
        self.signal("KILL");
        let _ = self.child.wait();
        self.log_text()
    }

    /// Waits for exit up to `timeout`; kills it on timeout and returns None.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; panics with the log after `timeout`.
    pub async fn wait_log(&self, needle: &str, timeout: Duration) -> String {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let log = self.log_text();
            if log.contains(needle) {
                return log;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {needle:?} in the relay's log after {timeout:?}:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A command's stderr as text.
/// The test broker's management API (`OUTBOX_TEST_MANAGEMENT_URL`).
pub fn management_url() -> String {
    std::env::var("OUTBOX_TEST_MANAGEMENT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

/// A command's stdout, then its stderr, as one text (for assertions and their messages).
pub fn output_text(out: &Output) -> String {
    format!("{}{}", stdout(out), stderr(out))
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A command's stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Owned environment pairs as the `&str` pairs `Env::cli_env` / `start_env` take.
pub fn as_refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, s)| (*k, s.as_str())).collect()
}

/// Checks the consumer-side guarantees for a sequence stream: every expected
/// aggregate_id present, first occurrences in order, and returns the number of
/// duplicates.
pub fn check_sequence(msgs: &[Msg], expected: usize) -> usize {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut firsts: Vec<usize> = Vec::new();
    for m in msgs {
        let seq: usize = m.header("aggregate_id").unwrap().parse().unwrap();
        let count = seen.entry(m.message_id()).or_insert(0);
        if *count == 0 {
            firsts.push(seq);
        }
        *count += 1;
    }
    assert_eq!(firsts.len(), expected, "distinct messages");
    for (i, s) in firsts.iter().enumerate() {
        assert_eq!(*s, i + 1, "first occurrences out of order at position {i}");
    }
    msgs.len() - expected
}

/// Drops a test role on the way out, also when the test fails.
pub struct DropRole {
    pub role: String,
    pub db: String,
}

impl Drop for DropRole {
    fn drop(&mut self) {
        // No assertions: this may run while a test panics.
        let psql = |db: &str, sql: &str| {
            let _ = testkit::try_psql(testkit::pg_port(), db, sql);
        };
        psql(&self.db, &format!("DROP OWNED BY {}", self.role));
        psql("postgres", &format!("DROP ROLE IF EXISTS {}", self.role));
    }
}

/// A plain HTTP/1.1 GET: `(status, body)`, or `None` if nothing answers.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let fetch = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status: u16 = text.split(' ').nth(1)?.parse().ok()?;
        let (_, body) = text.split_once("\r\n\r\n")?;
        Some((status, body.to_string()))
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}
