//! The HTTP server under `/metrics`, `/healthz`, `/readyz`, `/poison` and `/control/`
//! (`[relay] metrics_*`), fit for `0.0.0.0` (docs/security.md):
//!
//! ```text
//!   accept ─► over max_connections? close at once
//!          ─► [TLS handshake, within the read timeout]
//!          ─► hyper HTTP/1: request headers within the read timeout (also the
//!             longest idle time between requests of a kept-alive connection)
//!          ─► crate::endpoint::guard: the Host (421), control's origin and shape
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

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::endpoint::auth::{key_error, Credentials};
use crate::endpoint::guard::{Guard, Hosts};
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
    /// (`[relay] metrics_allowed_hosts`, crate::endpoint::guard).
    pub allowed_hosts: Vec<String>,
    /// Where this start's control token is written (crate::control_token).
    pub token_file: crate::control_token::TokenFile,
}

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
        crate::endpoint::guard::check,
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
