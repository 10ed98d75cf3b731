//! `outbox-bench`: measures outbox-relay against the physical limits of this machine,
//! in one run, so that ratios are meaningful on noisy machines.
//!
//! ```text
//! cargo run --release -p outbox-bench -- [--events N] [--runs R] [--quick] [--out FILE]
//! ```
//!
//! Scenarios (each figure the median of `--runs` runs):
//! - **lapin**: a raw pipelined lapin publisher with the relay's message shape and
//!   window: the broker's limit.
//! - **lapin-light**: the same with the lighter message a hand-written relay sends
//!   (issue #33): persistent, mandatory, message_id, type and content_type, no
//!   headers. The relay's default drain is reported against both.
//! - **recvlogical**: `pg_recvlogical` draining a slot holding N outbox inserts: the
//!   decode limit.
//! - **reader**: the wal-reader draining the same slot shape into a counting sink.
//! - **stream-raw**: a raw stream publisher (rabbitmq-stream-client, named producer,
//!   explicit publishing ids) with the relay's stream message shape and window, into
//!   a fresh stream: the broker's stream limit, until a consumer from the first
//!   offset holds all N (and, as a second figure, until all are confirmed).
//! - **drain**: N preloaded outbox rows (1-row and 100-row transactions); the relay
//!   binary starts; time until a consumer holds all N. Relay CPU and peak RSS.
//! - **drain-aggregate**: the same WAL, right after `drain` in each run, the relay
//!   with `[rabbitmq] ordering = "aggregate"` and `channels = 4` (the rows' aggregate
//!   ids are all distinct); its rate, CPU, and each run's ratio to `drain`'s rate.
//! - **drain-hash**, **drain-aggregate-hash**: the same two relays (one channel; and
//!   `ordering = "aggregate"` on 4 channels) into 4 queues behind an
//!   `x-consistent-hash` exchange on the `aggregate_id` header, so that the broker's
//!   work spreads over 4 queue processes; each run's ratio of the second to `drain`
//!   and to `drain-hash`.
//! - **drain-messages**: the same number of events in the same transaction sizes,
//!   emitted as transactional logical messages (`pg_logical_emit_message(true,
//!   'outbox', json)`, the content `outbox_emit` writes) into a database without an
//!   outbox table; the relay with `[postgres] messages = ["outbox"]` drains them into
//!   a queue (docs/messages.md). Beside it, for both sources: the WAL bytes per event
//!   of the load (`pg_current_wal_lsn()` before and after), and for the table also the
//!   WAL of the retention `DELETE` of its rows after the drains and its size per
//!   event (`pg_total_relation_size`): what messages avoid.
//! - **stream-drain**: the same WAL, the relay with `[rabbitmq] stream` set; time
//!   until a consumer reading the fresh stream from its first offset holds all N.
//! - **cluster-drain**: the same WAL, on the 3-node cluster of
//!   `scripts/rabbitmq-cluster.sh`: the relay given every node's URL publishes
//!   through an exchange to a quorum queue (3 members); time until its consumer holds
//!   all N.
//! - **cluster-stream-drain**: the same into a stream with 3 replicas, the relay given
//!   every node's stream URL; time until a consumer from the first offset holds all N.
//!   Both cluster drains are skipped (a line in the report says why) unless
//!   `OUTBOX_TEST_CLUSTER_AMQP_URLS` (and, for the stream,
//!   `OUTBOX_TEST_CLUSTER_STREAM_URLS`) name the nodes; `--quick` runs them on the
//!   100-row transactions only.
//! - **steady**: single-row transactions at a fixed rate (`--rate`, by `--clients`
//!   producers); commit → receive latency percentiles at the consumer, relay CPU
//!   share and RSS. Then, in the same run, at the same rate by as many producers, two
//!   baselines (issue #40): `pg_recvlogical`'s commit → receipt (its own slot,
//!   pgoutput, its output read by the harness) and a raw lapin publisher's publish →
//!   delivery (the relay's message, one confirm-mode channel); and the relay's own
//!   share of the p99, its p99 less the larger baseline's. `--quick` runs each
//!   baseline for 1 s.
//! - **steady-high**: the same at ten times the rate by twice the producers.
//! - **large**: one 1M-row transaction: time and the relay's peak RSS.
//! - **stalled**: 400 events of 2 MiB (160 with `--quick`); once two are delivered,
//!   a proxy stops forwarding the relay's bytes to the broker (a broker that stops
//!   reading), or the broker's bytes to the relay (it reads all and confirms none),
//!   for 20 s (5 s): the relay's RSS meanwhile, bounded by `max_in_flight_bytes`
//!   (issue #49); then the time until the rest is delivered.
//!
//! Needs the services of `scripts/test-services.sh` (Postgres 55432 with
//! wal_level=logical, RabbitMQ 5672 and its stream port 5552, or
//! `OUTBOX_TEST_STREAM_URL`; for the cluster drains, its 3-node cluster). The relay
//! binary is `$OUTBOX_BENCH_RELAY_BIN`, or built in the harness's profile (release
//! with `cargo run --release`).
//!
//! Exits non-zero when a scenario failed or produced no figure (after writing the
//! report, which lists the problems). `--quick` writes to `target/bench-quick.md`
//! unless `--out` says otherwise: a smoke run never overwrites docs/benchmarks.md.

mod harness;
mod plot;
mod scenarios;

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Benchmark harness for outbox-relay")]
pub struct Args {
    /// Events per drain / baseline run.
    #[arg(long, default_value_t = 100_000)]
    pub events: usize,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Rows of the large transaction.
    #[arg(long, default_value_t = 1_000_000)]
    pub large_rows: usize,
    /// Steady scenario: events per second and seconds.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    #[arg(long, default_value_t = 20)]
    pub seconds: u32,
    /// Steady scenario: producers (connections), each committing single-row
    /// transactions at rate / clients per second.
    #[arg(long, default_value_t = 4)]
    pub clients: u32,
    /// Publisher window (the relay's max_in_flight) for lapin and the relay.
    #[arg(long, default_value_t = 10_000)]
    pub window: usize,
    /// Small numbers, one run: a smoke test of the harness itself.
    #[arg(long)]
    pub quick: bool,
    /// Only these scenarios (comma-separated: lapin,lapin-light,shape,channels,
    /// stream-raw,recvlogical,reader,drain,drain-minimal,drain-aggregate,drain-hash,
    /// drain-aggregate-hash,drain-messages,stream-drain,cluster-drain,
    /// cluster-stream-drain,steady,steady-high,large,stalled).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Only draw the SVG of an existing report (e.g. a docs/benchmarks.md merged from
    /// several runs) beside it, and exit.
    #[arg(long, value_name = "REPORT.md")]
    pub plot: Option<PathBuf>,
    /// Where to write the markdown report (default: docs/benchmarks.md; with --quick,
    /// target/bench-quick.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run the relays with tracing on at 100% sampling (docs/tracing.md), exporting
    /// every span to an OTLP/HTTP receiver in this process (testkit::otlp): the
    /// relays inherit OTEL_EXPORTER_OTLP_ENDPOINT pointing at it. Compare the relay
    /// CPU per event with a run without it (docs/benchmarks.md, "Tracing").
    #[arg(long)]
    pub tracing: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(report) = &args.plot {
        let text = std::fs::read_to_string(report)
            .with_context(|| format!("read {}", report.display()))?;
        let figures = plot::parse_markdown(&text);
        if figures.is_empty() {
            bail!(
                "{} holds no figure table; give a report written by outbox-bench",
                report.display()
            );
        }
        let svg = report.with_extension("svg");
        std::fs::write(&svg, plot::svg(&figures))
            .with_context(|| format!("write {}", svg.display()))?;
        println!("wrote {} ({} figures)", svg.display(), figures.len());
        return Ok(());
    }
    if args.quick {
        args.events = args.events.min(20_000);
        args.runs = 1;
        args.large_rows = args.large_rows.min(100_000);
        args.seconds = args.seconds.min(5);
    }
    // The relays are children of this process: they inherit the variable.
    let receiver = if args.tracing {
        let receiver = testkit::otlp::Receiver::sink()
            .await
            .context("start the OTLP receiver")?;
        // The relay's default sampling_ratio is 1.0: every span is exported.
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint());
        Some(receiver)
    } else {
        None
    };
    let report = scenarios::run_all(&args).await?;
    println!("{}", report.table());
    if let Some(receiver) = &receiver {
        println!(
            "tracing: the OTLP receiver took {} spans in {} requests",
            receiver.span_count(),
            receiver.requests()
        );
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = args.out.clone().unwrap_or_else(|| {
        if args.quick {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| root.join("target"), PathBuf::from)
                .join("bench-quick.md")
        } else {
            root.join("docs/benchmarks.md")
        }
    });
    let svg = out.with_extension("svg");
    let svg_name = svg
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::fs::write(&svg, plot::svg(&report.figures))
        .with_context(|| format!("write {}", svg.display()))?;
    std::fs::write(&out, report.markdown(&args, Some(&svg_name)))
        .with_context(|| format!("write {}", out.display()))?;
    println!("wrote {} and {}", out.display(), svg.display());
    let problems = report.problems();
    if !problems.is_empty() {
        bail!(
            "{} problem(s): {}; see {}",
            problems.len(),
            problems.join("; "),
            out.display()
        );
    }
    Ok(())
}
