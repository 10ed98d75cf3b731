//! The `[rabbitmq]` section (docs/design.md §6), owned by the publisher: the relay's
//! TOML deserializes straight into [`RabbitMqConfig`], whose defaults are the
//! `DEFAULT_*` constants here and whose checks are [`RabbitMqConfig::validate`]
//! (`checks.rs`). [`RabbitMqConfig::publisher_config`] and
//! [`RabbitMqConfig::stream_config`] turn it into what each target runs with, given
//! the few values that come from other sections ([`Shared`]).
//!
//! The flow limit `max_in_flight` is read here once: both targets' windows take it
//! from this section, and it is checked once, by [`check_max_in_flight`](crate::check_max_in_flight).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::amqp::config::PublisherConfig;
use crate::config::DEFAULT_MAX_IN_FLIGHT;
use crate::error::redact_url;
use crate::message::{self, HeaderProfile, MessageFormat};
use crate::stream::StreamConfig;
use crate::tls::ClientAuth;

mod checks;
mod de;
pub mod topology;

pub use checks::{check_routing_key, SettingError};
pub use de::{de_duration, de_secret_list, parse_duration};
pub use topology::{
    ArgValue, Arguments, Binding, ExchangeDecl, QueueDecl, QueueType, TopologyConfig,
    MAX_NAME_BYTES,
};

/// Default `rabbitmq.url`.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default `rabbitmq.exchange`.
pub const DEFAULT_EXCHANGE: &str = "outbox";
/// Default `rabbitmq.exchange_type`.
pub const DEFAULT_EXCHANGE_TYPE: ExchangeType = ExchangeType::Topic;
/// Default `rabbitmq.declare_exchange`.
pub const DEFAULT_DECLARE_EXCHANGE: bool = true;
/// Default `rabbitmq.declare_topology`.
pub const DEFAULT_DECLARE_TOPOLOGY: bool = false;
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

/// Default `rabbitmq.ordering`.
pub const DEFAULT_ORDERING: Ordering = Ordering::Commit;
/// Default `rabbitmq.channels`.
pub const DEFAULT_CHANNELS: usize = 1;

/// The order the exchange target keeps (`rabbitmq.ordering`, docs/design.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// One channel, every event in commit order.
    Commit,
    /// `channels` channels, each aggregate on one: order kept per aggregate.
    Aggregate,
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
    pub const fn as_str(self) -> &'static str {
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
    /// Declare every exchange, queue and binding of `[topology]` at start and after
    /// each reconnect (needs the `configure` permission on them, docs/security.md);
    /// `false`: `check` only compares them with the broker's.
    pub declare_topology: bool,
    /// Routing key template over `{aggregate_type}`, `{aggregate_id}`, `{event_type}`,
    /// `{table}`. Checked at load.
    pub routing_key: String,
    /// Messages published but not yet confirmed to Postgres (≥ 1).
    pub max_in_flight: usize,
    /// Bytes of message bodies published and not yet acked, at most (one message
    /// always goes, whatever its size).
    pub max_in_flight_bytes: usize,
    /// Globs (`*`: one or more of `[A-Za-z0-9_.:-]`) an exchange chosen by an event
    /// must match; `[]` = the template's own shape (`events.{aggregate_type}` allows
    /// `events.*`), or any such name for an exchange column. `amq.*` and the
    /// dead-letter exchange only when listed by name (docs/routing.md).
    pub allowed_exchanges: Vec<String>,
    /// Exchanges chosen by events that one relay declares at most; the next ones are
    /// poison (docs/routing.md).
    pub max_declared_exchanges: usize,
    /// How long any request to the broker (and publishes waiting for their confirms
    /// while the connection is not blocked) may go unanswered before the connection
    /// counts as failed and the next node is tried (docs/reliability.md).
    #[serde(deserialize_with = "de_duration")]
    pub request_timeout: Option<Duration>,
    /// Events waiting with nothing confirmed this long: the stall is named (an
    /// ERROR line, `/readyz` 503, `outbox_relay_stalled_seconds`).
    #[serde(deserialize_with = "de_duration")]
    pub stall_after: Option<Duration>,
    /// `"commit"`: one channel, one global order. `"aggregate"`: `channels`
    /// channels, each aggregate pinned to one, order kept per aggregate.
    pub ordering: Ordering,
    /// Channels (each on its own connection) with `ordering = "aggregate"`.
    pub channels: usize,
    /// Exchange unroutable (returned) messages are republished to; `""` = none, retry.
    pub dead_letter_exchange: String,
    /// PEM file of CA certificates trusted for `amqps://`; `""` = the system roots.
    pub ca_file: String,
    /// AMQP heartbeat in seconds, added to every URL as `?heartbeat=N` (the AMQP client honours
    /// that query parameter). 0 = keep the URL's own `heartbeat` or the broker's
    /// proposal (RabbitMQ: 60 s). Also the stream target's heartbeat and liveness
    /// interval (docs/design.md §4, *A silent broker*; 0 = 60 s).
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
    /// The template of each stream message's filter value (RabbitMQ 3.13+ filters on
    /// it for consumers: docs/streams.md, "Filter values"), rendered per event like
    /// `routing_key`, e.g. `"{aggregate_type}"`; `""` = none (publish v1 as before).
    pub stream_filter_value: String,
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
    /// The management plugin's HTTP API (`http://127.0.0.1:15672`), read only by
    /// `check --routes` for the broker's own exchanges, bindings and queues; `""` =
    /// none. Credentials: the URL's own, else `management_user` with
    /// `management_password_file`, else those of `url` (and `password_file`); the
    /// AMQP password is never sent for another user (docs/security.md). May hold a
    /// password: secret.
    pub management_url: SecretString,
    /// A user of its own for the management API; `""` = `url`'s. Set with
    /// `management_password_file`.
    pub management_user: String,
    /// A file holding `management_user`'s password (the secret files' rule).
    pub management_password_file: String,
    /// Send the management API's credentials over plain `http://` beyond
    /// loopback (refused otherwise: anyone on the path reads them).
    pub allow_insecure_http: bool,
}

impl Default for RabbitMqConfig {
    fn default() -> RabbitMqConfig {
        RabbitMqConfig {
            url: vec![SecretString::from(DEFAULT_AMQP_URL)],
            exchange: DEFAULT_EXCHANGE.to_string(),
            exchange_type: DEFAULT_EXCHANGE_TYPE,
            declare_exchange: DEFAULT_DECLARE_EXCHANGE,
            declare_topology: DEFAULT_DECLARE_TOPOLOGY,
            routing_key: message::DEFAULT_ROUTING_KEY.to_string(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_in_flight_bytes: crate::amqp::config::DEFAULT_MAX_IN_FLIGHT_BYTES,
            allowed_exchanges: Vec::new(),
            max_declared_exchanges: crate::amqp::destinations::DEFAULT_MAX_DECLARED_EXCHANGES,
            request_timeout: Some(crate::amqp::config::DEFAULT_REQUEST_TIMEOUT),
            stall_after: Some(crate::watchdog::DEFAULT_STALL_AFTER),
            ordering: DEFAULT_ORDERING,
            channels: DEFAULT_CHANNELS,
            dead_letter_exchange: DEFAULT_DEAD_LETTER_EXCHANGE.to_string(),
            ca_file: DEFAULT_CA_FILE.to_string(),
            heartbeat_secs: DEFAULT_HEARTBEAT_SECS,
            stream: DEFAULT_STREAM.to_string(),
            stream_url: vec![SecretString::from(crate::stream::DEFAULT_STREAM_URL)],
            declare_stream: DEFAULT_DECLARE_STREAM,
            max_length_bytes: 0,
            max_age: None,
            producer_name: String::new(),
            stream_filter_value: String::new(),
            cert_file: String::new(),
            key_file: String::new(),
            password_file: String::new(),
            stream_password_file: String::new(),
            management_url: SecretString::from(""),
            management_user: String::new(),
            management_password_file: String::new(),
            allow_insecure_http: false,
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
            .field("declare_topology", &self.declare_topology)
            .field("routing_key", &self.routing_key)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("allowed_exchanges", &self.allowed_exchanges)
            .field("max_declared_exchanges", &self.max_declared_exchanges)
            .field("request_timeout", &self.request_timeout)
            .field("stall_after", &self.stall_after)
            .field("ordering", &self.ordering)
            .field("channels", &self.channels)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("ca_file", &self.ca_file)
            .field("heartbeat_secs", &self.heartbeat_secs)
            .field("stream", &self.stream)
            .field("stream_url", &stream_urls)
            .field("declare_stream", &self.declare_stream)
            .field("max_length_bytes", &self.max_length_bytes)
            .field("max_age", &self.max_age)
            .field("producer_name", &self.producer_name)
            .field("stream_filter_value", &self.stream_filter_value)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("password_file", &self.password_file)
            .field("stream_password_file", &self.stream_password_file)
            .field(
                "management_url",
                &redact_url(self.management_url.expose_secret()),
            )
            .field("management_user", &self.management_user)
            .field("management_password_file", &self.management_password_file)
            .field("allow_insecure_http", &self.allow_insecure_http)
            .finish()
    }
}

/// What both targets take from outside `[rabbitmq]`: the messages' shape
/// (`[message]`) and the bound on a clean stop (`[relay] shutdown_timeout_ms`).
#[derive(Debug, Clone)]
pub struct Shared {
    pub format: MessageFormat,
    pub headers: HeaderProfile,
    pub shutdown_timeout: Duration,
}

impl RabbitMqConfig {
    /// The AMQP URLs in order, passwords included, with `heartbeat=N` added when
    /// `heartbeat_secs` is set. Do not log them.
    pub fn expose_urls(&self) -> Vec<String> {
        let hb = self.heartbeat_secs;
        self.url
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

    /// `request_timeout`, its default when unset.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
            .unwrap_or(crate::amqp::config::DEFAULT_REQUEST_TIMEOUT)
    }

    /// `stall_after`, its default when unset.
    pub fn stall_after(&self) -> Duration {
        self.stall_after
            .unwrap_or(crate::watchdog::DEFAULT_STALL_AFTER)
    }

    /// `ca_file`, `None` when `""` (system roots).
    pub fn ca_file(&self) -> Option<PathBuf> {
        Some(&self.ca_file)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    }

    /// The client certificate (`cert_file`, `key_file`) and `password_file` (that of
    /// `url` or of `stream_url`).
    fn client_auth(&self, password_file: &str) -> ClientAuth {
        let path = |s: &str| Some(PathBuf::from(s)).filter(|_| !s.is_empty());
        ClientAuth {
            cert_file: path(&self.cert_file),
            key_file: path(&self.key_file),
            password_file: path(password_file),
        }
    }

    /// What the AMQP publisher runs with; `connection_name` is shown by
    /// `rabbitmqctl list_connections`.
    pub fn publisher_config(&self, shared: Shared, connection_name: String) -> PublisherConfig {
        let urls = self.expose_urls();
        let mut p = PublisherConfig::new(urls.first().cloned().unwrap_or_default(), &self.exchange);
        p.urls = urls;
        p.ca_file = self.ca_file();
        p.auth = self.client_auth(&self.password_file);
        p.exchange_type = self.exchange_type.as_str().to_string();
        p.declare_exchange = self.declare_exchange;
        p.routing_key = self.routing_key.clone();
        p.max_in_flight = self.max_in_flight;
        p.max_in_flight_bytes = self.max_in_flight_bytes;
        p.allowed_exchanges = self.allowed_exchanges.clone();
        p.max_declared_exchanges = self.max_declared_exchanges;
        p.request_timeout = self.request_timeout();
        p.stall_after = self.stall_after();
        p.channels = match self.ordering {
            Ordering::Commit => 1,
            Ordering::Aggregate => self.channels,
        };
        p.dead_letter_exchange = Some(self.dead_letter_exchange.clone()).filter(|s| !s.is_empty());
        p.shutdown_timeout = shared.shutdown_timeout;
        p.connection_name = connection_name;
        p.format = shared.format;
        p.headers = shared.headers;
        p
    }

    /// What the stream publisher runs with (with `stream` set). The producers'
    /// source is set per session, from the server's identity and history
    /// (docs/design.md §4).
    pub fn stream_config(&self, shared: Shared) -> StreamConfig {
        let urls: Vec<String> = self
            .stream_url
            .iter()
            .map(|u| u.expose_secret().to_string())
            .collect();
        let mut s = StreamConfig::new(urls.first().cloned().unwrap_or_default(), &self.stream);
        s.urls = urls;
        s.declare_stream = self.declare_stream;
        s.max_length_bytes = Some(self.max_length_bytes).filter(|&b| b > 0);
        s.max_age = self.max_age;
        s.max_in_flight = self.max_in_flight;
        s.ca_file = self.ca_file();
        s.auth = self.client_auth(&self.stream_password_file);
        s.shutdown_timeout = shared.shutdown_timeout;
        s.stall_after = self.stall_after();
        s.format = shared.format;
        s.headers = shared.headers;
        // Checked at load (`checks.rs`).
        s.filter_value = Some(self.stream_filter_value.as_str())
            .filter(|t| !t.is_empty())
            .and_then(|t| message::RoutingKeyTemplate::parse(t).ok());
        // One heartbeat setting for both protocols; 0 keeps the stream client's and
        // RabbitMQ's default (docs/operations.md, "Running against a cluster").
        if self.heartbeat_secs > 0 {
            s.heartbeat = std::time::Duration::from_secs(self.heartbeat_secs);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime config's default exchange type is the file's (two constants, so
    /// that `amqp/config.rs` needs nothing from this module).
    #[test]
    fn the_default_exchange_type_is_one() {
        assert_eq!(
            DEFAULT_EXCHANGE_TYPE.as_str(),
            crate::amqp::config::DEFAULT_EXCHANGE_TYPE
        );
    }

    fn shared() -> Shared {
        Shared {
            format: MessageFormat::Native,
            headers: HeaderProfile::Full,
            shutdown_timeout: crate::DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }

    /// The section's defaults are valid and build the targets' own defaults.
    #[test]
    fn defaults_are_valid_and_build_the_targets_defaults() {
        let r = RabbitMqConfig::default();
        assert_eq!(r.validate(), []);
        let p = r.publisher_config(shared(), "outbox-relay".into());
        let d = PublisherConfig::new(DEFAULT_AMQP_URL, DEFAULT_EXCHANGE);
        assert_eq!(p.urls, d.urls);
        assert_eq!(p.exchange_type, d.exchange_type);
        assert_eq!(p.routing_key, d.routing_key);
        assert_eq!(p.max_in_flight, d.max_in_flight);
        assert_eq!(p.dead_letter_exchange, None);
        let s = r.stream_config(shared());
        assert_eq!(s.max_in_flight, DEFAULT_MAX_IN_FLIGHT);
        assert_eq!((s.max_length_bytes, s.max_age), (None, None));
    }

    /// One flow limit: both targets take `max_in_flight` from the section, and 0 is
    /// refused under its key.
    #[test]
    fn max_in_flight_reaches_both_targets_and_zero_is_refused() {
        let mut r = RabbitMqConfig {
            max_in_flight: 7,
            ..RabbitMqConfig::default()
        };
        assert_eq!(r.publisher_config(shared(), String::new()).max_in_flight, 7);
        assert_eq!(r.stream_config(shared()).max_in_flight, 7);
        r.max_in_flight = 0;
        let keys: Vec<&str> = r.validate().iter().map(|e| e.key).collect();
        assert_eq!(keys, ["rabbitmq.max_in_flight"]);
    }

    /// `channels` only with per-aggregate order, only on the exchange, within range
    /// and within the flow limit; per-aggregate order reaches the publisher as its
    /// channel count, commit order as one channel.
    #[test]
    fn ordering_and_channels_are_checked_together() {
        let keys = |r: &RabbitMqConfig| -> Vec<&'static str> {
            r.validate().iter().map(|e| e.key).collect()
        };
        let mut r = RabbitMqConfig {
            channels: 4,
            ..RabbitMqConfig::default()
        };
        assert_eq!(keys(&r), ["rabbitmq.channels"]);
        assert!(r.validate()[0].reason.contains("ordering = \"aggregate\""));
        r.ordering = Ordering::Aggregate;
        assert_eq!(keys(&r), Vec::<&str>::new());
        assert_eq!(r.publisher_config(shared(), String::new()).channels, 4);
        r.channels = 0;
        assert_eq!(keys(&r), ["rabbitmq.channels"]);
        r.channels = crate::lanes::MAX_CHANNELS + 1;
        assert_eq!(keys(&r), ["rabbitmq.channels"]);
        r.channels = 8;
        r.max_in_flight = 4;
        assert_eq!(keys(&r), ["rabbitmq.channels"]);
        assert!(r.validate()[0].reason.contains("raise max_in_flight"));
        r.max_in_flight = 100;
        r.stream = "orders".into();
        assert_eq!(keys(&r), ["rabbitmq.ordering"]);
        let commit = RabbitMqConfig::default();
        assert_eq!(commit.publisher_config(shared(), String::new()).channels, 1);
    }
}
