//! The connection's byte stream: TCP, and TLS for `amqps://` (rustls, with the
//! roots and client certificate of docs/security.md, "AMQPS").

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::Params;

/// What the connection reads and writes: a TCP stream, plain or under TLS (or,
/// in tests, any in-process stream).
pub(crate) trait Socket: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Socket for T {}

/// TCP keepalive: probes after a minute idle, every 10 s, 6 unanswered ones end the
/// connection (about two minutes for a peer that vanished).
const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 6;

/// TCP keepalive on: a peer gone without a word (a half-open connection) is noticed
/// by the kernel too, not only by heartbeats (which the broker may have switched off).
pub(crate) fn set_keepalive(tcp: &TcpStream) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
}

/// The host `url` names: its IPv6 literal, or the host the URL parser read (which
/// takes a literal in brackets for no host at all).
pub(crate) fn host_of(url: &str, uri: &AMQPUri) -> String {
    ipv6_literal(url).unwrap_or_else(|| uri.authority.host.clone())
}

/// The IPv6 address of a URL whose host is a literal in brackets, without them.
pub(crate) fn ipv6_literal(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let inner = host.strip_prefix('[')?.split_once(']')?.0;
    inner
        .parse::<std::net::Ipv6Addr>()
        .ok()
        .map(|ip| ip.to_string())
}

/// Why the socket could not be opened: a local configuration problem (a TLS file)
/// or the network.
pub(crate) enum OpenError {
    Io(String),
}

/// Connects TCP and, for `amqps`, TLS. A plain `amqp://` URL to a host other than
/// this one is warned about (once per URL).
pub(crate) async fn open(
    url: &str,
    uri: &AMQPUri,
    params: &Params,
) -> Result<Box<dyn Socket>, OpenError> {
    // The URL parser reads an IPv6 literal (`amqp://[::1]:5673/`) as no host at
    // all and would connect to localhost: the host is read from the URL here.
    let host = host_of(url, uri);
    let host = host.as_str();
    let secure = uri.scheme == AMQPScheme::AMQPS;
    #[cfg(test)]
    if let Some(dialed) = sim_dial::dial(host, uri.authority.port) {
        return dialed.map_err(OpenError::Io);
    }
    let tcp = TcpStream::connect((host, uri.authority.port))
        .await
        .map_err(|e| OpenError::Io(format!("connecting to {host}:{}: {e}", uri.authority.port)))?;
    let _ = tcp.set_nodelay(true);
    set_keepalive(&tcp);
    if !secure {
        return Ok(Box::new(tcp));
    }
    let Some(rustls) = params.tls.clone() else {
        return Err(OpenError::Io(format!(
            "{host}: an amqps URL without a TLS configuration"
        )));
    };
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| OpenError::Io(format!("the host {host} is not a TLS server name: {e}")))?;
    let stream = tokio_rustls::TlsConnector::from(rustls)
        .connect(name, tcp)
        .await
        .map_err(|e| OpenError::Io(format!("the TLS handshake: {e}")))?;
    Ok(Box::new(stream))
}

/// The simulation's network (`amqp/run/sim.rs`): while a test thread has set a
/// dialer, connections to its hosts are made by it (a socket pair to the scripted
/// broker, or a refusal) instead of TCP.
#[cfg(test)]
pub(crate) mod sim_dial {
    use std::cell::RefCell;

    use super::Socket;

    type Dialer = Box<dyn FnMut(&str, u16) -> Option<Result<Box<dyn Socket>, String>>>;

    thread_local! {
        static DIALER: RefCell<Option<Dialer>> = const { RefCell::new(None) };
    }

    /// Routes this thread's connections through `dialer` (`None` from it: TCP).
    pub(crate) fn set(dialer: Option<Dialer>) {
        DIALER.with(|d| *d.borrow_mut() = dialer);
    }

    pub(super) fn dial(host: &str, port: u16) -> Option<Result<Box<dyn Socket>, String>> {
        DIALER.with(|d| d.borrow_mut().as_mut().and_then(|f| f(host, port)))
    }
}
