//! `stream-consumer`: an exactly-once consumer of the RabbitMQ stream outbox-relay
//! publishes to. The logic lives in the library (`src/lib.rs`); this is the CLI.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use stream_consumer::{run, Config, Stats, Tracking};

/// Where the consumer stores its position in the stream.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Offsets {
    /// In the consumer's database, in the transaction that applies the messages:
    /// exactly once.
    Database,
    /// On the broker under --consumer-name (store_offset after the commit): at least
    /// once.
    Server,
}

/// Consume an outbox-relay stream: apply each message and record the stream offset
/// reached in the same Postgres transaction; resume after the stored offset.
#[derive(Debug, Parser)]
#[command(name = "stream-consumer", version)]
struct Cli {
    /// RabbitMQ stream-protocol URL (rabbitmq-stream[+tls]://user:password@host:port/vhost).
    #[arg(
        long,
        env = "STREAM_CONSUMER_STREAM_URL",
        default_value = "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f",
        hide_env_values = true
    )]
    stream_url: String,

    /// CA bundle for rabbitmq-stream+tls:// (default: the system's).
    #[arg(long, env = "STREAM_CONSUMER_CA_FILE")]
    ca_file: Option<String>,

    /// Stream to consume (the relay's `[rabbitmq] stream`).
    #[arg(long, env = "STREAM_CONSUMER_STREAM")]
    stream: String,

    /// Postgres URL or key=value conninfo of the consumer's database.
    #[arg(long, env = "STREAM_CONSUMER_POSTGRES_URL", hide_env_values = true)]
    postgres_url: String,

    /// The consumer's name (its row in stream_offsets; with --offsets server, its
    /// offset reference on the broker); default: the stream.
    #[arg(long, env = "STREAM_CONSUMER_NAME")]
    consumer_name: Option<String>,

    /// Where the position is stored.
    #[arg(
        long,
        env = "STREAM_CONSUMER_OFFSETS",
        value_enum,
        default_value = "database"
    )]
    offsets: Offsets,

    /// Messages applied per transaction at most (only those already received).
    #[arg(long, env = "STREAM_CONSUMER_BATCH_SIZE", default_value_t = 100)]
    batch_size: usize,

    /// Create the stream_offsets and stream_effects tables when missing.
    #[arg(long)]
    init: bool,

    /// Exit once no message arrived for this many milliseconds (batch runs, tests).
    #[arg(long, value_name = "MS")]
    exit_when_idle_ms: Option<u64>,

    /// Test hook: exit(1) right after the commit that brings the applied messages to N
    /// (with --offsets server: before the offset is stored on the broker).
    #[arg(long, value_name = "N", env = "STREAM_CONSUMER_EXIT_AFTER_COMMIT")]
    exit_after_commit: Option<u64>,

    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if cli.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }

    let config = Config {
        consumer_name: cli.consumer_name.unwrap_or_else(|| cli.stream.clone()),
        stream_url: cli.stream_url,
        ca_file: cli.ca_file,
        stream: cli.stream,
        postgres_url: cli.postgres_url,
        tracking: match cli.offsets {
            Offsets::Database => Tracking::Database,
            Offsets::Server => Tracking::Server,
        },
        batch_size: cli.batch_size,
        init: cli.init,
        exit_after_commit: cli.exit_after_commit,
        exit_when_idle: cli.exit_when_idle_ms.map(Duration::from_millis),
    };
    let stats = Arc::new(Stats::default());
    let result = run(&config, stats.clone(), shutdown_signal()).await;
    // The summary goes to stdout (logs go to stderr), one line, for scripts and tests.
    println!("stream-consumer: {stats}");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// The error and its causes, skipping a cause whose text the previous one already
/// contains.
fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}
