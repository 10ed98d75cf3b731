//! Stream-protocol connections: URL parsing, connect, stream and publisher
//! declaration, the producer's last publishing id, and the handler that forwards the
//! broker's confirms and refusals to the run loop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use rabbitmq_stream_client::error::ClientError;
use rabbitmq_stream_client::types::{ResponseCode, ResponseKind};
use rabbitmq_stream_client::{Client, ClientOptions, TlsConfiguration};

use tokio::sync::mpsc;

use super::StreamConfig;
use crate::error::{percent_decode, redact_url, userinfo_is_ambiguous, PublishError};

/// The one publisher id used on a connection.
pub(super) const PUBLISHER_ID: u8 = 1;
/// Bound on connecting and on each request of the setup.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on closing a connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Where the system's CA bundle usually is (used for `+tls` without `ca_file`).
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A parsed `rabbitmq-stream[+tls]://user:password@host:port/vhost` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub tls: bool,
    pub user: String,
    pub password: String,
    pub host: String,
    pub port: u16,
    pub vhost: String,
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> Result<Endpoint, PublishError> {
        let invalid = |reason: String| PublishError::InvalidConfig {
            key: "stream_url",
            reason,
        };
        let (tls, rest) = if let Some(r) = url.strip_prefix("rabbitmq-stream+tls://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("rabbitmq-stream://") {
            (false, r)
        } else {
            return Err(invalid(format!(
                "{} is not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL; fix the scheme",
                redact_url(url)
            )));
        };
        if userinfo_is_ambiguous(url) {
            return Err(invalid(crate::error::PERCENT_ENCODE_PASSWORD.into()));
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostport) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            Some(u) => {
                let (user, password) = u.split_once(':').unwrap_or((u, ""));
                (percent_decode(user), percent_decode(password))
            }
            None => ("guest".to_string(), "guest".to_string()),
        };
        if hostport.starts_with('[') {
            return Err(invalid(format!(
                "{} has an IPv6 address as its host: use a host name that resolves to it",
                redact_url(url)
            )));
        }
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| invalid(format!("{} has an invalid port", redact_url(url))))?,
            ),
            None => (hostport, if tls { 5551 } else { 5552 }),
        };
        if host.is_empty() {
            return Err(invalid(format!("{} has no host", redact_url(url))));
        }
        let path = path.split(['?', '#']).next().unwrap_or_default();
        let vhost = if path.is_empty() {
            "/".to_string()
        } else {
            percent_decode(path)
        };
        Ok(Endpoint {
            tls,
            user,
            password,
            host: host.to_string(),
            port,
            vhost,
        })
    }

    pub(super) fn options(&self, config: &StreamConfig) -> Result<ClientOptions, PublishError> {
        let mut tls = TlsConfiguration::default();
        tls.enable(self.tls);
        if self.tls {
            let roots = config
                .ca_file
                .clone()
                .unwrap_or_else(|| PathBuf::from(SYSTEM_CA_BUNDLE));
            if std::fs::metadata(&roots).is_err() {
                return Err(PublishError::CaFile {
                    path: roots.display().to_string(),
                    reason: "not readable".into(),
                });
            }
            tls.trust_certificates(false);
            tls.add_root_certificates_path(roots.display().to_string());
        }
        Ok(ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .tls(tls)
            .build())
    }
}

/// What the broker reports on a publishing connection.
#[derive(Debug)]
pub(super) enum BrokerEvent {
    Confirmed(Vec<u64>),
    /// Publishing ids refused, with the code.
    Refused(Vec<(u64, ResponseCode)>),
    /// The connection is gone or the stream changed (deleted, leader moved).
    Closed(String),
}

/// One connection with the publisher declared.
pub(super) struct Session {
    pub client: Client,
    pub events: mpsc::UnboundedReceiver<BrokerEvent>,
    pub url_index: usize,
    /// The named producer's last stored publishing id (0: none, or unnamed).
    pub last_id: u64,
}

impl Session {
    /// Closes the connection, bounded.
    pub async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.client.close()).await;
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

/// Opens a plain client connection to URL `index` (also used by the tail reader).
pub(super) async fn open(config: &StreamConfig, index: usize) -> Result<Client, PublishError> {
    let url = &config.urls[index];
    let endpoint = Endpoint::parse(url)?;
    let options = endpoint.options(config)?;
    match tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(options)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(classify(url, &e)),
        Err(_) => Err(PublishError::Unreachable {
            url: redact_url(url),
            reason: "timed out connecting".into(),
        }),
    }
}

async fn connect_one(config: &StreamConfig, index: usize) -> Result<Session, PublishError> {
    let url = &config.urls[index];
    let client = open(config, index).await?;
    let setup = async {
        if config.declare_stream {
            declare_stream(&client, config).await?;
        }
        let (tx, events) = mpsc::unbounded_channel();
        let forward = move |item: rabbitmq_stream_client::types::MessageResult| {
            let tx = tx.clone();
            async move {
                let event = match item {
                    Some(Ok(response)) => match response.kind() {
                        ResponseKind::PublishConfirm(c) => {
                            Some(BrokerEvent::Confirmed(c.publishing_ids))
                        }
                        ResponseKind::PublishError(e) => Some(BrokerEvent::Refused(
                            e.publishing_errors
                                .into_iter()
                                .map(|p| (p.publishing_id, p.error_code))
                                .collect(),
                        )),
                        ResponseKind::MetadataUpdate(m) => Some(BrokerEvent::Closed(format!(
                            "the broker reports a change of the stream ({m:?})"
                        ))),
                        ResponseKind::Close(c) => Some(BrokerEvent::Closed(format!(
                            "the broker closed the connection ({:?})",
                            c
                        ))),
                        _ => None,
                    },
                    Some(Err(e)) => Some(BrokerEvent::Closed(e.to_string())),
                    None => Some(BrokerEvent::Closed("connection closed".into())),
                };
                if let Some(event) = event {
                    let _ = tx.send(event);
                }
                Ok(())
            }
        };
        client.set_handler(forward).await;
        let response = client
            .declare_publisher(
                PUBLISHER_ID,
                config.producer_reference.clone(),
                &config.stream,
            )
            .await
            .map_err(|e| classify(url, &e))?;
        if !response.is_ok() {
            return Err(refused(config, response.code()));
        }
        let last_id = match &config.producer_reference {
            Some(reference) => client
                .query_publisher_sequence(reference, &config.stream)
                .await
                .map_err(|e| match e {
                    ClientError::RequestError(code) => refused(config, &code),
                    e => classify(url, &e),
                })?,
            None => 0,
        };
        Ok::<_, PublishError>((events, last_id))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
        Ok(Ok((events, last_id))) => Ok(Session {
            client,
            events,
            url_index: index,
            last_id,
        }),
        Ok(Err(e)) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, client.close()).await;
            Err(e)
        }
        Err(_) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, client.close()).await;
            Err(PublishError::Unreachable {
                url: redact_url(url),
                reason: "timed out declaring the stream publisher".into(),
            })
        }
    }
}

async fn declare_stream(client: &Client, config: &StreamConfig) -> Result<(), PublishError> {
    let mut arguments = HashMap::new();
    if let Some(bytes) = config.max_length_bytes {
        arguments.insert("max-length-bytes".to_string(), bytes.to_string());
    }
    if let Some(age) = config.max_age {
        arguments.insert("max-age".to_string(), format!("{}s", age.as_secs().max(1)));
    }
    let response = client
        .create_stream(&config.stream, arguments)
        .await
        .map_err(|e| classify(&config.urls[0], &e))?;
    match response.code() {
        ResponseCode::Ok | ResponseCode::StreamAlreadyExists => Ok(()),
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
pub(super) fn classify(url: &str, error: &ClientError) -> PublishError {
    let url = redact_url(url);
    let reason = crate::error::scrub(&error.to_string(), &url);
    match error {
        ClientError::RequestError(
            ResponseCode::AuthenticationFailure
            | ResponseCode::AuthenticationFailureLoopback
            | ResponseCode::SaslError
            | ResponseCode::SaslMechanismNotSupported,
        ) => PublishError::AuthenticationRefused { url, reason },
        ClientError::RequestError(ResponseCode::VirtualHostAccessFailure) => {
            PublishError::VirtualHost { url, reason }
        }
        _ if crate::error::is_certificate_error(&reason) => {
            PublishError::TlsRefused { url, reason }
        }
        _ => PublishError::Unreachable { url, reason },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_stream_urls() {
        let e = Endpoint::parse("rabbitmq-stream://u:p%2Fw@vm:5553/%2f").unwrap();
        assert_eq!(
            e,
            Endpoint {
                tls: false,
                user: "u".into(),
                password: "p/w".into(),
                host: "vm".into(),
                port: 5553,
                vhost: "/".into(),
            }
        );
        let e = Endpoint::parse("rabbitmq-stream+tls://h/prod").unwrap();
        assert!(e.tls);
        assert_eq!(
            (e.port, e.vhost.as_str(), e.user.as_str()),
            (5551, "prod", "guest")
        );
        assert!(Endpoint::parse("amqp://h/").is_err());
        assert!(Endpoint::parse("rabbitmq-stream://[::1]:5552/").is_err());
        assert!(Endpoint::parse("rabbitmq-stream://h:x/").is_err());
        let err = Endpoint::parse("rabbitmq-stream://u:secret@h:x/")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("secret"), "{err}");
    }
}
