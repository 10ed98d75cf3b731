//! A stream-protocol URL, `rabbitmq-stream[+tls]://user:password@host:port/vhost`,
//! parsed, and the client options it gives (TLS files checked first).

use std::path::PathBuf;

use rabbitmq_stream_client::{ClientOptions, TlsConfiguration};
use rabbitmq_stream_client_legacy as legacy;

use super::StreamConfig;
use crate::error::{percent_decode, redact_url, userinfo_is_ambiguous, PublishError};

/// Where the system's CA bundle usually is (used for `+tls` without `ca_file`).
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The CA bundle, and the client certificate and key when both are set.
type TlsFiles = (PathBuf, Option<(PathBuf, PathBuf)>);

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

    /// The TLS files the client reads: the CA bundle and the client certificate and
    /// key (when both are set). Each is checked first as the client reads it (it
    /// unwraps what it cannot use: a panic, exit 101), so that a bad one is an error
    /// naming its key; `url` is for messages. `None` without TLS.
    fn tls_files(
        &self,
        config: &StreamConfig,
        url: &str,
    ) -> Result<Option<TlsFiles>, PublishError> {
        if !self.tls {
            return Ok(None);
        }
        let roots = config
            .ca_file
            .clone()
            .unwrap_or_else(|| PathBuf::from(SYSTEM_CA_BUNDLE));
        crate::tls::check_ca_file_strictly(&roots)?;
        crate::tls::check_server_name(&self.host, "stream_url", url)?;
        let identity = match (&config.auth.cert_file, &config.auth.key_file) {
            (Some(cert), Some(key)) => {
                crate::tls::check_stream_identity(&config.auth)?;
                Some((cert.clone(), key.clone()))
            }
            _ => None,
        };
        Ok(Some((roots, identity)))
    }

    /// The heartbeat the client proposes (the broker takes the lower of its own and
    /// this), and the interval of the publisher's liveness check (`liveness.rs`).
    fn heartbeat(config: &StreamConfig) -> u32 {
        u32::try_from(config.heartbeat.as_secs())
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// The options of the current client (rabbitmq-stream-client 0.11).
    pub(super) fn options(
        &self,
        config: &StreamConfig,
        url: &str,
    ) -> Result<ClientOptions, PublishError> {
        let mut tls = TlsConfiguration::builder().enable(self.tls);
        if let Some((roots, identity)) = self.tls_files(config, url)? {
            // 0.11 builds its rustls configuration with the process's default
            // crypto provider: the relay's is ring, as everywhere else.
            let _ = rustls::crypto::ring::default_provider().install_default();
            tls = tls.add_root_certificates(roots);
            if let Some((cert, key)) = identity {
                tls = tls.add_client_certificates_keys(cert, key);
            }
        }
        let tls = tls.build().map_err(|reason| PublishError::InvalidConfig {
            key: "stream_url",
            reason: format!("the stream client's TLS settings: {reason}"),
        })?;
        Ok(ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .heartbeat(Self::heartbeat(config))
            .tls(tls)
            .build())
    }

    /// The options of the client for RabbitMQ before 3.11 (rabbitmq-stream-client 0.4,
    /// `client.rs`).
    pub(super) fn legacy_options(
        &self,
        config: &StreamConfig,
        url: &str,
    ) -> Result<legacy::ClientOptions, PublishError> {
        let mut tls = legacy::TlsConfiguration::default();
        tls.enable(self.tls);
        if let Some((roots, identity)) = self.tls_files(config, url)? {
            tls.trust_certificates(false);
            tls.add_root_certificates_path(roots.display().to_string());
            if let Some((cert, key)) = identity {
                tls.add_client_certificates_keys(
                    cert.display().to_string(),
                    key.display().to_string(),
                );
            }
        }
        Ok(legacy::ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .heartbeat(Self::heartbeat(config))
            .tls(tls)
            .build())
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
