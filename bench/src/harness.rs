//! Shared plumbing: databases with an outbox, slots, the relay process, consumers,
//! process CPU and memory readings.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use testkit::{unique_name, TestDb};

mod sink;
mod stream_sink;
pub use sink::*;
pub use stream_sink::*;

pub const OUTBOX_DDL: &str = "CREATE TABLE outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb,
    created_at timestamptz NOT NULL DEFAULT now());";

/// ~300-byte payload expression over the series variable `n`.
pub const PAYLOAD_SQL: &str =
    "jsonb_build_object('n', n, 'customer', 'c-' || (n % 1000), 'pad', repeat('x', 240))";

/// The prefix of the logical messages the `drain-messages` load emits and its relay
/// relays (`[postgres] messages`, docs/messages.md).
pub const MESSAGE_PREFIX: &str = "outbox";

/// The content of the message for event `n` (the series variable): the JSON object
/// `outbox_emit` (sql/outbox_messages.sql) writes for the row [`BenchDb::preload`]
/// inserts for `n` ([`PAYLOAD_SQL`]), its fresh uuid id included.
pub fn message_content_sql() -> String {
    format!(
        "jsonb_build_object('id', gen_random_uuid()::text, 'aggregate_type', 'bench', \
         'aggregate_id', n::text, 'event_type', 'tick', 'payload', {PAYLOAD_SQL})::text"
    )
}

/// What a load writes per event: an outbox row, or a transactional logical message
/// with the same fields (docs/messages.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    Rows,
    Messages,
}

impl Load {
    /// One statement writing events `from..=to` (one transaction under psql -c).
    fn range_sql(self, from: usize, to: usize) -> String {
        match self {
            Load::Rows => format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'bench', n::text, 'tick', {PAYLOAD_SQL} FROM generate_series({from}, {to}) AS s(n)"
            ),
            // count() of the calls: each row's call is evaluated, in series order,
            // and psql prints one number instead of N positions.
            Load::Messages => format!(
                "SELECT count(pg_logical_emit_message(true, '{MESSAGE_PREFIX}', {}))
                   FROM generate_series({from}, {to}) AS s(n)",
                message_content_sql()
            ),
        }
    }

    /// A procedure `name(total int)` writing events 1..=total, one transaction each.
    fn one_per_tx_procedure(self, name: &str) -> String {
        let write = match self {
            Load::Rows => format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                   VALUES ('bench', n::text, 'tick', {PAYLOAD_SQL});"
            ),
            Load::Messages => format!(
                "PERFORM pg_logical_emit_message(true, '{MESSAGE_PREFIX}', {});",
                message_content_sql()
            ),
        };
        // A DO block cannot COMMIT in a loop; a procedure may.
        format!(
            "CREATE OR REPLACE PROCEDURE {name}(total int) LANGUAGE plpgsql AS $$
             BEGIN FOR n IN 1..total LOOP
               {write}
               COMMIT;
             END LOOP; END $$;"
        )
    }
}

/// A database with an outbox table and a publication.
pub struct BenchDb {
    pub db: TestDb,
    pub publication: String,
}

impl BenchDb {
    pub fn new() -> BenchDb {
        let db = TestDb::new("bench");
        db.psql(OUTBOX_DDL);
        let publication = unique_name("pub");
        db.psql(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')"
        ));
        BenchDb { db, publication }
    }

    /// A database for logical messages only: no outbox table, and a publication of
    /// no table (what `slot create` makes with `[postgres] tables = []`; pgoutput
    /// needs a publication, messages do not go through it).
    pub fn without_table() -> BenchDb {
        let db = TestDb::new("bench");
        let publication = unique_name("pub");
        db.psql(&format!(
            "CREATE PUBLICATION {publication} WITH (publish = 'insert')"
        ));
        BenchDb { db, publication }
    }

    pub fn create_slot(&self) -> String {
        let slot = unique_name("slot");
        self.db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
        slot
    }

    /// Inserts `n` rows in transactions of `per_tx` rows (server-side generation);
    /// returns the WAL bytes the load wrote ([`BenchDb::wal_bytes_since`]).
    pub fn preload(&self, n: usize, per_tx: usize) -> u64 {
        self.load(Load::Rows, n, per_tx)
    }

    /// Emits `n` transactional logical messages ([`MESSAGE_PREFIX`],
    /// [`message_content_sql`]) in transactions of `per_tx`, as [`BenchDb::preload`]
    /// inserts rows; returns the WAL bytes the load wrote.
    pub fn preload_messages(&self, n: usize, per_tx: usize) -> u64 {
        self.load(Load::Messages, n, per_tx)
    }

    /// Writes `n` events of `load` in transactions of `per_tx` (server-side
    /// generation) and returns the WAL written from its first to its last commit.
    fn load(&self, load: Load, n: usize, per_tx: usize) -> u64 {
        if per_tx == 1 && n > 1 {
            // One transaction per event, generated server-side by a procedure (which
            // may COMMIT), created before the measurement starts.
            let name = match load {
                Load::Rows => "bench_load",
                Load::Messages => "bench_emit",
            };
            self.db.psql(&load.one_per_tx_procedure(name));
            let before = self.current_lsn();
            // A separate statement: psql -c runs its statements in one transaction,
            // where the procedure could not COMMIT.
            self.db.psql(&format!("CALL {name}({n})"));
            return self.wal_bytes_since(&before);
        }
        let before = self.current_lsn();
        let mut start = 1;
        while start <= n {
            let end = (start + per_tx - 1).min(n);
            self.db.psql(&load.range_sql(start, end));
            start = end + 1;
        }
        self.wal_bytes_since(&before)
    }

    /// WAL bytes from `lsn` to `pg_current_wal_lsn()`. The WAL is the cluster's:
    /// whatever else runs on it meanwhile counts too.
    pub fn wal_bytes_since(&self, lsn: &str) -> u64 {
        self.db
            .psql(&format!(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn}')::bigint"
            ))
            .parse()
            .unwrap_or(0)
    }

    /// The outbox table's size on disk, indexes and TOAST included.
    pub fn outbox_bytes(&self) -> u64 {
        self.db
            .psql("SELECT pg_total_relation_size('outbox')")
            .parse()
            .unwrap_or(0)
    }

    /// Deletes every outbox row in one statement, as retention would in batches,
    /// and returns the WAL bytes it wrote (vacuum's later WAL not included).
    pub fn delete_outbox(&self) -> u64 {
        let before = self.current_lsn();
        self.db.psql("DELETE FROM outbox");
        self.wal_bytes_since(&before)
    }

    pub fn current_lsn(&self) -> String {
        self.db.psql("SELECT pg_current_wal_lsn()")
    }
}

pub fn epoch_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Environment variable naming a prebuilt relay binary (the quick run uses the
/// debug build; nothing is built then).
pub const RELAY_BIN_ENV: &str = "OUTBOX_BENCH_RELAY_BIN";

/// The relay binary: `$OUTBOX_BENCH_RELAY_BIN`, or built on demand in the harness's
/// own profile (release for `cargo run --release`) next to the harness binary.
pub fn relay_binary() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os(RELAY_BIN_ENV) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!(
                "{RELAY_BIN_ENV}={} is not a file; build outbox-relay or unset it",
                bin.display()
            );
        }
        return Ok(bin);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut build = Command::new("cargo");
    build.args([
        "build",
        "--locked",
        "-p",
        "outbox-relay",
        "--bin",
        "outbox-relay",
    ]);
    if !cfg!(debug_assertions) {
        build.arg("--release");
    }
    let status = build
        .current_dir(&root)
        .status()
        .context("run cargo build")?;
    if !status.success() {
        bail!("building outbox-relay failed");
    }
    // Cargo puts both binaries of one profile in the same directory (wherever
    // CARGO_TARGET_DIR points).
    let exe = std::env::current_exe().context("locate the harness binary")?;
    let bin = exe
        .parent()
        .map(|d| d.join("outbox-relay"))
        .context("the harness binary has no directory")?;
    if !bin.is_file() {
        bail!(
            "built outbox-relay but found no {}; set {RELAY_BIN_ENV}",
            bin.display()
        );
    }
    Ok(bin)
}

/// Whether a relay binary is a release build (judged by its directory name).
pub fn is_release(bin: &Path) -> bool {
    bin.parent()
        .and_then(|d| d.file_name())
        .is_some_and(|n| n == "release")
}

/// The test broker's URL (its credentials and vhost) with the host and port of a
/// local proxy instead.
fn through_port(url: &str, port: u16) -> String {
    let (prefix, rest) = match url.rsplit_once('@') {
        Some((scheme_user, rest)) => (format!("{scheme_user}@"), rest),
        None => match url.split_once("://") {
            Some((scheme, rest)) => (format!("{scheme}://"), rest),
            None => ("amqp://".to_string(), url),
        },
    };
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    format!("{prefix}127.0.0.1:{port}{path}")
}

/// Where the relay publishes.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// An exchange over AMQP (publisher confirms).
    Exchange(&'a str),
    /// The same through a proxy on this local port (the `stalled` scenario).
    Via(&'a str, u16),
    /// A stream over the stream protocol (named producer, publishing ids).
    Stream(&'a str),
    /// An exchange, the relay given every node of a cluster.
    ClusterExchange(&'a str, &'a ClusterUrls),
    /// A stream declared beforehand (replicated), the relay given every node of a
    /// cluster.
    ClusterStream(&'a str, &'a ClusterUrls),
}

/// Every node's URLs of a RabbitMQ cluster (docs/operations.md, "Running against a
/// cluster"), in the order given to the relay.
#[derive(Debug, Clone)]
pub struct ClusterUrls {
    pub amqp: Vec<String>,
    pub stream: Vec<String>,
}

/// What a scenario adds to the relay's config file.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConfigExtra<'a> {
    /// Keys appended to the `[postgres]` section (e.g. `messages = ["outbox"]`).
    pub postgres: &'a str,
    /// Keys appended to the `[rabbitmq]` section (e.g. `ordering = "aggregate"`): TOML
    /// allows no second `[rabbitmq]` header.
    pub rabbitmq: &'a str,
    /// Whole sections appended to the file (e.g. `[message]\nheaders = "minimal"`).
    pub sections: &'a str,
}

/// A running relay process.
pub struct RelayProc {
    pub child: Child,
    dir: PathBuf,
}

impl RelayProc {
    pub fn start(
        bin: &Path,
        db: &BenchDb,
        slot: &str,
        target: Target<'_>,
        window: usize,
    ) -> anyhow::Result<RelayProc> {
        Self::start_with(bin, db, slot, target, window, ConfigExtra::default())
    }

    /// [`RelayProc::start`] with `extra` added to the config file.
    pub fn start_with(
        bin: &Path,
        db: &BenchDb,
        slot: &str,
        target: Target<'_>,
        window: usize,
        extra: ConfigExtra<'_>,
    ) -> anyhow::Result<RelayProc> {
        let dir = std::env::temp_dir().join(unique_name("bench"));
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("relay.toml");
        let single = format!("{:?}", testkit::amqp_url());
        let (url, target) = match target {
            Target::Exchange(exchange) => (single, format!("exchange = {exchange:?}\n")),
            Target::Via(exchange, port) => (
                format!("{:?}", through_port(&testkit::amqp_url(), port)),
                format!("exchange = {exchange:?}\n"),
            ),
            Target::Stream(stream) => (
                single,
                format!(
                    "stream = {stream:?}\nstream_url = {:?}\n",
                    testkit::stream::stream_url()
                ),
            ),
            Target::ClusterExchange(exchange, c) => (
                format!("{:?}", c.amqp),
                format!("exchange = {exchange:?}\n"),
            ),
            Target::ClusterStream(stream, c) => (
                format!("{:?}", c.amqp),
                format!(
                    "stream = {stream:?}\nstream_url = {:?}\ndeclare_stream = false\n",
                    c.stream
                ),
            ),
        };
        std::fs::write(
            &config,
            format!(
                "[postgres]\nurl = {:?}\nslot = {slot:?}\npublication = {:?}\n{}\n\n\
                 [rabbitmq]\nurl = {url}\n{target}max_in_flight = {window}\n{}\n\n\
                 [relay]\nmetrics_listen = \"\"\n\n{}\n",
                db.db.url(),
                db.publication,
                extra.postgres,
                extra.rabbitmq,
                extra.sections,
            ),
        )?;
        let child = Command::new(bin)
            .arg("--config")
            .arg(&config)
            .arg("run")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        Ok(RelayProc { child, dir })
    }

    /// CPU seconds (user + system) used so far.
    pub fn cpu_seconds(&self) -> f64 {
        cpu_seconds(self.child.id())
    }

    /// Peak resident set size in MB.
    pub fn peak_rss_mb(&self) -> f64 {
        proc_status_kb(self.child.id(), "VmHWM:") as f64 / 1024.0
    }

    /// Current resident set size in MB.
    pub fn rss_mb(&self) -> f64 {
        proc_status_kb(self.child.id(), "VmRSS:") as f64 / 1024.0
    }

    /// Asks the relay to stop (SIGTERM) and waits up to 30 s; then as on drop.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RelayProc {
    /// Kills the relay if it still runs (a failed scenario leaves none behind).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses and may hold spaces).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 here.
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

pub fn proc_status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Waits until `count` reaches `n` while `relay` runs; errors when the relay exits
/// first or after `timeout`.
pub async fn wait_relay(
    count: &AtomicUsize,
    n: usize,
    timeout: Duration,
    relay: &mut RelayProc,
) -> anyhow::Result<Instant> {
    wait_child(count, n, timeout, &mut relay.child, "the relay").await
}

/// Waits until `count` reaches `n` while `child` (named `what` in errors) runs;
/// errors when it exits first or after `timeout`.
pub async fn wait_child(
    count: &AtomicUsize,
    n: usize,
    timeout: Duration,
    child: &mut Child,
    what: &str,
) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        let have = count.load(Ordering::Relaxed);
        if have >= n {
            return Ok(Instant::now());
        }
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{what} exited ({status}) with {have} of {n} messages delivered");
        }
        if Instant::now() > deadline {
            bail!(
                "timed out after {}s with {have} of {n} messages delivered",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod tests {
    /// The proxy's port replaces the broker's; credentials and vhost stay.
    #[test]
    fn a_url_through_a_proxy_keeps_its_credentials_and_vhost() {
        assert_eq!(
            super::through_port("amqp://relay:s3cret@10.0.0.5:5672/app", 41000),
            "amqp://relay:s3cret@127.0.0.1:41000/app"
        );
        assert_eq!(
            super::through_port("amqp://127.0.0.1:5672/%2f", 41000),
            "amqp://127.0.0.1:41000/%2f"
        );
    }
}
