//! What the relay tells the publisher crate's one target abstraction
//! ([`publisher::Target`]): which target the configuration names
//! ([`target_config`]), and the stream producers' source for a session
//! ([`stream_source`]).

use outbox_event::history::History;
use outbox_event::Lsn;
use publisher::stream::StreamSource;
use publisher::TargetConfig;
use wal_reader::StartInfo;

use crate::config::Config;

/// The target `run` publishes to: the stream when `rabbitmq.stream` is set, else the
/// exchange.
pub fn target_config(cfg: &Config) -> TargetConfig {
    match cfg.stream() {
        Some(_) => TargetConfig::Stream {
            config: cfg.stream_config(),
            producer_name: cfg.producer_name().map(str::to_string),
        },
        None => TargetConfig::Exchange(cfg.publisher_config()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_is_the_stream_when_one_is_named() {
        let d = Config::default();
        assert!(matches!(target_config(&d), TargetConfig::Exchange(_)));
        let mut c = Config::default();
        c.rabbitmq.stream = "orders".into();
        assert!(matches!(
            target_config(&c),
            TargetConfig::Stream {
                producer_name: None,
                ..
            }
        ));
        c.rabbitmq.producer_name = "orders-db".into();
        assert!(matches!(
            target_config(&c),
            TargetConfig::Stream {
                producer_name: Some(ref n),
                ..
            } if n == "orders-db"
        ));
    }
}
