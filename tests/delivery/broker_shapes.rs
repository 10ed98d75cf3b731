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

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lapin::options::QueueBindOptions;
use lapin::types::{AMQPValue, FieldTable};
use support::stream::parse_lsn;
use support::{Env, Relay};
use testkit::free_addr;
use testkit::recording::{Consumer, Rec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod dead_letter;
mod held_slot;
mod nack_storm;

// ---------------------------------------------------------------------------------
// Consumer

/// One delivery as a consumer saw it: `kind` (`aggregate_type`), `seq`
/// (`aggregate_id`, the row's global sequence number), `commit_lsn` and, with
/// `[message] headers = "minimal"`, the kind and seq read from the routing key and
/// the body.
type Delivery = Rec;

/// A manual-ack consumer recording every delivery with its headers (testkit's: the
/// broker's redeliveries of a message it already recorded are the broker repeating
/// itself, not relay duplicates, and are skipped). `delay_ms` is slept before each
/// ack (a slow consumer) and can be changed while it runs
/// (`Consumer::set_ack_delay`).
fn recorder(queue: &str, prefetch: u16, delay_ms: u64) -> Consumer {
    Consumer::builder(queue.to_string())
        .prefetch(prefetch)
        .ack_delay_ms(delay_ms)
        .headers()
        .start()
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
    recorders: &[&Consumer],
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
