//! Asking the running relay's endpoint (`[relay] metrics_*`) a question, as a
//! scraper does: with its credentials (bearer token, else basic) and over its TLS.
//! `status` reads `/poison` this way (docs/security.md), and `ctl` sends its
//! commands to `/control/`.
//!
//! ```text
//!   metrics_listen (0.0.0.0 / :: → the loopback address of that family)
//!     ─► [TLS: the server's certificate must be the first of metrics_tls_cert_file]
//!     ─► GET path HTTP/1.0 + Authorization ─► 200: the body; else why not
//! ```
//!
//! The relay trusts exactly the certificate it serves itself: no CA and no host name
//! come into it, and nothing else on the port is believed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::endpoint::{read_secret, EndpointConfig};

/// How long one question may take, connection and TLS included.
const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest answer read.
const MAX_ANSWER: u64 = 1 << 20;

/// `GET path` on the endpoint: the body of a 200 answer, else why there is none (a
/// sentence fragment without any secret).
pub async fn get(ep: &EndpointConfig, path: &str) -> Result<String, String> {
    let (status, body) = request(ep, "GET", path).await?;
    match status {
        200 => Ok(body),
        other => Err(refusal(other)),
    }
}

/// `method path` on the endpoint (`ctl`): the status code and the body, whatever
/// the status; `Err` when no HTTP answer came.
pub async fn request(
    ep: &EndpointConfig,
    method: &str,
    path: &str,
) -> Result<(u16, String), String> {
    match tokio::time::timeout(ASK_TIMEOUT, ask(ep, method, path)).await {
        Ok(answer) => answer,
        Err(_) => Err(format!("no answer within {} s", ASK_TIMEOUT.as_secs())),
    }
}

/// Why a status other than 200 gave no answer.
pub fn refusal(status: u16) -> String {
    match status {
        401 => "the endpoint refused the credentials (HTTP 401): check [relay] metrics_bearer_token_file or metrics_basic_auth_* here and in the running relay".into(),
        other => format!("the endpoint answered HTTP {other}"),
    }
}

async fn ask(ep: &EndpointConfig, method: &str, path: &str) -> Result<(u16, String), String> {
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: outbox-relay\r\nContent-Length: 0\r\n{}\r\n",
        authorization(ep)?
    );
    let addr = reachable(ep.addr);
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let answer = match &ep.tls {
        None => exchange(tcp, &request).await?,
        Some((cert, _)) => {
            let connector = tokio_rustls::TlsConnector::from(Arc::new(pinned_config(cert)?));
            let name = ServerName::try_from("outbox-relay").map_err(|e| e.to_string())?;
            let tls = connector
                .connect(name, tcp)
                .await
                .map_err(|e| format!("the TLS handshake with {addr} failed: {e}"))?;
            exchange(tls, &request).await?
        }
    };
    let text = String::from_utf8_lossy(&answer);
    let status = text.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok());
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    match status {
        Some(status) => Ok((status, body.to_string())),
        None => Err("the endpoint sent no HTTP answer".into()),
    }
}

/// The header carrying the configured credentials (empty when none are set).
fn authorization(ep: &EndpointConfig) -> Result<String, String> {
    use base64::Engine;
    let read = |key: &str, path: &Path| {
        read_secret(path).map_err(|why| format!("cannot read [relay] {key} ({why})"))
    };
    if let Some(path) = &ep.auth.bearer_token_file {
        let token = read("metrics_bearer_token_file", path)?;
        return Ok(format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some((user, path)) = &ep.auth.basic {
        let password = read("metrics_basic_auth_password_file", path)?;
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        return Ok(format!("Authorization: Basic {pair}\r\n"));
    }
    Ok(String::new())
}

/// The address to connect to: a wildcard listen address is reached on loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &str,
) -> Result<Vec<u8>, String> {
    let io = |e: std::io::Error| format!("the endpoint's connection failed: {e}");
    stream.write_all(request.as_bytes()).await.map_err(io)?;
    let mut answer = Vec::new();
    let read = (&mut stream)
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .await;
    // A TLS peer that closes without close_notify still sent the whole answer.
    if let Err(e) = read {
        if answer.is_empty() {
            return Err(io(e));
        }
    }
    Ok(answer)
}

/// A TLS client that accepts only the first certificate of `cert_file` (the one
/// the endpoint serves), checking the handshake's signatures with it.
fn pinned_config(cert_file: &Path) -> Result<rustls::ClientConfig, String> {
    let pem = std::fs::read(cert_file)
        .map_err(|e| format!("cannot read [relay] metrics_tls_cert_file ({e})"))?;
    let cert = rustls_pemfile::certs(&mut pem.as_slice())
        .next()
        .and_then(Result::ok)
        .ok_or("[relay] metrics_tls_cert_file holds no PEM certificate")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(Pinned {
        cert,
        provider: provider.clone(),
    });
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// Trusts one certificate, the endpoint's own.
#[derive(Debug)]
struct Pinned {
    cert: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.cert.as_ref() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the server's certificate is not the one of [relay] metrics_tls_cert_file".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listen_address_is_reached_on_loopback() {
        let at = |s: &str| reachable(s.parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))));
        assert_eq!(at("0.0.0.0:9187").to_string(), "127.0.0.1:9187");
        assert_eq!(at("[::]:9187").to_string(), "[::1]:9187");
        assert_eq!(at("10.1.2.3:9187").to_string(), "10.1.2.3:9187");
    }
}
