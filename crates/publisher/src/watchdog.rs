//! The stall watchdog, the last line of defence of "no event waits silently"
//! (docs/reliability.md): if events wait and nothing is confirmed for
//! `stall_after`, the publisher says so. It reads only the status both publishing
//! loops keep ([`PublisherStatus`]: how many events wait, a progress count that moves
//! whenever one settles, the oldest waiting event, the broker's last answer), on
//! its own timer, so it fires whatever the loop is doing (waiting for a confirm,
//! backing off, waiting for an answer). It does not replace the handling of any
//! edge; it makes the next unknown one loud:
//!
//! - an ERROR line naming the oldest waiting event (message id, commit LSN,
//!   destination) and the broker's last answer, again every `stall_after` (at
//!   least a minute) while it lasts;
//! - [`PublisherStatus::stalled`], which `/readyz` reports (503 with the reason);
//! - the gauge `outbox_relay_stalled_seconds`.

use std::convert::Infallible;
use std::time::Duration;

use tokio::time::Instant;

use crate::status::{PublisherStatus, Stall};

/// Default `[rabbitmq] stall_after`.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);

/// Watches `status` for ever (run it beside the publishing loop).
pub(crate) async fn watch(status: PublisherStatus, stall_after: Duration) -> Infallible {
    let stall_after = stall_after.max(Duration::from_millis(100));
    let tick = (stall_after / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut seen = status.progress();
    let mut quiet_since = Instant::now();
    let mut logged: Option<Instant> = None;
    loop {
        tokio::time::sleep(tick).await;
        let now = Instant::now();
        let progress = status.progress();
        if progress != seen || !status.waiting() {
            seen = progress;
            quiet_since = now;
            if logged.take().is_some() {
                tracing::info!("events are confirmed again; the stall is over");
            }
            if status.stalled().is_some() {
                status.set_stall(None);
            }
            continue;
        }
        let quiet = now.duration_since(quiet_since);
        if quiet < stall_after {
            continue;
        }
        let stall = Stall {
            quiet,
            oldest: status.oldest(),
            last_answer: status.last_answer(),
        };
        let again = stall_after.max(Duration::from_secs(60));
        if logged.is_none_or(|at| now.duration_since(at) >= again) {
            let oldest = stall.oldest.as_ref();
            tracing::error!(
                message_id = oldest.map(|w| w.message_id.as_str()),
                commit_lsn = oldest.map(|w| w.commit_lsn.to_string()),
                destination = oldest.map(|w| w.destination.as_str()),
                last_answer = stall.last_answer.as_deref(),
                quiet_secs = quiet.as_secs(),
                "events wait and nothing was confirmed for stall_after: {stall} (docs/operations.md, \"Broker edges\")"
            );
            logged = Some(now);
        }
        status.set_stall(Some(stall));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use outbox_event::Lsn;

    use super::*;
    use crate::status::{Describe, Waiting};

    #[derive(Debug)]
    struct Event;

    impl Describe for Event {
        fn waiting(&self) -> Waiting {
            Waiting {
                message_id: "m-1".into(),
                commit_lsn: Lsn(0x10),
                destination: "events.x".into(),
            }
        }
    }

    /// Nothing confirmed for `stall_after` while events wait: a stall that names the
    /// oldest event and the last answer; progress ends it; an empty window is never
    /// a stall.
    #[tokio::test(start_paused = true)]
    async fn a_stall_is_named_after_stall_after_and_ends_with_progress() {
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        let watch = tokio::spawn(watch(status.clone(), Duration::from_secs(60)));
        // Nothing waits: no stall however long.
        tokio::time::sleep(Duration::from_secs(300)).await;
        assert_eq!(status.stalled(), None);
        status.set_in_flight(3, 3, None);
        status.set_oldest(Some(Arc::new(Event)));
        status.set_last_answer("channel closed by the broker (404)");
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(status.stalled(), None, "named before stall_after");
        assert!(status.ready());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let stall = status.stalled().expect("a stall after stall_after");
        assert!(!status.ready());
        let text = stall.to_string();
        assert!(
            text.contains("m-1") && text.contains("0/10") && text.contains("events.x"),
            "{text}"
        );
        assert!(text.contains("(404)"), "{text}");
        status.add_progress();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(status.stalled(), None, "progress ends the stall");
        watch.abort();
    }
}
