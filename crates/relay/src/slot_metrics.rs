//! Slot gauges (retained WAL bytes): not in this build yet.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::pipeline::Health;

/// Starts the task that samples the slot for metrics.
pub fn spawn(
    _cfg: &Config,
    _health: &Health,
    _stop: watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    None
}
