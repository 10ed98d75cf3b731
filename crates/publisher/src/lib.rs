//! RabbitMQ publishing with publisher confirms, and the *acked watermark*.
//!
//! # Dataflow
//!
//! Inside this crate (the whole path of a row is docs/design.md §2):
//!
//! ```text
//!  wal-reader ──mpsc<WalBatch>──▶ Publisher::run (one task owns the connections)
//!                                   │ Event  → MessageBuilder → Window (buffer)
//!                                   │ Commit / Keepalive → mark in the Window
//!                                   ▼
//!              Wire::publish: basic.publish frames into one write buffer
//!                                   ▼
//!              Wire::poll_io: writes; reads acks, returns, closes in order
//!                                   ▼
//!              Engine::confirmed → Window::ack → watermark ──watch<Lsn>──▶ relay
//! ```
//!
//! Events come in as [`outbox_event`] types, ready to send (the reader has already
//! decoded the body and chosen the content type): this crate knows AMQP, not
//! Postgres, and does not depend on the reader.
//!
//! Two connections to one node, owned by the task running [`Publisher::run`]: the
//! session (lapin: login, exchange declarations) and the publishing connection
//! (`wire.rs`, our own client) with one confirm-mode channel. Publishing is
//! pipelined: up to `max_in_flight` messages are published and unconfirmed at once,
//! their confirms are read as they come while publishing continues; there is no
//! per-message round trip to the broker.
//!
//! # How progress is tracked
//!
//! [`window`] keeps every message and every commit / keepalive position in arrival
//! order until the watermark passes them. The watermark moves to a position once
//! every message before it is acked, never backwards, and the `watch` is only sent
//! when it advances.
//!
//! # Failures
//!
//! A nack, an unroutable return (without a dead-letter exchange), a channel error
//! or a lost connection all end the same way: the channel is dropped, and after an
//! exponential backoff with jitter everything still buffered is published again
//! from the oldest unacked message, in the original order, on a fresh channel (on
//! the next URL when the connection is gone). The buffer is kept in memory rather
//! than restarting the replication stream because it is already bounded by the
//! window and a retry then costs no Postgres round trip and cannot skip anything;
//! the reader never learns about broker hiccups. One warning is logged per failure
//! episode (not per message), and counters record every retry.
//!
//! Unroutable messages with a dead-letter exchange configured are republished there
//! with `x-outbox-error`, `x-original-exchange` and `x-original-routing-key` headers,
//! and count as done only once that publish is acked.
//!
//! One warning is logged when a failure episode begins and one info line when it
//! is over (everything buffered at its start is acked); retries in between are
//! debug lines. Unroutable messages are logged with their exchange and routing key.
//!
//! When the broker blocks the connection (`connection.blocked`, a resource alarm),
//! publishing stops, the watermark holds, and [`PublisherStatus::blocked`] is set
//! until `connection.unblocked`.

pub mod backoff;
mod config;
pub mod error;
pub mod message;
pub mod status;
pub mod stream;
pub mod window;

mod connection;
pub(crate) mod engine;
pub mod lanes;
pub mod probe;
mod progress;
mod report;
mod run;
pub mod settings;
#[cfg(test)]
mod sim;
mod target;
mod tls;
mod wire;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

pub use config::{
    check_channels, check_max_in_flight, PublisherConfig, DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX, DEFAULT_EXCHANGE_TYPE, DEFAULT_MAX_IN_FLIGHT, DEFAULT_SHUTDOWN_TIMEOUT,
};
pub use error::{redact_url, PublishError};
pub use report::PublisherReport;
pub use status::{PoisonMessage, PublisherStatus};
pub use target::{Target, TargetConfig};
pub use tls::ClientAuth;

/// A connected publisher; see the crate docs.
pub struct Publisher {
    config: PublisherConfig,
    tls: connection::Tls,
    session: connection::Session,
    wire: Box<wire::Wire>,
    status: PublisherStatus,
}

impl Publisher {
    /// Connects to the first reachable URL, opens one confirm-mode channel and
    /// declares the exchange if asked. Login, vhost and exchange problems are
    /// definite errors; an unreachable broker is transient
    /// ([`PublishError::is_transient`]).
    pub async fn connect(config: PublisherConfig) -> Result<Publisher, PublishError> {
        config.validate()?;
        let tls = config.tls()?;
        let session = connection::connect_any(&config, &tls, 0).await?;
        let wire = Box::new(wire::Wire::connect(&config, &tls, session.url_index).await?);
        tracing::info!(
            node = %redact_url(&config.urls[session.url_index]),
            exchange = %config.exchange,
            "connected to rabbitmq"
        );
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        Ok(Publisher {
            config,
            tls,
            session,
            wire,
            status,
        })
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
    /// definite problem found while reconnecting (login, vhost, exchange).
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
        run::Runner::new(self, watermark, flushed)?.run(input).await
    }
}
