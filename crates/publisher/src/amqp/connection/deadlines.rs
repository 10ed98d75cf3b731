//! The connection's deadlines: heartbeats out and in, and the confirm deadline
//! (`request_timeout`) of a broker alive but not answering. One timer serves all.

use std::future::Future;
use std::task::Context;

use amq_protocol::frame::AMQPFrame;
use tokio::time::Instant;

use super::{ConnError, Connection};

impl Connection {
    /// Sends a heartbeat when nothing was written for half the interval; fails when
    /// nothing was read for two, or when publishes wait for their confirms longer
    /// than `request_timeout` while the broker does not block the connection (a
    /// broker alive but not answering: its heartbeats alone would satisfy the read
    /// deadline); arms the timer for whichever comes first. While bytes wait for the
    /// socket (a broker that stopped reading), no heartbeat can go out before them:
    /// only the deadlines are armed, and the socket's readiness wakes the task.
    pub(super) fn poll_heartbeat(&mut self, cx: &mut Context<'_>) -> Result<(), ConnError> {
        for _ in 0..2 {
            let now = Instant::now();
            let mut wake: Option<Instant> = None;
            if self.unwritten() > 0 || std::mem::take(&mut self.answered) {
                // Publishes still on their way out (the broker cannot have
                // confirmed what it has not read; the socket's readiness wakes us),
                // or the broker answering: the deadline starts again.
                self.confirm_since = now;
            } else if self.tags.unconfirmed() > 0 && !self.blocked() && self.channel_open {
                let due = self.confirm_since + self.request_timeout;
                if now >= due {
                    return Err(ConnError::Io(format!(
                        "no confirm from the broker for {:?} (request_timeout) while {} publishes waited",
                        self.request_timeout,
                        self.tags.unconfirmed()
                    )));
                }
                wake = Some(due);
            }
            if let Some(interval) = self.heartbeat {
                let read_deadline = self.last_read + interval * 2;
                if now >= read_deadline {
                    return Err(ConnError::Io(format!(
                        "the broker sent nothing for {:?} (two heartbeat intervals)",
                        interval * 2
                    )));
                }
                let mut at = read_deadline;
                if self.unwritten() == 0 {
                    if now.duration_since(self.last_write) >= interval / 2 {
                        self.push_frame(&AMQPFrame::Heartbeat);
                        // Counts as written even if the socket did not take it yet.
                        self.last_write = now;
                        self.poll_write(cx)?;
                    }
                    if self.unwritten() == 0 {
                        at = at.min(self.last_write + interval / 2);
                    }
                }
                wake = Some(wake.map_or(at, |w| w.min(at)));
            }
            let Some(wake) = wake else {
                return Ok(());
            };
            self.timer.as_mut().reset(wake);
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
        Ok(())
    }
}
