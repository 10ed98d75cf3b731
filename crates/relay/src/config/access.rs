//! Typed access to the configuration: the accessors (values checked at load, so
//! they cannot fail), and what each component needs (the Postgres connection
//! options, the reader's and the publisher's configurations).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use outbox_event::Lsn;
use publisher::PublisherConfig;
use secrecy::ExposeSecret;
use wal_reader::conninfo::ConnInfoError;
use wal_reader::{ColumnMapping, PgConnectOptions, ReaderConfig, TableName};

use super::{redact_url, Config, HeaderProfileKind, MessageFormatKind};
use publisher::message::cloudevents::CloudEventsFormat;
use publisher::message::{HeaderProfile, MessageFormat};
use publisher::stream::StreamConfig;

impl Config {
    /// The Postgres URL or conninfo, password included. Do not log it.
    pub fn postgres_url_exposed(&self) -> &str {
        self.postgres.url.expose_secret()
    }

    /// The AMQP URLs in order, passwords included, with `heartbeat=N` added when
    /// `rabbitmq.heartbeat_secs` is set. Do not log them.
    pub fn expose_amqp_urls(&self) -> Vec<String> {
        let hb = self.rabbitmq.heartbeat_secs;
        self.rabbitmq
            .url
            .iter()
            .map(|u| {
                let u = u.expose_secret();
                if hb == 0 {
                    u.to_string()
                } else if u.contains('?') {
                    format!("{u}&heartbeat={hb}")
                } else {
                    format!("{u}?heartbeat={hb}")
                }
            })
            .collect()
    }

    /// The AMQP URLs with passwords replaced by `***`, for logs.
    pub fn amqp_urls_redacted(&self) -> Vec<String> {
        self.rabbitmq
            .url
            .iter()
            .map(|u| redact_url(u.expose_secret()))
            .collect()
    }

    /// The column mapping for the reader: `headers = ""` and `correlation_id = ""`
    /// mean no such column ([`wal_reader::MappingConfig::columns`]).
    pub fn mapping(&self) -> ColumnMapping {
        self.mapping.columns()
    }

    /// The outbox tables (validated at load).
    pub fn tables(&self) -> Vec<TableName> {
        self.postgres
            .tables
            .iter()
            .filter_map(|t| TableName::parse(t))
            .collect()
    }

    /// `rabbitmq.dead_letter_exchange`, `None` when `""`.
    pub fn dead_letter_exchange(&self) -> Option<&str> {
        Some(self.rabbitmq.dead_letter_exchange.as_str()).filter(|s| !s.is_empty())
    }

    /// `rabbitmq.ca_file`, `None` when `""` (system roots).
    pub fn ca_file(&self) -> Option<&Path> {
        Some(self.rabbitmq.ca_file.as_str())
            .filter(|s| !s.is_empty())
            .map(Path::new)
    }

    /// `relay.status_interval_ms`.
    pub fn status_interval(&self) -> Duration {
        Duration::from_millis(self.relay.status_interval_ms)
    }

    /// `relay.shutdown_timeout_ms`.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.relay.shutdown_timeout_ms)
    }

    /// `relay.metrics_listen`, `None` when disabled.
    pub fn metrics_listen(&self) -> Option<SocketAddr> {
        self.relay.metrics_listen
    }

    /// The metrics endpoint (`relay.metrics_*`), `None` when disabled.
    pub fn metrics_endpoint(&self) -> Option<crate::endpoint::EndpointConfig> {
        let r = &self.relay;
        let path = |s: &str| Some(std::path::PathBuf::from(s)).filter(|_| !s.is_empty());
        Some(crate::endpoint::EndpointConfig {
            addr: r.metrics_listen?,
            read_timeout: Duration::from_millis(r.metrics_read_timeout_ms),
            max_connections: r.metrics_max_connections,
            auth: crate::endpoint::Credentials {
                bearer_token_file: path(&r.metrics_bearer_token_file),
                basic: path(&r.metrics_basic_auth_password_file)
                    .map(|p| (r.metrics_basic_auth_user.clone(), p)),
            },
            tls: path(&r.metrics_tls_cert_file).zip(path(&r.metrics_tls_key_file)),
        })
    }

    /// `relay.replay_window`, `None` when there is none.
    pub fn replay_window(&self) -> Option<Duration> {
        self.relay.replay_window
    }

    /// `retention.keep`, `None` when retention is off.
    pub fn retention_keep(&self) -> Option<Duration> {
        self.retention.keep
    }

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
            max_in_flight: self.rabbitmq.max_in_flight,
        })
    }

    /// The messages' shape for both publishers (`[message]`, docs/cloudevents.md):
    /// with `cloudevents`, `{database}` of the source is the Postgres URL's database.
    pub fn message_format(&self) -> MessageFormat {
        let m = &self.message;
        match m.format {
            MessageFormatKind::Native => MessageFormat::Native,
            MessageFormatKind::CloudEvents => {
                let database = self.pg_options().map(|o| o.dbname).unwrap_or_default();
                let prefix = &m.cloudevents_type_prefix;
                // The source was checked at load, so the fallback is never taken.
                MessageFormat::CloudEvents(
                    CloudEventsFormat::new(&m.cloudevents_source, &database, prefix)
                        .unwrap_or_else(|_| {
                            CloudEventsFormat::with_default_source(&database, prefix)
                        }),
                )
            }
        }
    }

    /// Which of the relay's headers every message carries (`message.headers`).
    pub fn header_profile(&self) -> HeaderProfile {
        match self.message.headers {
            HeaderProfileKind::Full => HeaderProfile::Full,
            HeaderProfileKind::Minimal => HeaderProfile::Minimal,
        }
    }

    /// `rabbitmq.stream`, `None` when events go to the exchange.
    pub fn stream(&self) -> Option<&str> {
        Some(self.rabbitmq.stream.as_str()).filter(|s| !s.is_empty())
    }

    /// `rabbitmq.producer_name`, `None` when `""` (derived from the source).
    pub fn producer_name(&self) -> Option<&str> {
        Some(self.rabbitmq.producer_name.as_str()).filter(|s| !s.is_empty())
    }

    /// The stream URLs with passwords replaced by `***`, for logs.
    pub fn stream_urls_redacted(&self) -> Vec<String> {
        self.rabbitmq
            .stream_url
            .iter()
            .map(|u| redact_url(u.expose_secret()))
            .collect()
    }

    /// What the stream publisher needs (with `rabbitmq.stream` set). The producers'
    /// source is set per session, from the server's identity and history
    /// (docs/design.md §4).
    pub fn stream_config(&self) -> StreamConfig {
        let urls: Vec<String> = self
            .rabbitmq
            .stream_url
            .iter()
            .map(|u| u.expose_secret().to_string())
            .collect();
        let mut s = StreamConfig::new(
            urls.first().cloned().unwrap_or_default(),
            &self.rabbitmq.stream,
        );
        s.urls = urls;
        s.declare_stream = self.rabbitmq.declare_stream;
        s.max_length_bytes = Some(self.rabbitmq.max_length_bytes).filter(|&b| b > 0);
        s.max_age = self.rabbitmq.max_age;
        s.max_in_flight = self.rabbitmq.max_in_flight;
        s.ca_file = self.ca_file().map(|p| p.to_path_buf());
        s.auth = self.client_auth(&self.rabbitmq.stream_password_file);
        s.shutdown_timeout = self.shutdown_timeout();
        s.format = self.message_format();
        s.headers = self.header_profile();
        s
    }

    /// The client certificate (`rabbitmq.cert_file`, `key_file`) and `password_file`
    /// (that of `url` or of `stream_url`).
    fn client_auth(&self, password_file: &str) -> publisher::ClientAuth {
        let path = |s: &str| Some(std::path::PathBuf::from(s)).filter(|_| !s.is_empty());
        publisher::ClientAuth {
            cert_file: path(&self.rabbitmq.cert_file),
            key_file: path(&self.rabbitmq.key_file),
            password_file: path(password_file),
        }
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
        p.auth = self.client_auth(&self.rabbitmq.password_file);
        p.exchange_type = self.rabbitmq.exchange_type.as_str().to_string();
        p.declare_exchange = self.rabbitmq.declare_exchange;
        p.routing_key = self.rabbitmq.routing_key.clone();
        p.max_in_flight = self.rabbitmq.max_in_flight;
        p.dead_letter_exchange = self.dead_letter_exchange().map(str::to_string);
        p.shutdown_timeout = self.shutdown_timeout();
        p.connection_name = format!("outbox-relay {}", self.postgres.slot);
        p.format = self.message_format();
        p.headers = self.header_profile();
        p
    }
}
