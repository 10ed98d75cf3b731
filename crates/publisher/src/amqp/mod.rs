//! The exchange target: publishing to a RabbitMQ exchange over AMQP 0-9-1 with
//! publisher confirms, on the relay's own client (docs/design.md §4).
//!
//! # Dataflow
//!
//! ```text
//!  wal-reader ──mpsc<WalBatch>──▶ Publisher::run (one task owns the connection)
//!                                   │ Event  → MessageBuilder → Window (buffer)
//!                                   │ Commit / Keepalive → mark in the Window
//!                                   ▼
//!              Connection::publish: basic.publish frames into one write buffer
//!                                   ▼
//!              Connection::poll_io: writes; reads confirms (one per tag),
//!                                   returns, closes, in arrival order
//!                                   ▼
//!              Engine::confirmed → Window::ack → watermark ──watch<Lsn>──▶ relay
//! ```
//!
//! One connection per lane (`connection/`), owned by the task running
//! [`Publisher::run`]: the control channel declares and checks the exchanges, the
//! publishing channel is in confirm mode. Publishing is pipelined: up to
//! `max_in_flight` messages are published and unconfirmed at once, their confirms
//! are read as they come while publishing continues; there is no per-message round
//! trip to the broker.
//!
//! # Failures
//!
//! A nack, an unroutable return (without a dead-letter exchange), a channel error
//! or a lost connection all end the same way: the channel is closed, and after an
//! exponential backoff with jitter everything still buffered is published again
//! from the oldest unacked message, in the original order, on a fresh channel (on
//! a new connection through the URL list when the connection is gone). The buffer
//! is kept in memory rather than restarting the replication stream because it is
//! already bounded by the window and a retry then costs no Postgres round trip and
//! cannot skip anything; the reader never learns about broker hiccups. One warning
//! is logged per failure episode (not per message), and counters record every retry.
//!
//! Unroutable messages with a dead-letter exchange configured are republished there
//! with `x-outbox-error`, `x-original-exchange` and `x-original-routing-key` headers,
//! and count as done only once that publish is acked. A message AMQP cannot carry
//! (its content header over the frame size) is poison: never sent, named, and
//! diverted to the dead-letter exchange or held for `slot skip`.
//!
//! When the broker blocks the connection (`connection.blocked`, a resource alarm),
//! publishing stops, the watermark holds, and [`PublisherStatus::blocked`] is set
//! until `connection.unblocked`.

pub mod config;
pub(crate) mod connection;
pub(crate) mod destinations;
pub(crate) mod engine;
pub mod lanes;
pub mod message;
mod run;
pub(crate) mod session;
#[cfg(test)]
mod sim;
pub(crate) mod topology;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

pub(crate) use crate::tls::Tls;

use crate::amqp::config::PublisherConfig;
use crate::error::{redact_url, PublishError};
use crate::report::PublisherReport;
use crate::status::PublisherStatus;

/// A connected publisher; see the module docs.
pub struct Publisher {
    config: PublisherConfig,
    tls: Tls,
    conn: Box<connection::Connection>,
    status: PublisherStatus,
}

impl Publisher {
    /// Connects to the first reachable URL, declares the exchange if asked (checks
    /// it and the dead-letter exchange otherwise) and opens the confirm-mode
    /// channel. Login, vhost and exchange problems are definite errors; an
    /// unreachable broker is transient ([`PublishError::is_transient`]).
    pub async fn connect(config: PublisherConfig) -> Result<Publisher, PublishError> {
        config.validate()?;
        let tls = config.tls()?;
        let mut conn = session::connect_any(&config, &tls, 0).await?;
        if let Err(e) = conn.open_channel().await {
            conn.abandon();
            return Err(PublishError::Unreachable {
                url: redact_url(&config.urls[conn.node]),
                reason: e.to_string(),
            });
        }
        tracing::info!(
            node = %redact_url(&config.urls[conn.node]),
            exchange = %config.exchange,
            "connected to rabbitmq"
        );
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        Ok(Publisher {
            config,
            tls,
            conn: Box::new(conn),
            status,
        })
    }

    /// Closes the connection politely (`connection.close`, its close-ok awaited at
    /// most 2 s), without publishing: for `check --declare`.
    pub async fn close(mut self) {
        let closing = tokio::time::timeout(std::time::Duration::from_secs(2), self.conn.close());
        if closing.await.is_err() {
            self.conn.abandon();
        }
    }

    /// A handle on the publisher's live state (for `/readyz` and metrics).
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }

    /// Consumes batches until `input` closes, publishing every event in order and
    /// advancing `watermark` as acks arrive. Reconnects and retries by itself on
    /// nacks, returns, channel errors and connection loss. Returns once the input
    /// is closed and everything received is acked, or when
    /// [`PublisherConfig::shutdown_timeout`] has passed since the input closed (then
    /// [`PublisherReport::abandoned`] counts what was not acked). Errors only on a
    /// definite problem found while reconnecting (a refused certificate).
    ///
    /// The watermark starts at the `watch`'s current value (the position the relay
    /// resumes from) and is only sent when it advances.
    ///
    /// `flushed` carries the positions actually sent to Postgres as flushed (the
    /// reader's status updates): a message counts against `max_in_flight` until a
    /// position past it has been sent, which is what bounds the duplicates after a
    /// crash (docs/design.md §1). Without it (`None`: `replay`, tools) the watermark
    /// itself counts as sent.
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<PublisherReport, PublishError> {
        let (status, stall_after) = (self.status.clone(), self.config.stall_after);
        let run = run::Runner::new(self, watermark, flushed)?.run(input);
        crate::watchdog::alongside(status, stall_after, run).await
    }
}
