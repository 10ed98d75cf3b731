//! The two targets a session publishes to, behind one face: an exchange over AMQP
//! ([`publisher::Publisher`]) or a RabbitMQ stream over the stream protocol, exactly
//! once ([`publisher::stream::StreamPublisher`], docs/design.md §4). Both take the
//! reader's batches and publish the acked watermark the same way, so the session
//! loop does not know which one it drives.

use outbox_event::history::History;
use outbox_event::{Lsn, WalBatch};
use publisher::stream::{StreamConfig, StreamPublisher, StreamSource};
use publisher::{PublishError, Publisher, PublisherConfig, PublisherReport, PublisherStatus};
use tokio::sync::{mpsc, watch};
use wal_reader::StartInfo;

use crate::config::Config;

/// Where a session publishes.
#[derive(Debug, Clone)]
pub enum SinkConfig {
    /// `[rabbitmq] exchange` over AMQP with publisher confirms.
    Exchange(PublisherConfig),
    /// `[rabbitmq] stream` over the stream protocol.
    Stream {
        config: StreamConfig,
        /// `[rabbitmq] producer_name`; `None`: derived from the source.
        producer_name: Option<String>,
    },
}

impl SinkConfig {
    /// The target `run` publishes to: the stream when `rabbitmq.stream` is set, else
    /// the exchange.
    pub fn of(cfg: &Config) -> SinkConfig {
        match cfg.stream() {
            Some(_) => SinkConfig::Stream {
                config: cfg.stream_config(),
                producer_name: cfg.producer_name().map(str::to_string),
            },
            None => SinkConfig::Exchange(cfg.publisher_config()),
        }
    }

    /// `exchange X` or `stream X`, for logs.
    pub fn target(&self) -> String {
        match self {
            SinkConfig::Exchange(p) => format!("exchange {}", p.exchange),
            SinkConfig::Stream { config, .. } => format!("stream {}", config.stream),
        }
    }
}

/// The stream producers' source for a session that started as `info` says, on
/// `slot` (docs/design.md §4): the producer reference is `producer_name`, or derived
/// from the server's system identifier, the database and the slot.
pub fn stream_source(producer_name: Option<&str>, slot: &str, info: &StartInfo) -> StreamSource {
    stream_source_of(
        producer_name,
        slot,
        &info.database,
        &info.history,
        info.server_wal,
    )
}

/// [`stream_source`] from its parts (`status`, `check`).
pub fn stream_source_of(
    producer_name: Option<&str>,
    slot: &str,
    database: &str,
    history: &History,
    server_wal: Lsn,
) -> StreamSource {
    let system_id = history.system_id;
    StreamSource {
        reference: producer_name
            .map(str::to_string)
            .unwrap_or_else(|| StreamSource::derived_reference(system_id, database, slot)),
        source: format!("{system_id}/{database}/{slot}"),
        history: history.clone(),
        server_wal,
    }
}

/// A connected publisher of either kind.
pub enum Sink {
    Exchange(Publisher),
    Stream(StreamPublisher),
}

impl Sink {
    /// Connects (declaring the exchange or stream when configured). A stream sink
    /// publishes as `source` (`None`: unnamed, for replay).
    pub async fn connect(
        cfg: &SinkConfig,
        source: Option<StreamSource>,
    ) -> Result<Sink, PublishError> {
        Ok(match cfg {
            SinkConfig::Exchange(p) => Sink::Exchange(Publisher::connect(p.clone()).await?),
            SinkConfig::Stream { config, .. } => {
                let mut config = config.clone();
                config.source = source;
                Sink::Stream(StreamPublisher::connect(config).await?)
            }
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
    /// (each counted in flight until `flushed` passes it; `None`: no Postgres
    /// feedback, `replay`).
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<PublisherReport, PublishError> {
        match self {
            Sink::Exchange(p) => p.run(input, watermark, flushed).await,
            Sink::Stream(s) => s.run(input, watermark, flushed).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_is_the_stream_when_one_is_named() {
        let d = Config::default();
        assert!(matches!(SinkConfig::of(&d), SinkConfig::Exchange(_)));
        let mut c = Config::default();
        c.rabbitmq.stream = "orders".into();
        assert!(matches!(
            SinkConfig::of(&c),
            SinkConfig::Stream {
                producer_name: None,
                ..
            }
        ));
        c.rabbitmq.producer_name = "orders-db".into();
        assert!(matches!(
            SinkConfig::of(&c),
            SinkConfig::Stream {
                producer_name: Some(ref n),
                ..
            } if n == "orders-db"
        ));
    }
}
