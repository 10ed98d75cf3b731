//! `inbox-consumer`: an idempotent consumer of outbox-relay messages (the inbox
//! pattern). The logic lives in the library (`src/lib.rs`); this is the CLI.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use inbox_consumer::{run, Config, Declare, Stats};

/// Consume outbox-relay messages idempotently: record each message_id in the `inbox`
/// table and perform the side effect in the same transaction, ack after commit.
#[derive(Debug, Parser)]
#[command(name = "inbox-consumer", version)]
struct Cli {
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "INBOX_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,

    /// Queue to consume.
    #[arg(long, env = "INBOX_QUEUE")]
    queue: String,

    /// Postgres URL or key=value conninfo of the consumer's database.
    #[arg(long, env = "INBOX_POSTGRES_URL", hide_env_values = true)]
    postgres_url: String,

    /// Name recorded in inbox.consumer (one per logical consumer); default: the queue.
    #[arg(long, env = "INBOX_CONSUMER_NAME")]
    consumer_name: Option<String>,

    /// Deliveries the broker sends ahead without an ack (basic.qos prefetch).
    #[arg(long, env = "INBOX_PREFETCH", default_value_t = 32)]
    prefetch: u16,

    /// Declare the queue (durable) and bind it to --exchange with --binding.
    #[arg(long)]
    declare: bool,

    /// Exchange to bind the queue to with --declare (declared as a durable topic
    /// exchange when missing, as the relay does).
    #[arg(long, default_value = "outbox", requires = "declare")]
    exchange: String,

    /// Binding key for --declare ('#' = every message on a topic exchange).
    #[arg(long, default_value = "#", requires = "declare")]
    binding: String,

    /// With --declare: declare a quorum queue.
    #[arg(long, requires = "declare")]
    quorum: bool,

    /// With --declare --quorum: dead-letter a message after this many deliveries
    /// (x-delivery-limit), so a poison message cannot loop forever.
    #[arg(long, requires = "quorum")]
    delivery_limit: Option<u32>,

    /// With --declare: x-dead-letter-exchange of the queue (rejected and
    /// over-the-limit messages go there).
    #[arg(long, requires = "declare")]
    dead_letter_exchange: Option<String>,

    /// Create the inbox (sql/inbox.sql) and side_effects tables when missing.
    #[arg(long)]
    init: bool,

    /// Exit once no message arrived for this many milliseconds (batch runs, tests).
    #[arg(long, value_name = "MS")]
    exit_when_idle_ms: Option<u64>,

    /// Test hook: exit(1) right after committing the N-th new message, before its ack.
    #[arg(long, value_name = "N", env = "INBOX_EXIT_AFTER_COMMIT")]
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
        consumer_name: cli.consumer_name.unwrap_or_else(|| cli.queue.clone()),
        amqp_url: cli.amqp_url,
        queue: cli.queue,
        postgres_url: cli.postgres_url,
        prefetch: cli.prefetch,
        declare: cli.declare.then_some(Declare {
            exchange: cli.exchange,
            binding: cli.binding,
            quorum: cli.quorum,
            delivery_limit: cli.delivery_limit,
            dead_letter_exchange: cli.dead_letter_exchange,
        }),
        init: cli.init,
        exit_after_commit: cli.exit_after_commit,
        exit_when_idle: cli.exit_when_idle_ms.map(Duration::from_millis),
    };
    // The consumer's spans continue the relay's trace (docs/tracing.md): exported
    // when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let tracer_provider = match inbox_consumer::trace::init_otlp() {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("error: cannot set up the OTLP trace export: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stats = Arc::new(Stats::default());
    let result = run(&config, stats.clone(), shutdown_signal()).await;
    if let Some(provider) = tracer_provider {
        let _ = provider.shutdown();
    }
    // The summary goes to stdout (logs go to stderr), one line, for scripts and tests.
    println!("inbox-consumer: {stats}");
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
/// contains (lapin errors repeat their source in their own message).
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
