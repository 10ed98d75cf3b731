//! Ordinary SQL connections (tokio-postgres) under the replication connection's
//! rules (docs/security.md): TLS per `sslmode` from [`super::make_tls_connect`],
//! and a socket that watches a plain link's first messages, which tokio-postgres
//! alone cannot do.

use std::sync::Arc;

use super::{make_tls_connect, TlsSetupError};
use crate::conninfo::{PgConnectOptions, SslMode};

/// A SQL connection could not be opened by [`connect_sql`].
#[derive(Debug, thiserror::Error)]
pub enum SqlConnectError {
    /// The TLS files are unusable (exit 2).
    #[error(transparent)]
    Setup(#[from] TlsSetupError),
    /// The relay refused to go on (a password asked for in cleartext or md5 over a
    /// plain link, an oversized message before login): the sentence names the fix.
    #[error("{0}")]
    Refused(String),
    /// The TCP connection failed (transient).
    #[error("cannot connect to Postgres at {target}: {source}; check host and port in [postgres] url and that Postgres is running")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    /// Anything tokio-postgres reports (server errors carry their SQLSTATE).
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
}

/// Opens an ordinary SQL connection with tokio-postgres under the same rules as the
/// replication connection (docs/security.md): TLS per `sslmode` and `sslrootcert`,
/// `channel_binding`, and, which tokio-postgres alone cannot do, no cleartext or md5
/// password over a plain TCP link unless `sslmode=disable` was given explicitly, and
/// the 30000-byte cap on messages before login on such a link. Spawn the returned
/// future: it drives the connection.
pub async fn connect_sql(
    opts: &PgConnectOptions,
) -> Result<
    (
        tokio_postgres::Client,
        impl std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
    ),
    SqlConnectError,
> {
    use tokio_postgres::tls::MakeTlsConnect;
    let mut make = make_tls_connect(opts)?;
    let tls = match <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<
        GuardedSocket,
    >>::make_tls_connect(&mut make, &opts.host)
    {
        Ok(t) => t,
        Err(never) => match never {},
    };
    let timeout = opts
        .connect_timeout
        .unwrap_or(std::time::Duration::from_secs(30));
    let connect_err = |source| SqlConnectError::Connect {
        target: opts.display_target(),
        source,
    };
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
    let sock = if opts.is_unix_socket() {
        let path = format!("{}/.s.PGSQL.{}", opts.host, opts.port);
        let s = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path))
            .await
            .map_err(|_| connect_err(timed_out()))?
            .map_err(connect_err)?;
        Sock::Unix(s)
    } else {
        let s = tokio::time::timeout(
            timeout,
            tokio::net::TcpStream::connect((opts.connect_host(), opts.port)),
        )
        .await
        .map_err(|_| connect_err(timed_out()))?
        .map_err(connect_err)?;
        let _ = s.set_nodelay(true);
        Sock::Tcp(s)
    };
    let plain_password_ok =
        opts.is_unix_socket() || (opts.sslmode == SslMode::Disable && opts.sslmode_explicit);
    let refused = Arc::new(std::sync::Mutex::new(None));
    let socket = GuardedSocket {
        sock,
        guard: Guard::new(plain_password_ok, refused.clone()),
    };
    let config = opts.to_tokio_postgres();
    let connecting = tokio::time::timeout(timeout, config.connect_raw(socket, tls));
    match connecting.await {
        Err(_) => Err(connect_err(timed_out())),
        Ok(Ok((client, conn))) => Ok((client, conn)),
        Ok(Err(e)) => {
            let why = refused.lock().map(|r| r.clone()).unwrap_or_default();
            match why {
                Some(sentence) => Err(SqlConnectError::Refused(sentence)),
                None => Err(SqlConnectError::Postgres(e)),
            }
        }
    }
}

enum Sock {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// The socket under a SQL connection, watching the server's first messages on a
/// plain link (see [`connect_sql`]); transparent once TLS starts or the session is
/// ready.
pub struct GuardedSocket {
    sock: Sock,
    guard: Guard,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing written yet: is the first message an SSLRequest?
    Start,
    /// SSLRequest sent: the next byte read is the answer.
    SslAnswer,
    /// A plain link before ReadyForQuery: messages are parsed.
    Plain,
    /// TLS, or the session is ready: nothing more to watch.
    Done,
}

struct Guard {
    phase: Phase,
    plain_password_ok: bool,
    /// The header (tag and length) of the message being read, and what is left of
    /// its body.
    header: Vec<u8>,
    body_left: usize,
    /// The start of an authentication request's body (its code).
    auth: Vec<u8>,
    refused: Arc<std::sync::Mutex<Option<String>>>,
}

impl Guard {
    fn new(plain_password_ok: bool, refused: Arc<std::sync::Mutex<Option<String>>>) -> Guard {
        Guard {
            phase: Phase::Start,
            plain_password_ok,
            header: Vec::new(),
            body_left: 0,
            auth: Vec::new(),
            refused,
        }
    }

    fn refuse(&self, sentence: String) -> std::io::Error {
        if let Ok(mut r) = self.refused.lock() {
            *r = Some(sentence.clone());
        }
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, sentence)
    }

    fn on_write(&mut self, data: &[u8]) {
        if self.phase == Phase::Start && !data.is_empty() {
            self.phase = if data.starts_with(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]) {
                Phase::SslAnswer
            } else {
                Phase::Plain
            };
        }
    }

    fn on_read(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        if self.phase == Phase::SslAnswer {
            let Some((&answer, rest)) = data.split_first() else {
                return Ok(());
            };
            self.phase = if answer == b'N' {
                Phase::Plain
            } else {
                Phase::Done
            };
            data = rest;
        }
        while self.phase == Phase::Plain && !data.is_empty() {
            if self.header.len() < 5 {
                let n = (5 - self.header.len()).min(data.len());
                self.header.extend_from_slice(&data[..n]);
                data = &data[n..];
                if self.header.len() == 5 {
                    let len = u32::from_be_bytes([
                        self.header[1],
                        self.header[2],
                        self.header[3],
                        self.header[4],
                    ]) as usize;
                    if !(4..=30_000).contains(&len) {
                        return Err(self.refuse(format!(
                            "Postgres sent a message of {len} bytes before the login completed (at most 30000 are accepted): this is not a Postgres server, or something in between tampers with the connection"
                        )));
                    }
                    self.body_left = len - 4;
                    self.auth.clear();
                    if self.header[0] == b'Z' {
                        self.phase = Phase::Done;
                    }
                }
                continue;
            }
            let n = self.body_left.min(data.len());
            if self.header[0] == b'R' && self.auth.len() < 4 {
                let take = (4 - self.auth.len()).min(n);
                self.auth.extend_from_slice(&data[..take]);
                if self.auth.len() == 4 {
                    let code = i32::from_be_bytes([
                        self.auth[0],
                        self.auth[1],
                        self.auth[2],
                        self.auth[3],
                    ]);
                    let method = match code {
                        3 => Some("cleartext"),
                        5 => Some("md5"),
                        _ => None,
                    };
                    if let Some(method) = method.filter(|_| !self.plain_password_ok) {
                        return Err(self.refuse(format!(
                            "Postgres asks for a {method} password over an unencrypted connection, and outbox-relay does not send a password that way: turn TLS on in the server and use sslmode=verify-full, or use scram-sha-256 in pg_hba.conf"
                        )));
                    }
                }
            }
            self.body_left -= n;
            data = &data[n..];
            if self.body_left == 0 {
                self.header.clear();
            }
        }
        Ok(())
    }
}

impl tokio::io::AsyncRead for GuardedSocket {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = match &mut this.sock {
            Sock::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Sock::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        };
        if let std::task::Poll::Ready(Ok(())) = &r {
            if this.guard.phase != Phase::Done {
                this.guard.on_read(&buf.filled()[before..])?;
            }
        }
        r
    }
}

impl tokio::io::AsyncWrite for GuardedSocket {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.guard.on_write(data);
        match &mut this.sock {
            Sock::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, data),
            Sock::Unix(s) => std::pin::Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match &mut self.get_mut().sock {
            Sock::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
            Sock::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match &mut self.get_mut().sock {
            Sock::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Sock::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}
