//! When a silent stream connection counts as dead (docs/design.md §4, "Exactly once
//! into a stream", *A silent broker*).
//!
//! The stream client sends heartbeats but gives up on a broker that sends nothing late
//! or never (rabbitmq-stream-client 0.11 after four heartbeat intervals, 0.4 never): it
//! consumes the broker's heartbeats itself and keeps the time of the last one to itself. So the publisher watches what it can
//! see — every confirm, refusal or answer on the connection — and, while it waits
//! for confirms, asks for the stream's metadata once the connection has been silent
//! for one heartbeat interval (a live broker answers at once, as it would send a
//! heartbeat). Silent for two intervals with confirms outstanding: the connection is
//! dead and the publisher reconnects to another node, as the AMQP client does
//! after two missed heartbeats. Pure bookkeeping: `run.rs` sends the probe and acts.

use std::time::Duration;

use tokio::time::Instant;

/// What the run loop does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Due {
    /// Ask the broker something (the answer counts as heard).
    Probe,
    /// Silent for two intervals while waiting for confirms: give the connection up.
    Dead(Duration),
}

pub(super) struct Liveness {
    interval: Duration,
    /// Start of the current silence while confirms are outstanding; `None` when
    /// nothing is awaited.
    since: Option<Instant>,
    probed: bool,
}

impl Liveness {
    pub(super) fn new(interval: Duration) -> Liveness {
        Liveness {
            interval: interval.max(Duration::from_millis(100)),
            since: None,
            probed: false,
        }
    }

    /// How long a silence may last with confirms outstanding.
    pub(super) fn limit(&self) -> Duration {
        self.interval * 2
    }

    /// Something arrived from the broker.
    pub(super) fn heard(&mut self, now: Instant) {
        if self.since.is_some() {
            self.since = Some(now);
        }
        self.probed = false;
    }

    /// Whether confirms are outstanding now. A silence counts only from the moment
    /// they are: an idle connection is not suspect.
    pub(super) fn waiting(&mut self, waiting: bool, now: Instant) {
        match (waiting, self.since) {
            (true, None) => {
                self.since = Some(now);
                self.probed = false;
            }
            (false, Some(_)) => self.since = None,
            _ => {}
        }
    }

    /// A new connection: nothing heard on it yet, nothing awaited.
    pub(super) fn reset(&mut self) {
        self.since = None;
        self.probed = false;
    }

    /// When [`Liveness::due`] has something to say next (`None`: never).
    pub(super) fn wake(&self) -> Option<Instant> {
        let since = self.since?;
        Some(if self.probed {
            since + self.limit()
        } else {
            since + self.interval
        })
    }

    /// What is due at `now`.
    pub(super) fn due(&mut self, now: Instant) -> Option<Due> {
        let since = self.since?;
        let silent = now.saturating_duration_since(since);
        if silent >= self.limit() {
            Some(Due::Dead(silent))
        } else if silent >= self.interval && !self.probed {
            self.probed = true;
            Some(Due::Probe)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_silent_broker_is_probed_after_one_interval_and_dead_after_two() {
        let t0 = Instant::now();
        let mut l = Liveness::new(2 * S);
        l.waiting(true, t0);
        assert_eq!(l.wake(), Some(t0 + 2 * S));
        assert_eq!(l.due(t0 + S), None);
        assert_eq!(l.due(t0 + 2 * S), Some(Due::Probe));
        assert_eq!(l.due(t0 + 3 * S), None, "one probe per silence");
        assert_eq!(l.wake(), Some(t0 + 4 * S));
        assert_eq!(l.due(t0 + 4 * S), Some(Due::Dead(4 * S)));
    }

    #[test]
    fn anything_heard_starts_the_silence_again() {
        let t0 = Instant::now();
        let mut l = Liveness::new(2 * S);
        l.waiting(true, t0);
        assert_eq!(l.due(t0 + 2 * S), Some(Due::Probe));
        // The probe's answer (or a confirm) arrives.
        l.heard(t0 + 3 * S);
        assert_eq!(l.due(t0 + 4 * S), None);
        assert_eq!(l.wake(), Some(t0 + 5 * S));
        assert_eq!(l.due(t0 + 5 * S), Some(Due::Probe));
        assert_eq!(l.due(t0 + 7 * S), Some(Due::Dead(4 * S)));
    }

    #[test]
    fn an_idle_connection_is_never_suspect() {
        let t0 = Instant::now();
        let mut l = Liveness::new(2 * S);
        assert_eq!(l.wake(), None);
        assert_eq!(l.due(t0 + 100 * S), None);
        // Confirms awaited after a long idle time: the silence counts from now.
        l.waiting(true, t0 + 100 * S);
        assert_eq!(l.due(t0 + 101 * S), None);
        assert_eq!(l.due(t0 + 102 * S), Some(Due::Probe));
        // Everything confirmed: nothing to watch any more.
        l.waiting(false, t0 + 103 * S);
        assert_eq!((l.wake(), l.due(t0 + 200 * S)), (None, None));
        l.waiting(true, t0 + 200 * S);
        l.reset();
        assert_eq!(l.wake(), None, "a new connection starts unwatched");
    }
}
