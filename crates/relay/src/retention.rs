//! `[retention] keep` (SPEC §8): not in this build yet.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::error::CliError;
use crate::pipeline::Health;

/// Refuses a configured retention until it is implemented.
pub fn validate(cfg: &Config) -> Result<(), CliError> {
    if cfg.retention_keep().is_some() {
        return Err(CliError::Precondition(
            "[retention] keep is not supported by this build yet: set it to \"\" and delete old outbox rows with a scheduled job, or use the insert-then-delete pattern".into(),
        ));
    }
    Ok(())
}

/// Starts the retention task (none without `keep`).
pub fn spawn(
    _cfg: &Config,
    _health: &Health,
    _stop: watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    None
}
