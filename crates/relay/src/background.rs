//! Tasks that run beside the pipeline while `run` is up: the replay window's anchor
//! slot ([`crate::anchor`]), outbox retention ([`crate::retention`]) and slot metrics
//! ([`crate::slot_metrics`]). Each owns an ordinary SQL connection and stops when
//! `stop` turns true.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::error::CliError;
use crate::pipeline::Health;

/// Configuration checks of the background features, before anything starts.
pub fn validate(cfg: &Config) -> Result<(), CliError> {
    crate::anchor::validate(cfg)?;
    crate::retention::validate(cfg)?;
    Ok(())
}

/// Starts every configured background task.
pub fn spawn(cfg: &Config, health: &Health, stop: &watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    tasks.extend(crate::anchor::spawn(cfg, health, stop.clone()));
    tasks.extend(crate::retention::spawn(cfg, health, stop.clone()));
    tasks.extend(crate::slot_metrics::spawn(cfg, health, stop.clone()));
    tasks
}
