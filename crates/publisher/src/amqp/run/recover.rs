//! Failures and recovery, the other half of the publishing loop: when a failure
//! ends the channel (a nack first waits for the confirms before it), the report of
//! a message the broker refuses or AMQP cannot carry, and the recovery itself, in
//! its steps: close the channel, back off ([`crate::backoff`]), declare again and
//! open a fresh channel on the connection, or make a new connection through the
//! URL list, and rewind the engine so that everything unacked is published again.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::{Runner, CLOSE_TIMEOUT};
use crate::amqp::engine::{Failure, Outgoing};
use crate::amqp::session::connect_any;
use crate::amqp::topology::declare_all;
use crate::backoff;
use crate::error::redact_url;
use crate::status::{self, PoisonMessage};
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

    /// A message AMQP cannot carry (`Connection::publish` refused to frame it): an
    /// error line naming it, and the poison report when it holds the relay.
    pub(super) fn report_unfit(&mut self, send: &Outgoing, reason: &str) {
        let seq = match send {
            Outgoing::Main { seq } | Outgoing::DeadLetter { seq, .. } => *seq,
        };
        let mut malformed = false;
        if let Some(message) = self.engine.message(seq) {
            let diverted = self.engine.poison().is_none_or(|p| p.seq != seq);
            malformed = message.event.malformed.is_some();
            tracing::error!(
                message_id = %message.message_id(),
                commit_lsn = %message.key().commit_lsn,
                tx_index = message.key().index,
                routing_key = message.routing_key.as_str(),
                reason = %outbox_event::redact::printable(reason),
                "{}; {}",
                if malformed {
                    "this logical message's content is malformed"
                } else {
                    "this message cannot be sent over AMQP"
                },
                if diverted {
                    "a notice of it went to the dead-letter exchange instead"
                } else {
                    "the relay holds the slot before it (skip it with `outbox-relay slot skip`, or set dead_letter_exchange; docs/recovery.md)"
                }
            );
        }
        if !malformed {
            metrics::counter!(status::EVENTS_UNFIT).increment(1);
        }
        if self.engine.poison().is_some_and(|p| p.seq == seq) {
            // Named above: the report without a second line.
            self.poison_logged = Some((seq, Instant::now()));
            self.report_poison();
        }
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

    /// Recovers from `failure`: [`Runner::begin_recovery`], then back off and
    /// [`Runner::renew`] until a channel is open. Every broker-side failure is
    /// retried: only the shutdown deadline or a refused certificate ends this.
    pub(super) async fn recover(
        &mut self,
        failure: Failure,
        input: &tokio::sync::mpsc::Receiver<outbox_event::WalBatch>,
    ) -> Recovered {
        if !self.begin_recovery(failure).await {
            return Recovered::DeadlinePassed;
        }
        let mut attempt = self.failures;
        loop {
            // What waits for the publisher, for the watchdog (batches the reader
            // queued while the broker is away wait too).
            self.status.set_queued(!input.is_empty());
            if !self.sleep_backoff(attempt).await {
                return Recovered::DeadlinePassed;
            }
            attempt = attempt.saturating_add(1);
            match until_deadline(self.deadline, self.renew()).await {
                None => return Recovered::DeadlinePassed,
                Some(Ok(())) => {
                    self.blocked = self.conn.blocked();
                    self.status.set_blocked(self.blocked);
                    return Recovered::Yes;
                }
                // The broker's certificate refused: only at start a configuration
                // error, mid-run a man in the middle or a rotation to an untrusted CA.
                // (A local file unreadable mid-run may be a secret being rotated.)
                Some(Err(e @ PublishError::TlsRefused { .. })) => return Recovered::Refused(e),
                Some(Err(e)) => self.report_renew_failure(&e, attempt),
            }
        }
    }

    /// The first step: the episode and the counters, the channel closed (its
    /// close-ok awaited, so nothing of it can still be routed; without one the
    /// connection is given up, since only a new one is certain to start clean),
    /// and the engine rewound. False when the shutdown deadline passed.
    async fn begin_recovery(&mut self, failure: Failure) -> bool {
        let node = redact_url(&self.config.urls[self.conn.node]);
        self.status.set_last_answer(failure.to_string());
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
        // A message sent alone and refused again (returned with no dead-letter
        // exchange) is named while it is retried.
        self.report_poison();
        self.failures = self.failures.saturating_add(1);
        self.report.retries += 1;
        metrics::counter!(status::PUBLISH_RETRIES).increment(1);
        if self.conn.channel_open() {
            let closed = until_deadline(
                self.deadline,
                tokio::time::timeout(CLOSE_TIMEOUT, self.conn.close_channel()),
            )
            .await;
            match closed {
                None => return false,
                Some(Ok(Ok(()))) => {}
                Some(_) => self.conn.abandon(),
            }
        } else if !self.conn.is_alive() {
            // Closes the socket of a connection that ended (no slot held meanwhile).
            self.conn.abandon();
        }
        let resent = self.engine.restart();
        tracing::debug!(resent, "window rewound");
        true
    }

    /// A fresh channel to publish on: declared again and opened on the connection
    /// while it lives, else on a new connection through the URL list (a reconnect).
    async fn renew(&mut self) -> Result<(), PublishError> {
        if self.conn.is_alive() {
            match self.reopen_channel().await {
                Ok(()) => return Ok(()),
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot open a channel; reconnecting");
                    self.conn.abandon();
                }
            }
        }
        self.reconnect().await
    }

    /// Declares again (with `[topology]` when it is declared: its exchanges keep
    /// their arguments) and opens the next channel on the live connection.
    async fn reopen_channel(&mut self) -> Result<(), PublishError> {
        declare_all(&mut self.conn, &self.config).await?;
        // Every request has the connection's deadline (`request_timeout`).
        self.conn
            .open_channel()
            .await
            .map_err(|e| self.outage(e.to_string()))
    }

    /// A new connection (the next node first) with its channel; counted as a
    /// reconnect.
    async fn reconnect(&mut self) -> Result<(), PublishError> {
        self.status.set_connected(false);
        let next = (self.conn.node + 1) % self.config.urls.len();
        let mut conn = connect_any(&self.config, &self.tls, next).await?;
        if let Err(e) = conn.open_channel().await {
            conn.abandon();
            return Err(PublishError::Unreachable {
                url: redact_url(&self.config.urls[conn.node]),
                reason: e.to_string(),
            });
        }
        let mut old = std::mem::replace(&mut self.conn, Box::new(conn));
        old.abandon();
        // Another node, perhaps another broker: exchanges named per event are
        // declared again as they come (refused ones stay poison until a restart).
        self.destinations.reconnected();
        self.renew_logged = None;
        tracing::info!(node = %redact_url(&self.config.urls[self.conn.node]), "reconnected to rabbitmq");
        self.report.reconnects += 1;
        self.status.add_reconnect();
        self.status.set_connected(true);
        Ok(())
    }

    /// Says why a reconnect failed: the user's connection limit (530) at ERROR at
    /// once, since only an operator frees a connection; a refused login, vhost or
    /// declaration (a broker still booting, or an operator change in progress) at
    /// WARN; an unreachable node at WARN from the third attempt on (a restart takes
    /// a few). Each is the broker's last answer for a stall to name.
    fn report_renew_failure(&mut self, e: &PublishError, attempt: u32) {
        self.status.set_last_answer(e.to_string());
        let first = self.renew_logged.as_deref() != Some(&e.to_string());
        match e {
            PublishError::ConnectionLimit { .. } if first => tracing::error!(error = %e,
                "rabbitmq refused the connection: the user's connection limit is reached (rabbitmqctl set_user_limits, or close other connections); retrying"),
            _ if !e.is_transient() && first => {
                tracing::warn!(error = %e, "rabbitmq refused the reconnect; retrying")
            }
            _ if e.is_transient() && first && attempt >= 3 => {
                tracing::warn!(error = %e, "rabbitmq still unreachable; retrying")
            }
            _ => {
                tracing::debug!(error = %e, "rabbitmq still unreachable");
                return;
            }
        }
        self.renew_logged = Some(e.to_string());
    }

    fn outage(&self, reason: String) -> PublishError {
        PublishError::Unreachable {
            url: redact_url(&self.config.urls[self.conn.node]),
            reason,
        }
    }

    /// Sleeps the backoff for `attempt` (1-based); false when the shutdown
    /// deadline passes first. A connection that lives is driven meanwhile: its
    /// heartbeats go out (a backoff longer than two heartbeat intervals would
    /// otherwise make the broker close it) and its notices are taken.
    async fn sleep_backoff(&mut self, attempt: u32) -> bool {
        let delay = backoff::delay(
            self.config.backoff_initial,
            self.config.backoff_max,
            attempt,
        );
        let sleep = sleep_unless_deadline(Instant::now() + delay, self.deadline);
        tokio::pin!(sleep);
        loop {
            if !self.conn.is_alive() {
                return sleep.await;
            }
            let conn = &mut self.conn;
            tokio::select! {
                biased;
                woke = &mut sleep => return woke,
                io = std::future::poll_fn(|cx| conn.poll_io(cx)) => match io {
                    Ok(events) => self.on_backoff_events(events),
                    Err(e) => {
                        self.status.set_last_answer(e.to_string());
                        tracing::debug!(error = %e, "the connection ended during the backoff");
                    }
                },
            }
        }
    }

    /// What a connection said during a backoff: only its blocked state matters (the
    /// channel's confirms belong to publishes already rewound).
    fn on_backoff_events(&mut self, events: Vec<crate::amqp::connection::Event>) {
        use crate::amqp::connection::Event;
        for event in events {
            match event {
                Event::Blocked(reason) => {
                    self.status
                        .set_last_answer(format!("connection.blocked ({reason})"));
                    self.blocked = true;
                    self.status.set_blocked(true);
                }
                Event::Unblocked => {
                    self.blocked = false;
                    self.status.set_blocked(false);
                }
                _ => {}
            }
        }
    }
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
