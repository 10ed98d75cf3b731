//! The scenarios and the report.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_event::{Lsn, WalItem};
use rabbitmq_stream_client::types::{Message, MessageResult, ResponseKind, SimpleValue};
use tokio::sync::{mpsc, watch};
use wal_reader::{ColumnMapping, PgConnectOptions, ReaderConfig, TableName, WalReader};

use crate::harness::*;
use crate::Args;

const WAIT: Duration = Duration::from_secs(600);
/// The quick run's bound: a smoke test fails fast.
const QUICK_WAIT: Duration = Duration::from_secs(120);
/// Messages in one stream publish frame, at most (as the relay: publisher::stream::run).
const STREAM_BATCH: usize = 1000;
/// Estimated bytes in one stream publish frame, at most (as the relay).
const STREAM_BATCH_BYTES: usize = 512 * 1024;
/// The relay's application properties naming its producer and the publishing id
/// (docs/streams.md, "The message").
const PRODUCER_PROPERTY: &str = "x-outbox-producer";
const PUBLISHING_ID_PROPERTY: &str = "x-outbox-publishing-id";

/// One measured figure.
#[derive(Debug, Clone)]
pub struct Figure {
    pub scenario: String,
    pub value: f64,
    pub unit: String,
    pub conditions: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub figures: Vec<Figure>,
    /// Scenarios that failed: (scenario, error).
    pub failures: Vec<(String, String)>,
    /// Figures the scenarios that ran must have produced.
    pub expected: Vec<String>,
    /// Whether the relay binary was a release build.
    pub release: bool,
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
            unit: unit.to_string(),
            conditions: conditions.into(),
        };
        println!(
            "  {:<52} {:>12.2} {:<12} {}",
            f.scenario, f.value, f.unit, f.conditions
        );
        self.figures.push(f);
    }

    fn expect(&mut self, names: &[&str]) {
        self.expected.extend(names.iter().map(|n| n.to_string()));
    }

    fn fail(&mut self, scenario: impl Into<String>, error: &anyhow::Error) {
        let scenario = scenario.into();
        eprintln!("  {scenario} FAILED: {error:#}");
        self.failures.push((scenario, format!("{error:#}")));
    }

    /// What makes the run a failure: failed scenarios, and expected figures that are
    /// missing, not finite or not positive.
    pub fn problems(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .failures
            .iter()
            .map(|(s, e)| format!("{s} failed: {e}"))
            .collect();
        for name in &self.expected {
            match self.get(name) {
                None => p.push(format!("{name}: no figure")),
                Some(v) if !(v.is_finite() && v > 0.0) => {
                    p.push(format!("{name}: implausible figure {v}"));
                }
                Some(_) => {}
            }
        }
        p
    }

    pub fn get(&self, scenario: &str) -> Option<f64> {
        self.figures
            .iter()
            .find(|f| f.scenario == scenario)
            .map(|f| f.value)
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<52} {:>12} {:<12} conditions",
            "figure", "value", "unit"
        );
        for f in &self.figures {
            let _ = writeln!(
                s,
                "{:<52} {:>12.2} {:<12} {}",
                f.scenario, f.value, f.unit, f.conditions
            );
        }
        for line in self.targets() {
            let _ = writeln!(s, "{line}");
        }
        for problem in self.problems() {
            let _ = writeln!(s, "PROBLEM: {problem}");
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
        for per_tx in [100usize, 1] {
            let stream = format!("stream drain {per_tx}-row tx: relay");
            let r = self.ratio(&stream, "stream raw publisher");
            t.push(fmt(
                &format!("stream drain ({per_tx}-row tx) / raw stream"),
                r,
                "≥ 0.80",
                r.map(|r| r >= 0.8),
            ));
            let r = self.ratio(&stream, &format!("drain {per_tx}-row tx: relay"));
            t.push(fmt(
                &format!("stream drain / queue drain ({per_tx}-row tx)"),
                r,
                "≥ 3",
                r.map(|r| r >= 3.0),
            ));
            let limit = match (
                self.get("stream raw publisher"),
                self.get(&format!("pg_recvlogical {per_tx}-row tx")),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                _ => None,
            };
            let r = self.get(&stream).zip(limit).map(|(s, l)| s / l);
            t.push(fmt(
                &format!("stream drain / min(raw stream, pg_recvlogical) ({per_tx}-row tx)"),
                r,
                "≥ 0.80",
                r.map(|r| r >= 0.8),
            ));
        }
        // Issue "performance, round 2", target 4: commit → receive p99 ≤ 5 ms at the
        // base rate (1000/s) and ≤ 30 ms at ten times it.
        let p50 = self.get("steady latency p50");
        t.push(fmt("steady p50 (ms)", p50, "≤ 5", p50.map(|v| v <= 5.0)));
        let p99 = self.get("steady latency p99");
        t.push(fmt("steady p99 (ms)", p99, "≤ 5", p99.map(|v| v <= 5.0)));
        let p99 = self.get("steady high latency p99");
        t.push(fmt(
            "steady high (10× rate) p99 (ms)",
            p99,
            "≤ 30",
            p99.map(|v| v <= 30.0),
        ));
        // Target 2: ≤ 10 µs of relay CPU per event = 0.10 core-s per 10k events.
        let cpu = self.get("drain 100-row tx: relay CPU per 10k events");
        t.push(fmt(
            "relay CPU s per 10k events (100-row tx)",
            cpu,
            "≤ 0.10",
            cpu.map(|v| v <= 0.10),
        ));
        let cpu = self.get("drain 1-row tx: relay CPU per 10k events");
        t.push(fmt(
            "relay CPU s per 10k events (1-row tx)",
            cpu,
            "≤ 0.10",
            cpu.map(|v| v <= 0.10),
        ));
        let cpu = self.get("stream drain 100-row tx: relay CPU per 10k events");
        t.push(fmt(
            "stream relay CPU s per 10k events (100-row tx)",
            cpu,
            "≤ 0.10",
            cpu.map(|v| v <= 0.10),
        ));
        // Target 5: the headers the relay adds cost the broker < 10% of its rate
        // (else a lean header profile is due).
        let r = self.ratio("shape: full message", "shape: no headers");
        t.push(fmt(
            "full message / no headers (broker rate)",
            r,
            "≥ 0.90",
            r.map(|r| r >= 0.9),
        ));
        // Its remedy, `[message] headers = "minimal"`, must itself cost < 10%.
        let r = self.ratio("shape: minimal headers", "shape: no headers");
        t.push(fmt(
            "minimal headers / no headers (broker rate)",
            r,
            "≥ 0.90",
            r.map(|r| r >= 0.9),
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

    /// The report; `plot` names the SVG written beside it, linked from it.
    pub fn markdown(&self, args: &Args, plot: Option<&str>) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Benchmarks\n");
        if args.quick || !self.release {
            let _ = writeln!(
                s,
                "**A smoke run of the harness (`--quick` and/or a debug build of the relay): \
                 these figures are not benchmarks.**\n"
            );
        }
        let _ = writeln!(
            s,
            "Produced by `{}` (see `bench/src/main.rs`) on a 2-core machine with Postgres \
             and RabbitMQ on loopback; persistent ~300-byte messages, publisher confirms, \
             one connection and channel, window {}. Stream figures: the stream protocol \
             (port 5552), a named producer with explicit publishing ids, publish frames of \
             at most 1000 messages, the same window of unconfirmed messages; a stream rate \
             is N divided by the time until a consumer reading the fresh stream from its \
             first offset holds all N (as the queue figures count until the queue's \
             consumer has all). Every figure is the median of {} run(s); these machines \
             are noisy, so compare ratios within one run, not absolute numbers across runs.\n",
            command_line(args),
            args.window,
            args.runs
        );
        if let Some(plot) = plot {
            let _ = writeln!(s, "Plot of these figures: [{plot}]({plot}).\n");
        }
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
        let _ = writeln!(
            s,
            "\nA target not met: its measured reason and the next step are in \
             [performance.md](performance.md) (\"Round 2: the targets not met\").\n"
        );
        let problems = self.problems();
        if !problems.is_empty() {
            let _ = writeln!(s, "\n## Problems\n");
            for p in problems {
                let _ = writeln!(s, "- {p}");
            }
        }
        s
    }
}

/// The command that reproduces a run.
pub fn command_line(args: &Args) -> String {
    let mut c = format!(
        "cargo run --release -p outbox-bench -- --events {} --runs {}",
        args.events, args.runs
    );
    if args.quick {
        c = "scripts/bench-quick.sh (outbox-bench --quick, debug build)".to_string();
    }
    if !args.only.is_empty() {
        let _ = write!(c, " --only {}", args.only.join(","));
    }
    c
}

fn wants(args: &Args, name: &str) -> bool {
    args.only.is_empty() || args.only.iter().any(|o| o == name)
}

/// How long a scenario waits for its messages before failing.
fn wait(args: &Args) -> Duration {
    if args.quick {
        QUICK_WAIT
    } else {
        WAIT
    }
}

/// The scenario names `--only` accepts.
pub const SCENARIOS: &[&str] = &[
    "lapin",
    "shape",
    "channels",
    "stream-raw",
    "recvlogical",
    "reader",
    "drain",
    "drain-minimal",
    "stream-drain",
    "steady",
    "steady-high",
    "large",
];

pub async fn run_all(args: &Args) -> anyhow::Result<Report> {
    let mut report = Report::default();
    if let Some(unknown) = args.only.iter().find(|o| !SCENARIOS.contains(&o.as_str())) {
        bail!(
            "unknown scenario {unknown:?} in --only; choose from {}",
            SCENARIOS.join(",")
        );
    }
    let bin = relay_binary()?;
    report.release = is_release(&bin);
    println!("relay binary: {}", bin.display());
    if wants(args, "lapin") {
        report.expect(&["lapin raw publisher"]);
        let mut rates = Vec::new();
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                rates.push(lapin_baseline(args, 1, Shape::Full).await?);
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => report.add(
                "lapin raw publisher",
                median(rates),
                "msgs/s",
                format!(
                    "N={}, window={}, until the consumer has all",
                    args.events, args.window
                ),
            ),
            Err(e) => report.fail("lapin", &e),
        }
    }
    if wants(args, "shape") {
        // What the message's shape costs the broker: the relay's full message, the
        // same without the headers table, and the body with delivery mode alone.
        // The shapes alternate within each run so that noise hits all three alike.
        let shapes = [
            Shape::Full,
            Shape::Minimal,
            Shape::NoHeaders,
            Shape::BodyOnly,
        ];
        for shape in shapes {
            report.expect(&[shape.figure()]);
        }
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); shapes.len()];
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                for (k, shape) in shapes.iter().enumerate() {
                    rates[k].push(lapin_baseline(args, 1, *shape).await?);
                }
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                for (shape, r) in shapes.iter().zip(rates) {
                    report.add(
                        shape.figure(),
                        median(r),
                        "msgs/s",
                        format!(
                            "N={}, window={}, {}, until the consumer has all",
                            args.events,
                            args.window,
                            shape.conditions()
                        ),
                    );
                }
            }
            Err(e) => report.fail("shape", &e),
        }
    }
    if wants(args, "channels") {
        // Would publishing over several channels (e.g. partitioned by aggregate_id)
        // raise the total? Same messages, one queue, the window split between them.
        for channels in [2usize, 4] {
            let name = format!("lapin raw publisher, {channels} channels");
            report.expect(&[&name]);
            let mut rates = Vec::new();
            let result: anyhow::Result<()> = async {
                for _ in 0..args.runs {
                    rates.push(lapin_baseline(args, channels, Shape::Full).await?);
                }
                Ok(())
            }
            .await;
            match result {
                Ok(()) => report.add(
                    name,
                    median(rates),
                    "msgs/s",
                    format!(
                        "N={}, window={} in total, one queue",
                        args.events, args.window
                    ),
                ),
                Err(e) => report.fail(format!("channels ({channels})"), &e),
            }
        }
    }
    if wants(args, "stream-raw") {
        report.expect(&[
            "stream raw publisher",
            "stream raw publisher: all confirmed",
        ]);
        let (mut consumed, mut confirmed) = (Vec::new(), Vec::new());
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                let r = stream_baseline(args).await?;
                consumed.push(r.consumed);
                confirmed.push(r.confirmed);
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                let cond = format!(
                    "N={}, window={}, frames ≤ {STREAM_BATCH} msgs, named producer",
                    args.events, args.window
                );
                report.add(
                    "stream raw publisher",
                    median(consumed),
                    "msgs/s",
                    format!("{cond}, until a consumer from the first offset has all"),
                );
                report.add(
                    "stream raw publisher: all confirmed",
                    median(confirmed),
                    "msgs/s",
                    format!("{cond}, until the broker confirmed all"),
                );
            }
            Err(e) => report.fail("stream-raw", &e),
        }
    }
    for per_tx in [100usize, 1] {
        if ![
            "drain",
            "drain-minimal",
            "reader",
            "recvlogical",
            "stream-drain",
        ]
        .iter()
        .any(|s| wants(args, s))
        {
            break;
        }
        let names = DrainNames::new(per_tx);
        if wants(args, "recvlogical") {
            report.expect(&[&names.recvlogical]);
        }
        if wants(args, "reader") {
            report.expect(&[&names.reader]);
        }
        if wants(args, "drain") {
            report.expect(&[&names.relay, &names.relay_cpu, &names.relay_rss]);
        }
        if wants(args, "drain-minimal") {
            report.expect(&[&names.minimal, &names.minimal_cpu]);
        }
        if wants(args, "stream-drain") {
            report.expect(&[&names.stream, &names.stream_cpu, &names.stream_rss]);
        }
        let mut runs = Vec::new();
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                runs.push(drain_run(args, &bin, per_tx).await?);
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            report.fail(format!("drain {per_tx}-row tx"), &e);
            continue;
        }
        let pick =
            |f: fn(&DrainRun) -> Option<f64>| -> Vec<f64> { runs.iter().filter_map(f).collect() };
        let cond = format!("N={}, {per_tx}-row transactions", args.events);
        let recv = pick(|r| r.recvlogical);
        if !recv.is_empty() {
            report.add(&names.recvlogical, median(recv), "rows/s", &cond);
        }
        let reader = pick(|r| r.reader);
        if !reader.is_empty() {
            report.add(&names.reader, median(reader), "rows/s", &cond);
        }
        let relay = pick(|r| r.relay.map(|m| m.rate));
        if !relay.is_empty() {
            report.add(
                &names.relay,
                median(relay),
                "events/s",
                format!(
                    "{cond}, window {}, until the queue's consumer has all",
                    args.window
                ),
            );
            let first = pick(|r| r.relay.map(|m| m.first));
            report.add(
                &names.relay_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = pick(|r| r.relay.map(|m| m.cpu_per_10k));
            report.add(&names.relay_cpu, median(cpu), "core-s", &cond);
            let rss = pick(|r| r.relay.map(|m| m.peak_rss));
            report.add(&names.relay_rss, median(rss), "MB", &cond);
        }
        let minimal = pick(|r| r.minimal.map(|m| m.rate));
        if !minimal.is_empty() {
            report.add(
                &names.minimal,
                median(minimal),
                "events/s",
                format!(
                    "{cond}, window {}, [message] headers = \"minimal\", until the queue's consumer has all",
                    args.window
                ),
            );
            let cpu = pick(|r| r.minimal.map(|m| m.cpu_per_10k));
            report.add(&names.minimal_cpu, median(cpu), "core-s", &cond);
        }
        let stream = pick(|r| r.stream.map(|m| m.rate));
        if !stream.is_empty() {
            report.add(
                &names.stream,
                median(stream),
                "events/s",
                format!(
                    "{cond}, window {}, until a consumer from the stream's first offset has all",
                    args.window
                ),
            );
            let first = pick(|r| r.stream.map(|m| m.first));
            report.add(
                &names.stream_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = pick(|r| r.stream.map(|m| m.cpu_per_10k));
            report.add(&names.stream_cpu, median(cpu), "core-s", &cond);
            let rss = pick(|r| r.stream.map(|m| m.peak_rss));
            report.add(&names.stream_rss, median(rss), "MB", &cond);
        }
    }
    // The two loads: the base rate (default 1000/s by 4 producers) and ten
    // times it by twice the producers ("steady-high").
    let high = (args.rate * 10, args.clients * 2, "steady high");
    for (scenario, (rate, clients, prefix)) in [
        ("steady", (args.rate, args.clients, "steady")),
        ("steady-high", high),
    ] {
        if !wants(args, scenario) {
            continue;
        }
        report.expect(&[
            &format!("{prefix} latency p50"),
            &format!("{prefix} latency p99"),
            &format!("{prefix} relay CPU share"),
            &format!("{prefix} relay RSS"),
        ]);
        if let Err(e) = steady(args, &bin, &mut report, rate, clients, prefix).await {
            report.fail(scenario, &e);
        }
    }
    if wants(args, "large") {
        report.expect(&["large tx: commit → all received", "large tx relay peak RSS"]);
        if let Err(e) = large(args, &bin, &mut report).await {
            report.fail("large", &e);
        }
    }
    Ok(report)
}

/// The figure names of one transaction size's drain.
struct DrainNames {
    recvlogical: String,
    reader: String,
    relay: String,
    relay_first: String,
    relay_cpu: String,
    relay_rss: String,
    minimal: String,
    minimal_cpu: String,
    stream: String,
    stream_first: String,
    stream_cpu: String,
    stream_rss: String,
}

impl DrainNames {
    fn new(per_tx: usize) -> DrainNames {
        DrainNames {
            recvlogical: format!("pg_recvlogical {per_tx}-row tx"),
            reader: format!("reader {per_tx}-row tx"),
            relay: format!("drain {per_tx}-row tx: relay"),
            relay_first: format!("drain {per_tx}-row tx: relay start → first message"),
            relay_cpu: format!("drain {per_tx}-row tx: relay CPU per 10k events"),
            relay_rss: format!("drain {per_tx}-row tx: relay peak RSS"),
            minimal: format!("drain {per_tx}-row tx: relay, minimal headers"),
            minimal_cpu: format!(
                "drain {per_tx}-row tx: relay CPU per 10k events, minimal headers"
            ),
            stream: format!("stream drain {per_tx}-row tx: relay"),
            stream_first: format!("stream drain {per_tx}-row tx: relay start → first message"),
            stream_cpu: format!("stream drain {per_tx}-row tx: relay CPU per 10k events"),
            stream_rss: format!("stream drain {per_tx}-row tx: relay peak RSS"),
        }
    }
}

/// The message a raw baseline publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// The relay's message: properties and the headers table.
    Full,
    /// The relay's properties and the headers of `[message] headers = "minimal"`
    /// (event_type, commit_lsn, tx_index).
    Minimal,
    /// The relay's properties (message id, type, content type, timestamp, app id,
    /// persistent), no headers.
    NoHeaders,
    /// The body, persistent, nothing else.
    BodyOnly,
}

impl Shape {
    fn figure(self) -> &'static str {
        match self {
            Shape::Full => "shape: full message",
            Shape::Minimal => "shape: minimal headers",
            Shape::NoHeaders => "shape: no headers",
            Shape::BodyOnly => "shape: body only",
        }
    }

    fn conditions(self) -> &'static str {
        match self {
            Shape::Full => "the relay's properties and its 7 headers",
            Shape::Minimal => "the relay's properties and the 3 minimal headers",
            Shape::NoHeaders => "the relay's properties, no headers",
            Shape::BodyOnly => "body and delivery mode 2 only",
        }
    }
}

async fn lapin_baseline(args: &Args, channels: usize, shape: Shape) -> anyhow::Result<f64> {
    let (n, window) = (args.events, args.window);
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
            shape,
        )));
    }
    for t in tasks {
        t.await??;
    }
    let end = sink.wait_for(n, wait(args)).await?;
    let rate = n as f64 / (end - start).as_secs_f64();
    let _ = conn.close(200, "done".into()).await;
    sink.cleanup().await;
    Ok(rate)
}

/// The body of every baseline message: the relay's (the payload's jsonb text).
fn bench_body() -> String {
    format!(
        "{{\"n\": 1, \"pad\": \"{}\", \"customer\": \"c-1\"}}",
        "x".repeat(240)
    )
}

struct StreamBaseline {
    /// Messages/s until the consumer held all.
    consumed: f64,
    /// Messages/s until the broker confirmed all.
    confirmed: f64,
}

/// A raw stream publisher into a fresh stream, read by a consumer from the first
/// offset.
async fn stream_baseline(args: &Args) -> anyhow::Result<StreamBaseline> {
    let n = args.events;
    let sink = StreamSink::new().await?;
    let result = async {
        let (start, confirmed) = stream_publish(&sink.stream, n, args.window).await?;
        let end = sink.wait_for(n, wait(args)).await?;
        Ok(StreamBaseline {
            consumed: n as f64 / (end - start).as_secs_f64(),
            confirmed: n as f64 / (confirmed - start).as_secs_f64(),
        })
    }
    .await;
    sink.cleanup().await;
    result
}

/// Publishes `n` relay-shaped stream messages under a named producer with explicit
/// publishing ids 1..=n, at most `window` unconfirmed; returns when it started (after
/// connecting) and when the last confirm arrived.
async fn stream_publish(
    stream: &str,
    n: usize,
    window: usize,
) -> anyhow::Result<(Instant, Instant)> {
    const PUBLISHER: u8 = 1;
    let window = window.max(1);
    let client = stream_client().await?;
    let (tx, mut confirms) = mpsc::unbounded_channel::<Result<usize, String>>();
    let handler = move |item: MessageResult| {
        let tx = tx.clone();
        async move {
            let event = match item {
                Some(Ok(response)) => match response.kind() {
                    ResponseKind::PublishConfirm(c) => Some(Ok(c.publishing_ids.len())),
                    ResponseKind::PublishError(e) => Some(Err(format!(
                        "the broker refused {} message(s): {:?}",
                        e.publishing_errors.len(),
                        e.publishing_errors.first().map(|p| &p.error_code)
                    ))),
                    _ => None,
                },
                Some(Err(e)) => Some(Err(e.to_string())),
                None => Some(Err("connection closed".into())),
            };
            if let Some(event) = event {
                let _ = tx.send(event);
            }
            Ok(())
        }
    };
    client.set_handler(handler).await;
    let producer = testkit::unique_name("bench-producer");
    let response = client
        .declare_publisher(PUBLISHER, Some(producer.clone()), stream)
        .await
        .context("declare the stream publisher")?;
    if !response.is_ok() {
        bail!("declaring a publisher on {stream}: {:?}", response.code());
    }
    let body = bench_body().into_bytes();
    let start = Instant::now();
    let (mut sent, mut confirmed) = (0usize, 0usize);
    while confirmed < n {
        if sent < n && sent - confirmed < window {
            let room = (n - sent).min(window - (sent - confirmed));
            let mut batch = Vec::with_capacity(room.min(STREAM_BATCH));
            let mut bytes = 0;
            while batch.len() < room.min(STREAM_BATCH) && bytes < STREAM_BATCH_BYTES {
                let id = (sent + batch.len() + 1) as u64;
                bytes += body.len() + 256;
                batch.push(stream_message(&body, &producer, id));
            }
            sent += batch.len();
            client
                .publish(PUBLISHER, batch)
                .await
                .context("publish to the stream")?;
            while let Ok(c) = confirms.try_recv() {
                confirmed += c.map_err(anyhow::Error::msg)?;
            }
            continue;
        }
        match confirms.recv().await {
            Some(c) => confirmed += c.map_err(anyhow::Error::msg)?,
            None => bail!("the stream connection closed"),
        }
    }
    let done = Instant::now();
    let _ = client.close().await;
    Ok((start, done))
}

/// One event as the relay puts it into a stream (publisher::stream::message): body,
/// message-id, content-type, creation-time and the same application properties.
fn stream_message(body: &[u8], producer: &str, id: u64) -> Message {
    let app = Message::builder()
        .body(body.to_vec())
        .properties()
        .message_id(format!("00000000-0000-4000-8000-{id:012}"))
        .content_type("application/json")
        .creation_time(chrono::Utc::now())
        .message_builder()
        .application_properties()
        .insert("aggregate_type", "bench")
        .insert("aggregate_id", id.to_string())
        .insert("event_type", "tick")
        .insert("table", "public.outbox")
        .insert("commit_lsn", "0/16B3748")
        .insert("tx_index", SimpleValue::from(0u64))
        .insert("xid", SimpleValue::from(id))
        .insert(PRODUCER_PROPERTY, producer)
        .insert(PUBLISHING_ID_PROPERTY, SimpleValue::from(id));
    app.message_builder().publising_id(id).build()
}

/// Publishes `n` relay-shaped messages on `ch` with a pipelined confirm window.
async fn publish_share(
    ch: lapin::Channel,
    exchange: String,
    n: usize,
    first: usize,
    window: usize,
    shape: Shape,
) -> anyhow::Result<()> {
    let window = window.max(1);
    let body = bench_body();
    let mut pending = VecDeque::with_capacity(window);
    for i in first..first + n {
        let mut headers = FieldTable::default();
        if shape == Shape::Full {
            headers.insert(
                "aggregate_type".into(),
                AMQPValue::LongString(LongString::from("bench")),
            );
            headers.insert(
                "aggregate_id".into(),
                AMQPValue::LongString(LongString::from(i.to_string())),
            );
            headers.insert(
                "outbox_table".into(),
                AMQPValue::LongString(LongString::from("public.outbox")),
            );
            headers.insert("xid".into(), AMQPValue::LongLongInt(i as i64));
        }
        headers.insert(
            "event_type".into(),
            AMQPValue::LongString(LongString::from("tick")),
        );
        headers.insert(
            "commit_lsn".into(),
            AMQPValue::LongString(LongString::from("0/16B3748")),
        );
        headers.insert("tx_index".into(), AMQPValue::LongLongInt(i as i64));
        let props = match shape {
            Shape::BodyOnly => BasicProperties::default().with_delivery_mode(2),
            Shape::Full | Shape::Minimal | Shape::NoHeaders => {
                let props = BasicProperties::default()
                    .with_message_id(ShortString::from(format!(
                        "00000000-0000-4000-8000-{i:012}"
                    )))
                    .with_type("tick".into())
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2)
                    .with_timestamp(1)
                    .with_app_id("outbox-relay".into());
                if shape == Shape::NoHeaders {
                    props
                } else {
                    props.with_headers(headers)
                }
            }
        };
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
    /// The relay publishing to a queue (through an exchange).
    relay: Option<RelayDrain>,
    /// The same with `[message] headers = "minimal"`.
    minimal: Option<RelayDrain>,
    /// The relay publishing to a stream.
    stream: Option<RelayDrain>,
}

#[derive(Debug, Clone, Copy)]
struct RelayDrain {
    rate: f64,
    /// Seconds from starting the relay to the first message at the consumer.
    first: f64,
    cpu_per_10k: f64,
    peak_rss: f64,
}

/// One database, five slots over the same WAL: pg_recvlogical, the reader, the relay
/// to a queue (with all headers and with the minimal ones), the relay to a stream.
async fn drain_run(args: &Args, bin: &std::path::Path, per_tx: usize) -> anyhow::Result<DrainRun> {
    let n = args.events;
    let db = BenchDb::new();
    let recv_slot = db.create_slot();
    let reader_slot = db.create_slot();
    let relay_slot = db.create_slot();
    let stream_slot = db.create_slot();
    let minimal_slot = db.create_slot();
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
            max_in_flight: 10_000,
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
        out.relay = Some(queue_drain(args, bin, &db, &relay_slot, "").await?);
    }

    if wants(args, "drain-minimal") {
        let extra = "[message]\nheaders = \"minimal\"";
        out.minimal = Some(queue_drain(args, bin, &db, &minimal_slot, extra).await?);
    }

    if wants(args, "stream-drain") {
        let sink = StreamSink::new().await?;
        let start = Instant::now();
        let result = async {
            let mut relay = RelayProc::start(
                bin,
                &db,
                &stream_slot,
                Target::Stream(&sink.stream),
                args.window,
            )?;
            let end = wait_relay(&sink.count, n, wait(args), &mut relay).await?;
            let first = sink.first.get().copied().unwrap_or(end);
            let measured = relay_drain(&relay, n, start, first, end);
            relay.stop();
            Ok::<_, anyhow::Error>(measured)
        }
        .await;
        sink.cleanup().await;
        out.stream = Some(result?);
    }
    Ok(out)
}

/// The relay draining `slot` into a queue, `extra` appended to its config.
async fn queue_drain(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    extra: &str,
) -> anyhow::Result<RelayDrain> {
    let n = args.events;
    let sink = Sink::new(false).await?;
    let start = Instant::now();
    let result = async {
        let mut relay = RelayProc::start_with(
            bin,
            db,
            slot,
            Target::Exchange(&sink.exchange),
            args.window,
            extra,
        )?;
        let end = wait_relay(&sink.count, n, wait(args), &mut relay).await?;
        let first = sink.first.get().copied().unwrap_or(end);
        let measured = relay_drain(&relay, n, start, first, end);
        relay.stop();
        Ok::<_, anyhow::Error>(measured)
    }
    .await;
    sink.cleanup().await;
    result
}

/// The rate, start-up time, CPU per 10k events and peak RSS of a relay started at
/// `start` that delivered its first event at `first` and all `n` at `end`.
fn relay_drain(
    relay: &RelayProc,
    n: usize,
    start: Instant,
    first: Instant,
    end: Instant,
) -> RelayDrain {
    RelayDrain {
        rate: n as f64 / (end - start).as_secs_f64(),
        first: (first - start).as_secs_f64(),
        cpu_per_10k: relay.cpu_seconds() / n as f64 * 10_000.0,
        peak_rss: relay.peak_rss_mb(),
    }
}

async fn steady(
    args: &Args,
    bin: &std::path::Path,
    report: &mut Report,
    rate: u32,
    clients: u32,
    prefix: &str,
) -> anyhow::Result<()> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    let sink = Sink::new(true).await?;
    let mut relay = RelayProc::start(
        bin,
        &db,
        &slot,
        Target::Exchange(&sink.exchange),
        args.window,
    )?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = relay.cpu_seconds();
    let clients = clients.max(1);
    let per_client = (rate / clients).max(1);
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
    wait_relay(&sink.count, total, wait(args), &mut relay).await?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = relay.cpu_seconds() - cpu0;
    let rss = relay.rss_mb();
    let mut lat = sink.latencies.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_by(|a, b| a.total_cmp(b));
    let cond = format!(
        "{rate} events/s offered by {clients} clients for {}s (achieved {:.0}/s), single-row transactions",
        args.seconds,
        total as f64 / insert_secs
    );
    for (name, q) in [("p50", 0.50), ("p99", 0.99), ("p99.9", 0.999)] {
        report.add(
            format!("{prefix} latency {name}"),
            percentile(&lat, q) * 1000.0,
            "ms",
            &cond,
        );
    }
    report.add(
        format!("{prefix} relay CPU share"),
        cpu / wall,
        "cores",
        &cond,
    );
    report.add(format!("{prefix} relay RSS"), rss, "MB", &cond);
    relay.stop();
    sink.cleanup().await;
    Ok(())
}

async fn large(args: &Args, bin: &std::path::Path, report: &mut Report) -> anyhow::Result<()> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    let sink = Sink::new(false).await?;
    let mut relay = RelayProc::start(
        bin,
        &db,
        &slot,
        Target::Exchange(&sink.exchange),
        args.window,
    )?;
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
    let end = wait_relay(&sink.count, n, wait(args), &mut relay).await?;
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
