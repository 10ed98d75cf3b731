//! Getting a connection to publish on: the URL list tried in order (the password
//! file read at every connect), and what is declared on it (`topology.rs`), as at
//! start so after every failure.

use crate::amqp::config::PublisherConfig;
use std::sync::Arc;

use crate::amqp::connection::{self, ConnError, ConnectError, Connection, Params, CONNECT_TIMEOUT};
use crate::error::{is_certificate_error, redact_url, scrub, PublishError};
use crate::tls::{self, Keys, Tls};

/// Connects to the URLs in order starting at `start`: the first node that answers
/// wins. Every URL is tried, whatever the others answered: a node that refuses the
/// virtual host (530 while it boots, 403 while the vhost is being re-created) or the
/// login may be the only bad one of a cluster. When every node failed, the most
/// meaningful error is returned ([`PublishError::specificity`]): a refusal names what
/// to fix, an unreachable node does not. The exchanges of `config`, and its
/// `[topology]` when it has one, are declared on the connection that answered.
pub(crate) async fn connect_any(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
) -> Result<Connection, PublishError> {
    first_that_answers(config, tls, start, true).await
}

/// [`connect_any`] without declaring anything: a login only (the probes of
/// `check`, which create nothing).
pub(crate) async fn login_any(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
) -> Result<Connection, PublishError> {
    first_that_answers(config, tls, start, false).await
}

/// What a connection takes from `config`, read now: the password file's password
/// put in the URLs, and the TLS configuration of `amqps` URLs built from the files
/// (so a rotated secret or certificate is used at the next connect).
pub(crate) fn params(config: &PublisherConfig, how: &Tls) -> Result<Params, PublishError> {
    let urls = match &config.auth.password_file {
        Some(path) => {
            let password = tls::read_password(path, Keys::Amqp)?;
            config
                .urls
                .iter()
                .map(|u| tls::with_password(u, &password))
                .collect()
        }
        None => config.urls.clone(),
    };
    // A TLS file that cannot be used fails the amqps URLs only (`first_that_answers`).
    let tls = if urls.iter().any(|u| is_amqps(u)) {
        tls_config(config, how).ok()
    } else {
        None
    };
    Ok(Params {
        urls,
        tls,
        request_timeout: config.request_timeout,
        name: config.connection_name.clone(),
    })
}

fn is_amqps(url: &str) -> bool {
    url.starts_with("amqps://")
}

/// The TLS client configuration of `config`'s `amqps` URLs, built from the files now.
fn tls_config(
    config: &PublisherConfig,
    how: &Tls,
) -> Result<Arc<rustls::ClientConfig>, PublishError> {
    let rustls = match how {
        Tls::Own => tls::amqps_config(config.ca_file.as_deref(), &config.auth)?,
        Tls::SystemRoots => tls::amqps_config(None, &tls::ClientAuth::default())?,
    };
    Ok(Arc::new(rustls))
}

/// Logs once per URL that a plain `amqp://` URL sends the credentials in clear to
/// a host other than this one.
fn warn_if_plaintext(url: &str) {
    if let Ok(uri) = url.parse::<amq_protocol::uri::AMQPUri>() {
        let host = connection::host_of(url, &uri);
        let secure = uri.scheme == amq_protocol::uri::AMQPScheme::AMQPS;
        tls::warn_if_plaintext_beyond_loopback(url, &host, secure);
    }
}

async fn first_that_answers(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
    declare: bool,
) -> Result<Connection, PublishError> {
    let mut params = params(config, tls)?;
    let count = params.urls.len();
    let mut best: Option<PublishError> = None;
    for offset in 0..count {
        let index = (start + offset) % count;
        if is_amqps(params.url(index)) && params.tls.is_none() {
            // The TLS files could not be used: this node's error is theirs.
            match tls_config(config, tls) {
                Ok(c) => params.tls = Some(c),
                Err(e) => {
                    keep_best(&mut best, e);
                    continue;
                }
            }
        }
        let connected: Result<Connection, PublishError> = match connect_to(&params, index).await {
            Ok(conn) if !declare => return Ok(conn),
            Ok(mut conn) => match super::topology::declare_all(&mut conn, config).await {
                Ok(()) => return Ok(conn),
                Err(e) => {
                    conn.close().await;
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        let Err(e) = connected else { continue };
        keep_best(&mut best, e);
    }
    Err(best.unwrap_or_else(|| PublishError::InvalidConfig {
        key: "url",
        reason: "no URL configured; set at least one amqp:// or amqps:// URL".into(),
    }))
}

/// Node `index` of `params`, as the connection opens it (the plaintext warning
/// first).
pub(crate) async fn connect_to(params: &Params, index: usize) -> Result<Connection, PublishError> {
    let url = params.url(index);
    warn_if_plaintext(url);
    let redacted = redact_url(url);
    connection::connect(params, index)
        .await
        .map_err(|e| match e {
            ConnectError::BadUrl(e) => PublishError::InvalidConfig {
                key: "url",
                reason: format!(
                    "{redacted} cannot be parsed ({}); fix the URL",
                    scrub(&e, url)
                ),
            },
            ConnectError::Handshake { error, after_login } => {
                classify(&redacted, url, &error, after_login)
            }
            ConnectError::Timeout => PublishError::Unreachable {
                url: redacted,
                reason: format!("no answer within {CONNECT_TIMEOUT:?}"),
            },
        })
}

/// Sorts a failed handshake into the publisher's errors, its text cleared of the
/// URL. The broker refuses a login with `connection.close` 403 (the relay asks for
/// `authentication_failure_close`), so a socket that ends after the credentials
/// were sent is an outage, not a refusal.
fn classify(redacted: &str, url: &str, error: &ConnError, after_login: bool) -> PublishError {
    let url_shown = redacted.to_string();
    let reason = scrub(&error.to_string(), url);
    match error {
        ConnError::Closed { code: 403, text } if text.contains("vhost") => {
            PublishError::VirtualHost {
                url: url_shown,
                reason,
            }
        }
        ConnError::Closed { code: 403, .. } => PublishError::AuthenticationRefused {
            url: url_shown,
            reason,
        },
        ConnError::Closed { code: 530, text } if text.contains("connection limit") => {
            PublishError::ConnectionLimit {
                url: url_shown,
                reason,
            }
        }
        ConnError::Closed {
            code: 530 | 402, ..
        } => PublishError::VirtualHost {
            url: url_shown,
            reason,
        },
        _ if is_certificate_error(&reason) => PublishError::TlsRefused {
            url: url_shown,
            reason,
        },
        ConnError::Io(_) if after_login => PublishError::Unreachable {
            url: url_shown,
            reason: format!("the connection ended during the login: {reason}"),
        },
        _ => PublishError::Unreachable {
            url: url_shown,
            reason,
        },
    }
}

/// Keeps the error of a node that failed if it says more than `best`: the first of
/// the most specific errors wins; among unreachable nodes the last one (a
/// connection limit, transient too, is never replaced by a later node that did not
/// answer).
fn keep_best(best: &mut Option<PublishError>, e: PublishError) {
    if e.is_transient() {
        tracing::debug!(error = %e, "broker node unreachable; trying the next");
    } else {
        tracing::debug!(error = %e, "broker node refused the connection; trying the next");
    }
    if best.as_ref().is_none_or(|b| {
        e.specificity() > b.specificity()
            || (e.specificity() == b.specificity() && b.is_transient() && e.is_transient())
    }) {
        *best = Some(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA file that cannot be read fails the amqps URLs of a round only: the plain
    /// URL of the same list still connects (real broker), and the amqps one alone
    /// reports the file.
    #[tokio::test]
    async fn an_unusable_tls_file_fails_only_the_amqps_urls() {
        let missing = std::env::temp_dir()
            .join(testkit::unique_name("no-ca"))
            .join("ca.pem");
        let mut config = PublisherConfig::new("amqps://guest:guest@127.0.0.1:1/%2f", "outbox");
        config.ca_file = Some(missing.clone());
        config.urls.push(testkit::amqp_url());
        let conn = login_any(&config, &Tls::Own, 0)
            .await
            .expect("the plain URL connects");
        assert_eq!(conn.node, 1);
        config.urls.truncate(1);
        let e = login_any(&config, &Tls::Own, 0)
            .await
            .err()
            .expect("the amqps URL alone fails");
        let text = e.to_string();
        assert!(
            text.contains("ca.pem") || text.contains("ca_file"),
            "{text}"
        );
    }
}
