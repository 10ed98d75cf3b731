//! The request to stop cleanly (SIGTERM/SIGINT, or the end of `run`), shared by
//! the session loop and the background tasks.
//!
//! Every clone sees the same request, which is made once and never withdrawn.
//! `WalReader::run` takes a raw `watch::Receiver<bool>`: a session gives it one of
//! its own and sets it when this request arrives (crate::pipeline), after logging.

use std::sync::Arc;

use tokio::sync::watch;

/// A clean-stop request, cheap to clone.
#[derive(Clone)]
pub struct Shutdown {
    /// Held by every clone, so that [`Shutdown::requested`] never sees the channel
    /// closed.
    tx: Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Shutdown {
    /// A request not yet made.
    pub fn new() -> Shutdown {
        let (tx, rx) = watch::channel(false);
        Shutdown {
            tx: Arc::new(tx),
            rx,
        }
    }

    /// Asks every holder to stop (idempotent).
    pub fn request(&self) {
        self.tx.send_replace(true);
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once a stop is requested (at once if it already was).
    pub async fn requested(&mut self) {
        // The sender lives as long as `self`: `wait_for` cannot fail.
        let _ = self.rx.wait_for(|stop| *stop).await;
    }
}

impl Default for Shutdown {
    fn default() -> Shutdown {
        Shutdown::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_clone_sees_the_request() {
        let a = Shutdown::new();
        let mut b = a.clone();
        assert!(!b.is_requested());
        a.request();
        b.requested().await;
        assert!(b.is_requested());
    }
}
