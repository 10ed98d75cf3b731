//! Configuration (docs/design.md §6): a TOML file overridden by `OUTBOX_RELAY_<SECTION>_<KEY>`
//! environment variables.
//!
//! # How a configuration is assembled
//!
//! ```text
//!   serde defaults (DEFAULT_* constants; the mapping, routing key and
//!                   max_in_flight are the reader's and the publisher's own)
//!        ▲ overridden by
//!   TOML file: --config FILE, else ./outbox-relay.toml if present
//!        ▲ overridden by
//!   environment: OUTBOX_RELAY_<SECTION>_<KEY>   (typed by the key table `KEYS`)
//!        │
//!        ▼  figment::extract (deny_unknown_fields)  →  Config::validate()
//!   Config   ── errors name the key and where it came from (file or variable)
//! ```
//!
//! Keys themselves contain underscores (`max_in_flight`), so an environment variable is
//! mapped by its known section prefix (`OUTBOX_RELAY_RABBITMQ_` → `rabbitmq.`) and the
//! rest of the name is the key. Every variable with the `OUTBOX_RELAY_` prefix must name
//! a known key: a typo is an error, not a silently ignored override. Values are typed
//! by the key table: lists (`postgres.tables`, `rabbitmq.url`) take a TOML array
//! (`["a", "b"]`); `postgres.tables` also takes a comma-separated list. AMQP URLs are
//! never split on commas, since a password may contain one.
//!
//! Secrets: the Postgres URL and the AMQP URLs carry passwords. They are held as
//! [`SecretString`], `Debug` shows them through [`redact_url`], and error messages never
//! quote their values. Code that needs the real value calls a method whose name says so
//! ([`Config::postgres_url_exposed`], [`Config::expose_amqp_urls`]).
//!
//! `tables`, durations and socket addresses are checked at load time, so the accessors
//! that return typed values ([`Config::tables`], [`Config::replay_window`], ...) cannot
//! fail afterwards.
//!
//! Files: this one holds the keys and their defaults; `load.rs` loads them (every
//! error at once) and refuses built-in server addresses; `env.rs` the environment
//! overrides, `de.rs` the value deserializers, `validate.rs` the checks, `access.rs`
//! the typed accessors and each component's configuration, `error.rs`
//! [`ConfigError`].

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

mod access;
mod de;
mod env;
mod error;
mod load;
mod validate;

pub use error::ConfigError;
pub use wal_reader::redact::redact_url;
/// `[mapping]` is the reader's own section: its keys, defaults and checks.
pub use wal_reader::{ColumnMapping, MappingConfig};

pub use load::Given;

use de::{de_duration, de_secret, de_secret_list, de_socket_addr, de_string_list};

/// The file read when `--config` is not given, if it exists in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "outbox-relay.toml";
/// Prefix of the environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// Default `postgres.url`.
pub const DEFAULT_POSTGRES_URL: &str = "postgresql://postgres@127.0.0.1:5432/app";
/// Default `postgres.slot`.
pub const DEFAULT_SLOT: &str = "outbox_relay";
/// Default `postgres.publication`.
pub const DEFAULT_PUBLICATION: &str = "outbox_relay";
/// Default `postgres.tables`.
pub const DEFAULT_TABLES: &[&str] = &["public.outbox"];

/// Default `rabbitmq.url`.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default `rabbitmq.exchange`.
pub const DEFAULT_EXCHANGE: &str = "outbox";
/// Default `rabbitmq.exchange_type`: the publisher's.
pub const DEFAULT_EXCHANGE_TYPE: ExchangeType =
    match ExchangeType::from_name(publisher::DEFAULT_EXCHANGE_TYPE) {
        Some(t) => t,
        None => panic!("publisher::DEFAULT_EXCHANGE_TYPE is not an exchange type"),
    };
/// Default `rabbitmq.declare_exchange`.
pub const DEFAULT_DECLARE_EXCHANGE: bool = true;
/// Default `rabbitmq.dead_letter_exchange` (none).
pub const DEFAULT_DEAD_LETTER_EXCHANGE: &str = "";
/// Default `rabbitmq.ca_file` (system roots).
pub const DEFAULT_CA_FILE: &str = "";
/// Default `rabbitmq.heartbeat_secs` (0: the URL's `heartbeat` or the broker's proposal).
pub const DEFAULT_HEARTBEAT_SECS: u64 = 0;
/// Default `rabbitmq.stream` (none: publish to the exchange).
pub const DEFAULT_STREAM: &str = "";
/// Default `rabbitmq.declare_stream`.
pub const DEFAULT_DECLARE_STREAM: bool = true;

/// Default `relay.status_interval_ms`.
pub const DEFAULT_STATUS_INTERVAL_MS: u64 = 1_000;
/// Smallest accepted `relay.status_interval_ms`.
pub const MIN_STATUS_INTERVAL_MS: u64 = 100;
/// Default `relay.metrics_listen`.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9187";
/// Default `relay.shutdown_timeout_ms`: the publishers'.
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = publisher::DEFAULT_SHUTDOWN_TIMEOUT.as_millis() as u64;
/// Default `relay.metrics_read_timeout_ms`.
pub const DEFAULT_METRICS_READ_TIMEOUT_MS: u64 = 10_000;
/// Default `relay.metrics_max_connections`.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = 64;

/// Where the configuration came from, for `check` and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ConfigSource {
    /// Built-in defaults (plus environment overrides): no file was read.
    #[default]
    Defaults,
    /// This file (plus environment overrides).
    File(PathBuf),
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::Defaults => write!(f, "defaults (no {DEFAULT_CONFIG_FILE} found)"),
            ConfigSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The whole configuration (docs/design.md §6).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[postgres]`: the database, slot, publication and outbox tables.
    pub postgres: PostgresConfig,
    /// `[mapping]`: outbox column names (the reader's [`MappingConfig`]).
    pub mapping: MappingConfig,
    /// `[rabbitmq]`: the broker and how messages are routed.
    pub rabbitmq: RabbitMqConfig,
    /// `[message]`: the messages' shape (docs/cloudevents.md).
    pub message: MessageConfig,
    /// `[relay]`: the relay process itself.
    pub relay: RelayConfig,
    /// `[retention]`: deletion of confirmed outbox rows.
    pub retention: RetentionConfig,
    /// Where the configuration was read from (not a key).
    #[serde(skip)]
    pub source: ConfigSource,
    /// Which connection settings were given rather than defaulted (not a key).
    #[serde(skip)]
    pub given: Given,
}

/// `[postgres]`.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// libpq-style URL (`postgresql://user:pw@host:port/db?sslmode=...`) or key=value
    /// conninfo (`host=... user=... password=...`). Holds a password: secret.
    #[serde(deserialize_with = "de_secret")]
    pub url: SecretString,
    /// Name of the pgoutput logical replication slot.
    pub slot: String,
    /// Name of the publication the slot streams.
    pub publication: String,
    /// Outbox tables, `schema.table` or `table` (schema `public`): a list, or one
    /// string of comma-separated names (as the environment variable). Checked at load.
    #[serde(deserialize_with = "de_string_list")]
    pub tables: Vec<String>,
}

impl Default for PostgresConfig {
    fn default() -> PostgresConfig {
        PostgresConfig {
            url: SecretString::from(DEFAULT_POSTGRES_URL),
            slot: DEFAULT_SLOT.to_string(),
            publication: DEFAULT_PUBLICATION.to_string(),
            tables: DEFAULT_TABLES.iter().map(|t| t.to_string()).collect(),
        }
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(self.url.expose_secret()))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("tables", &self.tables)
            .finish()
    }
}

/// AMQP exchange types (`rabbitmq.exchange_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeType {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeType {
    /// The type of an AMQP name (`"topic"`, ...).
    pub const fn from_name(name: &str) -> Option<ExchangeType> {
        match name.as_bytes() {
            b"direct" => Some(ExchangeType::Direct),
            b"fanout" => Some(ExchangeType::Fanout),
            b"topic" => Some(ExchangeType::Topic),
            b"headers" => Some(ExchangeType::Headers),
            _ => None,
        }
    }

    /// The AMQP name (`"topic"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeType::Direct => "direct",
            ExchangeType::Fanout => "fanout",
            ExchangeType::Topic => "topic",
            ExchangeType::Headers => "headers",
        }
    }
}

/// `[rabbitmq]`.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// `amqp://` or `amqps://` URL, or a list of them (the nodes of a cluster, tried in
    /// order on every (re)connect). Hold passwords: secret.
    #[serde(deserialize_with = "de_secret_list")]
    pub url: Vec<SecretString>,
    /// Exchange messages are published to (`""` = the default exchange).
    pub exchange: String,
    /// Type of the exchange, used when declaring it.
    pub exchange_type: ExchangeType,
    /// Declare the exchange (durable) if it is missing.
    pub declare_exchange: bool,
    /// Routing key template over `{aggregate_type}`, `{aggregate_id}`, `{event_type}`,
    /// `{table}`. Checked at load.
    pub routing_key: String,
    /// Messages published but not yet confirmed to Postgres (≥ 1).
    pub max_in_flight: usize,
    /// Exchange unroutable (returned) messages are republished to; `""` = none, retry.
    pub dead_letter_exchange: String,
    /// PEM file of CA certificates trusted for `amqps://`; `""` = the system roots.
    pub ca_file: String,
    /// AMQP heartbeat in seconds, added to every URL as `?heartbeat=N` (lapin honours
    /// that query parameter). 0 = keep the URL's own `heartbeat` or the broker's
    /// proposal (RabbitMQ: 60 s).
    pub heartbeat_secs: u64,
    /// A RabbitMQ stream to publish every event to over the stream protocol, exactly
    /// once (docs/design.md §1 item 6), instead of to `exchange`; `""` = the exchange.
    pub stream: String,
    /// `rabbitmq-stream://` or `rabbitmq-stream+tls://` URL, or a list of them, used
    /// when `stream` is set. Hold passwords: secret.
    #[serde(deserialize_with = "de_secret_list")]
    pub stream_url: Vec<SecretString>,
    /// Create the stream if it is missing.
    pub declare_stream: bool,
    /// Retention of a declared stream by size in bytes (`max-length-bytes`); 0 = no
    /// size limit.
    pub max_length_bytes: u64,
    /// Retention of a declared stream by age (`max-age`), e.g. `"7d"`; `""` = none.
    #[serde(deserialize_with = "de_duration")]
    pub max_age: Option<Duration>,
    /// The first part of the stream producer references (docs/streams.md); `""` =
    /// derived from the source: `outbox-relay/<system id>/<database>/<slot>`. It must
    /// name one source: two relays on different databases must never share it.
    pub producer_name: String,
    // Client certificate and password files (docs/security.md).
    /// PEM client certificate presented over `amqps://` and `rabbitmq-stream+tls://`
    /// (with `?auth_mechanism=external` in an AMQP URL, the broker logs the relay in
    /// as the user it names); `""` = none.
    pub cert_file: String,
    /// Its PEM private key (readable by its owner only); `""` = none.
    pub key_file: String,
    /// A file holding the password of every `url`, read at every (re)connect
    /// (Kubernetes and Vault secret mounts); `""` = the URLs' own.
    pub password_file: String,
    /// The same for every `stream_url`.
    pub stream_password_file: String,
}

impl Default for RabbitMqConfig {
    fn default() -> RabbitMqConfig {
        RabbitMqConfig {
            url: vec![SecretString::from(DEFAULT_AMQP_URL)],
            exchange: DEFAULT_EXCHANGE.to_string(),
            exchange_type: DEFAULT_EXCHANGE_TYPE,
            declare_exchange: DEFAULT_DECLARE_EXCHANGE,
            // The publisher's defaults (one source for both).
            routing_key: publisher::message::DEFAULT_ROUTING_KEY.to_string(),
            max_in_flight: publisher::DEFAULT_MAX_IN_FLIGHT,
            dead_letter_exchange: DEFAULT_DEAD_LETTER_EXCHANGE.to_string(),
            ca_file: DEFAULT_CA_FILE.to_string(),
            heartbeat_secs: DEFAULT_HEARTBEAT_SECS,
            stream: DEFAULT_STREAM.to_string(),
            stream_url: vec![SecretString::from(publisher::stream::DEFAULT_STREAM_URL)],
            declare_stream: DEFAULT_DECLARE_STREAM,
            max_length_bytes: 0,
            max_age: None,
            producer_name: String::new(),
            cert_file: String::new(),
            key_file: String::new(),
            password_file: String::new(),
            stream_password_file: String::new(),
        }
    }
}

impl fmt::Debug for RabbitMqConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<String> = self
            .url
            .iter()
            .map(|u| redact_url(u.expose_secret()))
            .collect();
        let stream_urls: Vec<String> = self
            .stream_url
            .iter()
            .map(|u| redact_url(u.expose_secret()))
            .collect();
        f.debug_struct("RabbitMqConfig")
            .field("url", &urls)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("declare_exchange", &self.declare_exchange)
            .field("routing_key", &self.routing_key)
            .field("max_in_flight", &self.max_in_flight)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("ca_file", &self.ca_file)
            .field("heartbeat_secs", &self.heartbeat_secs)
            .field("stream", &self.stream)
            .field("stream_url", &stream_urls)
            .field("declare_stream", &self.declare_stream)
            .field("max_length_bytes", &self.max_length_bytes)
            .field("max_age", &self.max_age)
            .field("producer_name", &self.producer_name)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("password_file", &self.password_file)
            .field("stream_password_file", &self.stream_password_file)
            .finish()
    }
}

/// `message.format` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageFormatKind {
    /// The relay's own headers (docs/design.md §5).
    #[default]
    Native,
    /// The native message plus the CloudEvents 1.0 attributes (docs/cloudevents.md).
    CloudEvents,
}

/// `message.headers` values (docs/design.md §5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderProfileKind {
    /// All of the relay's headers.
    #[default]
    Full,
    /// `event_type`, `commit_lsn` and `tx_index` only (docs/performance.md).
    Minimal,
}

/// `[message]`: the messages' shape (docs/cloudevents.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MessageConfig {
    /// `native` (the default) or `cloudevents`.
    pub format: MessageFormatKind,
    /// `full` (the default) or `minimal`: which of the relay's headers a message
    /// carries.
    pub headers: HeaderProfileKind,
    /// The CloudEvents `source`: a URI reference over `{database}` and `{table}`.
    /// Checked at load.
    pub cloudevents_source: String,
    /// Prepended to the event type to form the CloudEvents `type`; `""` = none.
    pub cloudevents_type_prefix: String,
}

impl Default for MessageConfig {
    fn default() -> MessageConfig {
        MessageConfig {
            format: MessageFormatKind::Native,
            headers: HeaderProfileKind::Full,
            // The publisher's default (one source for both).
            cloudevents_source: publisher::message::cloudevents::DEFAULT_SOURCE.to_string(),
            cloudevents_type_prefix: String::new(),
        }
    }
}

/// `[relay]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// Standby status update period in milliseconds (≥ 100).
    pub status_interval_ms: u64,
    /// Address of the Prometheus `/metrics`, `/healthz`, `/readyz` listener;
    /// `""` disables it. Checked at load.
    #[serde(deserialize_with = "de_socket_addr")]
    pub metrics_listen: Option<SocketAddr>,
    /// WAL kept for `replay --from-lsn` by an anchor slot, e.g. `"1h"`; `""` = none.
    #[serde(deserialize_with = "de_duration")]
    pub replay_window: Option<Duration>,
    /// How long a clean stop waits for outstanding broker confirms, in milliseconds.
    pub shutdown_timeout_ms: u64,
    // The metrics endpoint's limits and credentials (docs/security.md).
    /// Time a client has to send a request's headers (and finish a TLS
    /// handshake), also the longest idle time of a kept-alive connection, in ms.
    pub metrics_read_timeout_ms: u64,
    /// Connections the metrics endpoint serves at once; more are closed at once.
    pub metrics_max_connections: usize,
    /// A file holding the token `/metrics` and `/poison` require as
    /// `Authorization: Bearer <token>`; `""` = none. Read at every request.
    pub metrics_bearer_token_file: String,
    /// The user of HTTP basic authentication for `/metrics` and `/poison`; `""` = none.
    pub metrics_basic_auth_user: String,
    /// A file holding that user's password. Read at every request.
    pub metrics_basic_auth_password_file: String,
    /// PEM certificate chain and key to serve the endpoint over HTTPS; `""` = HTTP.
    pub metrics_tls_cert_file: String,
    pub metrics_tls_key_file: String,
}

impl Default for RelayConfig {
    fn default() -> RelayConfig {
        RelayConfig {
            status_interval_ms: DEFAULT_STATUS_INTERVAL_MS,
            metrics_listen: DEFAULT_METRICS_LISTEN.parse().ok(),
            replay_window: None,
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
            metrics_read_timeout_ms: DEFAULT_METRICS_READ_TIMEOUT_MS,
            metrics_max_connections: DEFAULT_METRICS_MAX_CONNECTIONS,
            metrics_bearer_token_file: String::new(),
            metrics_basic_auth_user: String::new(),
            metrics_basic_auth_password_file: String::new(),
            metrics_tls_cert_file: String::new(),
            metrics_tls_key_file: String::new(),
        }
    }
}

/// `[retention]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Delete confirmed outbox rows older than this, e.g. `"7d"`; `""` = keep all.
    #[serde(deserialize_with = "de_duration")]
    pub keep: Option<Duration>,
}

#[cfg(test)]
mod tests;
