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

mod baselines;
mod cluster;
mod drain;
mod latency;
mod report;
mod stalled;

use baselines::*;
use cluster::*;
use drain::*;
use latency::*;
pub use report::{Figure, Report};
use stalled::*;

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
    "lapin-light",
    "shape",
    "channels",
    "stream-raw",
    "recvlogical",
    "reader",
    "drain",
    "drain-minimal",
    "drain-aggregate",
    "drain-hash",
    "drain-aggregate-hash",
    "drain-messages",
    "stream-drain",
    "cluster-drain",
    "cluster-stream-drain",
    "steady",
    "steady-high",
    "large",
    "stalled",
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
    // The broker's limit for the relay's message, and for the lighter message a
    // hand-written relay sends (issue #33): persistent, mandatory, message_id, type
    // and content_type, no headers.
    for (scenario, shape, name, what) in [
        ("lapin", Shape::Full, LAPIN, "the relay's message"),
        (
            "lapin-light",
            Shape::Light,
            LAPIN_LIGHT,
            Shape::Light.conditions(),
        ),
    ] {
        if !wants(args, scenario) {
            continue;
        }
        report.expect(&[name]);
        let mut rates = Vec::new();
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                rates.push(lapin_baseline(args, 1, shape).await?);
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
                    "N={}, window={}, {what}, until the consumer has all",
                    args.events, args.window
                ),
            ),
            Err(e) => report.fail(scenario, &e),
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
    // The cluster drains (when the cluster is named in the environment) drain the same
    // WAL as the single-node ones, beside them in the report.
    let cluster = ClusterPlan::new(args, &mut report);
    for per_tx in [100usize, 1] {
        let cluster = cluster.at(args, per_tx);
        if ![
            "drain",
            "drain-minimal",
            "drain-aggregate",
            "drain-hash",
            "drain-aggregate-hash",
            "drain-messages",
            "reader",
            "recvlogical",
            "stream-drain",
        ]
        .iter()
        .any(|s| wants(args, s))
            && !cluster.any()
        {
            continue;
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
        if wants(args, "drain-aggregate") {
            report.expect(&[&names.aggregate, &names.aggregate_cpu]);
            if wants(args, "drain") {
                report.expect(&[&names.aggregate_ratio]);
            } else if per_tx == 100 {
                report.skip(
                    "drain-aggregate / drain ratio",
                    "needs the single-channel drain in the same run: add drain to --only",
                );
            }
        }
        if wants(args, "drain-hash") {
            report.expect(&[&RelayNames::hashed(per_tx).rate]);
        }
        if wants(args, "drain-aggregate-hash") {
            report.expect(&[&RelayNames::aggregate_hashed(per_tx).rate]);
            for (other, name) in [
                ("drain", &names.hashed_ratio),
                ("drain-hash", &names.hashed_channels_ratio),
            ] {
                if wants(args, other) {
                    report.expect(&[name]);
                }
            }
        }
        if wants(args, "stream-drain") {
            report.expect(&[&names.stream, &names.stream_cpu, &names.stream_rss]);
        }
        if wants(args, "drain") || wants(args, "drain-messages") {
            report.expect(&[
                &names.table_wal,
                &names.table_delete_wal,
                &names.table_total_wal,
                &names.table_size,
            ]);
        }
        if wants(args, "drain-messages") {
            report.expect(&[
                &names.messages,
                &names.messages_cpu,
                &names.messages_wal,
                &names.messages_wal_ratio,
            ]);
        }
        cluster.expect(&mut report, per_tx);
        let mut runs = Vec::new();
        let result: anyhow::Result<()> = async {
            for _ in 0..args.runs {
                runs.push(drain_run(args, &bin, per_tx, &cluster).await?);
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
        let aggregate = pick(|r| r.aggregate.map(|m| m.rate));
        if !aggregate.is_empty() {
            let how = format!(
                "[rabbitmq] ordering = \"aggregate\", channels = {AGGREGATE_CHANNELS}, \
                 {} distinct aggregate ids",
                args.events
            );
            report.add(
                &names.aggregate,
                median(aggregate),
                "events/s",
                format!(
                    "{cond}, window {}, {how}, until the queue's consumer has all",
                    args.window
                ),
            );
            let first = pick(|r| r.aggregate.map(|m| m.first));
            report.add(
                &names.aggregate_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = pick(|r| r.aggregate.map(|m| m.cpu_per_10k));
            report.add(&names.aggregate_cpu, median(cpu), "core-s", &cond);
            let rss = pick(|r| r.aggregate.map(|m| m.peak_rss));
            report.add(&names.aggregate_rss, median(rss), "MB", &cond);
            // Each run's ratio (the two drains back to back on the same WAL), then
            // their median: the load of one run hits both alike.
            let ratio = pick(|r| Some(r.aggregate?.rate / r.relay?.rate));
            if !ratio.is_empty() {
                report.add(
                    &names.aggregate_ratio,
                    median(ratio),
                    "×",
                    format!("{cond}: the median of each run's ratio of the two rates"),
                );
            }
        }
        let cond_hash = format!(
            "{cond}, {HASH_QUEUES} queues behind a consistent-hash exchange on the {HASH_HEADER} header"
        );
        let rate_cond = format!(
            "{cond_hash}, window {}, until the queues' consumers have all",
            args.window
        );
        let hashed: Vec<RelayDrain> = runs.iter().filter_map(|r| r.hashed).collect();
        RelayNames::hashed(per_tx).add(&mut report, &hashed, &cond_hash, &rate_cond);
        let aggregate_hashed: Vec<RelayDrain> =
            runs.iter().filter_map(|r| r.aggregate_hashed).collect();
        let rate_cond = format!(
            "{rate_cond}, [rabbitmq] ordering = \"aggregate\", channels = {AGGREGATE_CHANNELS}"
        );
        RelayNames::aggregate_hashed(per_tx).add(
            &mut report,
            &aggregate_hashed,
            &cond_hash,
            &rate_cond,
        );
        // Per run, as for the aggregate ratio above: against the default drain (one
        // channel, one queue: the move a user makes) and against one channel into the
        // same queues (the channels' own share).
        for (name, ratio, against) in [
            (
                &names.hashed_ratio,
                pick(|r| Some(r.aggregate_hashed?.rate / r.relay?.rate)),
                "the default drain (1 channel, 1 queue)",
            ),
            (
                &names.hashed_channels_ratio,
                pick(|r| Some(r.aggregate_hashed?.rate / r.hashed?.rate)),
                "1 channel into the same queues",
            ),
        ] {
            if !ratio.is_empty() {
                report.add(
                    name,
                    median(ratio),
                    "×",
                    format!("{cond}: the median of each run's ratio, against {against}"),
                );
            }
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
        let messages = pick(|r| r.messages.map(|m| m.rate));
        if !messages.is_empty() {
            report.add(
                &names.messages,
                median(messages),
                "events/s",
                format!(
                    "{cond} each emitting the events as transactional logical messages \
                     (pg_logical_emit_message(true, 'outbox', json): outbox_emit's content), \
                     the relay with [postgres] messages = [\"outbox\"] and no table, window {}, \
                     until the queue's consumer has all",
                    args.window
                ),
            );
            let first = pick(|r| r.messages.map(|m| m.first));
            report.add(
                &names.messages_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = pick(|r| r.messages.map(|m| m.cpu_per_10k));
            report.add(&names.messages_cpu, median(cpu), "core-s", &cond);
            let rss = pick(|r| r.messages.map(|m| m.peak_rss));
            report.add(&names.messages_rss, median(rss), "MB", &cond);
        }
        // The WAL each source writes per event, and what the table costs besides
        // (docs/messages.md, "Messages or a table"). pg_current_wal_lsn() is the
        // cluster's: anything else running on it meanwhile counts too.
        let wal_cond = format!(
            "{cond}: pg_wal_lsn_diff of pg_current_wal_lsn() before and after, over N \
             (cluster-wide)"
        );
        let table_wal = pick(|r| r.table.map(|t| t.insert_wal));
        if !table_wal.is_empty() {
            report.add(
                &names.table_wal,
                median(table_wal),
                "bytes",
                format!("{wal_cond}: the inserts"),
            );
            let delete = pick(|r| r.table.map(|t| t.delete_wal));
            report.add(
                &names.table_delete_wal,
                median(delete),
                "bytes",
                format!(
                    "{wal_cond}: DELETE FROM outbox after the drains, as retention deletes \
                     (vacuum's WAL not included)"
                ),
            );
            let total = pick(|r| r.table.map(|t| t.insert_wal + t.delete_wal));
            report.add(
                &names.table_total_wal,
                median(total),
                "bytes",
                format!("{wal_cond}: the inserts and the retention DELETE"),
            );
            let size = pick(|r| r.table.map(|t| t.size));
            report.add(
                &names.table_size,
                median(size),
                "bytes",
                format!(
                    "{cond}: pg_total_relation_size of the outbox (heap, primary key, TOAST) \
                     before the DELETE, over N: the space logical messages never use"
                ),
            );
        }
        let messages_wal = pick(|r| r.messages_wal);
        if !messages_wal.is_empty() {
            report.add(
                &names.messages_wal,
                median(messages_wal),
                "bytes",
                format!("{wal_cond}: the messages (nothing to delete later)"),
            );
            let ratio =
                pick(|r| Some(r.messages_wal? / (r.table?.insert_wal + r.table?.delete_wal)));
            report.add(
                &names.messages_wal_ratio,
                median(ratio),
                "×",
                format!("{cond}: the median of each run's ratio"),
            );
        }
        for (scenario, e) in runs.iter().flat_map(|r| &r.failures) {
            report.fail(format!("{scenario} {per_tx}-row tx"), e);
        }
        let queue: Vec<RelayDrain> = runs.iter().filter_map(|r| r.cluster).collect();
        let c = format!("{cond}, {QUEUE_COND}");
        let rate_cond = format!(
            "{c}, window {}, until the queue's consumer has all",
            args.window
        );
        RelayNames::queue(per_tx).add(&mut report, &queue, &c, &rate_cond);
        let stream: Vec<RelayDrain> = runs.iter().filter_map(|r| r.cluster_stream).collect();
        let c = format!("{cond}, {STREAM_COND}");
        let rate_cond = format!(
            "{c}, window {}, until a consumer from the stream's first offset has all",
            args.window
        );
        RelayNames::stream(per_tx).add(&mut report, &stream, &c, &rate_cond);
    }
    steady_scenarios(args, &bin, &mut report).await;
    if wants(args, "large") {
        report.expect(&["large tx: commit → all received", "large tx relay peak RSS"]);
        if let Err(e) = large(args, &bin, &mut report).await {
            report.fail("large", &e);
        }
    }
    if wants(args, "stalled") {
        for how in [Stall::NotReading, Stall::NotAnswering] {
            let name = how.name();
            let rss = format!("{name}: relay RSS meanwhile");
            let rest = format!("{name}: the rest delivered after it answers again");
            report.expect(&[&rss, &rest]);
            if let Err(e) = stalled(args, &bin, how, &mut report).await {
                report.fail("stalled", &e);
            }
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
    aggregate: String,
    aggregate_first: String,
    aggregate_cpu: String,
    aggregate_rss: String,
    aggregate_ratio: String,
    hashed_ratio: String,
    hashed_channels_ratio: String,
    stream: String,
    stream_first: String,
    stream_cpu: String,
    stream_rss: String,
    messages: String,
    messages_first: String,
    messages_cpu: String,
    messages_rss: String,
    messages_wal: String,
    messages_wal_ratio: String,
    table_wal: String,
    table_delete_wal: String,
    table_total_wal: String,
    table_size: String,
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
            aggregate: aggregate_name(per_tx),
            aggregate_first: format!(
                "drain {per_tx}-row tx: relay start → first message, aggregate {AGGREGATE_CHANNELS} channels"
            ),
            aggregate_cpu: aggregate_cpu_name(per_tx),
            aggregate_rss: format!(
                "drain {per_tx}-row tx: relay peak RSS, aggregate {AGGREGATE_CHANNELS} channels"
            ),
            aggregate_ratio: aggregate_ratio_name(per_tx),
            hashed_ratio: hashed_ratio_name(per_tx),
            hashed_channels_ratio: format!(
                "hashed drain {per_tx}-row tx: aggregate {AGGREGATE_CHANNELS} channels / 1 channel, {HASH_QUEUES} queues"
            ),
            stream: format!("stream drain {per_tx}-row tx: relay"),
            stream_first: format!("stream drain {per_tx}-row tx: relay start → first message"),
            stream_cpu: format!("stream drain {per_tx}-row tx: relay CPU per 10k events"),
            stream_rss: format!("stream drain {per_tx}-row tx: relay peak RSS"),
            messages: format!("drain-messages {per_tx}-row tx: relay"),
            messages_first: format!(
                "drain-messages {per_tx}-row tx: relay start → first message"
            ),
            messages_cpu: format!("drain-messages {per_tx}-row tx: relay CPU per 10k events"),
            messages_rss: format!("drain-messages {per_tx}-row tx: relay peak RSS"),
            messages_wal: messages_wal_name(per_tx),
            messages_wal_ratio: messages_wal_ratio_name(per_tx),
            table_wal: format!("drain {per_tx}-row tx: WAL per event"),
            table_delete_wal: format!("drain {per_tx}-row tx: retention DELETE WAL per event"),
            table_total_wal: table_total_wal_name(per_tx),
            table_size: format!(
                "drain {per_tx}-row tx: table size per event (bloat messages avoid)"
            ),
        }
    }
}

/// The figure names of the baselines and the drains that the targets read.
pub(super) const LAPIN: &str = "lapin raw publisher";
pub(super) const LAPIN_LIGHT: &str = "lapin raw publisher, light message";

pub(super) fn aggregate_name(per_tx: usize) -> String {
    format!("drain {per_tx}-row tx: relay, aggregate {AGGREGATE_CHANNELS} channels")
}

pub(super) fn aggregate_cpu_name(per_tx: usize) -> String {
    format!(
        "drain {per_tx}-row tx: relay CPU per 10k events, aggregate {AGGREGATE_CHANNELS} channels"
    )
}

pub(super) fn aggregate_ratio_name(per_tx: usize) -> String {
    format!("drain {per_tx}-row tx: aggregate {AGGREGATE_CHANNELS} channels / single-channel drain")
}

pub(super) fn messages_wal_name(per_tx: usize) -> String {
    format!("drain-messages {per_tx}-row tx: WAL per event")
}

pub(super) fn table_total_wal_name(per_tx: usize) -> String {
    format!("drain {per_tx}-row tx: insert + retention DELETE WAL per event")
}

pub(super) fn messages_wal_ratio_name(per_tx: usize) -> String {
    format!("drain-messages {per_tx}-row tx: WAL per event / table insert + DELETE")
}

pub(super) fn hashed_ratio_name(per_tx: usize) -> String {
    format!(
        "hashed drain {per_tx}-row tx: aggregate {AGGREGATE_CHANNELS} channels, {HASH_QUEUES} queues / single-channel drain"
    )
}
