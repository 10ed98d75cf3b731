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
//! - **recvlogical**: `pg_recvlogical` draining a slot holding N outbox inserts: the
//!   decode limit.
//! - **reader**: the wal-reader draining the same slot shape into a counting sink.
//! - **drain**: N preloaded outbox rows (1-row and 100-row transactions); the relay
//!   binary starts; time until a consumer holds all N. Relay CPU and peak RSS.
//! - **steady**: single-row transactions at a fixed rate; commit → receive latency
//!   percentiles at the consumer, relay CPU share and RSS.
//! - **large**: one 1M-row transaction: time and the relay's peak RSS.
//!
//! Needs the services of `scripts/test-services.sh` (Postgres 55432 with
//! wal_level=logical, RabbitMQ 5672) and a release build of `outbox-relay`.

mod harness;
mod scenarios;

use std::path::PathBuf;

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
    /// Publisher window (the relay's max_in_flight) for lapin and the relay.
    #[arg(long, default_value_t = 10_000)]
    pub window: usize,
    /// Small numbers, one run: a smoke test of the harness itself.
    #[arg(long)]
    pub quick: bool,
    /// Only these scenarios (comma-separated: lapin,channels,recvlogical,reader,drain,steady,large).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Where to write the markdown report (default: docs/benchmarks.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.events = args.events.min(20_000);
        args.runs = 1;
        args.large_rows = args.large_rows.min(100_000);
        args.seconds = args.seconds.min(5);
    }
    let report = scenarios::run_all(&args).await?;
    println!("{}", report.table());
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md"));
    std::fs::write(&out, report.markdown(&args))?;
    println!("wrote {}", out.display());
    Ok(())
}
