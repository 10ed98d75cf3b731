//! The scenarios and the report.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_event::{Lsn, WalItem};
use tokio::sync::{mpsc, watch};
use wal_reader::{ColumnMapping, PgConnectOptions, ReaderConfig, TableName, WalReader};

use crate::harness::*;
use crate::Args;

const WAIT: Duration = Duration::from_secs(600);

/// One measured figure.
#[derive(Debug, Clone)]
pub struct Figure {
    pub scenario: String,
    pub value: f64,
    pub unit: &'static str,
    pub conditions: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub figures: Vec<Figure>,
}

impl Report {
    fn add(
        &mut self,
        scenario: impl Into<String>,
        value: f64,
        unit: &'static str,
        conditions: impl Into<String>,
    ) {
        let f = Figure {
            scenario: scenario.into(),
            value,
            unit,
            conditions: conditions.into(),
        };
        println!(
            "  {:<44} {:>12.2} {:<12} {}",
            f.scenario, f.value, f.unit, f.conditions
        );
        self.figures.push(f);
    }

    fn get(&self, scenario: &str) -> Option<f64> {
        self.figures
            .iter()
            .find(|f| f.scenario == scenario)
            .map(|f| f.value)
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<44} {:>12} {:<12} conditions",
            "figure", "value", "unit"
        );
        for f in &self.figures {
            let _ = writeln!(
                s,
                "{:<44} {:>12.2} {:<12} {}",
                f.scenario, f.value, f.unit, f.conditions
            );
        }
        for line in self.targets() {
            let _ = writeln!(s, "{line}");
        }
        s
    }

    fn ratio(&self, a: &str, b: &str) -> Option<f64> {
        Some(self.get(a)? / self.get(b)?)
    }

    fn targets(&self) -> Vec<String> {
        let mut t = Vec::new();
        let fmt = |name: &str, v: Option<f64>, target: &str, ok: Option<bool>| {
            format!(
                "| {name} | {} | {target} | {} |",
                v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "–".into()),
                match ok {
                    Some(true) => "met",
                    Some(false) => "not met",
                    None => "not measured",
                }
            )
        };
        let r = self.ratio("drain 100-row tx: relay", "lapin raw publisher");
        t.push(fmt(
            "drain (100-row tx) / raw lapin",
            r,
            "≥ 0.90",
            r.map(|r| r >= 0.9),
        ));
        let r = self.ratio("drain 1-row tx: relay", "lapin raw publisher");
        t.push(fmt(
            "drain (1-row tx) / raw lapin",
            r,
            "≥ 0.90",
            r.map(|r| r >= 0.9),
        ));
        let r = self.ratio("reader 100-row tx", "pg_recvlogical 100-row tx");
        t.push(fmt(
            "reader / pg_recvlogical (100-row tx)",
            r,
            "≥ 1.0",
            r.map(|r| r >= 1.0),
        ));
        let r = self.ratio("reader 1-row tx", "pg_recvlogical 1-row tx");
        t.push(fmt(
            "reader / pg_recvlogical (1-row tx)",
            r,
            "≥ 1.0",
            r.map(|r| r >= 1.0),
        ));
        let p50 = self.get("steady latency p50");
        t.push(fmt("steady p50 (ms)", p50, "≤ 5", p50.map(|v| v <= 5.0)));
        let p99 = self.get("steady latency p99");
        t.push(fmt("steady p99 (ms)", p99, "≤ 20", p99.map(|v| v <= 20.0)));
        let cpu = self.get("drain 100-row tx: relay CPU per 10k events");
        t.push(fmt(
            "relay CPU s per 10k events (100-row tx)",
            cpu,
            "≤ 0.25",
            cpu.map(|v| v <= 0.25),
        ));
        let rss = self.get("steady relay RSS");
        t.push(fmt("steady RSS (MB)", rss, "≤ 50", rss.map(|v| v <= 50.0)));
        let rss = self.get("large tx relay peak RSS");
        t.push(fmt(
            "1M-row tx peak RSS (MB)",
            rss,
            "≤ 100",
            rss.map(|v| v <= 100.0),
        ));
        t
    }

    pub fn markdown(&self, args: &Args) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Benchmarks\n");
        let _ = writeln!(
            s,
            "Produced by `cargo run --release -p outbox-bench -- --events {} --runs {}` \
             (see `bench/src/main.rs`) on a 2-core machine with Postgres and RabbitMQ on \
             loopback; persistent ~300-byte messages, publisher confirms, one connection \
             and channel, window {}. Every figure is the median of {} run(s); these machines \
             are noisy, so compare ratios within one run, not absolute numbers across runs.\n",
            args.events, args.runs, args.window, args.runs
        );
        let _ = writeln!(
            s,
            "| figure | value | unit | conditions |\n|---|---|---|---|"
        );
        for f in &self.figures {
            let _ = writeln!(
                s,
                "| {} | {:.2} | {} | {} |",
                f.scenario, f.value, f.unit, f.conditions
            );
        }
        let _ = writeln!(
            s,
            "\n## Targets\n\n| target | measured | goal | status |\n|---|---|---|---|"
        );
        for line in self.targets() {
            let _ = writeln!(s, "{line}");
        }
        s
    }
}

fn wants(args: &Args, name: &str) -> bool {
    args.only.is_empty() || args.only.iter().any(|o| o == name)
}

pub async fn run_all(args: &Args) -> anyhow::Result<Report> {
    let mut report = Report::default();
    let bin = relay_binary()?;
    if wants(args, "lapin") {
        let mut rates = Vec::new();
        for _ in 0..args.runs {
            rates.push(lapin_baseline(args.events, args.window, 1).await?);
        }
        report.add(
            "lapin raw publisher",
            median(rates),
            "msgs/s",
            format!(
                "N={}, window={}, until the consumer has all",
                args.events, args.window
            ),
        );
    }
    if wants(args, "channels") {
        // Would publishing over several channels (e.g. partitioned by aggregate_id)
        // raise the total? Same messages, one queue, the window split between them.
        for channels in [2usize, 4] {
            let mut rates = Vec::new();
            for _ in 0..args.runs {
                rates.push(lapin_baseline(args.events, args.window, channels).await?);
            }
            report.add(
                format!("lapin raw publisher, {channels} channels"),
                median(rates),
                "msgs/s",
                format!(
                    "N={}, window={} in total, one queue",
                    args.events, args.window
                ),
            );
        }
    }
    for per_tx in [100usize, 1] {
        if !(wants(args, "drain") || wants(args, "reader") || wants(args, "recvlogical")) {
            break;
        }
        let (mut recv, mut reader, mut relay, mut cpu, mut rss) =
            (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..args.runs {
            let r = drain_run(args, &bin, per_tx).await?;
            recv.extend(r.recvlogical);
            reader.extend(r.reader);
            relay.extend(r.relay);
            cpu.extend(r.cpu_per_10k);
            rss.extend(r.peak_rss);
        }
        let cond = format!("N={}, {per_tx}-row transactions", args.events);
        if !recv.is_empty() {
            report.add(
                format!("pg_recvlogical {per_tx}-row tx"),
                median(recv),
                "rows/s",
                &cond,
            );
        }
        if !reader.is_empty() {
            report.add(
                format!("reader {per_tx}-row tx"),
                median(reader),
                "rows/s",
                &cond,
            );
        }
        if !relay.is_empty() {
            report.add(
                format!("drain {per_tx}-row tx: relay"),
                median(relay),
                "events/s",
                format!("{cond}, window {}", args.window),
            );
            report.add(
                format!("drain {per_tx}-row tx: relay CPU per 10k events"),
                median(cpu),
                "core-s",
                &cond,
            );
            report.add(
                format!("drain {per_tx}-row tx: relay peak RSS"),
                median(rss),
                "MB",
                &cond,
            );
        }
    }
    if wants(args, "steady") {
        steady(args, &bin, &mut report).await?;
    }
    if wants(args, "large") {
        large(args, &bin, &mut report).await?;
    }
    Ok(report)
}

async fn lapin_baseline(n: usize, window: usize, channels: usize) -> anyhow::Result<f64> {
    let sink = Sink::new(false).await?;
    let conn = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..channels {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let exchange = sink.exchange.clone();
        let share = n / channels + usize::from(c < n % channels);
        tasks.push(tokio::spawn(publish_share(
            ch,
            exchange,
            share,
            c * n,
            window / channels,
        )));
    }
    for t in tasks {
        t.await??;
    }
    let end = sink.wait_for(n, WAIT).await?;
    let rate = n as f64 / (end - start).as_secs_f64();
    let _ = conn.close(200, "done".into()).await;
    sink.cleanup().await;
    Ok(rate)
}

/// Publishes `n` relay-shaped messages on `ch` with a pipelined confirm window.
async fn publish_share(
    ch: lapin::Channel,
    exchange: String,
    n: usize,
    first: usize,
    window: usize,
) -> anyhow::Result<()> {
    let window = window.max(1);
    let body = format!(
        "{{\"n\": 1, \"pad\": \"{}\", \"customer\": \"c-1\"}}",
        "x".repeat(240)
    );
    let mut pending = VecDeque::with_capacity(window);
    for i in first..first + n {
        let mut headers = FieldTable::default();
        headers.insert(
            "aggregate_type".into(),
            AMQPValue::LongString(LongString::from("bench")),
        );
        headers.insert(
            "aggregate_id".into(),
            AMQPValue::LongString(LongString::from(i.to_string())),
        );
        headers.insert(
            "event_type".into(),
            AMQPValue::LongString(LongString::from("tick")),
        );
        headers.insert(
            "outbox_table".into(),
            AMQPValue::LongString(LongString::from("public.outbox")),
        );
        headers.insert(
            "commit_lsn".into(),
            AMQPValue::LongString(LongString::from("0/16B3748")),
        );
        headers.insert("xid".into(), AMQPValue::LongLongInt(i as i64));
        let props = BasicProperties::default()
            .with_message_id(ShortString::from(format!(
                "00000000-0000-4000-8000-{i:012}"
            )))
            .with_type("tick".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_timestamp(1)
            .with_app_id("outbox-relay".into())
            .with_headers(headers);
        let confirm = ch
            .basic_publish(
                exchange.as_str().into(),
                "bench.tick".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                props,
            )
            .await?;
        pending.push_back(confirm);
        while pending.len() >= window {
            if let Some(c) = pending.pop_front() {
                c.await?;
            }
        }
    }
    for c in pending {
        c.await?;
    }
    Ok(())
}

#[derive(Default)]
struct DrainRun {
    recvlogical: Option<f64>,
    reader: Option<f64>,
    relay: Option<f64>,
    cpu_per_10k: Option<f64>,
    peak_rss: Option<f64>,
}

/// One database, three slots over the same WAL: pg_recvlogical, the reader, the relay.
async fn drain_run(args: &Args, bin: &std::path::Path, per_tx: usize) -> anyhow::Result<DrainRun> {
    let n = args.events;
    let db = BenchDb::new();
    let recv_slot = db.create_slot();
    let reader_slot = db.create_slot();
    let relay_slot = db.create_slot();
    db.preload(n, per_tx);
    let end_lsn = db.current_lsn();
    let mut out = DrainRun::default();

    if wants(args, "recvlogical") {
        let start = Instant::now();
        let status = std::process::Command::new("pg_recvlogical")
            .args([
                "-d",
                &db.db.conninfo(),
                "--slot",
                &recv_slot,
                "--start",
                "--no-loop",
            ])
            .args(["-E", &end_lsn, "-f", "/dev/null"])
            .args([
                "-o",
                "proto_version=1",
                "-o",
                &format!("publication_names={}", db.publication),
            ])
            .status()
            .context("run pg_recvlogical")?;
        if !status.success() {
            bail!("pg_recvlogical failed");
        }
        out.recvlogical = Some(n as f64 / start.elapsed().as_secs_f64());
    }

    if wants(args, "reader") {
        let end: Lsn = end_lsn.parse()?;
        let cfg = ReaderConfig {
            conn: PgConnectOptions::parse(&db.db.conninfo())?,
            slot: reader_slot,
            publication: db.publication.clone(),
            tables: vec![TableName::parse("public.outbox").context("table")?],
            mapping: ColumnMapping::default(),
            start_lsn: None,
            status_interval: Duration::from_secs(1),
            hold_events: 10_000,
        };
        let start = Instant::now();
        let reader = WalReader::start(cfg).await?;
        let (tx, mut rx) = mpsc::channel(64);
        let (acked, acked_rx) = watch::channel(Lsn::ZERO);
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(reader.run(tx, acked_rx, stop_rx));
        let mut events = 0usize;
        'outer: while let Some(batch) = rx.recv().await {
            for item in batch {
                match item {
                    WalItem::Event(_) => events += 1,
                    WalItem::Commit(c) => {
                        if c.end_lsn >= end || events >= n {
                            let _ = acked.send(c.end_lsn);
                            break 'outer;
                        }
                    }
                    WalItem::Keepalive(_) => {}
                }
            }
        }
        let elapsed = start.elapsed();
        let _ = stop.send(true);
        while rx.recv().await.is_some() {}
        drop(acked);
        let _ = task.await;
        if events < n {
            bail!("reader saw {events} of {n} events");
        }
        out.reader = Some(n as f64 / elapsed.as_secs_f64());
    }

    if wants(args, "drain") {
        let sink = Sink::new(false).await?;
        let start = Instant::now();
        let relay = RelayProc::start(bin, &db, &relay_slot, &sink.exchange, args.window)?;
        let end = sink.wait_for(n, WAIT).await?;
        let secs = (end - start).as_secs_f64();
        out.relay = Some(n as f64 / secs);
        out.cpu_per_10k = Some(relay.cpu_seconds() / n as f64 * 10_000.0);
        out.peak_rss = Some(relay.peak_rss_mb());
        relay.stop();
        sink.cleanup().await;
    }
    Ok(out)
}

async fn steady(args: &Args, bin: &std::path::Path, report: &mut Report) -> anyhow::Result<()> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    let sink = Sink::new(true).await?;
    let relay = RelayProc::start(bin, &db, &slot, &sink.exchange, args.window)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = relay.cpu_seconds();
    let clients = 4u32;
    let per_client = (args.rate / clients).max(1);
    let total = (per_client * clients * args.seconds) as usize;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let conninfo = db.db.conninfo();
        let seconds = args.seconds;
        tasks.push(tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            let stmt = client
                .prepare(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('bench', $1, 'tick', jsonb_build_object(
                        't', extract(epoch from clock_timestamp()), 'pad', repeat('x', 240)))",
                )
                .await?;
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_client as f64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for i in 0..per_client * seconds {
                tick.tick().await;
                client.execute(&stmt, &[&i.to_string()]).await?;
            }
            Ok::<(), anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let insert_secs = started.elapsed().as_secs_f64();
    sink.wait_for(total, WAIT).await?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = relay.cpu_seconds() - cpu0;
    let rss = relay.rss_mb();
    let mut lat = sink.latencies.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_by(|a, b| a.total_cmp(b));
    let cond = format!(
        "{} events/s offered by {clients} clients for {}s (achieved {:.0}/s), single-row transactions",
        args.rate,
        args.seconds,
        total as f64 / insert_secs
    );
    report.add(
        "steady latency p50",
        percentile(&lat, 0.50) * 1000.0,
        "ms",
        &cond,
    );
    report.add(
        "steady latency p99",
        percentile(&lat, 0.99) * 1000.0,
        "ms",
        &cond,
    );
    report.add(
        "steady latency p99.9",
        percentile(&lat, 0.999) * 1000.0,
        "ms",
        &cond,
    );
    report.add("steady relay CPU share", cpu / wall, "cores", &cond);
    report.add("steady relay RSS", rss, "MB", &cond);
    relay.stop();
    sink.cleanup().await;
    Ok(())
}

async fn large(args: &Args, bin: &std::path::Path, report: &mut Report) -> anyhow::Result<()> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    let sink = Sink::new(false).await?;
    let relay = RelayProc::start(bin, &db, &slot, &sink.exchange, args.window)?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let n = args.large_rows;
    let start = Instant::now();
    let name = db.db.name.clone();
    tokio::task::spawn_blocking(move || {
        testkit::psql(
            &name,
            &format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'bench', n::text, 'tick', {PAYLOAD_SQL} FROM generate_series(1, {n}) AS s(n)"
            ),
        )
    })
    .await?;
    let committed = Instant::now();
    let end = sink.wait_for(n, WAIT).await?;
    let cond = format!("one transaction of {n} rows, window {}", args.window);
    report.add(
        "large tx: commit → all received",
        (end - committed).as_secs_f64(),
        "s",
        &cond,
    );
    report.add(
        "large tx: insert + relay total",
        (end - start).as_secs_f64(),
        "s",
        &cond,
    );
    report.add("large tx relay peak RSS", relay.peak_rss_mb(), "MB", &cond);
    relay.stop();
    sink.cleanup().await;
    Ok(())
}
