//! The HTTP server under `/metrics`, `/healthz`, `/readyz`, `/poison` and `/control/`
//! (`[relay] metrics_*`), fit for `0.0.0.0` (docs/security.md):
//!
//! ```text
//!   accept ─► over max_connections? close at once
//!          ─► [TLS handshake, within the read timeout]
//!          ─► hyper HTTP/1: request headers within the read timeout (also the
//!             longest idle time between requests of a kept-alive connection)
//!          ─► crate::endpoint_guard: the Host (421), control's origin and shape
//!             (403), credentials (bearer token or basic, or this start's control
//!             token) for /metrics, /poison and /control/ (401)
//!          ─► the router (crate::metrics)
//!   every connection ends after CONNECTION_LIFETIME whatever it does
//! ```
//!
//! The probes (`/healthz`, `/readyz`) answer without credentials, as Kubernetes
//! probes cannot send them from a secret; without credentials `/readyz` says only
//! ready or not. The credential files are read at every request, so a rotated token
//! or password works at once. The control token (crate::control_token) is made at
//! every start and written where `ctl` on this host finds it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::endpoint_guard::{Guard, Hosts};
use crate::error::CliError;

/// The longest a connection lives, whatever it does: bounds slow readers and slow
/// request bodies (a scrape answers in milliseconds).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// How the endpoint is served (`[relay] metrics_*`).
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    pub addr: SocketAddr,
    /// Time to read a request's headers (and a TLS handshake); also the longest
    /// idle time between requests.
    pub read_timeout: Duration,
    /// Connections served at once; more are closed at once.
    pub max_connections: usize,
    pub auth: Credentials,
    /// Certificate chain and key (PEM) to serve HTTPS; `None`: plain HTTP.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Host names requests may carry besides the listener's own
    /// (`[relay] metrics_allowed_hosts`, crate::endpoint_guard).
    pub allowed_hosts: Vec<String>,
    /// Where this start's control token is written (crate::control_token).
    pub token_file: crate::control_token::TokenFile,
}

/// What `/metrics` and `/poison` require; nothing when neither is set.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// A file holding the token of `Authorization: Bearer <token>`.
    pub bearer_token_file: Option<PathBuf>,
    /// The user and a file holding the password of `Authorization: Basic`.
    pub basic: Option<(String, PathBuf)>,
}

impl Credentials {
    pub fn is_set(&self) -> bool {
        self.bearer_token_file.is_some() || self.basic.is_some()
    }

    /// Reads every file once, so that a missing or empty one is an error at start
    /// that names its key.
    fn check(&self) -> Result<(), CliError> {
        if let Some(path) = &self.bearer_token_file {
            read_secret(path).map_err(|why| key_error("metrics_bearer_token_file", path, &why))?;
        }
        if let Some((user, path)) = &self.basic {
            if user.contains(':') {
                return Err(CliError::Precondition(
                    "[relay] metrics_basic_auth_user may not contain ':' (HTTP basic authentication separates user and password with it): choose another user name".into(),
                ));
            }
            read_secret(path)
                .map_err(|why| key_error("metrics_basic_auth_password_file", path, &why))?;
        }
        Ok(())
    }

    /// True when `headers` carry one of the configured credentials (always when
    /// none is configured).
    pub(crate) fn allow(&self, headers: &axum::http::HeaderMap) -> bool {
        if !self.is_set() {
            return true;
        }
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let (scheme, value) = given.trim().split_once(' ').unwrap_or((given, ""));
        let value = value.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            if let Some(path) = &self.bearer_token_file {
                return read_secret(path).is_ok_and(|t| same(t.as_bytes(), value.as_bytes()));
            }
        }
        if scheme.eq_ignore_ascii_case("basic") {
            if let Some((user, path)) = &self.basic {
                use base64::Engine;
                let Ok(password) = read_secret(path) else {
                    return false;
                };
                let expected =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                return same(expected.as_bytes(), value.as_bytes());
            }
        }
        false
    }
}

/// A secret file's content without surrounding whitespace (a trailing newline is
/// common); an empty one is an error.
pub(crate) fn read_secret(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let text = text.trim();
    if text.is_empty() {
        return Err("it is empty".into());
    }
    Ok(text.to_string())
}

fn key_error(key: &str, path: &std::path::Path, why: &str) -> CliError {
    CliError::Precondition(format!(
        "cannot read [relay] {key} {} ({why}): point it at a readable file holding the secret",
        path.display()
    ))
}

/// Compares without an early exit on the first difference.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carried the configured credentials (or none are needed);
/// `/readyz` gives its detail only then.
#[derive(Debug, Clone, Copy)]
pub struct Authorized(pub bool);

/// Binds the listener and serves `router` in the background under `cfg`'s limits.
pub async fn serve(cfg: EndpointConfig, router: Router) -> Result<(), CliError> {
    cfg.auth.check()?;
    let tls = match &cfg.tls {
        Some((cert, key)) => Some(tls_acceptor(cert, key)?),
        None => None,
    };
    let addr = cfg.addr;
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        CliError::Precondition(format!(
            "cannot listen on {addr} for metrics ({e}): choose a free address in [relay] metrics_listen, or \"\" to disable"
        ))
    })?;
    if !addr.ip().is_loopback() {
        if !cfg.auth.is_set() {
            warn!(%addr, "the metrics endpoint listens beyond loopback without credentials: anyone who reaches it reads /metrics and /poison (message ids, routing keys), and control (ctl) is refused; set [relay] metrics_bearer_token_file or metrics_basic_auth_user and metrics_basic_auth_password_file (docs/security.md)");
        } else if tls.is_none() {
            warn!(%addr, "the metrics endpoint takes credentials over plain HTTP beyond loopback: anyone on the path reads them; set [relay] metrics_tls_cert_file and metrics_tls_key_file (docs/security.md)");
        }
    }
    let token = crate::control_token::generate().map_err(CliError::Runtime)?;
    // Control works on loopback, or with credentials: only then is the file of use.
    let written = if addr.ip().is_loopback() || cfg.auth.is_set() {
        write_token(&cfg.token_file, &token)?
    } else {
        None
    };
    let guard = Arc::new(Guard {
        auth: cfg.auth.clone(),
        loopback: addr.ip().is_loopback(),
        hosts: Hosts::new(addr.ip(), &cfg.allowed_hosts),
        token,
    });
    let router = router.layer(axum::middleware::from_fn_with_state(
        guard,
        crate::endpoint_guard::check,
    ));
    let limits = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    let read_timeout = cfg.read_timeout;
    tokio::spawn(async move {
        // Removed with the task, when the runtime ends at the process's exit.
        let _written = written;
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: do not spin.
                    debug!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = limits.clone().try_acquire_owned() else {
                debug!(%peer, "metrics endpoint: connection cap reached; connection closed");
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let router = router.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let conn = async move {
                    match tls {
                        None => connection(tcp, router, read_timeout).await,
                        Some(acceptor) => {
                            match tokio::time::timeout(read_timeout, acceptor.accept(tcp)).await {
                                Ok(Ok(stream)) => connection(stream, router, read_timeout).await,
                                Ok(Err(e)) => {
                                    debug!(%peer, error = %e, "metrics endpoint: TLS handshake failed")
                                }
                                Err(_) => {
                                    debug!(%peer, "metrics endpoint: TLS handshake timed out")
                                }
                            }
                        }
                    }
                };
                if tokio::time::timeout(CONNECTION_LIFETIME, conn)
                    .await
                    .is_err()
                {
                    debug!(%peer, "metrics endpoint: connection closed after {CONNECTION_LIFETIME:?}");
                }
            });
        }
    });
    Ok(())
}

/// Writes this start's control token; a failure stops `run` when
/// `[relay] control_token_file` names the file, else it is warned about.
fn write_token(
    file: &crate::control_token::TokenFile,
    token: &str,
) -> Result<Option<crate::control_token::Written>, CliError> {
    match crate::control_token::write(file, token) {
        Ok(written) => {
            info!(file = %file.path.display(), "control token written: `outbox-relay ctl` as this user reads it");
            Ok(Some(written))
        }
        Err(why) if file.configured => Err(CliError::Precondition(format!(
            "cannot write the control token to [relay] control_token_file ({why}): name a file in a directory the relay's user may write, or \"\" for the default"
        ))),
        Err(why) => {
            warn!("cannot write the control token ({why}): `ctl` on this host cannot control the relay without it; set [relay] control_token_file to a file in a directory the relay's user may write (docs/operations.md, \"Incident levers\")");
            Ok(None)
        }
    }
}

/// Serves HTTP/1 requests on one connection until it ends.
async fn connection<I>(io: I, router: Router, read_timeout: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(router);
    let result = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(read_timeout)
        .max_buf_size(64 * 1024)
        .serve_connection(TokioIo::new(io), service)
        .await;
    if let Err(e) = result {
        debug!(error = %e, "metrics endpoint: connection ended");
    }
}

fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, CliError> {
    let pem = std::fs::read(cert)
        .map_err(|e| key_error("metrics_tls_cert_file", cert, &e.to_string()))?;
    let chain: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| key_error("metrics_tls_cert_file", cert, &e.to_string()))?;
    if chain.is_empty() {
        return Err(key_error(
            "metrics_tls_cert_file",
            cert,
            "it holds no PEM certificate",
        ));
    }
    let pem =
        std::fs::read(key).map_err(|e| key_error("metrics_tls_key_file", key, &e.to_string()))?;
    let private = rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| key_error("metrics_tls_key_file", key, &e.to_string()))?
        .ok_or_else(|| key_error("metrics_tls_key_file", key, "it holds no PEM private key"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CliError::Runtime(format!("cannot set up TLS for metrics: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| {
            key_error(
                "metrics_tls_key_file",
                key,
                &format!("it does not fit the certificate ({e})"),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn credentials_are_compared_whole() {
        let dir = std::env::temp_dir().join(testkit::unique_name("cred"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("t"), "tok\n").unwrap();
        std::fs::write(dir.join("p"), "pw").unwrap();
        let c = Credentials {
            bearer_token_file: Some(dir.join("t")),
            basic: Some(("u".into(), dir.join("p"))),
        };
        let h = |v: &str| {
            let mut m = axum::http::HeaderMap::new();
            m.insert(header::AUTHORIZATION, v.parse().unwrap());
            m
        };
        assert!(c.allow(&h("Bearer tok")));
        assert!(c.allow(&h("bearer  tok")));
        assert!(!c.allow(&h("Bearer to")));
        assert!(!c.allow(&h("Bearer tokk")));
        assert!(c.allow(&h("Basic dTpwdw==")));
        assert!(!c.allow(&h("Basic dTpwdx==")));
        assert!(!c.allow(&axum::http::HeaderMap::new()));
        assert!(Credentials::default().allow(&axum::http::HeaderMap::new()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
