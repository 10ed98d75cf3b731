//! The broker's frame maximum, read from its `Tune` (docs/design.md §4, "Frames within
//! the limit").
//!
//! A stream-protocol connection negotiates `frame_max` once: the broker proposes its
//! own in a `Tune` after authentication, the client answers the smaller of that and its
//! own, and a broker that enforces the limit closes the connection on a larger frame
//! (RabbitMQ 4.x answers with `FRAME_TOO_LARGE`; 3.10, the broker of these machines,
//! advertises the limit but does not check it). The client library keeps the
//! negotiated value to itself, so the publisher reads the broker's proposal on a short
//! connection of its own — `PeerProperties`, `SaslHandshake`, `SaslAuthenticate`
//! (PLAIN) and the broker's `Tune` — and closes it. The negotiated maximum is then
//! `min(CLIENT_FRAME_MAX, proposal)`, exactly what the client answered.
//!
//! The same connection reads the broker's `version` peer property, which decides the
//! client version (`client.rs`; docs/streams.md, "Client and broker versions").

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::endpoint::Endpoint;

/// The frame maximum the publisher's client asks for (the library's default).
pub(crate) const CLIENT_FRAME_MAX: u32 = 1 << 20;
/// Bound on the whole exchange.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A broker frame larger than this during the handshake is not a broker's.
const HANDSHAKE_FRAME_LIMIT: u32 = 1 << 16;

const PEER_PROPERTIES: u16 = 0x0011;
const SASL_HANDSHAKE: u16 = 0x0012;
const SASL_AUTHENTICATE: u16 = 0x0013;
const TUNE: u16 = 0x0014;
const RESPONSE: u16 = 0x8000;
const OK: u16 = 0x0001;

/// Why the broker's proposal could not be read.
#[derive(Debug)]
pub(super) enum TuneError {
    /// No answer within the time allowed: the node is paused or cut off.
    Unreachable(String),
    /// A refused connection, a refusal, a protocol surprise: the client's own
    /// connection says what is wrong in its words.
    Other(String),
}

/// What the short connection learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Tuned {
    /// The negotiated frame maximum.
    pub frame_max: u32,
    /// The broker's `version` peer property (`"3.10.8"`), if it sent one.
    pub version: Option<String>,
}

/// The negotiated frame maximum for a connection to `endpoint`: the smaller of the
/// broker's proposal and [`CLIENT_FRAME_MAX`] (a proposal of 0 means no limit); and
/// the broker's version.
pub(super) async fn negotiated_frame_max(
    endpoint: &Endpoint,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> Result<Tuned, TuneError> {
    let tcp = tokio::time::timeout(
        TIMEOUT,
        TcpStream::connect((endpoint.host.as_str(), endpoint.port)),
    )
    .await
    .map_err(|_| TuneError::Unreachable("timed out connecting".into()))?
    .map_err(|e| TuneError::Other(format!("cannot connect: {e}")))?;
    let (proposal, version) = tokio::time::timeout(TIMEOUT, proposal(tcp, endpoint, tls))
        .await
        .map_err(|_| TuneError::Unreachable("timed out reading the broker's tune".into()))?
        .map_err(TuneError::Other)?;
    let frame_max = match proposal {
        0 => CLIENT_FRAME_MAX,
        p => p.min(CLIENT_FRAME_MAX),
    };
    Ok(Tuned { frame_max, version })
}

async fn proposal(
    tcp: TcpStream,
    endpoint: &Endpoint,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> Result<(u32, Option<String>), String> {
    let _ = tcp.set_nodelay(true);
    match tls {
        None => handshake(tcp, endpoint).await,
        Some(config) => {
            let name = rustls::pki_types::ServerName::try_from(endpoint.host.clone())
                .map_err(|_| format!("{:?} is not a valid TLS server name", endpoint.host))?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            handshake(stream, endpoint).await
        }
    }
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    endpoint: &Endpoint,
) -> Result<(u32, Option<String>), String> {
    // PeerProperties with an empty map.
    send(&mut s, PEER_PROPERTIES, 1, &0u32.to_be_bytes()).await?;
    let properties = expect_ok(&mut s, PEER_PROPERTIES, 1).await?;
    let version = peer_property(&properties, "version");
    send(&mut s, SASL_HANDSHAKE, 2, &[]).await?;
    expect_ok(&mut s, SASL_HANDSHAKE, 2).await?;
    let mut auth = Vec::new();
    let mechanism = b"PLAIN";
    auth.extend_from_slice(&(mechanism.len() as u16).to_be_bytes());
    auth.extend_from_slice(mechanism);
    let mut plain = vec![0u8];
    plain.extend_from_slice(endpoint.user.as_bytes());
    plain.push(0);
    plain.extend_from_slice(endpoint.password.as_bytes());
    auth.extend_from_slice(&(plain.len() as u32).to_be_bytes());
    auth.extend_from_slice(&plain);
    send(&mut s, SASL_AUTHENTICATE, 3, &auth).await?;
    expect_ok(&mut s, SASL_AUTHENTICATE, 3).await?;
    loop {
        let (key, body) = read_frame(&mut s).await?;
        if key == TUNE && body.len() >= 4 {
            let _ = s.shutdown().await;
            let proposal = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
            return Ok((proposal, version));
        }
    }
}

/// Writes a request: size, key, version 1, correlation id, body.
async fn send<S: AsyncWrite + Unpin>(
    s: &mut S,
    key: u16,
    correlation: u32,
    body: &[u8],
) -> Result<(), String> {
    let mut frame = Vec::with_capacity(12 + body.len());
    frame.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
    frame.extend_from_slice(&key.to_be_bytes());
    frame.extend_from_slice(&1u16.to_be_bytes());
    frame.extend_from_slice(&correlation.to_be_bytes());
    frame.extend_from_slice(body);
    s.write_all(&frame).await.map_err(|e| e.to_string())?;
    s.flush().await.map_err(|e| e.to_string())
}

/// Reads one frame: its key (without the version) and what follows the version.
async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> Result<(u16, Vec<u8>), String> {
    let size = s.read_u32().await.map_err(|e| e.to_string())?;
    if !(4..=HANDSHAKE_FRAME_LIMIT).contains(&size) {
        return Err(format!("unexpected frame of {size} bytes"));
    }
    let mut frame = vec![0u8; size as usize];
    s.read_exact(&mut frame).await.map_err(|e| e.to_string())?;
    let key = u16::from_be_bytes([frame[0], frame[1]]);
    Ok((key, frame.split_off(4)))
}

/// `key` in a PeerProperties answer's map (count, then short strings: key, value);
/// `None` when it is absent or the map is cut short.
fn peer_property(map: &[u8], key: &str) -> Option<String> {
    fn string(b: &[u8]) -> Option<(&[u8], &[u8])> {
        let len = usize::try_from(i16::from_be_bytes([*b.first()?, *b.get(1)?])).ok()?;
        let rest = b.get(2..)?;
        Some((rest.get(..len)?, rest.get(len..)?))
    }
    let count = u32::from_be_bytes(map.get(..4)?.try_into().ok()?);
    let mut rest = map.get(4..)?;
    for _ in 0..count {
        let (k, r) = string(rest)?;
        let (v, r) = string(r)?;
        if k == key.as_bytes() {
            return Some(String::from_utf8_lossy(v).into_owned());
        }
        rest = r;
    }
    None
}

/// Reads the response to request `key` #`correlation`, checks its code and returns
/// what follows the code.
async fn expect_ok<S: AsyncRead + Unpin>(
    s: &mut S,
    key: u16,
    correlation: u32,
) -> Result<Vec<u8>, String> {
    let (got, body) = read_frame(s).await?;
    if got != key | RESPONSE || body.len() < 6 {
        return Err(format!("unexpected answer {got:#06x} to {key:#06x}"));
    }
    let corr = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    let code = u16::from_be_bytes([body[4], body[5]]);
    if corr != correlation || code != OK {
        return Err(format!(
            "the broker answered code {code:#06x} to {key:#06x}"
        ));
    }
    Ok(body[6..].to_vec())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A scripted broker: answers the three requests and proposes `frame_max`.
    async fn fake(frame_max: u32) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for _ in 0..3 {
                let size = s.read_u32().await.unwrap();
                let mut f = vec![0u8; size as usize];
                s.read_exact(&mut f).await.unwrap();
                let key = u16::from_be_bytes([f[0], f[1]]) | RESPONSE;
                let mut reply = Vec::new();
                reply.extend_from_slice(&10u32.to_be_bytes());
                reply.extend_from_slice(&key.to_be_bytes());
                reply.extend_from_slice(&1u16.to_be_bytes());
                reply.extend_from_slice(&f[4..8]);
                reply.extend_from_slice(&OK.to_be_bytes());
                s.write_all(&reply).await.unwrap();
            }
            let mut tune = Vec::new();
            tune.extend_from_slice(&12u32.to_be_bytes());
            tune.extend_from_slice(&TUNE.to_be_bytes());
            tune.extend_from_slice(&1u16.to_be_bytes());
            tune.extend_from_slice(&frame_max.to_be_bytes());
            tune.extend_from_slice(&60u32.to_be_bytes());
            s.write_all(&tune).await.unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        port
    }

    fn endpoint(port: u16) -> Endpoint {
        Endpoint::parse(&format!("rabbitmq-stream://u:p@127.0.0.1:{port}/%2f")).unwrap()
    }

    #[tokio::test]
    async fn negotiates_the_smaller_maximum() {
        let port = fake(300_000).await;
        assert_eq!(
            negotiated_frame_max(&endpoint(port), None).await.unwrap(),
            Tuned {
                frame_max: 300_000,
                version: None
            }
        );
        let port = fake(20 << 20).await;
        assert_eq!(
            negotiated_frame_max(&endpoint(port), None)
                .await
                .unwrap()
                .frame_max,
            CLIENT_FRAME_MAX
        );
        let port = fake(0).await;
        assert_eq!(
            negotiated_frame_max(&endpoint(port), None)
                .await
                .unwrap()
                .frame_max,
            CLIENT_FRAME_MAX
        );
    }

    #[test]
    fn reads_the_version_peer_property() {
        let mut map = 2u32.to_be_bytes().to_vec();
        for s in ["product", "RabbitMQ", "version", "3.10.8"] {
            map.extend_from_slice(&(s.len() as i16).to_be_bytes());
            map.extend_from_slice(s.as_bytes());
        }
        assert_eq!(peer_property(&map, "version").as_deref(), Some("3.10.8"));
        assert_eq!(peer_property(&map, "platform"), None);
        assert_eq!(peer_property(&map[..map.len() - 2], "version"), None);
        assert_eq!(peer_property(&[], "version"), None);
    }

    #[tokio::test]
    async fn a_refusal_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(&[0, 0, 0, 6, 0x80, 0x11, 0, 1, 0, 0])
                .await
                .unwrap();
        });
        assert!(negotiated_frame_max(&endpoint(port), None).await.is_err());
    }
}
