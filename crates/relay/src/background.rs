//! Tasks that run beside the pipeline while `run` is up: the replay window's anchor
//! slot ([`crate::anchor`]), outbox retention ([`crate::retention`]) and slot metrics
//! ([`crate::slot_metrics`]). Each owns an ordinary SQL connection and stops at its
//! next await point between steps once a stop is requested; all three run the same
//! tick-and-reconnect loop, [`tick::every_tick`] (`background/tick.rs`).

use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::debug;

use crate::config::Config;
use crate::error::CliError;
use crate::shutdown::Shutdown;

pub(crate) mod tick;

/// Bound on the wait for the tasks to finish their current step after a stop
/// request (a retention DELETE is itself bounded by its 5 s lock timeout).
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Configuration checks of the background features, before anything starts.
pub fn validate(cfg: &Config) -> Result<(), CliError> {
    crate::anchor::validate(cfg)?;
    crate::retention::validate(cfg)?;
    Ok(())
}

/// The running background tasks.
pub struct Background {
    tasks: Vec<JoinHandle<()>>,
    shutdown: Shutdown,
}

/// Starts every configured background task; they stop when `shutdown` is requested.
pub fn spawn(cfg: &Config, shutdown: &Shutdown) -> Background {
    let mut tasks = Vec::new();
    tasks.extend(crate::anchor::spawn(cfg, shutdown.clone()));
    tasks.extend(crate::retention::spawn(cfg, shutdown.clone()));
    tasks.extend(crate::slot_metrics::spawn(cfg, shutdown.clone()));
    Background {
        tasks,
        shutdown: shutdown.clone(),
    }
}

impl Background {
    /// Requests a stop (the pipeline may have ended on an error without one) and
    /// waits for each task to finish its step, so that none is cut in the middle of
    /// a statement.
    pub async fn stop(self) {
        self.shutdown.request();
        let deadline = tokio::time::Instant::now() + STOP_WAIT;
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                // Stuck past the bound (a statement the server does not answer): the
                // process is exiting, and the server ends the statement with the
                // connection, so abort rather than hang.
                debug!("a background task did not stop in time; aborting it");
                task.abort();
            }
        }
    }
}
