//! Stream-protocol connections: URL parsing, connect, stream and publisher
//! declaration, a producer's last publishing id, the negotiated frame maximum
//! (`tune.rs`), and the handler that forwards the broker's confirms and refusals to
//! the run loop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rabbitmq_stream_client::error::ClientError;
use rabbitmq_stream_client::types::{ResponseCode, ResponseKind};
use rabbitmq_stream_client::{Client, ClientOptions, TlsConfiguration};

use tokio::sync::mpsc;

use super::{tune, StreamConfig};
use crate::error::{percent_decode, redact_url, userinfo_is_ambiguous, PublishError};

/// Bound on connecting and on each request of the setup.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on closing a connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Where the system's CA bundle usually is (used for `+tls` without `ca_file`).
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A parsed `rabbitmq-stream[+tls]://user:password@host:port/vhost` URL. Its `Debug`
/// hides the password.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub tls: bool,
    pub user: String,
    pub password: String,
    pub host: String,
    pub port: u16,
    pub vhost: String,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &"***")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("vhost", &self.vhost)
            .finish()
    }
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

    /// The client's options. Every TLS file is checked first as the client reads it
    /// (it unwraps what it cannot use: a panic, exit 101), so that a bad one is an
    /// error naming its key; `url` is for messages.
    pub(super) fn options(
        &self,
        config: &StreamConfig,
        url: &str,
    ) -> Result<ClientOptions, PublishError> {
        let mut tls = TlsConfiguration::default();
        tls.enable(self.tls);
        if self.tls {
            let roots = config
                .ca_file
                .clone()
                .unwrap_or_else(|| PathBuf::from(SYSTEM_CA_BUNDLE));
            crate::tls::check_ca_file_strictly(&roots)?;
            crate::tls::check_server_name(&self.host, "stream_url", url)?;
            tls.trust_certificates(false);
            tls.add_root_certificates_path(roots.display().to_string());
            if let (Some(cert), Some(key)) = (&config.auth.cert_file, &config.auth.key_file) {
                crate::tls::check_stream_identity(&config.auth)?;
                tls.add_client_certificates_keys(
                    cert.display().to_string(),
                    key.display().to_string(),
                );
            }
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
    /// Publishing ids of a publisher stored (or dropped as duplicates).
    Confirmed(u8, Vec<u64>),
    /// Publishing ids of a publisher refused, with the code.
    Refused(u8, Vec<(u64, ResponseCode)>),
    /// The connection is gone or the stream changed (deleted, leader moved).
    Closed(String),
}

/// One connection, the stream declared (when asked), the broker's events forwarded.
pub(super) struct Session {
    pub client: Client,
    pub events: mpsc::UnboundedReceiver<BrokerEvent>,
    pub url_index: usize,
    /// The negotiated frame maximum (`tune.rs`).
    pub frame_max: usize,
}

impl Session {
    /// Closes the connection, bounded.
    pub async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.client.close()).await;
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
            let response = self
                .client
                .declare_publisher(publisher_id, reference.map(str::to_string), &config.stream)
                .await
                .map_err(|e| classify(url, &e))?;
            if !response.is_ok() {
                return Err(refused(config, response.code()));
            }
            match reference {
                Some(reference) => self
                    .client
                    .query_publisher_sequence(reference, &config.stream)
                    .await
                    .map_err(|e| match e {
                        ClientError::RequestError(code) => refused(config, &code),
                        e => classify(url, &e),
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

/// Opens a plain client connection to URL `index` (also used by the tail reader),
/// with the password of the password file when one is configured (read now). A
/// plain `rabbitmq-stream://` URL to a host other than this one is warned about.
pub(super) async fn open(config: &StreamConfig, index: usize) -> Result<Client, PublishError> {
    let url = &config.urls[index];
    let mut endpoint = Endpoint::parse(url)?;
    if let Some(path) = &config.auth.password_file {
        endpoint.password = crate::tls::read_password(path, crate::tls::Keys::Stream)?;
    }
    crate::tls::warn_if_plaintext_beyond_loopback(url, &endpoint.host, endpoint.tls);
    let options = endpoint.options(config, url)?;
    // The client unwraps more than the checks above can foresee: a panic in its
    // connect is a configuration error, not the end of the process.
    let mut connecting = tokio::spawn(Client::connect(options));
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
                            Some(BrokerEvent::Confirmed(c.publisher_id, c.publishing_ids))
                        }
                        ResponseKind::PublishError(e) => Some(BrokerEvent::Refused(
                            e.publisher_id,
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
        let mut endpoint = Endpoint::parse(url)?;
        if let Some(path) = &config.auth.password_file {
            endpoint.password = crate::tls::read_password(path, crate::tls::Keys::Stream)?;
        }
        let tls = if endpoint.tls {
            Some(probe_tls(config)?)
        } else {
            None
        };
        let frame_max = match tune::negotiated_frame_max(&endpoint, tls).await {
            Ok(f) => f,
            Err(reason) => {
                // The client connected with the same settings, so this is unusual:
                // assume the protocol's default.
                tracing::debug!(%reason, "could not read the stream broker's frame maximum; assuming 1 MiB");
                tune::CLIENT_FRAME_MAX
            }
        };
        Ok::<_, PublishError>((events, frame_max as usize))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
        Ok(Ok((events, frame_max))) => Ok(Session {
            client,
            events,
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
        // It exists with other arguments (an operator created it with its own
        // retention or segment size): use it as it is.
        ResponseCode::PrecoditionFailed => {
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
        let e = Endpoint::parse("rabbitmq-stream://u:Sekr1t@h:5552/").unwrap();
        let debug = format!("{e:?} {e:#?}");
        assert!(
            !debug.contains("Sekr1t") && debug.contains("***"),
            "{debug}"
        );
    }
}
