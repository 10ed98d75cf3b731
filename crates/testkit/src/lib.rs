//! Test support shared by the workspace's integration tests.
//!
//! Every test gets its own database ([`TestDb`]), and its own slot, publication,
//! exchange and queue names ([`unique_name`]), so tests run in parallel. The services
//! are the ones `scripts/test-services.sh` prepares: a Postgres cluster of the tests'
//! own with `wal_level=logical` (port `OUTBOX_TEST_PG_PORT`, default 55432) and the
//! machine's RabbitMQ (`OUTBOX_TEST_AMQP`). [`recording`] holds the recording consumer
//! and the checker of what arrived; [`BROKER`] the one broker lock.
#![allow(clippy::unwrap_used)]

pub mod amqp;
pub mod connections;
pub mod hostile;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod proxy;
pub mod recording;
pub mod sim;
pub mod stream;
pub mod stream_proxy;

use std::process::Command;

/// Port of the tests' own Postgres cluster.
pub fn pg_port() -> u16 {
    std::env::var("OUTBOX_TEST_PG_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55432)
}

/// Port of the second cluster, reserved for fault tests that restart or crash
/// Postgres (`outbox_fault`, default 55433).
pub fn pg_fault_port() -> u16 {
    std::env::var("OUTBOX_TEST_FAULT_PG_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55433)
}

/// `major/name` of the fault-test cluster, for `pg_ctlcluster`.
pub fn pg_fault_cluster() -> (String, String) {
    let (v, _) = pg_cluster();
    (v, "outbox_fault".to_string())
}

/// `major/name` of the tests' cluster, for `pg_ctlcluster`.
pub fn pg_cluster() -> (String, String) {
    let spec = std::env::var("OUTBOX_TEST_PG_CLUSTER").unwrap_or_else(|_| {
        let version = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter_map(|n| n.parse::<u32>().ok())
                    .max()
            })
            .unwrap_or(15);
        format!("{version}/outbox_test")
    });
    let (v, n) = spec.split_once('/').unwrap_or(("15", "outbox_test"));
    (v.to_string(), n.to_string())
}

/// Path of the CA certificate that signed the test cluster's server certificate.
pub fn pg_ca_file() -> String {
    std::env::var("OUTBOX_TEST_PG_CA").unwrap_or_else(|_| {
        let (v, n) = pg_cluster();
        format!("/etc/postgresql/{v}/{n}/certs/ca.crt")
    })
}

/// AMQP URL of the test broker.
pub fn amqp_url() -> String {
    std::env::var("OUTBOX_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string())
}

/// Which broker of the test matrix the tests run against: "rabbitmq-3" (the machine's
/// node, the default) or "rabbitmq-4" (scripts/rabbitmq4.sh; `OUTBOX_TEST_BROKER`).
pub fn broker_major() -> u32 {
    match std::env::var("OUTBOX_TEST_BROKER").as_deref() {
        Ok("rabbitmq-4") => 4,
        _ => 3,
    }
}

/// `rabbitmqctl` for the test broker: `OUTBOX_TEST_RABBITMQCTL` when set (the RabbitMQ 4
/// node's CLI in its Debian 13 root, scripts/rabbitmq4.sh), else the machine's.
pub fn rabbitmqctl_command() -> std::process::Command {
    let program =
        std::env::var_os("OUTBOX_TEST_RABBITMQCTL").unwrap_or_else(|| "rabbitmqctl".into());
    std::process::Command::new(program)
}

/// The test broker's AMQPS URL (`OUTBOX_TEST_AMQPS`: guest over TLS, verified by the
/// test CA).
pub fn amqps_url() -> String {
    std::env::var("OUTBOX_TEST_AMQPS")
        .unwrap_or_else(|_| "amqps://guest:guest@localhost:5671/%2f".to_string())
}

/// The test broker's AMQPS URL for a certificate login (EXTERNAL, no user in the URL).
pub fn amqps_external_url() -> String {
    format!(
        "amqps://localhost:{}/%2f?auth_mechanism=external",
        port_of(&amqps_url(), 5671)
    )
}

/// The port of the test broker's AMQP listener (from [`amqp_url`]).
pub fn amqp_port() -> u16 {
    port_of(&amqp_url(), 5672)
}

/// The test broker's AMQP listener as an address (a proxy's upstream).
pub fn amqp_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], amqp_port()))
}

/// An AMQP URL of the test broker for another user and vhost (the vhost as it goes in
/// the URL: `%2f` for `/`).
pub fn amqp_url_for(user: &str, password: &str, vhost: &str) -> String {
    format!("amqp://{user}:{password}@127.0.0.1:{}/{vhost}", amqp_port())
}

/// The explicit port of `url` (`scheme://user:pass@host:port/...`), else `default`.
pub fn port_of(url: &str, default: u16) -> u16 {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    hostport
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(default)
}

/// Writes `contents` to `path` atomically (a temporary file renamed over it), so a
/// relay process reading the file while a test rewrites it never sees it truncated.
pub fn write_atomic(path: &std::path::Path, contents: &str) {
    let tmp = path.with_extension(format!("tmp{}", unique_name("w")));
    std::fs::write(&tmp, contents).expect("write a temporary file");
    std::fs::rename(&tmp, path).expect("rename a temporary file over its target");
}

/// Tests that need a healthy broker hold this for reading; a test that changes the
/// broker for everyone (a memory alarm, `stop_app`) holds it for writing, so it never
/// overlaps them. The lock is per process: it covers the tests of one test binary.
pub static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A port on 127.0.0.1 free right now (the relay binds it moments later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("the bound address")
        .port()
}

/// [`free_port`] as `127.0.0.1:PORT`.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// A name no other test uses: `prefix_` followed by 12 hex digits. Valid as a Postgres
/// identifier (slot, publication, database, role) and as an AMQP name.
pub fn unique_name(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &id[..12])
}

/// libpq key=value conninfo for `user` on `dbname` of the test cluster.
pub fn pg_conninfo(dbname: &str) -> String {
    format!(
        "host=127.0.0.1 port={} user=postgres dbname={dbname}",
        pg_port()
    )
}

/// URL form of [`pg_conninfo`].
pub fn pg_url(dbname: &str) -> String {
    format!("postgresql://postgres@127.0.0.1:{}/{dbname}", pg_port())
}

/// Runs SQL on the test cluster with `psql` (synchronous: usable from `Drop`).
/// Returns stdout; panics with psql's stderr on failure.
pub fn psql(dbname: &str, sql: &str) -> String {
    psql_at(pg_port(), dbname, sql)
}

/// [`psql`] on the cluster listening on `port`.
pub fn psql_at(port: u16, dbname: &str, sql: &str) -> String {
    psql_run(port, dbname, &["-c", sql])
}

/// Runs the SQL file `path` with psql variables `vars` (`-v name=value`) on the
/// cluster listening on `port`; returns stdout, panics with psql's stderr on failure.
pub fn psql_file_at(port: u16, dbname: &str, path: &str, vars: &[(&str, &str)]) -> String {
    let mut args: Vec<String> = Vec::new();
    for (name, value) in vars {
        args.push("-v".into());
        args.push(format!("{name}={value}"));
    }
    args.push("-f".into());
    args.push(path.into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    psql_run(port, dbname, &args)
}

fn psql_run(port: u16, dbname: &str, what: &[&str]) -> String {
    let out = Command::new("psql")
        .args([
            "-XAtq",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
        ])
        .args(["-p", &port.to_string(), "-d", dbname])
        .args(what)
        .output()
        .expect("psql runs");
    assert!(
        out.status.success(),
        "psql failed on {what:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
}

/// A fresh database on the test cluster, dropped (with its slots) on drop.
pub struct TestDb {
    pub name: String,
    /// The cluster's port.
    pub port: u16,
}

impl TestDb {
    /// Creates a database named after `prefix` plus a unique suffix.
    pub fn new(prefix: &str) -> TestDb {
        Self::new_at(pg_port(), prefix)
    }

    /// Like [`TestDb::new`], on the fault-test cluster ([`pg_fault_port`]), which
    /// fault tests may restart or crash.
    pub fn new_on_fault_cluster(prefix: &str) -> TestDb {
        Self::new_at(pg_fault_port(), prefix)
    }

    /// Like [`TestDb::new`], on the cluster listening on `port` (e.g. one of the
    /// per-version clusters of `scripts/pg-versions.sh`).
    pub fn new_at(port: u16, prefix: &str) -> TestDb {
        let name = unique_name(prefix);
        psql_at(port, "postgres", &format!("CREATE DATABASE {name}"));
        TestDb { name, port }
    }

    /// libpq key=value conninfo for this database as `postgres`.
    pub fn conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={}",
            self.port, self.name
        )
    }

    /// URL for this database as `postgres`.
    pub fn url(&self) -> String {
        format!(
            "postgresql://postgres@127.0.0.1:{}/{}",
            self.port, self.name
        )
    }

    /// Runs SQL in this database with psql.
    pub fn psql(&self, sql: &str) -> String {
        psql_at(self.port, &self.name, sql)
    }

    /// An ordinary tokio-postgres client on this database (its connection task is
    /// spawned on the current runtime).
    #[cfg(feature = "postgres")]
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.conninfo(), tokio_postgres::NoTls)
            .await
            .expect("connect to test database");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = &self.name;
        // Slots keep a database alive; end their walsenders first, then drop them.
        let sql = format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
               WHERE database = '{name}' AND active_pid IS NOT NULL;"
        );
        let _ = Command::new("psql")
            .args(["-XAtq", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &self.port.to_string(), "-d", "postgres", "-c", &sql])
            .output();
        for _ in 0..50 {
            let sql = format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                   WHERE database = '{name}' AND NOT active; \
                 SELECT count(*) FROM pg_replication_slots WHERE database = '{name}';"
            );
            let out = Command::new("psql")
                .args(["-XAtq", "-h", "127.0.0.1", "-U", "postgres"])
                .args(["-p", &self.port.to_string(), "-d", "postgres", "-c", &sql])
                .output();
            match out {
                Ok(o) if String::from_utf8_lossy(&o.stdout).trim_end().ends_with('0') => break,
                _ => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
        }
        let _ = Command::new("psql")
            .args(["-XAtq", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &self.port.to_string(), "-d", "postgres"])
            .args([
                "-c",
                &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            ])
            .output();
    }
}

/// `X/Y` → u64.
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.trim().split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

/// Runs SQL with `psql` on the cluster listening on `port`: whether it succeeded
/// (for retries through restarts; [`psql_at`] panics instead).
pub fn try_psql(port: u16, db: &str, sql: &str) -> bool {
    Command::new("psql")
        .args([
            "-XAtq",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
        ])
        .args(["-p", &port.to_string(), "-d", db, "-c", sql])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}
