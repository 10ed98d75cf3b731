//! Asking the running relay's endpoint (`[relay] metrics_*`) a question: `status`
//! reads `/poison` and `/metrics` this way, and `ctl` sends its commands to
//! `/control/` (docs/security.md, "Control").
//!
//! ```text
//!   target (metrics_listen, 0.0.0.0 / :: → loopback; or ctl --endpoint URL)
//!     ─► which credential: none for the probes; on this host the control token
//!        file's token; else the configured ones, over TLS only
//!     ─► [TLS: the server's certificate must be the first of metrics_tls_cert_file]
//!     ─► [plain HTTP with the token: GET /control/proof?nonce=N, checked]
//!     ─► request + Authorization on that same connection ─► status and body
//! ```
//!
//! A credential goes only to a port whose owner is proven to be the relay: TLS with
//! the relay's own certificate, or, on this host, the proof of this start's control
//! token (crate::control_token) on the connection that then carries it. A process
//! that took the port answers neither, and gets nothing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::control_token::{self, CONTROL_HEADER, PROOF_PATH};
use crate::endpoint::auth::{read_secret, Credentials};

mod pinned;

/// How long one question may take, connection, TLS and proof included.
const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest answer read.
const MAX_ANSWER: u64 = 1 << 20;
/// The largest proof answer read (headers and body).
const MAX_PROOF_ANSWER: usize = 16 * 1024;

/// Where and how to ask.
#[derive(Debug, Clone)]
pub struct Target {
    /// An IP address or a host name (without an IPv6 literal's brackets).
    pub host: String,
    pub port: u16,
    /// Speak TLS trusting exactly this certificate (`metrics_tls_cert_file`).
    pub tls_cert: Option<PathBuf>,
    pub auth: Credentials,
    /// The control token file of a relay on this host.
    pub token_file: PathBuf,
}

impl Target {
    /// The endpoint at `addr` (a wildcard address is reached on loopback).
    pub fn at(
        addr: SocketAddr,
        auth: Credentials,
        tls_cert: Option<PathBuf>,
        token_file: PathBuf,
    ) -> Target {
        Target {
            host: reachable(addr).ip().to_string(),
            port: addr.port(),
            tls_cert,
            auth,
            token_file,
        }
    }

    /// The endpoint of `run`'s own configuration.
    pub fn of(ep: &crate::endpoint::EndpointConfig) -> Target {
        Target::at(
            ep.addr,
            ep.auth.clone(),
            ep.tls.as_ref().map(|(cert, _)| cert.clone()),
            ep.token_file.path.clone(),
        )
    }

    /// `host:port` as a `Host` header and messages write it.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The first address the host resolves to.
    async fn resolve(&self) -> Result<SocketAddr, AskError> {
        if let Ok(ip) = self.host.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, self.port));
        }
        tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| AskError::Unreachable(format!("cannot resolve {}", self.authority())))
    }

    /// True when the endpoint is on this host (a process here owns its port).
    pub async fn is_local(&self) -> bool {
        self.resolve().await.is_ok_and(|a| is_local(a.ip()))
    }
}

/// True for an address of this host: loopback, or one a socket can bind.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
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

/// What went with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// This start's control token, from this file.
    Token(PathBuf),
    /// The configured bearer token or basic credentials.
    Configured,
    /// Nothing; with why the control token was not read, when it was looked for.
    Nothing(Option<String>),
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: String,
    pub sent: Sent,
}

/// Why no answer came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AskError {
    /// No connection, no TLS, no HTTP answer, or no answer in time.
    Unreachable(String),
    /// Nothing was sent: the port's owner is not proven to be the relay.
    Unproven(String),
}

impl std::fmt::Display for AskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskError::Unreachable(why) | AskError::Unproven(why) => f.write_str(why),
        }
    }
}

/// `GET path`: the body of a 200 answer, else why there is none (a sentence
/// fragment without any secret).
pub async fn get(target: &Target, path: &str) -> Result<String, String> {
    let answer = request(target, "GET", path)
        .await
        .map_err(|e| e.to_string())?;
    match answer.status {
        200 => Ok(answer.body),
        _ => Err(refusal(target, &answer)),
    }
}

/// `method path`: the answer, whatever its status.
pub async fn request(target: &Target, method: &str, path: &str) -> Result<Answer, AskError> {
    match tokio::time::timeout(ASK_TIMEOUT, ask(target, method, path)).await {
        Ok(answer) => answer,
        Err(_) => Err(AskError::Unreachable(format!(
            "no answer within {} s",
            ASK_TIMEOUT.as_secs()
        ))),
    }
}

/// Why an answer other than 200 says no, naming the fix.
pub fn refusal(target: &Target, answer: &Answer) -> String {
    let body = answer.body.trim();
    match (answer.status, &answer.sent) {
        (401, Sent::Token(file)) => format!(
            "the relay refused the control token of {} (HTTP 401): the relay at {} wrote another file; give ctl the relay's [relay] control_token_file",
            file.display(),
            target.authority()
        ),
        (401, Sent::Nothing(Some(why))) => format!(
            "the relay needs its control token (HTTP 401), and ctl cannot read {} ({why}): run ctl as the relay's user (or root), or set [relay] control_token_file to the file the relay logged at start",
            target.token_file.display()
        ),
        (401, _) => "the endpoint refused the credentials (HTTP 401): check [relay] metrics_bearer_token_file or metrics_basic_auth_* here and in the running relay".into(),
        (421, _) => format!(
            "the relay does not answer to the name {} (HTTP 421): use its IP address, or add the name to its [relay] metrics_allowed_hosts",
            target.host
        ),
        (403, _) if !body.is_empty() => format!(
            "the relay refused (HTTP 403): {}",
            outbox_event::redact::printable(&body.chars().take(400).collect::<String>())
        ),
        (other, _) => format!("the endpoint answered HTTP {other}"),
    }
}

/// A credential and the header that carries it.
enum Credential {
    Token(String),
    Configured(String),
}

/// Which credential `path` gets, if any: the probes none; `/metrics` and `/poison`
/// only when credentials are configured; control always.
fn choose(
    target: &Target,
    path: &str,
    local: bool,
) -> Result<(Option<Credential>, Sent), AskError> {
    let wanted = path.starts_with("/control/")
        || (target.auth.is_set() && matches!(path, "/metrics" | "/poison"));
    if !wanted {
        return Ok((None, Sent::Nothing(None)));
    }
    let token = if local {
        control_token::read(&target.token_file)
    } else {
        Err("the relay is on another host".to_string())
    };
    let unread = match token {
        Ok(token) => {
            return Ok((
                Some(Credential::Token(token)),
                Sent::Token(target.token_file.clone()),
            ))
        }
        Err(why) => why,
    };
    if !target.auth.is_set() {
        return Ok((None, Sent::Nothing(Some(unread))));
    }
    if target.tls_cert.is_none() {
        return Err(AskError::Unproven(format!(
            "ctl sends the configured credentials only where no other process can take them: over TLS ([relay] metrics_tls_cert_file), or to a relay on this host that proves the token of its control token file, which cannot be read here ({}: {unread}); nothing was sent to {}",
            target.token_file.display(),
            target.authority()
        )));
    }
    Ok((
        Some(Credential::Configured(configured_header(&target.auth)?)),
        Sent::Configured,
    ))
}

/// The header carrying the configured credentials (bearer token, else basic).
fn configured_header(auth: &Credentials) -> Result<String, AskError> {
    use base64::Engine;
    let read = |key: &str, path: &std::path::Path| {
        read_secret(path)
            .map_err(|why| AskError::Unproven(format!("cannot read [relay] {key} ({why})")))
    };
    if let Some(path) = &auth.bearer_token_file {
        let token = read("metrics_bearer_token_file", path)?;
        return Ok(format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some((user, path)) = &auth.basic {
        let password = read("metrics_basic_auth_password_file", path)?;
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        return Ok(format!("Authorization: Basic {pair}\r\n"));
    }
    Ok(String::new())
}

async fn ask(target: &Target, method: &str, path: &str) -> Result<Answer, AskError> {
    let addr = target.resolve().await?;
    let (credential, sent) = choose(target, path, is_local(addr.ip()))?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| AskError::Unreachable(format!("cannot connect to {addr}: {e}")))?;
    let answer = match &target.tls_cert {
        None => converse(tcp, target, method, path, credential, true).await?,
        Some(cert) => {
            let config = pinned::pinned_config(cert).map_err(AskError::Unproven)?;
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let name = ServerName::try_from("outbox-relay")
                .map_err(|e| AskError::Unproven(e.to_string()))?;
            let tls = connector.connect(name, tcp).await.map_err(|e| {
                AskError::Unreachable(format!("the TLS handshake with {addr} failed: {e}"))
            })?;
            converse(tls, target, method, path, credential, false).await?
        }
    };
    let text = String::from_utf8_lossy(&answer);
    let status = text.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok());
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    match status {
        Some(status) => Ok(Answer {
            status,
            body: body.to_string(),
            sent,
        }),
        None => Err(AskError::Unreachable(
            "the endpoint sent no HTTP answer".into(),
        )),
    }
}

/// One request on `stream`, after the proof of the token when `prove` (plain HTTP):
/// the raw answer.
async fn converse<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    target: &Target,
    method: &str,
    path: &str,
    credential: Option<Credential>,
    prove: bool,
) -> Result<Vec<u8>, AskError> {
    let header = match &credential {
        None => String::new(),
        Some(Credential::Token(token)) => {
            if prove {
                prove_token(&mut stream, target, token).await?;
            }
            format!("Authorization: Bearer {token}\r\n")
        }
        Some(Credential::Configured(header)) => header.clone(),
    };
    let control = if path.starts_with("/control/") {
        format!("{CONTROL_HEADER}: 1\r\n")
    } else {
        String::new()
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: 0\r\n{control}{header}\r\n",
        target.authority()
    );
    crate::endpoint::http_exchange::exchange(&mut stream, &request, MAX_ANSWER)
        .await
        .map_err(|e| AskError::Unreachable(format!("the endpoint's connection failed: {e}")))
}

/// Asks the peer to prove it holds `token` (crate::control_token), on the
/// connection kept open for the request: refused unless it does.
async fn prove_token<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    target: &Target,
    token: &str,
) -> Result<(), AskError> {
    let unproven = |why: &str| {
        AskError::Unproven(format!(
            "the process on {} is not the relay whose control token is in {} ({why}): another process may have taken the port; nothing was sent",
            target.authority(),
            target.token_file.display()
        ))
    };
    let nonce = control_token::nonce().map_err(AskError::Unproven)?;
    let request = format!(
        "GET {PROOF_PATH}?nonce={nonce} HTTP/1.1\r\nHost: {}\r\n{CONTROL_HEADER}: 1\r\n\r\n",
        target.authority()
    );
    let io =
        |e: std::io::Error| AskError::Unreachable(format!("the endpoint's connection failed: {e}"));
    stream.write_all(request.as_bytes()).await.map_err(io)?;
    let (status, body) = read_sized_answer(stream).await.map_err(io)?;
    if status != 200 {
        return Err(unproven(&format!(
            "it answered the proof with HTTP {status}"
        )));
    }
    let proof = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["proof"].as_str().map(str::to_string))
        .unwrap_or_default();
    if !control_token::verify(token, &nonce, &proof) {
        return Err(unproven("its proof is wrong"));
    }
    Ok(())
}

/// One answer with a `Content-Length` body, leaving the connection open: the
/// status and the body.
async fn read_sized_answer<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> std::io::Result<(u16, Vec<u8>)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_PROOF_ANSWER {
            return Err(bad("the answer's headers are too long"));
        }
        let mut chunk = [0u8; 1024];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(bad("the connection closed before an answer"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| bad("no HTTP status"))?;
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    if length > MAX_PROOF_ANSWER {
        return Err(bad("the answer is too long"));
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 1024];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(bad("the connection closed inside the answer"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok((status, body))
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
        let t = Target::at(
            "[::]:9187"
                .parse()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
            Credentials::default(),
            None,
            PathBuf::from("t"),
        );
        assert_eq!(t.authority(), "[::1]:9187");
    }

    /// Configured credentials never go over plain HTTP without the token's proof;
    /// the probes get no credential at all.
    #[test]
    fn credentials_go_only_where_the_relay_is_proven() {
        let dir = std::env::temp_dir().join(testkit::unique_name("choose"));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        std::fs::write(dir.join("bearer"), "Tk-configured\n").unwrap_or_default();
        let target = Target {
            host: "127.0.0.1".into(),
            port: 1,
            tls_cert: None,
            auth: Credentials {
                bearer_token_file: Some(dir.join("bearer")),
                basic: None,
            },
            token_file: dir.join("missing.token"),
        };
        assert!(matches!(
            choose(&target, "/healthz", true),
            Ok((None, Sent::Nothing(None)))
        ));
        assert!(matches!(
            choose(&target, "/control/pause", true),
            Err(AskError::Unproven(_))
        ));
        let tls = Target {
            tls_cert: Some(dir.join("cert.pem")),
            ..target.clone()
        };
        assert!(matches!(
            choose(&tls, "/metrics", false),
            Ok((Some(Credential::Configured(_)), Sent::Configured))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
