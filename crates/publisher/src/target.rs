//! The two targets, behind one face: an exchange over AMQP ([`Publisher`]; with
//! `channels = N`, N of them as [`Lanes`]) or a RabbitMQ stream over the stream
//! protocol, exactly once ([`StreamPublisher`], docs/design.md §4). Both take the reader's batches and publish the acked
//! watermark the same way (`progress.rs`), so the relay's session loop does not know
//! which one it drives.

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

use crate::amqp::config::PublisherConfig;
use crate::error::PublishError;
use crate::lanes::Lanes;
use crate::report::PublisherReport;
use crate::status::PublisherStatus;
use crate::stream::{StreamConfig, StreamPublisher, StreamSource};
use crate::Publisher;

/// Where events are published.
#[derive(Debug, Clone)]
pub enum TargetConfig {
    /// An exchange over AMQP with publisher confirms.
    Exchange(PublisherConfig),
    /// A stream over the stream protocol.
    Stream {
        config: StreamConfig,
        /// The producer reference asked for (`[rabbitmq] producer_name`); `None`:
        /// derived from the source.
        producer_name: Option<String>,
    },
}

impl TargetConfig {
    /// `exchange X` or `stream X`, for logs.
    pub fn target(&self) -> String {
        match self {
            TargetConfig::Exchange(p) => format!("exchange {}", p.exchange),
            TargetConfig::Stream { config, .. } => format!("stream {}", config.stream),
        }
    }
}

/// A connected publisher of either kind.
// One value per process, never moved in a loop: boxing the larger variant would
// save nothing.
#[allow(clippy::large_enum_variant)]
pub enum Target {
    Exchange(Publisher),
    /// The exchange on N channels, each aggregate on one (`ordering = "aggregate"`).
    Lanes(Lanes),
    Stream(StreamPublisher),
}

impl Target {
    /// Connects (declaring the exchange or stream when configured). A stream target
    /// publishes as `source` (`None`: unnamed, for replay).
    pub async fn connect(
        cfg: &TargetConfig,
        source: Option<StreamSource>,
    ) -> Result<Target, PublishError> {
        Ok(match cfg {
            TargetConfig::Exchange(p) if p.channels > 1 => {
                Target::Lanes(Lanes::connect(p.clone()).await?)
            }
            TargetConfig::Exchange(p) => Target::Exchange(Publisher::connect(p.clone()).await?),
            TargetConfig::Stream { config, .. } => {
                let mut config = config.clone();
                config.source = source;
                Target::Stream(StreamPublisher::connect(config).await?)
            }
        })
    }

    /// The live status behind `/readyz`, `status` and the metrics.
    pub fn status(&self) -> PublisherStatus {
        match self {
            Target::Exchange(p) => p.status(),
            Target::Lanes(l) => l.status(),
            Target::Stream(s) => s.status(),
        }
    }

    /// Publishes until `input` ends, moving `watermark` only past confirmed events
    /// (each counted in flight until `flushed` passes it; `None`: no Postgres
    /// feedback, `replay`): [`Publisher::run`].
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<PublisherReport, PublishError> {
        match self {
            Target::Exchange(p) => p.run(input, watermark, flushed).await,
            Target::Lanes(l) => l.run(input, watermark, flushed).await,
            Target::Stream(s) => s.run(input, watermark, flushed).await,
        }
    }
}
