//! Typed access to the configuration: the accessors (values checked at load, so
//! they cannot fail), and what each component needs from more than its own section
//! (the Postgres connection options and the reader's configuration; the publishers'
//! configurations are built by their `[rabbitmq]` settings, given [`Shared`]).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use outbox_event::Lsn;
use publisher::PublisherConfig;
use secrecy::ExposeSecret;
use wal_reader::conninfo::ConnInfoError;
use wal_reader::{PgConnectOptions, ReaderConfig, TableName};

use super::{
    redact_url, ColumnMapping, Config, HeaderProfileKind, MessageFormatKind, TraceAttributesKind,
};
use publisher::message::cloudevents::CloudEventsFormat;
use publisher::message::{HeaderProfile, MessageFormat, RoutingKeyTemplate};
use publisher::settings::Shared;
use publisher::stream::StreamConfig;
use publisher::trace::{AttributeSet, TraceOptions};

impl Config {
    /// The Postgres URL or conninfo, password included. Do not log it.
    pub fn postgres_url_exposed(&self) -> &str {
        self.postgres.url.expose_secret()
    }

    /// The AMQP URLs in order, passwords included, with `heartbeat=N` added when
    /// `rabbitmq.heartbeat_secs` is set (what the publisher connects to). Do not log
    /// them.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn expose_amqp_urls(&self) -> Vec<String> {
        self.rabbitmq.expose_urls()
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
        self.postgres.tables()
    }

    /// `rabbitmq.dead_letter_exchange`, `None` when `""`.
    pub fn dead_letter_exchange(&self) -> Option<&str> {
        Some(self.rabbitmq.dead_letter_exchange.as_str()).filter(|s| !s.is_empty())
    }

    /// `rabbitmq.ca_file`, `None` when `""` (system roots; what the publisher reads).
    #[cfg_attr(not(test), allow(dead_code))]
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
            auth: crate::endpoint::auth::Credentials {
                bearer_token_file: path(&r.metrics_bearer_token_file),
                basic: path(&r.metrics_basic_auth_password_file)
                    .map(|p| (r.metrics_basic_auth_user.clone(), p)),
            },
            tls: path(&r.metrics_tls_cert_file).zip(path(&r.metrics_tls_key_file)),
            allowed_hosts: r.metrics_allowed_hosts.clone(),
            token_file: crate::control_token::TokenFile::new(
                &r.control_token_file,
                r.metrics_listen?.port(),
            ),
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
        self.postgres.reader_config(
            &self.mapping,
            start_lsn,
            self.status_interval(),
            self.rabbitmq.max_in_flight,
        )
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

    /// How the publish spans are made (`[tracing]`, docs/tracing.md): the
    /// destinations the configuration names (the exchange as written, the
    /// dead-letter exchange, the stream) are the only ones `attributes = "minimal"`
    /// names; a template exchange is the destination template.
    pub fn trace_options(&self) -> TraceOptions {
        let t = &self.tracing;
        let exchange = &self.rabbitmq.exchange;
        let template = RoutingKeyTemplate::parse(exchange).is_ok_and(|t| t.has_placeholders());
        let configured = (!template).then_some(exchange.as_str());
        TraceOptions {
            attributes: match t.attributes {
                TraceAttributesKind::Full => AttributeSet::Full,
                TraceAttributesKind::Minimal => AttributeSet::Minimal,
            },
            respect_parent_sampled: t.respect_parent_sampled,
            sampling_ratio: t.sampling_ratio,
            configured_destinations: [configured, self.dead_letter_exchange(), self.stream()]
                .into_iter()
                .flatten()
                .map(str::to_string)
                .collect(),
            destination_template: template.then(|| exchange.clone()),
        }
    }

    /// What both targets take from outside `[rabbitmq]`.
    fn shared(&self) -> Shared {
        Shared {
            format: self.message_format(),
            headers: self.header_profile(),
            shutdown_timeout: self.shutdown_timeout(),
        }
    }

    /// What the stream publisher needs (with `rabbitmq.stream` set).
    pub fn stream_config(&self) -> StreamConfig {
        self.rabbitmq.stream_config(self.shared())
    }

    /// What the publisher needs; with `declare_topology`, the `[topology]` it
    /// declares at every connect.
    pub fn publisher_config(&self) -> PublisherConfig {
        let name = format!("outbox-relay {}", self.postgres.slot);
        let mut p = self.rabbitmq.publisher_config(self.shared(), name);
        if self.rabbitmq.declare_topology && !self.topology.is_empty() {
            p.topology = Some(std::sync::Arc::new(self.topology.clone()));
        }
        p
    }
}
