//! Production-shaped broker behaviour against the real relay binary, real Postgres and
//! real RabbitMQ, judged only by what consumers received and where the slot is:
//!
//! - routable and unroutable rows mixed in the same transactions, with a
//!   dead-letter exchange (docs/design.md §5: every unroutable message in the DLQ with its
//!   `x-outbox-error` headers, every routable one in the main queue, nothing lost,
//!   no duplicates, the slot past the end);
//! - the same without a dead-letter exchange (the relay must not move the slot past
//!   an unroutable message; once a queue is bound for it, everything arrives);
//! - a nack storm from a `reject-publish` queue drained slowly and then fast
//!   (everything arrives, nacks are counted, the slot reaches the end).
//!
//! Every test counts exactly: the expected ids come from the outbox table, and the
//! assertions name the numbers (missing, unexpected, duplicates, reordered).
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use support::{Env, Relay};
use testkit::unique_name;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------
// Consumer

/// One delivery as a consumer saw it.
#[derive(Debug, Clone)]
struct Delivery {
    id: String,
    /// `aggregate_type` header.
    kind: String,
    /// `aggregate_id` header: the row's global sequence number.
    seq: i64,
    /// `commit_lsn` header.
    commit_lsn: u64,
    headers: HashMap<String, String>,
}

impl Delivery {
    /// Commit order: commit LSN, then insert order inside the transaction.
    fn key(&self) -> (u64, i64) {
        (self.commit_lsn, self.seq)
    }
}

/// A manual-ack consumer recording every delivery (broker redeliveries of a message
/// it already recorded are the broker repeating itself, not relay duplicates, and
/// are skipped). `delay_ms` is slept before each ack (a slow consumer) and can be
/// changed while it runs.
struct Recorder {
    recs: Arc<Mutex<Vec<Delivery>>>,
    distinct: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
    delay_ms: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    fn start(queue: &str, prefetch: u16, delay_ms: u64) -> Recorder {
        let recs = Arc::new(Mutex::new(Vec::new()));
        let distinct = Arc::new(AtomicUsize::new(0));
        let total = Arc::new(AtomicUsize::new(0));
        let delay = Arc::new(AtomicU64::new(delay_ms));
        let (r, d, t, dl) = (recs.clone(), distinct.clone(), total.clone(), delay.clone());
        let queue = queue.to_string();
        let task = tokio::spawn(async move {
            let mut seen = HashSet::new();
            loop {
                if let Err(e) = consume(&queue, prefetch, &r, &d, &t, &dl, &mut seen).await {
                    eprintln!("consumer on {queue}: {e}; reconnecting");
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        Recorder {
            recs,
            distinct,
            total,
            delay_ms: delay,
            task,
        }
    }

    fn snapshot(&self) -> Vec<Delivery> {
        self.recs.lock().unwrap().clone()
    }

    fn distinct(&self) -> usize {
        self.distinct.load(Ordering::SeqCst)
    }

    fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    fn set_delay(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::SeqCst);
    }

    fn stop(&self) {
        self.task.abort();
    }
}

fn header_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => s.to_string(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

async fn consume(
    queue: &str,
    prefetch: u16,
    sink: &Mutex<Vec<Delivery>>,
    distinct: &AtomicUsize,
    total: &AtomicUsize,
    delay_ms: &AtomicU64,
    seen: &mut HashSet<String>,
) -> Result<(), lapin::Error> {
    let conn = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
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
        let headers: HashMap<String, String> = p
            .headers()
            .as_ref()
            .map(|h| {
                h.inner()
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), header_text(v)))
                    .collect()
            })
            .unwrap_or_default();
        if !(d.redelivered && seen.contains(&id)) {
            if seen.insert(id.clone()) {
                distinct.fetch_add(1, Ordering::SeqCst);
            }
            total.fetch_add(1, Ordering::SeqCst);
            // With `[message] headers = "minimal"` there is no aggregate_type or
            // aggregate_id header: the kind is the routing key's first word and
            // the sequence number is in the body.
            let kind = headers.get("aggregate_type").cloned().unwrap_or_else(|| {
                let key = headers
                    .get("x-original-routing-key")
                    .map_or(d.routing_key.as_str(), String::as_str);
                key.split('.').next().unwrap_or_default().to_string()
            });
            let seq = headers
                .get("aggregate_id")
                .and_then(|s| s.parse().ok())
                .or_else(|| {
                    serde_json::from_slice::<serde_json::Value>(&d.data)
                        .ok()?
                        .get("seq")?
                        .as_i64()
                })
                .unwrap_or(-1);
            sink.lock().unwrap().push(Delivery {
                kind,
                seq,
                commit_lsn: headers
                    .get("commit_lsn")
                    .and_then(|s| parse_lsn(s))
                    .unwrap_or(0),
                headers,
                id,
            });
        }
        let delay = delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        d.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Counting

/// What one queue received against what it should have received.
#[derive(Debug, Default)]
struct Tally {
    received: usize,
    distinct: usize,
    duplicates: usize,
    /// Expected ids never received.
    missing: usize,
    /// Distinct ids received that this queue must not receive.
    unexpected: usize,
    /// Adjacent first occurrences out of commit order (commit LSN, then seq).
    inversions: usize,
    first_inversion: Option<String>,
    /// First occurrences that arrived after a later message (in commit order) had
    /// already arrived: the ones that were overtaken.
    overtaken: usize,
    /// Of those, how many are not allowed to be overtaken (see [`tally`]).
    overtaken_not_allowed: usize,
    /// The largest overtake, in messages (commit-order ranks between the overtaken
    /// message and the newest message received before it).
    max_overtake: usize,
    /// Deliveries without a commit_lsn header (the order checks need it).
    without_commit_lsn: usize,
}

/// Counts `recs` against `expected`. `may_be_overtaken(d)` says which messages the
/// spec allows to arrive after later ones (docs/design.md §1.2: only a message the broker
/// refused: a nack, or a return without a dead-letter exchange).
fn tally(
    recs: &[Delivery],
    expected: &HashSet<String>,
    may_be_overtaken: impl Fn(&Delivery) -> bool,
) -> Tally {
    let mut firsts: Vec<&Delivery> = Vec::new();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut t = Tally {
        received: recs.len(),
        ..Tally::default()
    };
    for r in recs {
        if r.commit_lsn == 0 {
            t.without_commit_lsn += 1;
        }
        if seen.insert(r.id.as_str()) {
            firsts.push(r);
        }
    }
    t.distinct = firsts.len();
    t.duplicates = t.received - t.distinct;
    t.missing = expected
        .iter()
        .filter(|id| !seen.contains(id.as_str()))
        .count();
    t.unexpected = firsts.iter().filter(|r| !expected.contains(&r.id)).count();
    for w in firsts.windows(2) {
        if w[0].key() >= w[1].key() {
            t.inversions += 1;
            if t.first_inversion.is_none() {
                t.first_inversion = Some(format!(
                    "{} (lsn {:X}, seq {}, {}) before {} (lsn {:X}, seq {}, {})",
                    w[0].id,
                    w[0].commit_lsn,
                    w[0].seq,
                    w[0].kind,
                    w[1].id,
                    w[1].commit_lsn,
                    w[1].seq,
                    w[1].kind
                ));
            }
        }
    }
    // Ranks in commit order among the distinct messages received.
    let mut keys: Vec<(u64, i64)> = firsts.iter().map(|r| r.key()).collect();
    keys.sort_unstable();
    let rank = |k: (u64, i64)| keys.partition_point(|x| *x < k);
    let mut newest: Option<usize> = None;
    for r in &firsts {
        let rk = rank(r.key());
        match newest {
            Some(n) if n > rk => {
                t.overtaken += 1;
                t.max_overtake = t.max_overtake.max(n - rk);
                if !may_be_overtaken(r) {
                    t.overtaken_not_allowed += 1;
                }
            }
            _ => newest = Some(rk),
        }
    }
    t
}

// ---------------------------------------------------------------------------------
// World

/// A free port on 127.0.0.1 right now (the relay binds it moments later).
fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `X/Y` → u64.
fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.trim().split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

fn fmt_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// The relay's config: `[rabbitmq]` gets `rabbitmq_extra` lines.
fn write_config(
    env: &Env,
    max_in_flight: usize,
    rabbitmq_extra: &str,
    metrics_listen: &str,
) -> PathBuf {
    let toml = format!(
        "[postgres]\nurl = {:?}\nslot = {:?}\npublication = {:?}\ntables = [\"public.outbox\"]\n\n\
         [rabbitmq]\nurl = {:?}\nexchange = {:?}\nmax_in_flight = {max_in_flight}\n{rabbitmq_extra}\n\n\
         [relay]\nstatus_interval_ms = 200\nmetrics_listen = {metrics_listen:?}\nshutdown_timeout_ms = 10000\n",
        env.db.url(),
        env.slot,
        env.publication,
        testkit::amqp_url(),
        env.exchange,
    );
    let path = env.dir.join("broker-shapes.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

fn create_slot(env: &Env, config: &std::path::Path) {
    let out = env.cli_with(config, "info", &["slot", "create"]);
    assert!(
        out.status.success(),
        "slot create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn bind(env: &Env, queue: &str, exchange: &str, key: &str) {
    env.broker
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

/// The slot's confirmed_flush_lsn (0 when unknown).
async fn confirmed(pg: &tokio_postgres::Client, slot: &str) -> u64 {
    pg.query_opt(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .unwrap()
    .and_then(|r| r.get::<_, Option<String>>(0))
    .and_then(|s| parse_lsn(&s))
    .unwrap_or(0)
}

/// Polls the slot until its confirmed_flush_lsn is past `lsn`; returns the last
/// value read (past it or not) and how long it took.
async fn wait_confirmed_past(
    pg: &tokio_postgres::Client,
    slot: &str,
    lsn: u64,
    timeout: Duration,
) -> (u64, Duration) {
    let start = Instant::now();
    loop {
        let c = confirmed(pg, slot).await;
        if c > lsn || start.elapsed() > timeout {
            return (c, start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `done()` holds, or nothing new arrived in any of `recorders` for
/// `stall`, or `timeout` passed. Returns whether `done()` held.
async fn wait_deliveries(
    recorders: &[&Recorder],
    timeout: Duration,
    stall: Duration,
    done: impl Fn() -> bool,
) -> bool {
    let start = Instant::now();
    let mut last_total = usize::MAX;
    let mut last_change = Instant::now();
    loop {
        if done() {
            return true;
        }
        let total: usize = recorders.iter().map(|r| r.total()).sum();
        if total != last_total {
            last_total = total;
            last_change = Instant::now();
        }
        if last_change.elapsed() > stall || start.elapsed() > timeout {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(id, aggregate_type)` of every row of the outbox.
async fn rows(pg: &tokio_postgres::Client) -> Vec<(String, String)> {
    pg.query("SELECT id::text, aggregate_type FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Rows `from..=to` (aggregate_id = seq), `bad` rows (`seq % every == 0`, when
/// `every > 0`) with aggregate_type `bad`, the others `good`: one transaction.
fn mixed_sql(from: u64, to: u64, every: u64) -> String {
    let kind = if every == 0 {
        "'good'".to_string()
    } else {
        format!("CASE WHEN s.n % {every} = 0 THEN 'bad' ELSE 'good' END")
    };
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT {kind}, s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {to}) AS s(n) ORDER BY s.n"
    )
}

/// A plain HTTP/1.1 GET of `/metrics`: the body, or `None` if nothing answers.
async fn scrape(addr: &str) -> Option<String> {
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (_, body) = text.split_once("\r\n\r\n")?;
        Some(body.to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}

/// The sum of the samples of counter `name` (any labels) in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if let Some(r) = rest.strip_prefix(' ') {
            r
        } else if rest.starts_with('{') {
            match rest.rsplit_once("} ") {
                Some((_, v)) => v,
                None => continue,
            }
        } else {
            continue;
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

fn stop(relay: Relay) -> Option<i32> {
    let (code, log) = relay.terminate();
    if code != Some(0) {
        eprintln!("relay exited with {code:?}; log:\n{log}");
    }
    code
}

// ---------------------------------------------------------------------------------
// Tests

/// docs/design.md §5, with `dead_letter_exchange`: 20,000 rows in transactions of 200 from two
/// connections (interleaved commits), every 9th row unroutable (aggregate_type
/// `bad`: nothing is bound to `bad.tick`). The main queue must receive exactly the
/// routable rows and the DLQ exactly the unroutable ones, each once, in commit order,
/// the DLQ copies with `x-outbox-error = "unroutable"`, `x-original-exchange` and
/// `x-original-routing-key`; then the slot must be past the last transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_unroutable_rows_go_to_the_dead_letter_exchange() {
    mixed_unroutable(20_000, "").await;
}

/// The same with `[message] headers = "minimal"` (docs/design.md §5): a returned
/// message is matched to its event by the `commit_lsn` and `tx_index` headers, which
/// the lean profile keeps, so the dead-lettering is as exact; and the messages carry
/// only the lean profile's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_unroutable_rows_under_minimal_headers() {
    mixed_unroutable(10_000, "\n[message]\nheaders = \"minimal\"").await;
}

/// `n` rows in transactions of 200 from two connections, every 9th unroutable, with
/// a dead-letter exchange; `extra` is appended to the `[rabbitmq]` section.
async fn mixed_unroutable(n: u64, extra: &str) {
    const PER_TX: u64 = 200;
    const EVERY: u64 = 9;
    assert_eq!(n % PER_TX, 0);
    let minimal = extra.contains("minimal");
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let main_q = env.broker.queue_bound(&exchange, "good.tick").await;
    let dlx = env.broker.exchange_name("dlx");
    env.broker.declare_exchange(&dlx, "fanout").await;
    let dlq = env.broker.queue_bound(&dlx, "").await;
    let config = write_config(
        &env,
        1000,
        &format!("dead_letter_exchange = {dlx:?}{extra}"),
        "",
    );
    create_slot(&env, &config);
    let main = Recorder::start(&main_q, 2000, 0);
    let dead = Recorder::start(&dlq, 2000, 0);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);

    // Two connections, alternating transactions, committing concurrently.
    let mut loaders = Vec::new();
    for c in 0..2u64 {
        let client = env.db.client().await;
        loaders.push(tokio::spawn(async move {
            let mut k = c;
            while k * PER_TX < n {
                let (from, to) = (k * PER_TX + 1, (k + 1) * PER_TX);
                client
                    .batch_execute(&mixed_sql(from, to, EVERY))
                    .await
                    .unwrap();
                k += 2;
            }
        }));
    }
    for l in loaders {
        l.await.unwrap();
    }
    let inserted = started.elapsed();
    let all = rows(&pg).await;
    assert_eq!(all.len(), n as usize);
    let good: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "good")
        .map(|(id, _)| id.clone())
        .collect();
    let bad: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "bad")
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(bad.len(), (n / EVERY) as usize);

    let complete = wait_deliveries(
        &[&main, &dead],
        Duration::from_secs(90),
        Duration::from_secs(8),
        || main.distinct() >= good.len() && dead.distinct() >= bad.len(),
    )
    .await;
    // Let stray duplicates arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let main_recs = main.snapshot();
    let dead_recs = dead.snapshot();
    let last_commit = main_recs
        .iter()
        .chain(&dead_recs)
        .map(|d| d.commit_lsn)
        .max()
        .unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;

    // Nothing is ever overtaken here: no message is refused for good.
    let m = tally(&main_recs, &good, |_| false);
    let d = tally(&dead_recs, &bad, |_| false);
    let main_ids: HashSet<&str> = main_recs.iter().map(|r| r.id.as_str()).collect();
    let dead_ids: HashSet<&str> = dead_recs.iter().map(|r| r.id.as_str()).collect();
    let in_neither = bad
        .iter()
        .filter(|id| !main_ids.contains(id.as_str()) && !dead_ids.contains(id.as_str()))
        .count();
    let in_both = dead_ids.intersection(&main_ids).count();
    let bad_headers = dead_recs
        .iter()
        .filter(|r| {
            r.headers.get("x-outbox-error").map(String::as_str) != Some("unroutable")
                || r.headers.get("x-original-exchange") != Some(&exchange)
                || r.headers.get("x-original-routing-key").map(String::as_str) != Some("bad.tick")
        })
        .count();
    eprintln!(
        "mixed with DLX: {} good / {} bad rows, inserted in {inserted:?}; complete: {complete} \
         after {:?}\n  main queue: {m:?}\n  DLQ: {d:?}\n  ids in both queues: {in_both}; \
         unroutable ids in neither: {in_neither}; DLQ copies with wrong x- headers: {bad_headers}\n  \
         slot {} vs last commit {} (waited {slot_wait:?})",
        good.len(),
        bad.len(),
        started.elapsed(),
        fmt_lsn(slot),
        fmt_lsn(last_commit),
    );
    let summary = format!("main {m:?}; DLQ {d:?}; in both {in_both}; in neither {in_neither}");
    assert_eq!(
        m.missing, 0,
        "routable rows missing from the main queue: {summary}"
    );
    assert_eq!(
        m.unexpected, 0,
        "unroutable rows in the main queue: {summary}"
    );
    assert_eq!(
        d.missing, 0,
        "unroutable rows missing from the DLQ: {summary}"
    );
    assert_eq!(d.unexpected, 0, "routable rows in the DLQ: {summary}");
    assert_eq!(m.distinct, good.len());
    assert_eq!(d.distinct, bad.len());
    assert_eq!(m.without_commit_lsn + d.without_commit_lsn, 0, "{summary}");
    assert_eq!(m.inversions, 0, "main queue out of commit order: {summary}");
    assert_eq!(d.inversions, 0, "DLQ out of commit order: {summary}");
    assert_eq!(
        bad_headers, 0,
        "DLQ copies without the x- headers: {summary}"
    );
    // The profile's headers, and only them, of the relay's own.
    let descriptive = ["aggregate_type", "aggregate_id", "outbox_table", "xid"];
    for r in main_recs.iter().chain(&dead_recs) {
        for key in ["event_type", "commit_lsn", "tx_index"] {
            assert!(r.headers.contains_key(key), "{key} missing: {r:?}");
        }
        for key in descriptive {
            assert_eq!(
                r.headers.contains_key(key),
                !minimal,
                "{key} with minimal={minimal}: {r:?}"
            );
        }
    }
    assert_eq!(
        m.duplicates + d.duplicates + in_both,
        0,
        "duplicates: {summary}"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {}) {slot_wait:?} after \
         everything arrived",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    main.stop();
    dead.stop();
    env.cleanup().await;
    eprintln!("took {:?}", started.elapsed());
}

/// docs/design.md §5, no dead-letter exchange: an unroutable message is retried, never
/// dropped, and the slot never moves past it. 500 routable rows (10 transactions),
/// then 2,000 rows in transactions of 50 with every 9th row unroutable (the first at
/// seq 504). After ~10 s the slot must be past the routable prefix and before the
/// commit of the transaction holding seq 504, with every row before 504 received;
/// then a binding for `bad.tick` makes them routable and every row must arrive
/// (only unroutable ones may have been overtaken) and the slot reach the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_rows_without_a_dead_letter_exchange_hold_the_slot() {
    const WARMUP: u64 = 500;
    const N: u64 = 2_000;
    const PER_TX: u64 = 50;
    const EVERY: u64 = 9;
    const FIRST_BAD: i64 = 504;
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let main_q = env.broker.queue_bound(&exchange, "good.tick").await;
    let config = write_config(&env, 1000, "", "");
    create_slot(&env, &config);
    let main = Recorder::start(&main_q, 2000, 0);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);

    // One connection: commit order is insert order.
    let loader = env.db.client().await;
    let mut i = 1;
    while i <= WARMUP + N {
        let to = i + PER_TX - 1;
        let every = if i > WARMUP { EVERY } else { 0 };
        loader
            .batch_execute(&mixed_sql(i, to, every))
            .await
            .unwrap();
        i = to + 1;
    }
    let inserted = Instant::now();
    let all = rows(&pg).await;
    assert_eq!(all.len(), (WARMUP + N) as usize);
    let ids: HashSet<String> = all.iter().map(|(id, _)| id.clone()).collect();
    let bad: HashSet<String> = all
        .iter()
        .filter(|(_, k)| k == "bad")
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(bad.len(), (N / EVERY) as usize);

    // Everything before the first unroutable row arrives.
    let before_ok = wait_deliveries(
        &[&main],
        Duration::from_secs(30),
        Duration::from_secs(30),
        || {
            let got: HashSet<i64> = main.snapshot().iter().map(|d| d.seq).collect();
            (1..FIRST_BAD).all(|s| got.contains(&s))
        },
    )
    .await;
    // Give the relay ~10 s of retrying.
    let settle = Duration::from_secs(10).saturating_sub(inserted.elapsed());
    tokio::time::sleep(settle).await;
    let held = confirmed(&pg, &env.slot).await;
    let recs = main.snapshot();
    let commit_of = |seq: i64| recs.iter().find(|d| d.seq == seq).map(|d| d.commit_lsn);
    let warmup_commit = commit_of(WARMUP as i64);
    // Seq 501 is in the transaction of the first unroutable row (501..=550).
    let bad_tx_commit = commit_of(WARMUP as i64 + 1);
    let received_before: usize = recs
        .iter()
        .map(|d| d.seq)
        .filter(|s| (1..FIRST_BAD).contains(s))
        .collect::<HashSet<_>>()
        .len();
    let bad_before_bind = recs.iter().filter(|d| d.kind == "bad").count();
    eprintln!(
        "no DLX, after {:?} of retrying: {received_before} of {} rows before seq {FIRST_BAD} \
         received (all: {before_ok}); {} deliveries so far ({} distinct); slot {} \
         (warm-up commit {:?}, commit of the first transaction with an unroutable row {:?})",
        inserted.elapsed(),
        FIRST_BAD - 1,
        main.total(),
        main.distinct(),
        fmt_lsn(held),
        warmup_commit.map(fmt_lsn),
        bad_tx_commit.map(fmt_lsn),
    );
    assert_eq!(
        received_before,
        FIRST_BAD as usize - 1,
        "rows before the first unroutable one"
    );
    assert_eq!(
        bad_before_bind, 0,
        "unroutable rows delivered before the bind"
    );
    let (warmup_commit, bad_tx_commit) = (warmup_commit.unwrap(), bad_tx_commit.unwrap());
    assert!(
        held > warmup_commit,
        "the slot ({}) is not past the routable prefix (commit {})",
        fmt_lsn(held),
        fmt_lsn(warmup_commit)
    );
    assert!(
        held < bad_tx_commit,
        "the slot ({}) moved past the commit ({}) of a transaction whose unroutable row was \
         never published anywhere",
        fmt_lsn(held),
        fmt_lsn(bad_tx_commit)
    );

    // Make them routable: everything must arrive.
    bind(&env, &main_q, &exchange, "bad.tick").await;
    let bound = Instant::now();
    let complete = wait_deliveries(
        &[&main],
        Duration::from_secs(60),
        Duration::from_secs(15),
        || main.distinct() >= ids.len(),
    )
    .await;
    let arrived_after = bound.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recs = main.snapshot();
    let last_commit = recs.iter().map(|d| d.commit_lsn).max().unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;
    // Only a returned message (no DLX) may be overtaken by later ones on the wire.
    let t = tally(&recs, &ids, |d| d.kind == "bad");
    eprintln!(
        "after the bind: complete {complete} in {arrived_after:?}: {t:?}; slot {} vs last \
         commit {} (waited {slot_wait:?}); took {:?}",
        fmt_lsn(slot),
        fmt_lsn(last_commit),
        started.elapsed()
    );
    assert_eq!(t.missing, 0, "rows never arrived: {t:?}");
    assert_eq!(t.unexpected, 0, "{t:?}");
    assert_eq!(t.distinct, ids.len());
    assert_eq!(t.without_commit_lsn, 0, "{t:?}");
    assert_eq!(
        t.overtaken_not_allowed, 0,
        "routable rows out of commit order: {t:?}"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {})",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    main.stop();
    env.cleanup().await;
}

/// docs/design.md §5 nacks: the only queue bound to the exchange holds 50 messages and
/// rejects publishes beyond that (`x-overflow = reject-publish`), and its consumer
/// drains it slowly for 8 s (10 msgs/s), then fast. 1,000 rows in transactions of
/// 10, `max_in_flight = 100`. Every row must arrive, the slot must reach the end,
/// and `outbox_relay_events_nacked_total` must show the storm. Order: a nacked
/// message may be overtaken by later ones already on the wire (docs/design.md §1.2), never by
/// more than the window; the number of first occurrences out of order is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nack_storm_from_a_full_reject_publish_queue() {
    const N: u64 = 1_000;
    const PER_TX: u64 = 10;
    const MAX_IN_FLIGHT: usize = 100;
    let started = Instant::now();
    let mut env = Env::new().await;
    let exchange = env.exchange.clone();
    env.broker.declare_exchange(&exchange, "topic").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(50));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let queue = env.broker.queue_bound_with(&exchange, "#", args).await;
    let addr = free_addr();
    let config = write_config(&env, MAX_IN_FLIGHT, "", &addr);
    create_slot(&env, &config);
    let consumer = Recorder::start(&queue, 1, 100);
    let pg = env.db.client().await;
    let relay = env.start_with(&config, "info", &[]);
    let loader = env.db.client().await;
    let mut i = 1;
    while i <= N {
        let to = i + PER_TX - 1;
        loader.batch_execute(&mixed_sql(i, to, 0)).await.unwrap();
        i = to + 1;
    }
    let ids: HashSet<String> = rows(&pg).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), N as usize);
    tokio::time::sleep(Duration::from_secs(8).saturating_sub(started.elapsed())).await;
    let slow_phase = (consumer.total(), consumer.distinct());
    let nacked_slow = scrape(&addr)
        .await
        .and_then(|m| metric(&m, "outbox_relay_events_nacked_total"));
    consumer.set_delay(0);
    let fast = Instant::now();
    let complete = wait_deliveries(
        &[&consumer],
        Duration::from_secs(60),
        Duration::from_secs(15),
        || consumer.distinct() >= ids.len(),
    )
    .await;
    let fast_took = fast.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recs = consumer.snapshot();
    let last_commit = recs.iter().map(|d| d.commit_lsn).max().unwrap_or(0);
    let (slot, slot_wait) = wait_confirmed_past(
        &pg,
        &env.slot,
        last_commit,
        Duration::from_secs(if complete { 30 } else { 3 }),
    )
    .await;
    let body = scrape(&addr).await.unwrap_or_default();
    let nacked = metric(&body, "outbox_relay_events_nacked_total");
    let retries = metric(&body, "outbox_relay_publish_retries_total");
    // Every message may have been nacked here.
    let t = tally(&recs, &ids, |_| true);
    eprintln!(
        "nack storm: slow phase {} deliveries ({} distinct), nacked {nacked_slow:?}; fast \
         phase complete {complete} in {fast_took:?}: {t:?}; nacked_total {nacked:?}, \
         retries_total {retries:?}; slot {} vs last commit {} (waited {slot_wait:?}); took {:?}",
        slow_phase.0,
        slow_phase.1,
        fmt_lsn(slot),
        fmt_lsn(last_commit),
        started.elapsed()
    );
    assert_eq!(t.missing, 0, "rows never arrived: {t:?}");
    assert_eq!(t.unexpected, 0, "{t:?}");
    assert_eq!(t.distinct, ids.len());
    assert_eq!(t.without_commit_lsn, 0, "{t:?}");
    assert!(
        t.max_overtake < MAX_IN_FLIGHT,
        "a message was overtaken by one {} positions later, more than the window of \
         {MAX_IN_FLIGHT} can explain: {t:?}",
        t.max_overtake
    );
    assert!(
        nacked.unwrap_or(0.0) > 0.0,
        "outbox_relay_events_nacked_total is {nacked:?}: no nack storm happened"
    );
    assert!(
        slot > last_commit,
        "the slot ({}) is not past the last transaction (commit {})",
        fmt_lsn(slot),
        fmt_lsn(last_commit)
    );
    assert_eq!(stop(relay), Some(0));
    consumer.stop();
    env.cleanup().await;
}
