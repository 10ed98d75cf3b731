//! The world a fault test runs in: a fresh database with the outbox, the exchange
//! and a bound queue, the relay's connections optionally through proxies, the
//! recording consumer and the LSN sampler.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{QueueBindOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use testkit::proxy::Proxy;
use testkit::{unique_name, TestDb};

use support::{bin, Env, Relay, OUTBOX_DDL};

use super::*;

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
    /// The broker of the exchange, the queue, the consumer and the sampler, and the
    /// relay's unless `relay_amqp_url` says otherwise (the test broker by default).
    pub broker_url: String,
    /// The relay's `[rabbitmq] url` when it is not `broker_url` (another user, TLS).
    pub relay_amqp_url: Option<String>,
    /// The relay's `[rabbitmq] url` as a list (the nodes tried in order), when not
    /// empty: it wins over `relay_amqp_url`.
    pub relay_amqp_urls: Vec<String>,
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
        Self::with_binding_on(&testkit::amqp_url(), cluster, proxies, max_in_flight, keys).await
    }

    /// [`World::new`] on the broker at `broker_url` (e.g. the node with small frames
    /// of scripts/rabbitmq-cluster.sh): exchange, queue, consumer, sampler and relay
    /// all use it. No proxies.
    pub async fn on_broker(broker_url: &str, cluster: Cluster, max_in_flight: usize) -> World {
        Self::with_binding_on(
            broker_url,
            cluster,
            Proxies::default(),
            max_in_flight,
            &["#"],
        )
        .await
    }

    async fn with_binding_on(
        broker_url: &str,
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
        let mut broker = testkit::amqp::TestBroker::connect_to(broker_url).await;
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
            Some(Proxy::start(testkit::amqp_addr()).await)
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
        let consumer = Consumer::start_on(queue.clone(), vec![broker_url.to_string()]);
        let mut w = World {
            env,
            queue,
            pg_proxy,
            amqp_proxy,
            max_in_flight,
            rabbitmq_extra: String::new(),
            broker_url: broker_url.to_string(),
            relay_amqp_url: None,
            relay_amqp_urls: Vec::new(),
            consumer,
            sampler: None,
        };
        w.create_slot();
        w.sampler = Some(Sampler::start_on(
            w.env.db.conninfo(),
            w.env.slot.clone(),
            w.queue.clone(),
            vec![broker_url.to_string()],
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
        if let Some(url) = &self.relay_amqp_url {
            return url.clone();
        }
        match &self.amqp_proxy {
            Some(p) => format!("amqp://guest:guest@127.0.0.1:{}/%2f", p.port()),
            None => self.broker_url.clone(),
        }
    }

    /// The `[rabbitmq] url` value in TOML: a string, or a list of them.
    fn amqp_url_toml(&self) -> String {
        if self.relay_amqp_urls.is_empty() {
            return format!("{:?}", self.amqp_url());
        }
        let urls: Vec<String> = self
            .relay_amqp_urls
            .iter()
            .map(|u| format!("{u:?}"))
            .collect();
        format!("[{}]", urls.join(", "))
    }

    /// Writes the relay's config file.
    pub fn config(&self) -> PathBuf {
        let toml = format!(
            "[postgres]\nurl = {:?}\nslot = {:?}\npublication = {:?}\ntables = [\"public.outbox\"]\n\n\
             [rabbitmq]\nurl = {}\nexchange = {:?}\nmax_in_flight = {}\n{}\n\n\
             [relay]\nstatus_interval_ms = 200\nmetrics_listen = \"\"\nshutdown_timeout_ms = 10000\n",
            self.pg_url(),
            self.env.slot,
            self.env.publication,
            self.amqp_url_toml(),
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
        self.start_env(&[])
    }

    /// [`World::start`] with extra environment variables (e.g.
    /// `OUTBOX_RELAY_RELAY_METRICS_LISTEN`).
    pub fn start_env(&self, vars: &[(&str, &str)]) -> Relay {
        let config = self.config();
        let log = self.env.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(&config)
            .arg("run")
            .current_dir(&self.env.dir)
            .env("RUST_LOG", "info")
            .envs(vars.iter().copied())
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
        self.verify_grouped(dup_bound, by_last, &|_| 0).await
    }

    /// [`World::verify_with`] for a relay that keeps order per aggregate only: the
    /// order is checked within each `group` ([`check_grouped`]).
    pub async fn verify_grouped(
        &self,
        dup_bound: usize,
        by_last: bool,
        group: &dyn Fn(&Rec) -> u64,
    ) -> Report {
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
        let report = check_grouped(&self.consumer.snapshot(), &ids, &samples, by_last, group);
        assert!(
            report.duplicates <= dup_bound,
            "{} duplicates exceed the bound {dup_bound}",
            report.duplicates
        );
        eprintln!("report: {report:?}");
        report
    }

    /// [`World::cleanup`] after `rabbitmqctl stop_app`: the test broker's own
    /// connection died with the app, so the queue and exchange go on a new one.
    pub async fn cleanup_after_broker_restart(self) {
        let queue = self.queue.clone();
        let exchange = self.env.exchange.clone();
        self.cleanup().await;
        let mut again = testkit::amqp::TestBroker::connect().await;
        again.declare_exchange(&exchange, "topic").await;
        let _ = again
            .channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        again.cleanup().await;
    }

    pub async fn cleanup(mut self) {
        if let Some(s) = self.sampler.take() {
            s.stop();
        }
        self.consumer.stop();
        self.env.cleanup().await;
    }
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

impl World {
    /// [`load_with`] on this world's database.
    pub fn load_with(
        &self,
        from: u64,
        n: u64,
        per_tx: u64,
        pause: Duration,
        sql: impl Fn(u64, u64) -> String + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        load_with(
            self.env.db.port,
            self.env.db.name.clone(),
            from,
            n,
            per_tx,
            pause,
            sql,
        )
    }

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
