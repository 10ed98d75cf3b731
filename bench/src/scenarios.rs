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
mod drain_report;
mod latency;
mod report;
mod stalled;

use baselines::*;
use cluster::*;
use drain::*;
use drain_report::*;
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
    lapin_scenarios(args, &mut report).await;
    shape_scenario(args, &mut report).await;
    channels_scenario(args, &mut report).await;
    stream_raw_scenario(args, &mut report).await;
    drain_scenarios(args, &bin, &mut report).await;
    steady_scenarios(args, &bin, &mut report).await;
    large_scenario(args, &bin, &mut report).await;
    stalled_scenarios(args, &bin, &mut report).await;
    Ok(report)
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
