//! The AMQP publisher's configuration: its defaults (docs/design.md §6), its
//! validation, and how it verifies the broker over TLS. What both targets share
//! (the flow limit and its check, the retry and shutdown defaults) is in
//! `crate::config`.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{
    validate_max_in_flight, DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX, DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_SHUTDOWN_TIMEOUT,
};
use crate::error::{self, redact_url, PublishError};
use crate::message;
use crate::tls::{self, ClientAuth};

/// Default `request_timeout`: how long any request to the broker (a declaration,
/// opening or closing a channel, closing the connection) and the confirms of
/// publishes waiting (while the broker does not block the connection) may go
/// unanswered before the connection counts as failed (docs/reliability.md).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `max_in_flight_bytes`: the bodies published and not yet acked, at most
/// (one message always goes, whatever its size). 256 MiB keeps a drain of 2 MiB
/// messages pipelined (128 of them in flight).
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 256 * 1024 * 1024;
/// Default exchange type (`[rabbitmq] exchange_type`, [`crate::settings`]).
pub const DEFAULT_EXCHANGE_TYPE: &str = "topic";

/// Most channels `[rabbitmq] channels` allows.
pub const MAX_CHANNELS: usize = 64;

/// The check of `[rabbitmq] channels` against the flow limit (each channel takes an
/// equal share of `max_in_flight`): the reason it is refused, if it is.
pub fn check_channels(channels: usize, max_in_flight: usize) -> Result<(), String> {
    let max = MAX_CHANNELS;
    if channels == 0 || channels > max {
        Err(format!(
            "{channels} is out of range: set it between 1 and {max}"
        ))
    } else if max_in_flight > 0 && channels > max_in_flight {
        Err(format!("{channels} channels cannot share max_in_flight = {max_in_flight} (each needs at least 1): raise max_in_flight or lower channels"))
    } else {
        Ok(())
    }
}

/// Everything the publisher needs; see docs/design.md §6 `[rabbitmq]`.
#[derive(Clone)]
pub struct PublisherConfig {
    /// amqp:// or amqps:// URLs (they contain the password), tried in order.
    pub urls: Vec<String>,
    /// PEM CA for verifying an amqps server (the host name is verified too).
    pub ca_file: Option<PathBuf>,
    /// A client certificate for amqps (EXTERNAL with `?auth_mechanism=external`) and
    /// a password file that replaces the URLs' password, read at every connect.
    pub auth: ClientAuth,
    /// The exchange, or a template over the routing key's placeholders that names
    /// each event's exchange (docs/routing.md).
    pub exchange: String,
    /// An event's exchange column (`[mapping] exchange`), when it has a value, wins
    /// over `exchange`; false for `replay --exchange`, which sends every copy there.
    pub exchange_from_events: bool,
    pub exchange_type: String,
    /// Declare the exchange durable when missing; otherwise only check it exists.
    /// Exchanges named per event are declared (or checked) the first time each is
    /// seen, before the first publish to it.
    pub declare_exchange: bool,
    /// Template over `{aggregate_type}` `{aggregate_id}` `{event_type}` `{table}`.
    pub routing_key: String,
    pub max_in_flight: usize,
    /// Channels to publish on (`[rabbitmq] channels`): 1 keeps one global commit
    /// order; more pin each aggregate to one of them, each on its own connection
    /// (`ordering = "aggregate"`, [`crate::lanes`]).
    pub channels: usize,
    /// Where unroutable messages go (must exist); `None` = retry them.
    pub dead_letter_exchange: Option<String>,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Headers added to every message, e.g. `("replay", "true")`.
    pub extra_headers: Vec<(String, String)>,
    /// The messages' shape (`[message] format`, docs/cloudevents.md).
    pub format: message::MessageFormat,
    /// Which of the relay's headers each message carries (`[message] headers`).
    pub headers: message::HeaderProfile,
    /// The `connection_name` client property (shown by `rabbitmqctl list_connections`).
    pub connection_name: String,
    /// How long [`crate::Publisher::run`] waits for outstanding confirms after its input
    /// closed before it returns with what is acked.
    pub shutdown_timeout: Duration,
    /// `[topology]` to declare at every connect, before the first publish
    /// (`[rabbitmq] declare_topology = true`); `None` declares none of it.
    pub topology: Option<std::sync::Arc<crate::settings::topology::TopologyConfig>>,
    /// Globs an exchange chosen by an event must match (`[rabbitmq]
    /// allowed_exchanges`); empty: the template's own shape (docs/routing.md).
    pub allowed_exchanges: Vec<String>,
    /// Exchanges named by events one publisher declares at most.
    pub max_declared_exchanges: usize,
    /// The deadline of every request to the broker ([`DEFAULT_REQUEST_TIMEOUT`]).
    pub request_timeout: Duration,
    /// Events waiting with nothing confirmed this long: the stall is named
    /// (`crate::watchdog`).
    pub stall_after: Duration,
    /// Bytes of message bodies published and not acked, at most.
    pub max_in_flight_bytes: usize,
}

impl PublisherConfig {
    /// A configuration with docs/design.md §6's defaults for one URL and exchange.
    pub fn new(url: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            ca_file: None,
            auth: ClientAuth::default(),
            exchange: exchange.into(),
            exchange_from_events: true,
            exchange_type: DEFAULT_EXCHANGE_TYPE.into(),
            declare_exchange: true,
            routing_key: message::DEFAULT_ROUTING_KEY.into(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            channels: 1,
            dead_letter_exchange: None,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            extra_headers: Vec::new(),
            format: message::MessageFormat::Native,
            headers: message::HeaderProfile::Full,
            connection_name: "outbox-relay".into(),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            topology: None,
            allowed_exchanges: Vec::new(),
            max_declared_exchanges: crate::amqp::destinations::DEFAULT_MAX_DECLARED_EXCHANGES,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            stall_after: crate::watchdog::DEFAULT_STALL_AFTER,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), PublishError> {
        self.validate_login()?;
        validate_max_in_flight(self.max_in_flight)?;
        check_channels(self.channels, self.max_in_flight).map_err(|reason| {
            PublishError::InvalidConfig {
                key: "channels",
                reason,
            }
        })?;
        if self.dead_letter_exchange.as_deref() == Some(self.exchange.as_str()) {
            // A return names the exchange it came from: the two must differ for the
            // relay to tell a returned copy from a returned original.
            return Err(PublishError::InvalidConfig {
                key: "dead_letter_exchange",
                reason: format!(
                    "{:?} is also [rabbitmq] exchange; name a different exchange for unroutable messages",
                    self.exchange
                ),
            });
        }
        message::RoutingKeyTemplate::parse(&self.routing_key)?;
        message::ExchangeRule::new(&self.exchange, self.exchange_from_events)?;
        Ok(())
    }

    /// What a login needs: the URLs, and the password file's use with them (the
    /// probes of `check`, which only log in).
    pub(crate) fn validate_login(&self) -> Result<(), PublishError> {
        if self.urls.is_empty() {
            return Err(PublishError::InvalidConfig {
                key: "url",
                reason: "no URL given; set url to an amqp:// or amqps:// URL".into(),
            });
        }
        for url in &self.urls {
            if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
                return Err(PublishError::InvalidConfig {
                    key: "url",
                    reason: format!(
                        "{} is not an amqp:// or amqps:// URL; fix the scheme",
                        redact_url(url)
                    ),
                });
            }
            if error::userinfo_is_ambiguous(url) {
                return Err(PublishError::InvalidConfig {
                    key: "url",
                    reason: error::PERCENT_ENCODE_PASSWORD.into(),
                });
            }
            if url.contains(char::is_whitespace) {
                return Err(PublishError::InvalidConfig {
                    key: "url",
                    reason: "a URL holds a space: percent-encode it (%20)".into(),
                });
            }
            match url.parse::<amq_protocol::uri::AMQPUri>() {
                Err(e) => {
                    return Err(PublishError::InvalidConfig {
                        key: "url",
                        reason: format!(
                            "{} cannot be parsed ({}); fix the URL",
                            redact_url(url),
                            error::scrub(&e, url)
                        ),
                    });
                }
                Ok(uri) => check_host(url, &uri)?,
            }
            if self.auth.password_file.is_some() {
                tls::check_password_file_url(url, tls::Keys::Amqp)?;
            }
        }
        Ok(())
    }

    /// How AMQPS connections verify the broker: the system's roots when nothing
    /// is configured, else ours: with `ca_file`, the certificates
    /// of that file *instead of* the system's roots, so that a private CA can be
    /// enforced, and the client certificate (docs/security.md). The files are read
    /// here, to refuse unusable ones at once, and again at every connect.
    pub(crate) fn tls(&self) -> Result<crate::tls::Tls, PublishError> {
        if self.ca_file.is_none() && self.auth.cert_file.is_none() && self.auth.key_file.is_none() {
            return Ok(crate::tls::Tls::SystemRoots);
        }
        tls::amqps_config(self.ca_file.as_deref(), &self.auth)?;
        Ok(crate::tls::Tls::Own)
    }
}

/// Refuses a host the AMQP client would not connect to as written. An IPv6
/// literal (`amqps://[fd00::5]/`) is read by the relay itself (the URL parser would
/// take it for no host at all: `connection/socket.rs`).
fn check_host(url: &str, uri: &amq_protocol::uri::AMQPUri) -> Result<(), PublishError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    if rest.starts_with('[') {
        if crate::amqp::connection::ipv6_literal(url).is_none() {
            return Err(PublishError::InvalidConfig {
                key: "url",
                reason: format!(
                    "{} has a host in brackets that is not an IPv6 address: fix the URL",
                    redact_url(url)
                ),
            });
        }
        return Ok(());
    }
    let written = rest.split(['/', '?', ':']).next().unwrap_or_default();
    if !written.is_empty() && uri.authority.host.is_empty() {
        return Err(PublishError::InvalidConfig {
            key: "url",
            reason: format!("{} has a host the AMQP client cannot read", redact_url(url)),
        });
    }
    Ok(())
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("PublisherConfig")
            .field("urls", &urls)
            .field("ca_file", &self.ca_file)
            .field("auth", &self.auth)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("declare_exchange", &self.declare_exchange)
            .field("routing_key", &self.routing_key)
            .field("max_in_flight", &self.max_in_flight)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("extra_headers", &self.extra_headers)
            .field("format", &self.format)
            .field("headers", &self.headers)
            .field("connection_name", &self.connection_name)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("topology", &self.topology)
            .field("allowed_exchanges", &self.allowed_exchanges)
            .field("max_declared_exchanges", &self.max_declared_exchanges)
            .field("request_timeout", &self.request_timeout)
            .field("stall_after", &self.stall_after)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::check_max_in_flight;

    #[test]
    fn dead_letter_exchange_must_differ_from_the_exchange() {
        let mut c = PublisherConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "outbox");
        assert!(c.validate().is_ok());
        c.dead_letter_exchange = Some("outbox".into());
        let e = c.validate().expect_err("same exchange");
        assert!(e.to_string().contains("dead_letter_exchange"), "{e}");
        c.dead_letter_exchange = Some("unrouted".into());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn max_in_flight_is_at_least_one() {
        assert!(check_max_in_flight(1).is_ok());
        let reason = check_max_in_flight(0).expect_err("0");
        assert!(reason.contains("at least 1"), "{reason}");
        let mut c = PublisherConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "outbox");
        c.max_in_flight = 0;
        let e = c.validate().expect_err("0");
        assert!(e.to_string().contains("max_in_flight"), "{e}");
    }
}
