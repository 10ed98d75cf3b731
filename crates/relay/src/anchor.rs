//! The replay window's anchor slot (SPEC §7): not in this build yet.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::error::CliError;
use crate::pipeline::Health;

/// Refuses a configured replay window until the anchor slot is implemented.
pub fn validate(cfg: &Config) -> Result<(), CliError> {
    if cfg.replay_window().is_some() {
        return Err(CliError::Precondition(
            "[relay] replay_window is not supported by this build yet: set it to \"\"".into(),
        ));
    }
    Ok(())
}

/// Starts the task that advances the anchor slot (none without a window).
pub fn spawn(
    _cfg: &Config,
    _health: &Health,
    _stop: watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    None
}
