//! `outbox-relay`: relays a transactional outbox from a Postgres logical replication
//! slot (pgoutput) to RabbitMQ with publisher confirms (docs/design.md §1).
//!
//! # Layout
//!
//! ```text
//!   main ─► Cli::parse (clap: bad usage exits 2)
//!        ─► logging::init (RUST_LOG, --log-format)
//!        ─► execute_command(cli): Config::load ─► one command ─► Result<(), CliError>
//!        ─► exit code: 0 ok, 1 runtime failure, 2 usage/config/precondition
//! ```
//!
//! The process:
//! - `cli`: the command line (docs/design.md §6); `build_info`: version, commit and
//!   target (`--version`, the metric `outbox_relay_build_info`).
//! - `config`: the TOML file and `OUTBOX_RELAY_*` overrides, and each component's
//!   configuration built from them (docs/design.md §6).
//! - `error`: [`error::CliError`], its exit codes, its one-line printing and the
//!   conversions from the lower layers' errors.
//! - `logging`: the tracing subscriber.
//! - `commands`: one module per command (docs/design.md §6): `check`, `run`, `slot`,
//!   `status` (with `standby`), `peek`, `replay`, `ctl`; `completions` (with the hidden
//!   `man`), which `main` runs before loading any configuration.
//!
//! What `run` runs:
//! - `pipeline`: reader → publisher → LSN feedback, reconnects, clean stop.
//! - `state`: the stored acked position (the table `outbox_relay_state`).
//! - `health`: the live state `/readyz` and the metrics read.
//! - `shutdown`: the clean-stop request shared by everything `run` starts.
//! - `control`: pause, resume and drain (docs/design.md §9); `control_token`: the
//!   per-start token control needs and `ctl` reads; `reload`: SIGHUP and `ctl reload`.
//! - `background`: the tasks beside the pipeline: `anchor` (the replay window's
//!   slot), `retention` (deleting confirmed rows), `slot_metrics` (slot gauges),
//!   all on one tick-and-reconnect loop (`background/tick.rs`).
//! - `metrics`: `/metrics`, `/healthz`, `/readyz` and their router; `endpoint/`:
//!   the HTTP side, both ends (`endpoint.rs` has its file map): the server under
//!   them, the guard every request passes, the credentials, the `/control/` routes,
//!   and the client `ctl` and `status` ask with.
//!
//! Shared: `sql`, the one way to open an ordinary SQL connection.

mod anchor;
mod background;
mod build_info;
mod cli;
mod commands;
mod config;
mod control;
mod control_token;
mod endpoint;
mod error;
mod health;
mod logging;
mod metrics;
mod pipeline;
mod reload;
mod retention;
mod shutdown;
mod slot_metrics;
mod sql;
mod state;
mod telemetry;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command, SlotCommand};
use crate::config::Config;
use crate::error::CliError;

/// jemalloc instead of the system allocator: the publish path allocates per message
/// (the frames, the header tables), and glibc's malloc, free and consolidation
/// were a quarter of the relay's CPU in the queue drain's profile; jemalloc cut the
/// CPU per event by a fifth at the same peak RSS (mimalloc cut as much but took a
/// quarter more memory). Measured in docs/performance.md.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Generated from the command line alone: no configuration, logger or runtime.
    let generated = match cli.command {
        Command::Completions(ref args) => Some(commands::completions::completions(args.shell)),
        Command::Man => Some(commands::completions::man()),
        _ => None,
    };
    if let Some(result) = generated {
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => e.report(),
        };
    }
    if let Err(e) = logging::init(cli.log_format) {
        return e.report();
    }
    // One thread for the relay's tasks: the reader and the publisher hand batches to
    // each other many thousand times a second, and on one thread that costs no
    // cross-thread wake-ups (the AMQP client runs on this thread too).
    // Measured with outbox-bench: relay CPU per 10k single-row transactions fell from
    // ~0.8 to ~0.4 core-seconds compared with the multi-threaded runtime.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return CliError::Runtime(format!(
                "cannot start the async runtime ({e}): check the process's thread and file limits"
            ))
            .report()
        }
    };
    match runtime.block_on(execute_command(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.report(),
    }
}

/// Loads the configuration and executes the one command the command line names.
async fn execute_command(cli: Cli) -> Result<(), CliError> {
    // `ctl` reads only the endpoint's keys, so that a bad edit elsewhere in the file
    // leaves the incident levers working (config::ctl).
    if let Command::Ctl(args) = &cli.command {
        let settings = Config::load_for_ctl(cli.config.as_deref(), args.endpoint.is_some())?;
        return commands::ctl::execute(&settings, args).await;
    }
    let config = Config::load(cli.config.as_deref())?;
    let log_format = cli.log_format;
    tracing::debug!(source = %config.source, "configuration loaded");
    // Bad usage first: it needs no configuration to be told.
    if let Command::Replay(args) = &cli.command {
        args.source()?;
    }
    // Which servers the command connects to: never to built-in defaults.
    let (name, postgres, broker) = match &cli.command {
        Command::Check(_) => ("check", true, true),
        Command::Run(_) => ("run", true, true),
        Command::Replay(args) => ("replay", true, !args.dry_run),
        Command::Slot(SlotCommand::Create(_)) => ("slot create", true, false),
        Command::Slot(SlotCommand::Drop(_)) => ("slot drop", true, false),
        Command::Slot(SlotCommand::Skip(_)) => ("slot skip", true, false),
        Command::Status(_) => ("status", true, false),
        Command::Peek(_) => ("peek", true, false),
        Command::Ctl(_) | Command::Completions(_) | Command::Man => ("", false, false),
    };
    config.require_connection_settings(name, postgres, broker)?;
    // `[relay] log_filter` wins over RUST_LOG (a reload can change only it).
    if !config.relay.log_filter.trim().is_empty() {
        if let Err(e) = logging::set_filter(&config.relay.log_filter) {
            tracing::warn!(error = %e, "[relay] log_filter not applied");
        }
    }
    // `check` prints them as lines of its own.
    if !matches!(cli.command, Command::Check(_)) {
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
    }
    match cli.command {
        Command::Check(args) => commands::check::execute(&config, &args).await,
        Command::Run(args) => commands::run::execute(&config, &args, cli.config).await,
        Command::Ctl(_) => Ok(()), // handled above
        Command::Slot(SlotCommand::Create(args)) => commands::slot::create(&config, &args).await,
        Command::Slot(SlotCommand::Drop(args)) => commands::slot::drop(&config, &args).await,
        Command::Slot(SlotCommand::Skip(args)) => commands::skip::skip(&config, &args).await,
        Command::Status(args) => commands::status::status(&config, &args).await,
        Command::Peek(args) => commands::peek::peek(&config, &args).await,
        Command::Replay(args) => commands::replay::replay(&config, &args, log_format).await,
        Command::Completions(_) | Command::Man => Ok(()), // handled in main
    }
}
