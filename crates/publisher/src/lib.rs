//! RabbitMQ publishing with publisher confirms, and the *acked watermark*.
//!
//! # Dataflow
//!
//! Inside this crate (the whole path of a row is docs/design.md §2):
//!
//! ```text
//!  wal-reader ──mpsc<WalBatch>──▶ Publisher::run (one task owns the connection)
//!                                   │ Event  → MessageBuilder → Window (buffer)
//!                                   │ Commit / Keepalive → mark in the Window
//!                                   ▼
//!              publishing: basic.publish futures, polled front to back
//!                                   ▼
//!              confirms: PublisherConfirm futures, handled in publish order
//!                                   ▼
//!              Window::ack → watermark ──watch<Lsn>──▶ relay (standby status)
//! ```
//!
//! Events come in as [`outbox_event`] types, ready to send (the reader has already
//! decoded the body and chosen the content type): this crate knows AMQP, not
//! Postgres, and does not depend on the reader.
//!
//! One connection and one confirm-mode channel, owned by the task running
//! [`Publisher::run`]. Publishing is pipelined: up to `max_in_flight` messages are
//! published and unconfirmed at once, their confirms are awaited in publish order
//! while publishing continues; there is no per-message round trip to the broker.
//!
//! # How progress is tracked
//!
//! [`window`] keeps every message and every commit / keepalive position in arrival
//! order until the watermark passes them. The watermark moves to a position once
//! every message before it is acked, never backwards, and the `watch` is only sent
//! when it advances.
//!
//! # Failures
//!
//! A nack, an unroutable return (without a dead-letter exchange), a channel error
//! or a lost connection all end the same way: the channel is dropped, and after an
//! exponential backoff with jitter everything still buffered is published again
//! from the oldest unacked message, in the original order, on a fresh channel (on
//! the next URL when the connection is gone). The buffer is kept in memory rather
//! than restarting the replication stream because it is already bounded by the
//! window and a retry then costs no Postgres round trip and cannot skip anything;
//! the reader never learns about broker hiccups. One warning is logged per failure
//! episode (not per message), and counters record every retry.
//!
//! Unroutable messages with a dead-letter exchange configured are republished there
//! with `x-outbox-error`, `x-original-exchange` and `x-original-routing-key` headers,
//! and count as done only once that publish is acked.
//!
//! One warning is logged when a failure episode begins and one info line when it
//! is over (everything buffered at its start is acked); retries in between are
//! debug lines. Unroutable messages are logged with their exchange and routing key.
//!
//! When the broker blocks the connection (`connection.blocked`, a resource alarm),
//! publishing stops, the watermark holds, and [`PublisherStatus::blocked`] is set
//! until `connection.unblocked`.

pub mod backoff;
pub mod error;
pub mod message;
pub mod status;
pub mod stream;
pub mod window;

mod confirms;
mod connection;
pub(crate) mod engine;
pub mod probe;
mod run;
#[cfg(test)]
mod sim;
mod tls;

use std::path::PathBuf;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

pub use error::{redact_url, PublishError};
pub use status::{PoisonMessage, PublisherStatus};
pub use tls::ClientAuth;

/// Default `max_in_flight` (docs/design.md §6).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// Default first retry delay.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// Default retry delay cap.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Default bound on the wait for outstanding confirms once the input has closed.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

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
    pub exchange: String,
    pub exchange_type: String,
    /// Declare the exchange durable when missing; otherwise only check it exists.
    pub declare_exchange: bool,
    /// Template over `{aggregate_type}` `{aggregate_id}` `{event_type}` `{table}`.
    pub routing_key: String,
    pub max_in_flight: usize,
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
    /// How long [`Publisher::run`] waits for outstanding confirms after its input
    /// closed before it returns with what is acked.
    pub shutdown_timeout: Duration,
}

impl PublisherConfig {
    /// A configuration with docs/design.md §6's defaults for one URL and exchange.
    pub fn new(url: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            ca_file: None,
            auth: ClientAuth::default(),
            exchange: exchange.into(),
            exchange_type: "topic".into(),
            declare_exchange: true,
            routing_key: message::DEFAULT_ROUTING_KEY.into(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            dead_letter_exchange: None,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            extra_headers: Vec::new(),
            format: message::MessageFormat::Native,
            headers: message::HeaderProfile::Full,
            connection_name: "outbox-relay".into(),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }

    fn validate(&self) -> Result<(), PublishError> {
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
            match url.parse::<lapin::uri::AMQPUri>() {
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
        if self.max_in_flight == 0 {
            return Err(PublishError::InvalidConfig {
                key: "max_in_flight",
                reason: "0 would never publish; set a positive number such as 10000".into(),
            });
        }
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
        Ok(())
    }

    /// How AMQPS connections verify the broker: lapin's own setup (the system's
    /// roots) when nothing is configured, else ours: with `ca_file`, the certificates
    /// of that file *instead of* the system's roots, so that a private CA can be
    /// enforced, and the client certificate (docs/security.md). The files are read
    /// here, to refuse unusable ones at once, and again at every connect.
    fn tls(&self) -> Result<connection::Tls, PublishError> {
        if self.ca_file.is_none() && self.auth.cert_file.is_none() && self.auth.key_file.is_none() {
            return Ok(connection::Tls::SystemRoots);
        }
        tls::amqps_config(self.ca_file.as_deref(), &self.auth)?;
        Ok(connection::Tls::Own)
    }
}

/// Refuses a host the AMQP client would not connect to as written: lapin's URL
/// parser reads an IPv6 literal (`amqps://[fd00::5]/`) as no host at all and
/// connects to `localhost` instead (docs/security.md).
fn check_host(url: &str, uri: &lapin::uri::AMQPUri) -> Result<(), PublishError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    if rest.starts_with('[') {
        return Err(PublishError::InvalidConfig {
            key: "url",
            reason: format!(
                "{} has an IPv6 address as its host, which the AMQP client cannot connect to (it would silently use localhost): use a host name that resolves to that address",
                redact_url(url)
            ),
        });
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
            .finish()
    }
}

/// What [`Publisher::run`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublisherReport {
    /// basic.publish calls for events (first publishes and retries).
    pub published: u64,
    /// Events acked (each counted once per ack, retries included).
    pub acked: u64,
    pub nacked: u64,
    pub returned: u64,
    pub dead_lettered: u64,
    /// Failure recoveries: each republished the buffer from the oldest unacked.
    pub retries: u64,
    pub reconnects: u64,
    /// The acked watermark at return.
    pub watermark: Lsn,
    /// Messages still unacked when the shutdown timeout passed (0 on a clean finish).
    pub abandoned: usize,
}

/// A connected publisher; see the crate docs.
pub struct Publisher {
    config: PublisherConfig,
    tls: connection::Tls,
    session: connection::Session,
    status: PublisherStatus,
}

impl Publisher {
    /// Connects to the first reachable URL, opens one confirm-mode channel and
    /// declares the exchange if asked. Login, vhost and exchange problems are
    /// definite errors; an unreachable broker is transient
    /// ([`PublishError::is_transient`]).
    pub async fn connect(config: PublisherConfig) -> Result<Publisher, PublishError> {
        config.validate()?;
        let tls = config.tls()?;
        let session = connection::connect_any(&config, &tls, 0).await?;
        tracing::info!(
            node = %redact_url(&config.urls[session.url_index]),
            exchange = %config.exchange,
            "connected to rabbitmq"
        );
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        Ok(Publisher {
            config,
            tls,
            session,
            status,
        })
    }

    /// A handle on the publisher's live state (for `/readyz` and metrics).
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }

    /// Consumes batches until `input` closes, publishing every event in order and
    /// advancing `watermark` as acks arrive. Reconnects and retries by itself on
    /// nacks, returns, channel errors and connection loss. Returns once the input
    /// is closed and everything received is acked, or when
    /// [`PublisherConfig::shutdown_timeout`] has passed since the input closed (then
    /// [`PublisherReport::abandoned`] counts what was not acked). Errors only on a
    /// definite problem found while reconnecting (login, vhost, exchange).
    ///
    /// The watermark starts at the `watch`'s current value (the position the relay
    /// resumes from) and is only sent when it advances.
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        run::Runner::new(self, watermark, None)?.run(input).await
    }

    /// [`Publisher::run`], with `flushed` carrying the positions actually sent to
    /// Postgres as flushed (the reader's status updates): a message counts against
    /// `max_in_flight` until a position past it has been sent, which is what bounds
    /// the duplicates after a crash (docs/design.md §1). Without it (`run`) the
    /// watermark itself counts as sent.
    pub async fn run_with_flushed(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: watch::Receiver<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        run::Runner::new(self, watermark, Some(flushed))?
            .run(input)
            .await
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

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
}
