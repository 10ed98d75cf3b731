//! The AMQP client at the broker's edges (issue 40, "Tests at the level of the risk"),
//! written failing-first against the client of before that issue:
//!
//! - `oversized`: an event whose content header frame can never fit the negotiated
//!   `frame_max` (a 200 KB headers column on the default 128 KiB, a 20 KB one on the
//!   node with 16 KiB frames) is poison — named in an ERROR line, `/poison` and
//!   `status`, dead-lettered when a `dead_letter_exchange` is set, skipped with
//!   `slot skip` — and bodies larger than a frame still arrive split;
//! - `connections`: how many AMQP connections a relay holds (one per lane), plain and
//!   over amqps with EXTERNAL, and a user connection limit while the broker closes the
//!   relay's connections mid-stream;
//! - `alarm`: a memory alarm while 1 MB messages stall the socket: the relay's CPU
//!   stays low, nothing is lost.
//!
//! And for issue 49 ("No stall and no endless loop at any broker edge"), against the
//! relay of before that issue:
//!
//! - `event_exchanges`: exchanges chosen by events: a newline in `aggregate_type`,
//!   an exchange deleted mid-run (with and without `declare_exchange`);
//! - `reconnects`: the connection lost during a per-event `exchange.declare`,
//!   failover to the second URL mid-run (the first node cut, or silent with its
//!   heartbeats still arriving), the user's connection limit (530) at a reconnect.
//!
//! Locks (faults.rs): the memory alarm holds `BROKER` for writing; every other test
//! here holds it for reading (their users, exchanges and queues are their own, and the
//! node with small frames, node 4 of scripts/rabbitmq-cluster.sh, is used by this
//! module only).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::{bin, http_get, Relay};

use crate::harness::*;

#[path = "amqp_edges/alarm.rs"]
mod alarm;
#[path = "amqp_edges/connections.rs"]
mod connections;
#[path = "amqp_edges/event_exchanges.rs"]
mod event_exchanges;
#[path = "amqp_edges/oversized.rs"]
mod oversized;
#[path = "amqp_edges/reconnects.rs"]
mod reconnects;

/// How long the relay may take to name a poison event, to recover after its
/// connections were closed, or to deliver a small backlog: the tests fail instead of
/// hanging.
const SOON: Duration = Duration::from_secs(20);

/// The environment variable that turns the relay's metrics endpoint on at `addr`.
const METRICS: &str = "OUTBOX_RELAY_RELAY_METRICS_LISTEN";

/// `outbox-relay --config <the world's config> ARGS` with `vars`.
fn cli(w: &World, args: &[&str], vars: &[(&str, &str)]) -> Output {
    Command::new(bin())
        .arg("--config")
        .arg(w.config())
        .args(args)
        .envs(vars.iter().copied())
        .current_dir(&w.env.dir)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// Inserts one row `seq` whose `headers` column holds a string of `header_bytes`
/// bytes (and a small payload) in a transaction of its own; returns its message id.
async fn insert_with_big_header(w: &World, seq: u64, header_bytes: usize) -> String {
    w.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('seq', '{seq}', 'tick', jsonb_build_object('seq', {seq}),
                 jsonb_build_object('pad', repeat('h', {header_bytes})))"
    ))
    .await;
    w.sql(&format!(
        "SELECT id FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{seq}'"
    ))
    .await
    .trim()
    .to_string()
}

/// What the relay says about `id` so far: its ERROR lines naming it, `/poison`,
/// `status`.
struct Named {
    error_lines: Vec<String>,
    poison: String,
    status: String,
}

impl Named {
    async fn ask(w: &World, relay: &Relay, metrics: &str, id: &str) -> Named {
        let error_lines = relay
            .log_text()
            .lines()
            .filter(|l| l.contains("ERROR") && l.contains(id))
            .map(str::to_string)
            .collect();
        let poison = http_get(metrics, "/poison")
            .await
            .map(|(code, body)| format!("{code} {body}"))
            .unwrap_or_else(|| "no answer".into());
        let out = cli(w, &["status"], &[(METRICS, metrics)]);
        let status = String::from_utf8_lossy(&out.stdout).into_owned();
        Named {
            error_lines,
            poison,
            status,
        }
    }

    fn complete(&self, id: &str) -> bool {
        !self.error_lines.is_empty()
            && self.poison.contains(id)
            && self
                .status
                .lines()
                .any(|l| l.contains("stuck_message") && l.contains(id))
    }
}

/// Waits until the relay names `id` as poison in an ERROR line, on `/poison` and in
/// `status`; panics after `within` with what it said (and the log's last lines).
async fn wait_named_as_poison(w: &World, relay: &Relay, metrics: &str, id: &str, within: Duration) {
    let start = Instant::now();
    loop {
        let named = Named::ask(w, relay, metrics, id).await;
        if named.complete(id) {
            eprintln!("poison {id} named after {:?}", start.elapsed());
            return;
        }
        if start.elapsed() > within {
            panic!(
                "the relay did not name {id} as poison within {within:?} (want an ERROR line naming it, \
                 /poison and `status` stuck_message showing it):\n\
                 ERROR lines naming it: {:?}\n/poison: {}\nstatus:\n{}\n\
                 {} distinct messages received; last log lines:\n{}",
                named.error_lines,
                named.poison,
                named.status,
                w.consumer.distinct(),
                tail(&relay.log_text(), 15)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Waits (at most `within`) until every row of the outbox but `except` arrived, then
/// checks what the consumer received: `except` never, every other row, first
/// occurrences in commit order, the slot never past an unacked message, at most
/// `dup_bound` duplicates. Panics naming what is missing.
async fn verify_within(
    w: &World,
    relay: &Relay,
    except: Option<&str>,
    within: Duration,
    dup_bound: usize,
) -> Report {
    let ids: std::collections::HashSet<String> = w
        .sql("SELECT id::text FROM outbox")
        .await
        .lines()
        .filter(|id| Some(*id) != except)
        .map(str::to_string)
        .collect();
    let start = Instant::now();
    while w.consumer.distinct() < ids.len() {
        assert!(
            start.elapsed() < within,
            "{} of the {} rows expected arrived within {within:?}; last log lines:\n{}",
            w.consumer.distinct(),
            ids.len(),
            tail(&relay.log_text(), 15)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let stray duplicates and the last markers arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recs = w.consumer.snapshot();
    if let Some(poison) = except {
        let copies = recs.iter().filter(|r| r.id == poison).count();
        assert_eq!(copies, 0, "the poison event {poison} was delivered");
    }
    let samples = w.sampler.as_ref().map(|s| s.samples()).unwrap_or_default();
    let report = check(&recs, &ids, &samples, false);
    assert!(
        report.duplicates <= dup_bound,
        "{} duplicates exceed the bound {dup_bound}",
        report.duplicates
    );
    eprintln!("report: {report:?}");
    report
}

/// The relay process's CPU time so far (user + system), from /proc/<pid>/stat.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): state is field 3, utime
    // field 14, stime field 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

/// `getconf CLK_TCK` (100 on Linux).
fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}
