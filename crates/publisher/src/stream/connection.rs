//! Stream-protocol connections: connect (the URL parsed by `endpoint.rs`), stream and publisher
//! declaration, a producer's last publishing id, the negotiated frame maximum
//! (`tune.rs`), and the handler that forwards the broker's confirms and refusals to
//! the run loop. The client is 0.11 or, for a broker before RabbitMQ 3.11, 0.4
//! (`client.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rabbitmq_stream_client::types::ResponseCode;

use tokio::sync::mpsc;

use super::client::{BrokerEvent, ClientFailure, ClientVersion, StreamClient};
use super::endpoint::Endpoint;
use super::{tune, StreamConfig};
use crate::error::{redact_url, PublishError};

/// Bound on connecting and on each request of the setup.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on closing a connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// One connection, the stream declared (when asked), the broker's events forwarded.
pub(super) struct Session {
    pub client: StreamClient,
    pub events: mpsc::UnboundedReceiver<BrokerEvent>,
    /// Where a liveness probe's answer goes (the same queue as the broker's events).
    probes: mpsc::UnboundedSender<BrokerEvent>,
    pub url_index: usize,
    /// The negotiated frame maximum (`tune.rs`).
    pub frame_max: usize,
}

impl Session {
    /// Closes the connection, bounded.
    pub async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.client.close()).await;
    }

    /// Asks the broker for the stream's metadata without waiting for the answer; an
    /// answer within `within` arrives as [`BrokerEvent::Alive`] (`liveness.rs`).
    pub fn probe(&self, stream: &str, within: Duration) {
        let client = self.client.clone();
        let probes = self.probes.clone();
        let stream = stream.to_string();
        tokio::spawn(async move {
            if let Ok(Ok(_)) = tokio::time::timeout(within, client.metadata(&stream)).await {
                let _ = probes.send(BrokerEvent::Alive);
            }
        });
    }

    /// Declares publisher `publisher_id` (named `reference`, or unnamed) and returns
    /// the broker's last stored id of that reference (0 for none, or unnamed).
    pub async fn declare(
        &self,
        config: &StreamConfig,
        publisher_id: u8,
        reference: Option<&str>,
    ) -> Result<u64, PublishError> {
        let url = &config.urls[self.url_index];
        let setup = async {
            let code = self
                .client
                .declare_publisher(publisher_id, reference.map(str::to_string), &config.stream)
                .await
                .map_err(|e| classify(url, &e))?;
            if code != ResponseCode::Ok {
                return Err(refused(config, &code));
            }
            match reference {
                Some(reference) => self
                    .client
                    .query_publisher_sequence(reference, &config.stream)
                    .await
                    .map_err(|e| match &e.code {
                        Some(code) => refused(config, code),
                        None => classify(url, &e),
                    }),
                None => Ok(0),
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
            Ok(res) => res,
            Err(_) => Err(PublishError::Unreachable {
                url: redact_url(url),
                reason: "timed out declaring the stream publisher".into(),
            }),
        }
    }
}

/// Connects to the URLs in order from `start`, wrapping around; returns the most
/// specific error when none works.
pub(super) async fn connect_any(
    config: &StreamConfig,
    start: usize,
) -> Result<Session, PublishError> {
    let mut best: Option<PublishError> = None;
    for k in 0..config.urls.len() {
        let index = (start + k) % config.urls.len();
        match connect_one(config, index).await {
            Ok(session) => return Ok(session),
            Err(e) => {
                if !e.is_transient() {
                    return Err(e);
                }
                tracing::debug!(error = %e, "stream connection failed");
                if best
                    .as_ref()
                    .is_none_or(|b| e.specificity() > b.specificity())
                {
                    best = Some(e);
                }
            }
        }
    }
    Err(best.unwrap_or(PublishError::Unreachable {
        url: String::new(),
        reason: "no URL".into(),
    }))
}

/// Opens a plain client connection to URL `index` with the client `version` needs
/// (`client.rs`), with the password of the password file when one is configured (read
/// now). A plain `rabbitmq-stream://` URL to a host other than this one is warned
/// about.
pub(super) async fn open(
    config: &StreamConfig,
    index: usize,
    version: ClientVersion,
) -> Result<StreamClient, PublishError> {
    let url = &config.urls[index];
    let mut endpoint = Endpoint::parse(url)?;
    if let Some(path) = &config.auth.password_file {
        endpoint.password = crate::tls::read_password(path, crate::tls::Keys::Stream)?;
    }
    crate::tls::warn_if_plaintext_beyond_loopback(url, &endpoint.host, endpoint.tls);
    // The client unwraps more than the checks above can foresee: a panic in its
    // connect is a configuration error, not the end of the process.
    let mut connecting = match version {
        ClientVersion::Current => {
            let options = endpoint.options(config, url)?;
            tokio::spawn(async move {
                rabbitmq_stream_client::Client::connect(options)
                    .await
                    .map(StreamClient::Current)
                    .map_err(ClientFailure::from)
            })
        }
        ClientVersion::Filtering => {
            let tls = if endpoint.tls {
                Some(probe_tls(config)?)
            } else {
                None
            };
            let heartbeat = config.heartbeat;
            tokio::spawn(async move {
                super::raw::RawClient::connect(&endpoint, tls, tune::CLIENT_FRAME_MAX, heartbeat)
                    .await
                    .map(StreamClient::Filtering)
            })
        }
        ClientVersion::Legacy => {
            let options = endpoint.legacy_options(config, url)?;
            tokio::spawn(async move {
                rabbitmq_stream_client_legacy::Client::connect(options)
                    .await
                    .map(StreamClient::Legacy)
                    .map_err(ClientFailure::from)
            })
        }
    };
    let result = tokio::time::timeout(CONNECT_TIMEOUT, &mut connecting).await;
    if result.is_err() {
        connecting.abort();
    }
    match result {
        Ok(Ok(Ok(client))) => Ok(client),
        Ok(Ok(Err(e))) => Err(classify(url, &e)),
        Ok(Err(join)) => Err(PublishError::InvalidConfig {
            key: "stream_url",
            reason: format!(
                "the stream client failed while connecting to {} ({}): check ca_file, cert_file, key_file and the URL's host",
                redact_url(url),
                if join.is_panic() { "it panicked" } else { "it was cancelled" }
            ),
        }),
        Err(_) => Err(PublishError::Unreachable {
            url: redact_url(url),
            reason: "timed out connecting".into(),
        }),
    }
}

/// The negotiated frame maximum of a connection to `url` (docs/design.md §4, "Frames
/// within the limit") and the broker's version.
async fn frame_max_of(config: &StreamConfig, url: &str) -> Result<tune::Tuned, PublishError> {
    let mut endpoint = Endpoint::parse(url)?;
    if let Some(path) = &config.auth.password_file {
        endpoint.password = crate::tls::read_password(path, crate::tls::Keys::Stream)?;
    }
    let tls = if endpoint.tls {
        Some(probe_tls(config)?)
    } else {
        None
    };
    Ok(match tune::negotiated_frame_max(&endpoint, tls).await {
        Ok(f) => f,
        // A node that does not answer would not answer the client either: try the
        // next URL now rather than after the client's own timeout too.
        Err(tune::TuneError::Unreachable(reason)) => {
            return Err(PublishError::Unreachable {
                url: redact_url(url),
                reason,
            })
        }
        Err(tune::TuneError::Other(reason)) => {
            // The client's own connection, made next with the same settings, reports
            // what is wrong if anything is: assume the protocol's default here.
            tracing::debug!(%reason, "could not read the stream broker's frame maximum; assuming 1 MiB");
            tune::Tuned {
                frame_max: tune::CLIENT_FRAME_MAX,
                version: None,
            }
        }
    })
}

pub(super) async fn connect_one(
    config: &StreamConfig,
    index: usize,
) -> Result<Session, PublishError> {
    let url = &config.urls[index];
    // The broker's frame maximum is read on a short connection of its own *before*
    // the client's: a limit raised in between then makes the publisher assume the
    // old, smaller one until its next reconnect (a needless wait), never a larger one
    // than its connection allows (a frame the broker refuses).
    let tuned = frame_max_of(config, url).await?;
    let frame_max = tuned.frame_max;
    let mut version = ClientVersion::for_broker(tuned.version.as_deref());
    if config.filter_value.is_some() {
        if let Some(reason) = super::client::filter_refusal(tuned.version.as_deref()) {
            return Err(PublishError::InvalidConfig {
                key: "stream_filter_value",
                reason,
            });
        }
        version = ClientVersion::Filtering;
    }
    tracing::debug!(broker = ?tuned.version, client = ?version, "stream broker version");
    let client = open(config, index, version).await?;
    let setup = async {
        if config.declare_stream {
            declare_stream(&client, config).await?;
        }
        let (tx, events) = mpsc::unbounded_channel();
        let probes = tx.clone();
        client.forward_events(tx).await;
        Ok::<_, PublishError>((events, probes, frame_max as usize))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
        Ok(Ok((events, probes, frame_max))) => Ok(Session {
            client,
            events,
            probes,
            url_index: index,
            frame_max,
        }),
        Ok(Err(e)) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, client.close()).await;
            Err(e)
        }
        Err(_) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, client.close()).await;
            Err(PublishError::Unreachable {
                url: redact_url(url),
                reason: "timed out setting up the stream connection".into(),
            })
        }
    }
}

/// The TLS settings of the frame-maximum probe: the same roots and client
/// certificate as the connection's (docs/security.md).
fn probe_tls(config: &StreamConfig) -> Result<Arc<rustls::ClientConfig>, PublishError> {
    crate::tls::amqps_config(config.ca_file.as_deref(), &config.auth).map(Arc::new)
}

async fn declare_stream(client: &StreamClient, config: &StreamConfig) -> Result<(), PublishError> {
    let mut arguments = HashMap::new();
    if let Some(bytes) = config.max_length_bytes {
        arguments.insert("max-length-bytes".to_string(), bytes.to_string());
    }
    if let Some(age) = config.max_age {
        arguments.insert("max-age".to_string(), format!("{}s", age.as_secs().max(1)));
    }
    let code = client
        .create_stream(&config.stream, arguments)
        .await
        .map_err(|e| classify(&config.urls[0], &e))?;
    match code {
        ResponseCode::Ok | ResponseCode::StreamAlreadyExists => Ok(()),
        // It exists with other arguments (an operator created it with its own
        // retention or segment size): use it as it is.
        ResponseCode::PreconditionFailed => {
            tracing::info!(
                stream = %config.stream,
                "the stream exists with other arguments than max_length_bytes / max_age; using it as it is"
            );
            Ok(())
        }
        code => Err(PublishError::Stream {
            stream: config.stream.clone(),
            reason: format!("the broker refused to create it ({code:?}); check the user's configure permission and max_length_bytes / max_age"),
        }),
    }
}

/// The error for a refused declaration or query.
fn refused(config: &StreamConfig, code: &ResponseCode) -> PublishError {
    let reason = match code {
        ResponseCode::StreamDoesNotExist => {
            "it does not exist; create it or set declare_stream = true".to_string()
        }
        ResponseCode::AccessRefused => {
            "access refused; grant the user write permission on it".to_string()
        }
        ResponseCode::StreamNotAvailable => {
            return PublishError::Unreachable {
                url: redact_url(&config.urls[0]),
                reason: format!("stream {:?} is not available yet", config.stream),
            }
        }
        code => format!("the broker answered {code:?}"),
    };
    PublishError::Stream {
        stream: config.stream.clone(),
        reason,
    }
}

/// Maps a client error to what the caller does next.
pub(super) fn classify(url: &str, error: &ClientFailure) -> PublishError {
    let url = redact_url(url);
    let reason = crate::error::scrub(&error.to_string(), &url);
    match &error.code {
        Some(
            ResponseCode::AuthenticationFailure
            | ResponseCode::AuthenticationFailureLoopback
            | ResponseCode::SaslError
            | ResponseCode::SaslMechanismNotSupported,
        ) => PublishError::AuthenticationRefused { url, reason },
        Some(ResponseCode::VirtualHostAccessFailure) => PublishError::VirtualHost { url, reason },
        _ if crate::error::is_certificate_error(&reason) => {
            PublishError::TlsRefused { url, reason }
        }
        _ => PublishError::Unreachable { url, reason },
    }
}
