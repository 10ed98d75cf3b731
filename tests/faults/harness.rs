#![allow(dead_code)]
//! The fault suite's world: a database (on the ordinary or the fault cluster), the
//! relay's connections optionally through TCP proxies, a reconnecting consumer that
//! records every delivery, a sampler of the slot's `confirmed_flush_lsn`, and the
//! consumer-side checker.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueBindOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use testkit::proxy::Proxy;
use testkit::{unique_name, TestDb};
use tokio::sync::RwLock;

use support::{bin, Env, Relay, OUTBOX_DDL};

/// Broker-changing tests (stop_app, memory alarm) take it for writing, every other
/// test for reading, so they never overlap inside this binary.
pub static BROKER: RwLock<()> = RwLock::const_new(());

pub const WAIT: Duration = Duration::from_secs(300);

/// Where the database lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Cluster {
    /// The shared test cluster (55432): never restarted.
    Test,
    /// The fault cluster (55433): may be restarted or crashed.
    Fault,
    /// The cluster of one supported major (`scripts/pg-versions.sh`, port
    /// `OUTBOX_TEST_PG<MAJOR>_PORT`): may be restarted or crashed by the one test of
    /// this binary that uses it.
    Version(u32),
}

impl Cluster {
    /// Restarts the cluster: `fast`, or `immediate` (a crash).
    pub async fn restart(self, mode: &str) {
        match self {
            Cluster::Test => panic!("the shared test cluster is never restarted"),
            Cluster::Fault => restart_fault_cluster(mode).await,
            Cluster::Version(major) => {
                let verb = if mode == "immediate" {
                    "crash"
                } else {
                    "restart"
                };
                let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/pg-versions.sh");
                let out = tokio::process::Command::new("bash")
                    .args([script, verb, &major.to_string()])
                    .output()
                    .await
                    .unwrap();
                assert!(
                    out.status.success(),
                    "pg-versions.sh {verb} {major}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

/// The port of the cluster of `major` (`scripts/pg-versions.sh`).
pub fn version_port(major: u32) -> u16 {
    std::env::var(format!("OUTBOX_TEST_PG{major}_PORT"))
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55500 + major as u16)
}

/// Which of the relay's connections go through a proxy.
#[derive(Clone, Copy, Default)]
pub struct Proxies {
    pub postgres: bool,
    pub amqp: bool,
}

pub struct World {
    pub env: Env,
    pub queue: String,
    pub pg_proxy: Option<Proxy>,
    pub amqp_proxy: Option<Proxy>,
    pub max_in_flight: usize,
    /// Extra lines for the `[rabbitmq]` section.
    pub rabbitmq_extra: String,
    pub consumer: Consumer,
    pub sampler: Option<Sampler>,
}

impl World {
    /// A fresh database with the default outbox, a slot, the exchange and a queue bound
    /// to everything, with a recording consumer and the LSN sampler running.
    pub async fn new(cluster: Cluster, proxies: Proxies, max_in_flight: usize) -> World {
        Self::with_binding(cluster, proxies, max_in_flight, &["#"]).await
    }

    pub async fn with_binding(
        cluster: Cluster,
        proxies: Proxies,
        max_in_flight: usize,
        keys: &[&str],
    ) -> World {
        // Build the binary before any connection is open (see support::bin).
        bin();
        let db = match cluster {
            Cluster::Test => TestDb::new("fault"),
            Cluster::Fault => TestDb::new_on_fault_cluster("fault"),
            Cluster::Version(major) => TestDb::new_at(version_port(major), "fault"),
        };
        db.psql(OUTBOX_DDL);
        let mut broker = testkit::amqp::TestBroker::connect().await;
        let exchange = broker.exchange_name("ex");
        broker.declare_exchange(&exchange, "topic").await;
        let queue = broker.queue_bound(&exchange, keys[0]).await;
        for k in &keys[1..] {
            bind(&broker, &queue, &exchange, k).await;
        }
        let dir = std::env::temp_dir().join(unique_name("faults"));
        std::fs::create_dir_all(&dir).unwrap();
        let pg_proxy = if proxies.postgres {
            Some(Proxy::start(SocketAddr::from(([127, 0, 0, 1], db.port))).await)
        } else {
            None
        };
        let amqp_proxy = if proxies.amqp {
            Some(Proxy::start(SocketAddr::from(([127, 0, 0, 1], 5672))).await)
        } else {
            None
        };
        let env = Env {
            db,
            slot: unique_name("slot"),
            publication: unique_name("pub"),
            exchange,
            broker,
            dir,
            extra: String::new(),
            tables: vec!["public.outbox".into()],
        };
        let consumer = Consumer::start(queue.clone());
        let mut w = World {
            env,
            queue,
            pg_proxy,
            amqp_proxy,
            max_in_flight,
            rabbitmq_extra: String::new(),
            consumer,
            sampler: None,
        };
        w.create_slot();
        w.sampler = Some(Sampler::start(
            w.env.db.conninfo(),
            w.env.slot.clone(),
            w.queue.clone(),
        ));
        w
    }

    /// Binds the queue to the exchange with one more key.
    pub async fn bind(&self, key: &str) {
        bind(&self.env.broker, &self.queue, &self.env.exchange, key).await;
    }

    fn pg_url(&self) -> String {
        let port = self.pg_proxy.as_ref().map_or(self.env.db.port, Proxy::port);
        format!(
            "postgresql://postgres@127.0.0.1:{port}/{}?connect_timeout=5",
            self.env.db.name
        )
    }

    fn amqp_url(&self) -> String {
        let port = self.amqp_proxy.as_ref().map_or(5672, Proxy::port);
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    }

    /// Writes the relay's config file.
    pub fn config(&self) -> PathBuf {
        let toml = format!(
            "[postgres]\nurl = {:?}\nslot = {:?}\npublication = {:?}\ntables = [\"public.outbox\"]\n\n\
             [rabbitmq]\nurl = {:?}\nexchange = {:?}\nmax_in_flight = {}\n{}\n\n\
             [relay]\nstatus_interval_ms = 200\nmetrics_listen = \"\"\nshutdown_timeout_ms = 10000\n",
            self.pg_url(),
            self.env.slot,
            self.env.publication,
            self.amqp_url(),
            self.env.exchange,
            self.max_in_flight,
            self.rabbitmq_extra,
        );
        let path = self.env.dir.join("outbox-relay.toml");
        testkit::write_atomic(&path, &toml);
        path
    }

    fn create_slot(&self) {
        let out = Command::new(bin())
            .arg("--config")
            .arg(self.config())
            .args(["slot", "create"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "slot create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts `outbox-relay run`.
    pub fn start(&self) -> Relay {
        let config = self.config();
        let log = self.env.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(&config)
            .arg("run")
            .current_dir(&self.env.dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    /// psql on this database, off the async workers.
    pub async fn sql(&self, sql: &str) -> String {
        let port = self.env.db.port;
        let name = self.env.db.name.clone();
        let sql = sql.to_string();
        tokio::task::spawn_blocking(move || testkit::psql_at(port, &name, &sql))
            .await
            .unwrap()
    }

    /// Inserts rows `from..from+n` (aggregate_id = seq) in transactions of `per_tx`.
    pub async fn insert(&self, from: u64, n: u64, per_tx: u64) {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx - 1).min(from + n - 1);
            self.sql(&insert_sql(i, end)).await;
            i = end + 1;
        }
    }

    /// Like [`World::insert`], retrying each transaction until the server takes it
    /// (for use while Postgres restarts). Retries cannot duplicate: a failed psql
    /// committed nothing, except when the connection died after COMMIT was sent, so
    /// each batch is guarded by a NOT EXISTS on its first seq.
    pub async fn insert_retrying(&self, from: u64, n: u64, per_tx: u64) {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx - 1).min(from + n - 1);
            let sql = format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                   FROM generate_series({i}, {end}) AS s(n)
                  WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{i}')
                  ORDER BY s.n"
            );
            let port = self.env.db.port;
            let name = self.env.db.name.clone();
            loop {
                let (p, nm, s) = (port, name.clone(), sql.clone());
                let ok = tokio::task::spawn_blocking(move || try_psql(p, &nm, &s))
                    .await
                    .unwrap();
                if ok {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            i = end + 1;
        }
    }

    /// A transaction that inserts rows and rolls back: never published.
    pub async fn rolled_back(&self, n: u64) {
        self.sql(&format!(
            "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               SELECT 'rolledback', s.n::text, 'tick', '{{}}' FROM generate_series(1, {n}) s(n);
             ROLLBACK;"
        ))
        .await;
    }

    /// Waits until every row of the outbox table was received at least once.
    pub async fn wait_all(&self, timeout: Duration) {
        let expected: usize = self
            .sql("SELECT count(*) FROM outbox")
            .await
            .parse()
            .unwrap();
        // Big streams get 2 ms per expected message if that is longer.
        let timeout = timeout.max(Duration::from_millis(2 * expected as u64));
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.consumer.distinct();
            if got >= expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out: {got} of {expected} distinct messages received"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until at least `n` distinct messages arrived.
    pub async fn wait_distinct(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.consumer.distinct() < n {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} messages"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The slot's confirmed_flush_lsn.
    pub async fn confirmed(&self) -> u64 {
        parse_lsn(
            &self
                .sql(&format!(
                    "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{}'",
                    self.env.slot
                ))
                .await,
        )
        .unwrap_or(0)
    }

    /// Waits for everything, then runs every consumer-side check and returns the
    /// report. `dup_bound` is the most duplicates the fault may cause.
    pub async fn verify(&self, dup_bound: usize) -> Report {
        self.verify_with(dup_bound, false).await
    }

    /// [`World::verify`], with the order checked on last occurrences (see [`check`]).
    pub async fn verify_with(&self, dup_bound: usize, by_last: bool) -> Report {
        self.wait_all(WAIT).await;
        // Let stray redeliveries and the last markers arrive.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let ids: HashSet<String> = self
            .sql("SELECT id::text FROM outbox")
            .await
            .lines()
            .map(str::to_string)
            .collect();
        let samples = self
            .sampler
            .as_ref()
            .map(|s| s.samples())
            .unwrap_or_default();
        let report = check(&self.consumer.snapshot(), &ids, &samples, by_last);
        assert!(
            report.duplicates <= dup_bound,
            "{} duplicates exceed the bound {dup_bound}",
            report.duplicates
        );
        eprintln!("report: {report:?}");
        report
    }

    pub async fn cleanup(mut self) {
        if let Some(s) = self.sampler.take() {
            s.stop();
        }
        self.consumer.stop();
        self.env.cleanup().await;
    }
}

pub fn insert_sql(from: u64, to: u64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {to}) AS s(n) ORDER BY s.n"
    )
}

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

async fn bind(broker: &testkit::amqp::TestBroker, queue: &str, exchange: &str, key: &str) {
    broker
        .channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind queue");
}

/// `X/Y` → u64.
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.trim().split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

// ---------------------------------------------------------------------------------
// Consumer

/// One recorded delivery.
#[derive(Debug, Clone)]
pub struct Rec {
    pub id: String,
    pub kind: String,
    pub seq: i64,
    pub commit_lsn: u64,
    pub body_len: usize,
    /// Set for the sampler's markers: the sample's index.
    pub marker: Option<usize>,
    /// The broker flagged this, the first delivery of the message to this consumer,
    /// as redelivered: it had been delivered on a connection that broke before the
    /// consumer saw it (see [`check_with`]).
    pub redelivered: bool,
    /// When the consumer received it.
    pub at: Instant,
}

/// A consumer with manual acks that reconnects when the broker goes away (so broker
/// restarts lose nothing on the consumer side), and skips the broker's own
/// redeliveries of messages it already recorded (those are not the relay's
/// duplicates).
pub struct Consumer {
    recs: Arc<Mutex<Vec<Rec>>>,
    /// Distinct relay messages so far (kept by the task: counting on demand over a
    /// million records would slow the consumer down).
    distinct: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Consumer {
    pub fn start(queue: String) -> Consumer {
        Self::start_on(queue, vec![testkit::amqp_url()])
    }

    /// A consumer on the nodes of a cluster: each (re)connect goes to the next URL of
    /// `urls`, so that it moves on when its node dies.
    pub fn start_on(queue: String, urls: Vec<String>) -> Consumer {
        let recs = Arc::new(Mutex::new(Vec::new()));
        let sink = recs.clone();
        let distinct = Arc::new(AtomicUsize::new(0));
        let counter = distinct.clone();
        let task = tokio::spawn(async move {
            // (message id, marker) deliveries seen, to drop broker redeliveries.
            let mut seen: HashSet<String> = HashSet::new();
            let mut last_error = String::new();
            let mut attempt = 0usize;
            loop {
                let url = &urls[attempt % urls.len()];
                attempt += 1;
                if let Err(e) = consume_once(url, &queue, &sink, &counter, &mut seen).await {
                    let e = e.to_string();
                    if e != last_error {
                        eprintln!("consumer: {e}; reconnecting");
                        last_error = e;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        Consumer {
            recs,
            distinct,
            task,
        }
    }

    pub fn snapshot(&self) -> Vec<Rec> {
        self.recs.lock().unwrap().clone()
    }

    /// [`Consumer::snapshot`] with arrival times.
    pub fn snapshot_timed(&self) -> Vec<(Rec, Instant)> {
        self.snapshot()
            .into_iter()
            .map(|r| {
                let at = r.at;
                (r, at)
            })
            .collect()
    }

    /// Distinct relay messages received (markers excluded).
    pub fn distinct(&self) -> usize {
        self.distinct.load(Ordering::SeqCst)
    }

    /// Relay messages received (markers excluded), duplicates included.
    pub fn total(&self) -> usize {
        self.recs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.marker.is_none())
            .count()
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

async fn consume_once(
    url: &str,
    queue: &str,
    sink: &Arc<Mutex<Vec<Rec>>>,
    distinct: &AtomicUsize,
    seen: &mut HashSet<String>,
) -> Result<(), lapin::Error> {
    // A dead node answers nothing: give up on it after a while.
    let conn = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| {
        lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "timed out connecting to {}",
                url.rsplit('@').next().unwrap_or("")
            ),
        ))
    })??;
    let ch = conn.create_channel().await?;
    ch.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut stream = ch
        .basic_consume(
            queue.into(),
            unique_name("ctag").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while let Some(d) = stream.next().await {
        let d = d?;
        let p = &d.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default();
        let header = |k: &str| -> Option<String> {
            match p.headers().as_ref()?.inner().get(k)? {
                AMQPValue::LongString(s) => Some(s.to_string()),
                AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
                AMQPValue::LongLongInt(i) => Some(i.to_string()),
                AMQPValue::LongInt(i) => Some(i.to_string()),
                _ => None,
            }
        };
        let marker = id.strip_prefix("marker:").and_then(|n| n.parse().ok());
        // A delivery flagged redelivered whose message we already recorded is the
        // broker repeating itself after our consumer connection broke before the ack:
        // not a duplicate publish by the relay.
        if !(d.redelivered && seen.contains(&id)) {
            if seen.insert(id.clone()) && marker.is_none() {
                distinct.fetch_add(1, Ordering::SeqCst);
            }
            sink.lock().unwrap().push(Rec {
                kind: header("aggregate_type").unwrap_or_default(),
                seq: header("aggregate_id")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(-1),
                commit_lsn: header("commit_lsn")
                    .and_then(|s| parse_lsn(&s))
                    .unwrap_or(0),
                body_len: d.data.len(),
                redelivered: d.redelivered,
                id,
                marker,
                at: Instant::now(),
            });
        }
        d.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Sampler

/// Samples the slot's `confirmed_flush_lsn` and drops a marker into the queue right
/// after each sample.
///
/// Why this check is sound: the relay may confirm a position only after the broker
/// acked every message below it, and RabbitMQ acks a persistent message only once it
/// is enqueued. The marker is published (on its own connection, straight to the
/// queue) *after* the position was read, so it is enqueued after every message the
/// relay had been acked for at that moment. A queue delivers in enqueue order, so
/// when the consumer receives marker *i*, every message of every transaction whose
/// commit LSN is below sample *i* must already have been received. A relay that
/// confirmed past an unacked message fails this check even when nothing crashes. The
/// consumer's own lag does not matter (the marker waits in the same queue), and a
/// marker that never arrives (broker down) simply checks nothing.
pub struct Sampler {
    samples: Arc<Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub fn start(conninfo: String, slot: String, queue: String) -> Sampler {
        Self::start_on(conninfo, slot, queue, vec![testkit::amqp_url()])
    }

    /// A sampler whose markers go to the nodes of a cluster (each reconnect to the
    /// next URL of `urls`). A quorum queue orders its messages in its Raft log, so a
    /// marker enqueued after a confirm is still behind every confirmed message.
    pub fn start_on(conninfo: String, slot: String, queue: String, urls: Vec<String>) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let mut pg: Option<tokio_postgres::Client> = None;
            let mut amqp: Option<(Connection, lapin::Channel)> = None;
            let mut last = 0u64;
            let mut attempt = 0usize;
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if pg.as_ref().is_none_or(|c| c.is_closed()) {
                    pg = match tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(async move {
                                let _ = conn.await;
                            });
                            Some(c)
                        }
                        Err(_) => None,
                    };
                }
                let Some(client) = &pg else { continue };
                let Ok(Ok(row)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    client.query_opt(
                        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    ),
                )
                .await
                else {
                    pg = None;
                    continue;
                };
                let Some(lsn) = row
                    .and_then(|r| r.get::<_, Option<String>>(0))
                    .and_then(|s| parse_lsn(&s))
                else {
                    continue;
                };
                if lsn == last {
                    continue;
                }
                if amqp.as_ref().is_none_or(|(c, _)| !c.status().connected()) {
                    let url = &urls[attempt % urls.len()];
                    attempt += 1;
                    amqp = tokio::time::timeout(Duration::from_secs(5), connect_channel(url))
                        .await
                        .ok()
                        .and_then(Result::ok);
                }
                let Some((_, ch)) = &amqp else { continue };
                let idx = out.lock().unwrap().len();
                // Record first: a marker can only arrive after its sample exists.
                out.lock().unwrap().push(lsn);
                let publish = ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    b"marker",
                    BasicProperties::default().with_message_id(format!("marker:{idx}").into()),
                );
                match tokio::time::timeout(Duration::from_secs(2), publish).await {
                    Ok(Ok(_)) => last = lsn,
                    _ => amqp = None,
                }
            }
        });
        Sampler { samples, task }
    }

    pub fn samples(&self) -> Vec<u64> {
        self.samples.lock().unwrap().clone()
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

async fn connect_channel(url: &str) -> Result<(Connection, lapin::Channel), lapin::Error> {
    let c = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = c.create_channel().await?;
    Ok((c, ch))
}

// ---------------------------------------------------------------------------------
// Checker

/// What the consumer saw.
#[derive(Debug, Default)]
pub struct Report {
    pub distinct: usize,
    pub duplicates: usize,
    pub markers_checked: usize,
    pub max_body: usize,
}

/// The consumer-side guarantees (panics on a violation):
/// - no loss: every committed row (`committed`, from the table) received;
/// - nothing else: no rolled-back row, nothing that is not in the table;
/// - order: first occurrences in commit order (commit LSN non-decreasing), and
///   within a transaction in insert order (seq increasing);
/// - the confirmed position never passed an unacked message (markers, see
///   [`Sampler`]).
///
/// With `by_last`, order is checked on last occurrences instead: a message the broker
/// returned (unroutable) is republished from the oldest unconfirmed one onwards, so
/// later messages of the same window can reach a queue before it does, and the
/// final, complete pass is what arrives in order.
pub fn check(recs: &[Rec], committed: &HashSet<String>, samples: &[u64], by_last: bool) -> Report {
    check_with(recs, committed, samples, by_last, false)
}

/// [`check`], for a quorum queue on a cluster when `redelivered_firsts` is set: a
/// message whose first delivery to the consumer was flagged redelivered is left out of
/// the order and marker checks (it must still arrive, and counts for loss and
/// duplicates). Why only there: when the node the consumer is connected to dies, the
/// quorum queue returns that consumer's unacknowledged deliveries — including ones
/// still on the wire, which the consumer never saw — and delivers them again from its
/// returns, ahead of or among messages delivered since, with the redelivered flag set.
/// Their first arrival is then late for reasons of the consumer's connection, not of
/// the relay's publishing: the relay had them confirmed, in order, before anything
/// after them. The flag marks exactly those deliveries; everything the relay published
/// once and the broker delivered once is still checked in full. Single-node tests
/// never set it.
pub fn check_with(
    recs: &[Rec],
    committed: &HashSet<String>,
    samples: &[u64],
    by_last: bool,
    redelivered_firsts: bool,
) -> Report {
    let mut first: HashMap<&str, usize> = HashMap::new();
    let mut firsts: Vec<&Rec> = Vec::new();
    let mut total = 0;
    let mut max_body = 0;
    for r in recs.iter().filter(|r| r.marker.is_none()) {
        total += 1;
        max_body = max_body.max(r.body_len);
        assert_ne!(r.kind, "rolledback", "a rolled-back row was published");
        assert!(
            committed.contains(&r.id),
            "message {} is not a committed row",
            r.id
        );
        if !first.contains_key(r.id.as_str()) {
            first.insert(&r.id, firsts.len());
            firsts.push(r);
        }
    }
    let missing = committed
        .iter()
        .filter(|id| !first.contains_key(id.as_str()))
        .count();
    assert_eq!(missing, 0, "{missing} committed rows never arrived");
    let mut ordered: Vec<&Rec> = firsts
        .iter()
        .copied()
        .filter(|r| !(redelivered_firsts && r.redelivered))
        .collect();
    if by_last {
        let mut last: HashMap<&str, usize> = HashMap::new();
        let msgs: Vec<&Rec> = recs.iter().filter(|r| r.marker.is_none()).collect();
        for (i, r) in msgs.iter().enumerate() {
            last.insert(&r.id, i);
        }
        ordered.sort_by_key(|r| last[r.id.as_str()]);
    }
    for w in ordered.windows(2) {
        let (a, b) = (w[0], w[1]);
        assert!(
            a.commit_lsn < b.commit_lsn || (a.commit_lsn == b.commit_lsn && a.seq < b.seq),
            "occurrences out of order: {} (lsn {:X}, seq {}) before {} (lsn {:X}, seq {})",
            a.id,
            a.commit_lsn,
            a.seq,
            b.id,
            b.commit_lsn,
            b.seq
        );
    }
    // Markers: everything committed below the sample arrived before the marker.
    let mut markers_checked = 0;
    // suffix_min[i]: the oldest commit LSN among messages first received at i or later.
    let mut suffix_min = vec![u64::MAX; firsts.len() + 1];
    for i in (0..firsts.len()).rev() {
        let lsn = if redelivered_firsts && firsts[i].redelivered {
            u64::MAX
        } else {
            firsts[i].commit_lsn
        };
        suffix_min[i] = suffix_min[i + 1].min(lsn);
    }
    let mut received_firsts = 0usize;
    for r in recs {
        if let Some(i) = r.marker {
            let sample = samples[i];
            // The oldest transaction not yet (completely) received when the marker
            // arrived must not be below the sampled position.
            assert!(
                suffix_min[received_firsts] >= sample,
                "slot confirmed {sample:X} while a message of the transaction at {:X} had not \
                 been acked (it arrived after the marker)",
                suffix_min[received_firsts]
            );
            markers_checked += 1;
        } else if first.get(r.id.as_str()) == Some(&received_firsts) {
            received_firsts += 1;
        }
    }
    Report {
        distinct: firsts.len(),
        duplicates: total - firsts.len(),
        markers_checked,
        max_body,
    }
}

// ---------------------------------------------------------------------------------
// Broker and Postgres faults

fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rabbitmqctl stop_app` until dropped (then `start_app`).
pub struct BrokerStopped;

impl BrokerStopped {
    pub fn stop() -> BrokerStopped {
        rabbitmqctl(&["stop_app"]);
        BrokerStopped
    }
}

impl Drop for BrokerStopped {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl").arg("start_app").output();
        let _ = Command::new("rabbitmqctl")
            .args(["await_startup", "--timeout", "60"])
            .output();
    }
}

/// The memory alarm raised (`set_vm_memory_high_watermark 0`) until dropped; the
/// value found before is restored.
pub struct MemoryAlarm {
    restore: Vec<String>,
}

impl MemoryAlarm {
    pub fn raise() -> MemoryAlarm {
        let env = rabbitmqctl(&["environment"]);
        let line = env
            .lines()
            .find(|l| l.contains("{vm_memory_high_watermark,"))
            .expect("vm_memory_high_watermark in rabbitmqctl environment");
        let value = line
            .split("{vm_memory_high_watermark,")
            .nth(1)
            .unwrap()
            .trim_end_matches([',', ' ', ']'])
            .trim_end_matches('}')
            .to_string();
        let restore = if let Some(abs) = value.strip_prefix("{absolute,") {
            vec![
                "absolute".to_string(),
                abs.trim_end_matches('}').trim_matches('"').to_string(),
            ]
        } else {
            vec![value]
        };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        MemoryAlarm { restore }
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let mut args = vec!["set_vm_memory_high_watermark".to_string()];
        args.extend(self.restore.iter().cloned());
        let _ = Command::new("rabbitmqctl").args(&args).output();
    }
}

/// `pg_ctlcluster <v> outbox_fault restart -m <mode>`.
pub async fn restart_fault_cluster(mode: &str) {
    let mode = mode.to_string();
    tokio::task::spawn_blocking(move || {
        let (v, name) = testkit::pg_fault_cluster();
        let out = Command::new("pg_ctlcluster")
            .args([v.as_str(), name.as_str(), "restart", "-m", mode.as_str()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctlcluster restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    })
    .await
    .unwrap();
}

/// Peak resident set of a process (VmHWM) in kB.
pub fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Held by tests that restart or crash the fault cluster (one at a time).
pub static FAULT_PG: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A pseudo-random number in `0..n` (no need for a random number crate).
pub fn rand_below(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = nanos ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x % n.max(1)
}

/// Background load: rows `from..from+n` in transactions of `per_tx`, pausing
/// `pause` between transactions, retrying through Postgres restarts (each batch is
/// guarded, so a retry after an unknown outcome cannot insert it twice).
pub fn load(
    port: u16,
    db: String,
    from: u64,
    n: u64,
    per_tx: u64,
    pause: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx - 1).min(from + n - 1);
            let sql = format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                   FROM generate_series({i}, {end}) AS s(n)
                  WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{i}')
                  ORDER BY s.n"
            );
            while !try_psql(port, &db, &sql) {
                std::thread::sleep(Duration::from_millis(200));
            }
            i = end + 1;
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    })
}

impl World {
    /// [`load`] on this world's database.
    pub fn load(
        &self,
        from: u64,
        n: u64,
        per_tx: u64,
        pause: Duration,
    ) -> tokio::task::JoinHandle<()> {
        load(
            self.env.db.port,
            self.env.db.name.clone(),
            from,
            n,
            per_tx,
            pause,
        )
    }

    /// Polls the relay's log until it contains `needle`.
    pub async fn wait_log(relay: &Relay, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if relay.log_text().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }
}
