//! `run [--start-lsn LSN | --skip-through MESSAGE_ID] [--paused]`: the relay until
//! SIGTERM/SIGINT or `ctl drain`; SIGHUP reloads the configuration.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};
use wal_reader::admin::{CheckStatus, Preflight};

use crate::cli::RunArgs;
use crate::config::Config;
use crate::control::Control;
use crate::endpoint::control::Live;
use crate::error::CliError;
use crate::health::Health;
use crate::pipeline::sink::target_config;
use crate::pipeline::{self, PipelineConfig};
use crate::reload::Reloader;
use crate::shutdown::Shutdown;

/// Runs the relay until a signal asks it to stop; exits 0 after a clean stop.
pub async fn execute(
    cfg: &Config,
    args: &RunArgs,
    config_path: Option<PathBuf>,
) -> Result<(), CliError> {
    crate::build_info::log();
    crate::background::validate(cfg)?;
    // Before the first publisher starts: each takes the tracer when it starts.
    let telemetry = crate::telemetry::start(cfg)?;
    let mut shutdown = Shutdown::new();
    spawn_signal_handler(shutdown.clone())?;
    let control = Control::new(args.paused, shutdown.clone());
    if args.paused {
        info!("starting paused (--paused): nothing is published until `ctl resume`");
    }
    let reloader = Arc::new(Reloader::new(config_path, cfg));
    spawn_reload_handler(reloader.clone())?;
    let health = Health::default();
    if let Some(endpoint) = cfg.metrics_endpoint() {
        let live = Live {
            control: control.clone(),
            reloader,
        };
        crate::metrics::serve(endpoint, health.clone(), live).await?;
        crate::metrics::set_target(cfg.stream(), &cfg.rabbitmq.exchange);
    }
    // A poison event to skip first (docs/recovery.md): before any session reads the
    // slot, which must be idle for it.
    if let Some(target) = &args.skip_through {
        let target = crate::commands::skip::Target::MessageId(target.trim().to_string());
        let skipped = crate::commands::skip::perform(cfg, &target, args.yes).await?;
        metrics::counter!(crate::commands::skip::SKIPPED_EVENTS).increment(skipped.events as u64);
    }
    // Check the preconditions once up front so that a misconfiguration stops the
    // relay with its fix; wait (with backoff) while Postgres is unreachable.
    let mut wait = Duration::from_millis(500);
    loop {
        match preflight(cfg).await {
            Ok(()) => break,
            Err(CliError::Runtime(e)) => {
                warn!(error = %e, retry_in = ?wait, "postgres not ready");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.requested() => return Ok(()),
                }
                wait = (wait * 2).min(Duration::from_secs(10));
            }
            Err(e) => return Err(e),
        }
    }
    let pcfg = PipelineConfig {
        reader: cfg.reader_config(args.start_lsn)?,
        publisher: target_config(cfg),
        shutdown_timeout: cfg.shutdown_timeout(),
    };
    let background = crate::background::spawn(cfg, &shutdown);
    match cfg.stream() {
        Some(stream) => info!(slot = %cfg.postgres.slot, %stream,
            brokers = ?cfg.stream_urls_redacted(), "relay starting (stream target, exactly once)"),
        None => info!(slot = %cfg.postgres.slot, exchange = %cfg.rabbitmq.exchange,
            brokers = ?cfg.amqp_urls_redacted(), "relay starting"),
    }
    let result = pipeline::run_sessions(pcfg, shutdown, health, &control).await;
    background.stop().await;
    if let Some(telemetry) = telemetry {
        // Sends the spans still queued (bounded), off the runtime's one thread.
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    }
    result
}

/// The Postgres preconditions, failing on the first unmet one. A slot held by
/// another relay is not a failure: `run` stands by.
async fn preflight(cfg: &Config) -> Result<(), CliError> {
    let client = crate::sql::connect_for_command(cfg).await?;
    let tables = cfg.tables();
    let mapping = cfg.mapping();
    let checks = Preflight {
        slot: &cfg.postgres.slot,
        publication: &cfg.postgres.publication,
        tables: &tables,
        mapping: &mapping,
    };
    for result in checks.run(&client).await {
        if let CheckStatus::Failed(e) = result.status {
            return Err(e.into());
        }
    }
    crate::retention::preflight(cfg, &client).await
}

/// SIGHUP reloads the configuration (crate::reload), as `ctl reload` does.
fn spawn_reload_handler(reloader: Arc<Reloader>) -> Result<(), CliError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())
        .map_err(|e| CliError::Runtime(format!("cannot install signal handlers: {e}")))?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            info!("SIGHUP: reloading the configuration");
            // Reading files: off the runtime's one thread.
            let r = reloader.clone();
            let _ = tokio::task::spawn_blocking(move || r.reload()).await;
        }
    });
    Ok(())
}

/// SIGTERM or SIGINT asks for a clean stop; a second one exits at once.
fn spawn_signal_handler(stop: Shutdown) -> Result<(), CliError> {
    use tokio::signal::unix::{signal, SignalKind};
    let err = |e: std::io::Error| CliError::Runtime(format!("cannot install signal handlers: {e}"));
    let mut term = signal(SignalKind::terminate()).map_err(err)?;
    let mut int = signal(SignalKind::interrupt()).map_err(err)?;
    tokio::spawn(async move {
        let mut stopping = false;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            if stopping {
                warn!("second signal: exiting without waiting");
                std::process::exit(130);
            }
            stopping = true;
            info!("signal received: stopping at the next transaction boundary");
            stop.request();
        }
    });
    Ok(())
}
