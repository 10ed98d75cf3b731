//! Configuration (docs/design.md §6): a TOML file overridden by `OUTBOX_RELAY_<SECTION>_<KEY>`
//! environment variables.
//!
//! # How a configuration is assembled
//!
//! ```text
//!   serde defaults (DEFAULT_* constants; [mapping] and [rabbitmq] are the
//!                   reader's and the publisher's own sections, with their defaults)
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
//! [`SecretString`](secrecy::SecretString), `Debug` shows them through [`redact_url`], and error messages never
//! quote their values. Code that needs the real value calls a method whose name says so
//! ([`Config::postgres_url_exposed`], [`Config::expose_amqp_urls`]).
//!
//! `tables`, durations and socket addresses are checked at load time, so the accessors
//! that return typed values ([`Config::tables`], [`Config::replay_window`], ...) cannot
//! fail afterwards.
//!
//! Files: this one holds the relay's own sections and their defaults (`[mapping]`
//! is wal-reader's [`MappingConfig`], `[rabbitmq]` the publisher's
//! [`RabbitMqConfig`]); `load.rs` loads them (every error at once) and refuses
//! built-in server addresses; `env.rs` the environment overrides, `de.rs` the value
//! deserializers, `validate.rs` the checks (those of `[mapping]` and `[rabbitmq]` are
//! their owners'), `ctl.rs` what `ctl` reads (the endpoint's keys alone when the
//! rest is broken), `access.rs` the typed accessors and what each component takes
//! from other sections, `error.rs` [`ConfigError`], `plain_http.rs` which URLs would
//! carry credentials in clear, `secret_files.rs` the secret files' rule.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

mod access;
mod ctl;
mod de;
mod env;
mod error;
mod keys;
mod load;
mod plain_http;
mod secret_files;
mod validate;

pub use ctl::CtlSettings;
pub use error::ConfigError;
pub use plain_http::{beyond_loopback, tracing_headers_in_clear};
/// `[rabbitmq]` is the publisher's own section: its keys, defaults and checks.
pub use publisher::settings::RabbitMqConfig;
/// `[topology]` is the publisher's too: the exchanges, queues and bindings it declares.
pub use publisher::settings::TopologyConfig;
pub use wal_reader::redact::redact_url;
/// `[postgres]` and `[mapping]` are the reader's own sections: their keys, defaults
/// and checks.
pub use wal_reader::{ColumnMapping, MappingConfig, PostgresConfig};
// Names of the two sections the relay's own code no longer spells (its tests do).
#[cfg_attr(not(test), allow(unused_imports))]
pub use publisher::settings::{ExchangeType, DEFAULT_AMQP_URL};
#[cfg_attr(not(test), allow(unused_imports))]
pub use wal_reader::settings::DEFAULT_POSTGRES_URL;

pub use load::Given;

use de::{de_duration, de_socket_addr};

/// The file read when `--config` is not given, if it exists in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "outbox-relay.toml";
/// Prefix of the environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

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
/// Default `relay.pause_alert_after`.
pub const DEFAULT_PAUSE_ALERT_AFTER: Duration = Duration::from_secs(3600);
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
    /// `[postgres]`: the database, slot, publication and outbox tables (the reader's
    /// [`PostgresConfig`]).
    pub postgres: PostgresConfig,
    /// `[mapping]`: outbox column names (the reader's [`MappingConfig`]).
    pub mapping: MappingConfig,
    /// `[rabbitmq]`: the broker and how messages are routed (the publisher's
    /// [`RabbitMqConfig`]).
    pub rabbitmq: RabbitMqConfig,
    /// `[message]`: the messages' shape (docs/cloudevents.md).
    pub message: MessageConfig,
    /// `[relay]`: the relay process itself.
    pub relay: RelayConfig,
    /// `[retention]`: deletion of confirmed outbox rows.
    pub retention: RetentionConfig,
    /// `[tracing]`: OpenTelemetry spans per event (docs/tracing.md).
    pub tracing: TracingConfig,
    /// `[topology]`: exchanges, queues and bindings to declare or check (the
    /// publisher's [`TopologyConfig`]). File only: environment variables cannot
    /// express its arrays of tables.
    pub topology: TopologyConfig,
    /// Where the configuration was read from (not a key).
    #[serde(skip)]
    pub source: ConfigSource,
    /// Which connection settings were given rather than defaulted (not a key).
    #[serde(skip)]
    pub given: Given,
    /// A hash of each key's value as given by the file and the environment (not a
    /// key): what a reload compares (crate::reload). Hashes, so that no secret is
    /// kept or shown twice.
    #[serde(skip)]
    pub fingerprint: Fingerprint,
}

/// A hash of each key's value as given, by dotted key (see [`Config::fingerprint`]).
/// Its `Debug` shows nothing: two configurations of the same values print alike.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Fingerprint(pub std::collections::BTreeMap<String, u64>);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint")
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
    /// Host names the endpoint answers to besides its own address (the IP literal
    /// it listens on, any IP literal on a wildcard, `localhost` on loopback): a
    /// request naming another gets 421 (DNS rebinding, docs/security.md); `"*"`
    /// admits every name. Checked at load.
    pub metrics_allowed_hosts: Vec<String>,
    /// Where `run` writes its per-start control token and `ctl` reads it;
    /// `""` = `/run/outbox-relay/`, `$XDG_RUNTIME_DIR/outbox-relay/` or
    /// `<temp>/outbox-relay-<uid>/`, as `control-<port>.token`
    /// (crate::control_token).
    pub control_token_file: String,
    /// The log filter (`tracing_subscriber::EnvFilter` syntax, e.g.
    /// `"info,outbox_relay=debug"`); `""` = `RUST_LOG`, else `info`. Reloaded by
    /// SIGHUP and `ctl reload`. Checked at load.
    pub log_filter: String,
    /// How long a pause (`ctl pause`) may last before the alert
    /// `OutboxRelayPausedTooLong` fires, e.g. `"1h"` (exported as
    /// `outbox_relay_pause_alert_after_seconds`). Reloaded by SIGHUP and `ctl reload`.
    #[serde(deserialize_with = "de_duration")]
    pub pause_alert_after: Option<Duration>,
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
            metrics_allowed_hosts: Vec::new(),
            control_token_file: String::new(),
            log_filter: String::new(),
            pause_alert_after: Some(DEFAULT_PAUSE_ALERT_AFTER),
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

/// Default `tracing.sampling_ratio`: every trace the relay starts is sampled.
pub const DEFAULT_SAMPLING_RATIO: f64 = 1.0;
/// Default `tracing.max_queue_size`: spans waiting for export, at most.
pub const DEFAULT_TRACE_QUEUE_SIZE: usize = 8192;

/// `tracing.attributes` values (docs/tracing.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceAttributesKind {
    /// Every attribute: message id, routing key, destination.
    #[default]
    Full,
    /// Without the message id, the routing key and the names rows chose.
    Minimal,
}

/// `[tracing]`: OpenTelemetry spans per event, exported over OTLP/HTTP
/// (docs/tracing.md). Off unless an endpoint is set here or in
/// `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    /// The OTLP/HTTP receiver, e.g. `http://collector:4318` (`/v1/traces` is
    /// added to a URL without a path); `""` = the `OTEL_EXPORTER_OTLP_*` variables.
    pub endpoint: String,
    /// The share of new traces sampled, 0.0 to 1.0; a row's sampled (or not)
    /// `traceparent` is followed while `respect_parent_sampled` is on. Checked at load.
    pub sampling_ratio: f64,
    /// A file of `key=value` request headers (authentication); never logged. A
    /// secret file: 0600, reread by a reload.
    pub headers_file: String,
    /// Spans waiting for export, at most; more are dropped and counted. Checked at load.
    pub max_queue_size: usize,
    /// `full` (the default) or `minimal`: without the message id, the routing key
    /// and the names rows chose.
    pub attributes: TraceAttributesKind,
    /// Follow a row's sampled flag (parent-based sampling, the default); `false`:
    /// `sampling_ratio` decides for every event.
    pub respect_parent_sampled: bool,
    /// Send `headers_file`'s headers over plain `http://` beyond loopback (refused
    /// otherwise: anyone on the path reads them).
    pub allow_insecure_http: bool,
}

impl Default for TracingConfig {
    fn default() -> TracingConfig {
        TracingConfig {
            endpoint: String::new(),
            sampling_ratio: DEFAULT_SAMPLING_RATIO,
            headers_file: String::new(),
            max_queue_size: DEFAULT_TRACE_QUEUE_SIZE,
            attributes: TraceAttributesKind::Full,
            respect_parent_sampled: true,
            allow_insecure_http: false,
        }
    }
}

#[cfg(test)]
mod tests;
