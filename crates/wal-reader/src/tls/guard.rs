//! The watch an SQL connection (tokio-postgres) keeps on the server until its session
//! is ready, which tokio-postgres alone does not (docs/security.md):
//!
//! ```text
//!   TcpStream/UnixStream ─► GuardedSocket ─(S)─► tokio-rustls ─► GuardedTls ─► tokio-postgres
//!                            │ the answer to SSLRequest:          │ the plaintext
//!                            │ S: TLS; N: plain (refused when     │ messages, as on
//!                            │ sslmode requires TLS); any other   │ a plain link
//!                            │ byte: refused                      │
//!                            └ on a plain link: the messages ─────┘
//! ```
//!
//! On the messages before ReadyForQuery, over TLS or not: a length above 30000 bytes
//! (libpq's limit before login) ends the connection at once, and every
//! authentication request goes through [`AuthPolicy`], the replication connection's
//! own rules (plain-link passwords, `require_auth`, `channel_binding=require`). A
//! refusal is recorded in [`Verdict`] for `connect_sql` to return, and the read fails
//! so that tokio-postgres sends nothing more.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::conn::policy::{AuthPolicy, Link, Request};
use crate::conn::Transport;
use crate::conninfo::{PgConnectOptions, SslMode};

/// The longest message accepted before the session is ready (libpq's limit).
const MAX_STARTUP_MESSAGE: usize = 30_000;

/// What the guards of one connection attempt found.
#[derive(Debug, Default)]
pub(super) struct Verdict {
    /// A refusal's sentence (definite).
    pub refusal: Option<String>,
    /// The TLS handshake's error: its kind and text.
    pub tls_error: Option<(io::ErrorKind, String)>,
    /// The server asked for a password (cleartext, md5 or SCRAM).
    pub password_asked: bool,
}

pub(super) type Shared = Arc<Mutex<Verdict>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing written yet: is the first message an SSLRequest?
    Start,
    /// SSLRequest sent: the next byte read is the answer.
    SslAnswer,
    /// Messages before ReadyForQuery are watched.
    Messages,
    /// TLS took over (on the socket), or the session is ready: nothing to watch.
    Done,
}

/// The watch itself (see the module docs).
pub(super) struct Guard {
    phase: Phase,
    policy: AuthPolicy,
    sslmode: SslMode,
    target: String,
    /// The message being read: tag, length word and body so far.
    msg: Vec<u8>,
    shared: Shared,
}

impl Guard {
    fn new(opts: &PgConnectOptions, link: Link, phase: Phase, shared: Shared) -> Guard {
        Guard {
            phase,
            policy: AuthPolicy::new(opts, link),
            sslmode: opts.sslmode,
            target: opts.display_target(),
            msg: Vec::new(),
            shared,
        }
    }

    fn refuse(&mut self, sentence: String) -> io::Error {
        self.phase = Phase::Done;
        if let Ok(mut v) = self.shared.lock() {
            v.refusal.get_or_insert(sentence.clone());
        }
        io::Error::new(io::ErrorKind::PermissionDenied, sentence)
    }

    fn on_write(&mut self, data: &[u8]) {
        if self.phase == Phase::Start && !data.is_empty() {
            self.phase = if data.starts_with(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]) {
                Phase::SslAnswer
            } else {
                Phase::Messages
            };
        }
    }

    fn on_read(&mut self, mut data: &[u8]) -> io::Result<()> {
        if self.phase == Phase::SslAnswer {
            let Some((&answer, rest)) = data.split_first() else {
                return Ok(());
            };
            match answer {
                b'S' => self.phase = Phase::Done,
                b'N' if self.sslmode.requires_tls() => {
                    let sentence = crate::conn::tls_refused(&self.target, self.sslmode);
                    return Err(self.refuse(sentence));
                }
                b'N' => self.phase = Phase::Messages,
                other => {
                    let sentence = crate::conn::not_postgres_answer(other, &self.target);
                    return Err(self.refuse(sentence));
                }
            }
            data = rest;
        }
        while self.phase == Phase::Messages && !data.is_empty() {
            if self.msg.len() < 5 {
                let n = (5 - self.msg.len()).min(data.len());
                self.msg.extend_from_slice(&data[..n]);
                data = &data[n..];
                if self.msg.len() < 5 {
                    break;
                }
                let len = u32::from_be_bytes([self.msg[1], self.msg[2], self.msg[3], self.msg[4]])
                    as usize;
                if !(4..=MAX_STARTUP_MESSAGE).contains(&len) {
                    return Err(self.refuse(format!(
                        "Postgres sent a message of {len} bytes before the login completed (at most {MAX_STARTUP_MESSAGE} are accepted): this is not a Postgres server, or something in between tampers with the connection"
                    )));
                }
            }
            let total = 1
                + u32::from_be_bytes([self.msg[1], self.msg[2], self.msg[3], self.msg[4]]) as usize;
            let n = (total - self.msg.len()).min(data.len());
            self.msg.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.msg.len() == total {
                let msg = std::mem::take(&mut self.msg);
                self.on_message(&msg)?;
            }
        }
        Ok(())
    }

    /// One whole message before ReadyForQuery.
    fn on_message(&mut self, msg: &[u8]) -> io::Result<()> {
        let body = &msg[5..];
        match msg[0] {
            b'R' if body.len() >= 4 => {
                let code = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                let verdict = match Request::parse(code, &body[4..]) {
                    None => self.policy.on_ok(),
                    Some(request) => {
                        if matches!(
                            request,
                            Request::Cleartext | Request::Md5 | Request::Sasl(_)
                        ) {
                            if let Ok(mut v) = self.shared.lock() {
                                v.password_asked = true;
                            }
                        }
                        self.policy.on_request(&request)
                    }
                };
                verdict.map_err(|sentence| self.refuse(sentence))
            }
            b'Z' => {
                self.phase = Phase::Done;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Runs `on_read` on what a read added to `buf`.
    fn after_read(&mut self, buf: &ReadBuf<'_>, before: usize) -> io::Result<()> {
        if self.phase == Phase::Done {
            return Ok(());
        }
        self.on_read(&buf.filled()[before..])
    }
}

/// A byte stream watched by a [`Guard`]: the socket (the answer to SSLRequest and,
/// on a plain link, the messages), or the TLS stream over it (the plaintext
/// messages, and the certificate's channel binding data).
pub struct Guarded<S> {
    inner: S,
    guard: Guard,
    /// The `tls-server-end-point` data of a TLS stream's server certificate.
    end_point: Option<Vec<u8>>,
}

/// The socket under a SQL connection (TCP or a Unix socket).
pub type GuardedSocket = Guarded<Transport>;

/// A TLS stream whose plaintext the guard watches.
pub type GuardedTls = Guarded<tokio_rustls::client::TlsStream<GuardedSocket>>;

impl GuardedSocket {
    pub(super) fn new(sock: Transport, opts: &PgConnectOptions, shared: Shared) -> GuardedSocket {
        let link = match sock {
            Transport::Unix(_) => Link::Unix,
            _ => Link::PlainTcp,
        };
        Guarded {
            inner: sock,
            guard: Guard::new(opts, link, Phase::Start, shared),
            end_point: None,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            this.guard.after_read(buf, before)?;
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.guard.on_write(data);
        Pin::new(&mut this.inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// TLS for tokio-postgres with the relay's configuration ([`super::client_config`]),
/// its channel binding data ([`super::tls_server_end_point`]), and the guard on the
/// plaintext. `config` is `None` under `sslmode=disable`, where tokio-postgres never
/// asks for TLS.
pub(super) struct GuardedTlsConnect {
    pub config: Option<Arc<ClientConfig>>,
    pub opts: PgConnectOptions,
    pub shared: Shared,
}

impl tokio_postgres::tls::TlsConnect<GuardedSocket> for GuardedTlsConnect {
    type Stream = GuardedTls;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<GuardedTls>> + Send>>;

    fn connect(self, stream: GuardedSocket) -> Self::Future {
        Box::pin(async move {
            let Some(config) = self.config else {
                return Err(io::Error::other("TLS is off (sslmode=disable)"));
            };
            let name = super::server_name(&self.opts)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            let connector = tokio_rustls::TlsConnector::from(config);
            let tls = match connector.connect(name, stream).await {
                Ok(tls) => tls,
                Err(e) => {
                    if let Ok(mut v) = self.shared.lock() {
                        v.tls_error = Some((e.kind(), e.to_string()));
                    }
                    return Err(e);
                }
            };
            let end_point = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| super::tls_server_end_point(c.as_ref()));
            let link = Link::Tls {
                end_point: end_point.is_some(),
            };
            let guard = Guard::new(&self.opts, link, Phase::Messages, self.shared);
            Ok(Guarded {
                inner: tls,
                guard,
                end_point,
            })
        })
    }
}

impl tokio_postgres::tls::TlsStream for GuardedTls {
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        match &self.end_point {
            Some(ep) => tokio_postgres::tls::ChannelBinding::tls_server_end_point(ep.clone()),
            None => tokio_postgres::tls::ChannelBinding::none(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn guard(conninfo: &str, link: Link) -> Guard {
        let opts = PgConnectOptions::parse_with_env(conninfo, &|_| None).unwrap();
        Guard::new(&opts, link, Phase::Messages, Shared::default())
    }

    #[test]
    fn messages_split_across_reads_are_checked_whole() {
        // A cleartext request over a plain link, one byte at a time: refused.
        let mut g = guard("host=h user=u", Link::PlainTcp);
        let msg = [b'R', 0, 0, 0, 8, 0, 0, 0, 3];
        let mut refused = false;
        for b in msg {
            if g.on_read(&[b]).is_err() {
                refused = true;
            }
        }
        assert!(refused);
        assert!(g
            .shared
            .lock()
            .unwrap()
            .refusal
            .as_deref()
            .unwrap()
            .contains("cleartext"));
        // Two messages in one read: a notice, then ReadyForQuery ends the watch.
        let mut g = guard("host=h user=u", Link::PlainTcp);
        let mut two = vec![b'N', 0, 0, 0, 5, 0];
        two.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
        g.on_read(&two).unwrap();
        assert_eq!(g.phase, Phase::Done);
        // A length word above the cap.
        let mut g = guard("host=h user=u", Link::Tls { end_point: true });
        assert!(g.on_read(&[b'E', 0, 0, 0x75, 0x31]).is_err());
    }
}
