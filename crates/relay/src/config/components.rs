//! What each component needs, from the configuration: the Postgres connection
//! options, the reader's and the publisher's configurations.

use publisher::PublisherConfig;
use wal_reader::conninfo::ConnInfoError;
use wal_reader::{Lsn, PgConnectOptions, ReaderConfig};

use super::Config;

impl Config {
    /// The parsed `[postgres] url` (a parse error names the key, never the password).
    pub fn pg_options(&self) -> Result<PgConnectOptions, ConnInfoError> {
        PgConnectOptions::parse(self.postgres_url_exposed())
    }

    /// What the reader needs; `start_lsn` is `run --start-lsn`.
    pub fn reader_config(&self, start_lsn: Option<Lsn>) -> Result<ReaderConfig, ConnInfoError> {
        Ok(ReaderConfig {
            conn: self.pg_options()?,
            slot: self.postgres.slot.clone(),
            publication: self.postgres.publication.clone(),
            tables: self.tables(),
            mapping: self.mapping(),
            start_lsn,
            status_interval: self.status_interval(),
            hold_events: self.rabbitmq.max_in_flight,
        })
    }

    /// What the publisher needs.
    pub fn publisher_config(&self) -> PublisherConfig {
        let urls = self.expose_amqp_urls();
        let mut p = PublisherConfig::new(
            urls.first().cloned().unwrap_or_default(),
            &self.rabbitmq.exchange,
        );
        p.urls = urls;
        p.ca_file = self.ca_file().map(|p| p.to_path_buf());
        p.exchange_type = self.rabbitmq.exchange_type.as_str().to_string();
        p.declare_exchange = self.rabbitmq.declare_exchange;
        p.routing_key = self.rabbitmq.routing_key.clone();
        p.max_in_flight = self.rabbitmq.max_in_flight;
        p.dead_letter_exchange = self.dead_letter_exchange().map(str::to_string);
        p.shutdown_timeout = self.shutdown_timeout();
        p.connection_name = format!("outbox-relay {}", self.postgres.slot);
        p
    }
}
