//! Failures and recovery, the other half of the publishing loop: when a failure
//! ends the channel (a nack first waits for the confirms before it), the report of
//! a message the broker refuses, and the recovery itself: close the channel, back
//! off ([`crate::backoff`]), open a fresh channel or reconnect through the URL list,
//! and rewind the engine so that everything unacked is published again.

use std::future::Future;
use std::time::Duration;

use lapin::ErrorKind;
use tokio::time::Instant;

use super::{Runner, CLOSE_TIMEOUT};
use crate::backoff;
use crate::connection::{connect_any, open_channel, Session};
use crate::engine::Failure;
use crate::error::redact_url;
use crate::status::{self, PoisonMessage};
use crate::wire::Wire;
use crate::PublishError;

/// The longest a nack waits for the confirms of earlier publishes before the
/// channel is closed ([`crate::engine::Engine::failure_ready`]).
const NACK_WAIT: Duration = Duration::from_secs(5);

/// How often a poison message is logged again while it holds the relay.
const POISON_LOG_EVERY: Duration = Duration::from_secs(60);

/// A failure episode: from the first failure until everything buffered then is
/// acked (one warning per episode, not per retry).
#[derive(Debug, Clone, Copy)]
pub(super) struct Episode {
    /// The episode ends once the window's front passes this sequence number.
    until_seq: u64,
    retries: u64,
}

/// Whether recovery succeeded or the shutdown deadline passed first.
pub(super) enum Recovered {
    Yes,
    DeadlinePassed,
    /// The broker's certificate refused on a reconnect: retrying cannot fix it and
    /// it may be a man in the middle (docs/security.md); the publisher stops with it.
    Refused(PublishError),
}

impl Runner {
    /// The failure that ends the channel now: at once, or for a nack once the
    /// publishes before it have settled, but no later than [`NACK_WAIT`].
    pub(super) fn take_failure(&mut self) -> Option<Failure> {
        if !self.engine.has_failed() {
            return None;
        }
        if let Some(failure) = self.engine.take_failure() {
            self.nack_wait = None;
            return Some(failure);
        }
        let until = *self
            .nack_wait
            .get_or_insert_with(|| Instant::now() + NACK_WAIT);
        if Instant::now() < until {
            return None;
        }
        tracing::debug!(wait = ?NACK_WAIT, "confirms before a nack did not all arrive; closing the channel");
        self.nack_wait = None;
        self.engine.force_failure()
    }

    pub(super) fn channel_failed(&mut self, failure: Failure) {
        self.engine.channel_failed(failure);
        self.report_poison();
    }

    /// Says loudly, once a minute, which message the broker refuses.
    fn report_poison(&mut self) {
        let Some(poison) = self.engine.poison().cloned() else {
            return;
        };
        let Some(message) = self.engine.message(poison.seq) else {
            return;
        };
        let message_id = message.message_id();
        let due = match self.poison_logged {
            Some((seq, at)) => seq != poison.seq || at.elapsed() >= POISON_LOG_EVERY,
            None => true,
        };
        if due {
            tracing::error!(
                %message_id,
                commit_lsn = %message.key().commit_lsn,
                tx_index = message.key().index,
                routing_key = message.routing_key.as_str(),
                reason = %poison.reason,
                "rabbitmq refuses this message; the relay holds the slot before it and retries (set dead_letter_exchange to move on, or see docs/recovery.md)"
            );
            self.poison_logged = Some((poison.seq, Instant::now()));
        }
        self.status.set_poison(Some(PoisonMessage {
            message_id,
            commit_lsn: message.key().commit_lsn,
            tx_index: message.key().index,
            routing_key: message.routing_key.to_string(),
            reason: poison.reason,
        }));
    }

    /// Ends the failure episode once everything buffered at its start is acked.
    pub(super) fn end_episode_if_over(&mut self) {
        if let Some(episode) = self.episode {
            if self.engine.window().front_seq() >= episode.until_seq {
                tracing::info!(retries = episode.retries, "publishing recovered");
                self.episode = None;
            }
        }
    }

    /// Closes the channel and waits for its close-ok (so nothing of it can still be
    /// routed), backs off, gets a fresh channel (reconnecting through the URL list
    /// when the connection is gone) and rewinds the engine. Every broker-side failure
    /// is retried: only the shutdown deadline ends this.
    pub(super) async fn recover(&mut self, failure: Failure) -> Recovered {
        let node = redact_url(&self.config.urls[self.session.url_index]);
        match &mut self.episode {
            None => {
                tracing::warn!(cause = %failure, %node, in_flight = self.engine.window().in_flight(),
                    "publish failed; republishing from the oldest unacked message, alone first (retrying with backoff)");
                self.episode = Some(Episode {
                    until_seq: self.engine.window().end_seq(),
                    retries: 1,
                });
            }
            Some(episode) => {
                episode.retries += 1;
                tracing::debug!(cause = %failure, "publish failed again");
            }
        }
        self.failures = self.failures.saturating_add(1);
        self.report.retries += 1;
        metrics::counter!(status::PUBLISH_RETRIES).increment(1);
        self.round_due = false;
        if self.wire.channel_open() {
            let closed = until_deadline(
                self.deadline,
                tokio::time::timeout(CLOSE_TIMEOUT, self.wire.close_channel()),
            )
            .await;
            match closed {
                None => return Recovered::DeadlinePassed,
                Some(Ok(Ok(()))) => {}
                // Without its close-ok the channel may still route what it took:
                // only a new connection is certain to start clean.
                Some(_) => self.wire.abandon(),
            }
        }
        let resent = self.engine.restart();
        tracing::debug!(resent, "window rewound");

        let mut attempt = self.failures;
        loop {
            if !self.sleep_backoff(attempt).await {
                return Recovered::DeadlinePassed;
            }
            attempt = attempt.saturating_add(1);
            if self.session.connection.status().connected() {
                let opened = until_deadline(
                    self.deadline,
                    open_channel(&self.session.connection, &self.config, &node),
                )
                .await;
                let Some(opened) = opened else {
                    return Recovered::DeadlinePassed;
                };
                match opened {
                    Ok(channel) => {
                        let old = std::mem::replace(&mut self.session.channel, channel);
                        tokio::spawn(async move {
                            let _ = tokio::time::timeout(
                                CLOSE_TIMEOUT,
                                old.close(200, "checked again".into()),
                            )
                            .await;
                        });
                        match self.renew_wire().await {
                            None => return Recovered::DeadlinePassed,
                            Some(Ok(())) => return Recovered::Yes,
                            Some(Err(e @ PublishError::TlsRefused { .. })) => {
                                return Recovered::Refused(e)
                            }
                            Some(Err(e)) if e.is_transient() => {
                                tracing::debug!(error = %e, "cannot open the publishing connection; retrying");
                                continue;
                            }
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "rabbitmq refused the publishing connection; retrying");
                                continue;
                            }
                        }
                    }
                    Err(e) if e.is_transient() => {
                        tracing::debug!(error = %e, "cannot open a channel; reconnecting");
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot open a channel; retrying"),
                }
            }
            self.status.set_connected(false);
            let next = (self.session.url_index + 1) % self.config.urls.len();
            let connected =
                until_deadline(self.deadline, connect_any(&self.config, &self.tls, next)).await;
            let Some(connected) = connected else {
                return Recovered::DeadlinePassed;
            };
            match connected {
                Ok(session) => {
                    let old = std::mem::replace(&mut self.session, session);
                    close_connection(old);
                    self.wire.abandon();
                    match self.renew_wire().await {
                        None => return Recovered::DeadlinePassed,
                        Some(Ok(())) => {}
                        Some(Err(e @ PublishError::TlsRefused { .. })) => {
                            return Recovered::Refused(e)
                        }
                        Some(Err(e)) => {
                            tracing::debug!(error = %e, "cannot open the publishing connection; retrying");
                            continue;
                        }
                    }
                    tracing::info!(node = %redact_url(&self.config.urls[self.session.url_index]),
                        "reconnected to rabbitmq");
                    self.status.set_connected(true);
                    return Recovered::Yes;
                }
                // The broker's certificate refused: only at start a configuration error,
                // mid-run a man in the middle or a rotation to an untrusted CA. (A local
                // file unreadable mid-run may be a secret being rotated: retried below.)
                Err(e @ PublishError::TlsRefused { .. }) => return Recovered::Refused(e),
                Err(e) if e.is_transient() => {
                    tracing::debug!(error = %e, "rabbitmq still unreachable");
                }
                // Mid-run a refused login or vhost is a broker still booting or an
                // operator change in progress: retry, loudly.
                Err(e) => tracing::warn!(error = %e, "rabbitmq refused the reconnect; retrying"),
            }
        }
    }

    /// A fresh confirm-mode channel to publish on: on the publishing connection
    /// while it lives, else on a new one to the session's node (a reconnect).
    /// `None` when the shutdown deadline passed first.
    async fn renew_wire(&mut self) -> Option<Result<(), PublishError>> {
        if self.wire.is_alive() {
            let opened = until_deadline(
                self.deadline,
                tokio::time::timeout(CLOSE_TIMEOUT * 5, self.wire.open_channel()),
            )
            .await?;
            match opened {
                Ok(Ok(())) => {
                    self.after_renew();
                    return Some(Ok(()));
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "cannot open a publishing channel; reconnecting it")
                }
                Err(_) => {
                    tracing::debug!("no answer to opening a publishing channel; reconnecting it")
                }
            }
            self.wire.abandon();
        }
        self.status.set_connected(false);
        let wire = until_deadline(
            self.deadline,
            Wire::connect(&self.config, &self.tls, self.session.url_index),
        )
        .await?;
        let wire = match wire {
            Ok(wire) => wire,
            Err(e) => return Some(Err(e)),
        };
        let mut old = std::mem::replace(&mut self.wire, Box::new(wire));
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, old.close()).await;
        });
        self.report.reconnects += 1;
        self.status.add_reconnect();
        self.status.set_connected(true);
        self.after_renew();
        Some(Ok(()))
    }

    fn after_renew(&mut self) {
        self.unconfirmed.reset();
        self.returns.clear();
        self.blocked = self.wire.blocked();
        self.status.set_blocked(self.blocked);
    }

    /// Sleeps the backoff for `attempt` (1-based); false when the shutdown
    /// deadline passes first.
    fn sleep_backoff(&self, attempt: u32) -> impl Future<Output = bool> + 'static {
        let delay = backoff::delay(
            self.config.backoff_initial,
            self.config.backoff_max,
            attempt,
        );
        sleep_unless_deadline(Instant::now() + delay, self.deadline)
    }
}

/// The engine's view of a lapin error: a channel the broker closed carries its
/// reply code (406 = it refused a message's content).
pub(super) fn failure_of(error: &lapin::Error) -> Failure {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => Failure::Channel {
            code: Some(amqp.get_id()),
            text: error.to_string(),
        },
        _ => Failure::Channel {
            code: None,
            text: error.to_string(),
        },
    }
}

fn close_connection(session: Session) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(
            CLOSE_TIMEOUT,
            session.connection.close(200, "reconnecting".into()),
        )
        .await;
    });
}

/// Runs `future` unless the deadline passes first (`None` then).
async fn until_deadline<F: Future>(deadline: Option<Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

async fn sleep_unless_deadline(wake: Instant, deadline: Option<Instant>) -> bool {
    match deadline {
        Some(deadline) if deadline <= wake => {
            tokio::time::sleep_until(deadline).await;
            false
        }
        _ => {
            tokio::time::sleep_until(wake).await;
            true
        }
    }
}
