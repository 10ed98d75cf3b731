//! Connecting to the first reachable broker URL and opening the confirm-mode channel.

use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{AMQPUriTcpExt, RustlsConnector};
use lapin::types::{FieldTable, LongString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{
    Channel, Connection, ConnectionProperties, DefaultConnectionBuilder, ErrorKind, Event,
    ExchangeKind,
};

use crate::error::{redact_url, scrub, PublishError};

/// Bound on one connection attempt (TCP, TLS, AMQP handshake, channel setup).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
use crate::config::PublisherConfig;

/// How AMQPS connections set up TLS.
#[derive(Clone, Debug)]
pub(crate) enum Tls {
    /// The operating system's roots, no client certificate (lapin's own TLS setup).
    SystemRoots,
    /// Ours, built at every connect from the files (`crate::tls::amqps_config`): only
    /// the certificates of `[rabbitmq] ca_file` when it is set (the system's roots
    /// are then not trusted, so a private CA is enforced), and the client
    /// certificate when one is configured (docs/security.md).
    Own,
}

/// An open connection, its one channel and its event stream.
pub(crate) struct Session {
    pub connection: Connection,
    pub channel: Channel,
    pub events: Pin<Box<dyn Stream<Item = Event> + Send>>,
    /// Index in `urls` of the node this session is connected to.
    pub url_index: usize,
}

/// What was being done when an error happened (decides how it is classified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Connect,
    Declare,
}

/// Connects to the URLs in order starting at `start`: the first node that answers
/// wins. Every URL is tried, whatever the others answered: a node that refuses the
/// virtual host (530 while it boots, 403 while the vhost is being re-created) or the
/// login may be the only bad one of a cluster. When every node failed, the most
/// meaningful error is returned ([`PublishError::specificity`]): a refusal names what
/// to fix, an unreachable node does not.
pub(crate) async fn connect_any(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
) -> Result<Session, PublishError> {
    let count = config.urls.len();
    let mut best: Option<PublishError> = None;
    for offset in 0..count {
        let index = (start + offset) % count;
        match connect_one(config, tls, index).await {
            Ok(session) => return Ok(session),
            Err(e) => {
                if e.is_transient() {
                    tracing::debug!(error = %e, "broker node unreachable; trying the next");
                } else {
                    tracing::debug!(error = %e, "broker node refused the connection; trying the next");
                }
                // The first of the most specific errors wins; among unreachable
                // nodes the last one (as before).
                if best.as_ref().is_none_or(|b| {
                    e.specificity() > b.specificity() || (b.is_transient() && e.is_transient())
                }) {
                    best = Some(e);
                }
            }
        }
    }
    Err(best.unwrap_or_else(|| PublishError::InvalidConfig {
        key: "url",
        reason: "no URL configured; set at least one amqp:// or amqps:// URL".into(),
    }))
}

/// `config.urls[index]` with the password file's password when one is configured:
/// the file is read at every connect (rotation needs no restart). Used by the
/// session and the publishing connection alike.
pub(crate) fn url_of(config: &PublisherConfig, index: usize) -> Result<String, PublishError> {
    Ok(match &config.auth.password_file {
        Some(path) => crate::tls::with_password(
            &config.urls[index],
            &crate::tls::read_password(path, crate::tls::Keys::Amqp)?,
        ),
        None => config.urls[index].clone(),
    })
}

async fn connect_one(
    config: &PublisherConfig,
    tls: &Tls,
    index: usize,
) -> Result<Session, PublishError> {
    let url = &url_of(config, index)?;
    match tokio::time::timeout(CONNECT_TIMEOUT, connect_one_inner(config, url, tls, index)).await {
        Ok(result) => result.map_err(|e| scrub_error(e, url)),
        Err(_) => Err(PublishError::Unreachable {
            url: redact_url(url),
            reason: format!("no answer within {CONNECT_TIMEOUT:?}"),
        }),
    }
}

/// Makes sure no error text quotes the URL's password.
fn scrub_error(error: PublishError, url: &str) -> PublishError {
    use PublishError::*;
    match error {
        Unreachable { url: u, reason } => Unreachable {
            url: u,
            reason: scrub(&reason, url),
        },
        AuthenticationRefused { url: u, reason } => AuthenticationRefused {
            url: u,
            reason: scrub(&reason, url),
        },
        TlsRefused { url: u, reason } => TlsRefused {
            url: u,
            reason: scrub(&reason, url),
        },
        VirtualHost { url: u, reason } => VirtualHost {
            url: u,
            reason: scrub(&reason, url),
        },
        Exchange { exchange, reason } => Exchange {
            exchange,
            reason: scrub(&reason, url),
        },
        other => other,
    }
}

async fn connect_one_inner(
    config: &PublisherConfig,
    url: &str,
    tls: &Tls,
    index: usize,
) -> Result<Session, PublishError> {
    let redacted = redact_url(url);
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(session_name(&config.connection_name)));
    let connector = match tls {
        Tls::SystemRoots => None,
        Tls::Own => Some(RustlsConnector::from(crate::tls::amqps_config(
            config.ca_file.as_deref(),
            &config.auth,
        )?)),
    };
    let connection = open_connection(url, properties, connector)
        .await
        .map_err(|e| classify(&redacted, &config.exchange, Stage::Connect, &e))?;
    let events = Box::pin(connection.events_listener());
    let channel = open_channel(&connection, config, &redacted).await?;
    Ok(Session {
        connection,
        channel,
        events,
        url_index: index,
    })
}

/// The session connection's name: the configured one is the publishing
/// connection's (`wire.rs`), which carries the messages.
pub(crate) fn session_name(name: &str) -> String {
    format!("{name} (session)")
}

/// Opens the AMQP connection. With the system's roots lapin does everything; with
/// `connector` (`ca_file`, a client certificate) the TLS handshake is ours, over a
/// connector that trusts only that file's certificates (lapin's own setup would add
/// them to the system's roots) and presents the certificate. A plain `amqp://` URL to
/// a host other than this one is warned about (once per URL).
async fn open_connection(
    url: &str,
    properties: ConnectionProperties,
    connector: Option<RustlsConnector>,
) -> lapin::Result<Connection> {
    let uri: AMQPUri = match url.parse() {
        Ok(uri) => uri,
        // Let lapin report the unparsable URL as it always has.
        Err(_) => return connect_with_system_roots(url, properties).await,
    };
    crate::tls::warn_if_plaintext_beyond_loopback(
        url,
        &uri.authority.host,
        uri.scheme == AMQPScheme::AMQPS,
    );
    let connector = match (connector, &uri.scheme) {
        (Some(connector), AMQPScheme::AMQPS) => connector,
        _ => return connect_with_system_roots(url, properties).await,
    };
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let host = uri.authority.host.clone();
            let mut plain = uri;
            plain.scheme = AMQPScheme::AMQP;
            let stream = plain.connect_async(&runtime).await?;
            Ok(stream.into_rustls(&connector, &host).await?)
        },
        properties,
    )
    .await
}

async fn connect_with_system_roots(
    url: &str,
    properties: ConnectionProperties,
) -> lapin::Result<Connection> {
    DefaultConnectionBuilder::new()?
        .with_uri_str(url.to_string())
        .with_properties(properties)
        .connect()
        .await
}

/// Opens a channel in confirm mode and declares (or checks) the exchanges.
pub(crate) async fn open_channel(
    connection: &Connection,
    config: &PublisherConfig,
    redacted_url: &str,
) -> Result<Channel, PublishError> {
    let connect_err =
        |e: lapin::Error| classify(redacted_url, &config.exchange, Stage::Connect, &e);
    let channel = connection.create_channel().await.map_err(connect_err)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| classify(redacted_url, &config.exchange, Stage::Connect, &e))?;
    if !config.exchange.is_empty() {
        let options = ExchangeDeclareOptions {
            passive: !config.declare_exchange,
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                config.exchange.as_str().into(),
                exchange_kind(&config.exchange_type),
                options,
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(redacted_url, &config.exchange, Stage::Declare, &e))?;
    }
    if let Some(dlx) = &config.dead_letter_exchange {
        // The dead-letter exchange is the operator's: only check that it exists.
        let options = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                dlx.as_str().into(),
                ExchangeKind::Fanout,
                options,
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(redacted_url, dlx, Stage::Declare, &e))?;
    }
    Ok(channel)
}

pub(crate) fn exchange_kind(kind: &str) -> ExchangeKind {
    match kind {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        "topic" => ExchangeKind::Topic,
        other => ExchangeKind::Custom(other.to_string()),
    }
}

/// Sorts a lapin error into the publisher's kinds by the AMQP reply code.
fn classify(url: &str, exchange: &str, stage: Stage, error: &lapin::Error) -> PublishError {
    let url = url.to_string();
    let reason = error.to_string();
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match (amqp.get_id(), stage) {
            (403, Stage::Connect) if reason.contains("vhost") => {
                PublishError::VirtualHost { url, reason }
            }
            (403, Stage::Connect) => PublishError::AuthenticationRefused { url, reason },
            (530, _) | (402, _) => PublishError::VirtualHost { url, reason },
            (403 | 404 | 406, Stage::Declare) => PublishError::Exchange {
                exchange: exchange.to_string(),
                reason,
            },
            _ => PublishError::Unreachable { url, reason },
        },
        ErrorKind::AuthProviderError(_) => PublishError::AuthenticationRefused { url, reason },
        _ if crate::error::is_certificate_error(&reason) => {
            PublishError::TlsRefused { url, reason }
        }
        _ => PublishError::Unreachable { url, reason },
    }
}
