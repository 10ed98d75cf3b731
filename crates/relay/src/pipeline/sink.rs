//! The two targets a session publishes to, behind one face: an exchange over AMQP
//! ([`publisher::Publisher`]) or a RabbitMQ stream over the stream protocol, exactly
//! once ([`publisher::stream::StreamPublisher`], docs/design.md §4). Both take the
//! reader's batches and publish the acked watermark the same way, so the session
//! loop does not know which one it drives.

use outbox_event::{Lsn, WalBatch};
use publisher::stream::{StreamConfig, StreamPublisher};
use publisher::{PublishError, Publisher, PublisherConfig, PublisherReport, PublisherStatus};
use tokio::sync::{mpsc, watch};

/// The producer reference of the relay that owns `slot`. Derived from the slot name
/// alone, so a restarted relay and a standby that takes the slot over publish under
/// the same producer and continue its publishing ids (docs/design.md §4).
pub fn producer_reference(slot: &str) -> String {
    format!("outbox-relay:{slot}")
}

/// Where a session publishes.
#[derive(Debug, Clone)]
pub enum SinkConfig {
    /// `[rabbitmq] exchange` over AMQP with publisher confirms.
    Exchange(PublisherConfig),
    /// `[rabbitmq] stream` over the stream protocol.
    Stream(StreamConfig),
}

impl SinkConfig {
    /// `rabbitmq.max_in_flight`.
    pub fn max_in_flight(&self) -> usize {
        match self {
            SinkConfig::Exchange(p) => p.max_in_flight,
            SinkConfig::Stream(s) => s.max_in_flight,
        }
    }

    /// `exchange X` or `stream X`, for logs.
    pub fn target(&self) -> String {
        match self {
            SinkConfig::Exchange(p) => format!("exchange {}", p.exchange),
            SinkConfig::Stream(s) => format!("stream {}", s.stream),
        }
    }
}

/// A connected publisher of either kind.
pub enum Sink {
    Exchange(Publisher),
    Stream(StreamPublisher),
}

impl Sink {
    /// Connects (declaring the exchange or stream when configured).
    pub async fn connect(cfg: &SinkConfig) -> Result<Sink, PublishError> {
        Ok(match cfg {
            SinkConfig::Exchange(p) => Sink::Exchange(Publisher::connect(p.clone()).await?),
            SinkConfig::Stream(s) => Sink::Stream(StreamPublisher::connect(s.clone()).await?),
        })
    }

    /// The live status behind `/readyz`, `status` and the metrics.
    pub fn status(&self) -> PublisherStatus {
        match self {
            Sink::Exchange(p) => p.status(),
            Sink::Stream(s) => s.status(),
        }
    }

    /// Publishes until `input` ends, moving `watermark` only past confirmed events
    /// (each counted in flight until `flushed` passes it).
    pub async fn run_with_flushed(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: watch::Receiver<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        match self {
            Sink::Exchange(p) => p.run_with_flushed(input, watermark, flushed).await,
            Sink::Stream(s) => s.run_with_flushed(input, watermark, flushed).await,
        }
    }

    /// Publishes until `input` ends (no Postgres feedback: `replay`).
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        match self {
            Sink::Exchange(p) => p.run(input, watermark).await,
            Sink::Stream(s) => s.run(input, watermark).await,
        }
    }
}
