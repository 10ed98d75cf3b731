//! A minimal Postgres frontend for replication connections: startup with
//! `replication=database`, authentication (trust, cleartext, md5, SCRAM-SHA-256 and
//! SCRAM-SHA-256-PLUS channel binding), TLS per `sslmode` (docs/security.md), simple queries, and the CopyBoth sub-protocol used by
//! `START_REPLICATION`. Message encoding comes from `postgres-protocol`; framing and
//! the CopyBoth (`W`) response, which that crate does not parse, are handled here.
//!
//! Reads go through one growable buffer: a single `read` syscall typically brings in
//! many replication frames, and each frame is handed out as a `Bytes` slice of that
//! buffer without copying. Writes are collected in a buffer and sent with one
//! `write_all` + `flush`.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::conninfo::{ChannelBindingMode, PgConnectOptions, SslMode};
use crate::error::{ReaderError, ServerError};

/// Largest backend message accepted (Postgres caps a field at 1 GB).
const MAX_MESSAGE_LEN: usize = (1 << 30) + (1 << 20);
/// Largest backend message accepted before the session is ready (authentication,
/// parameter status, errors): libpq's limit for such messages, so a hostile server
/// or a man in the middle cannot make the relay reserve a gigabyte before it even
/// logged in (docs/security.md).
const MAX_STARTUP_MESSAGE_LEN: usize = 30_000;
/// Set once the superuser warning was logged (once per process).
static SUPERUSER_WARNED: AtomicBool = AtomicBool::new(false);
/// How the "TLS refused" precondition starts (the `allow` retry recognises it).
const TLS_REFUSED: &str = "Postgres does not accept TLS";
/// Initial read buffer; grows for larger frames.
const READ_BUFFER: usize = 256 * 1024;

/// The byte stream under a connection.
pub(crate) enum Transport {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// One backend message: its tag and its body (without the length word).
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub tag: u8,
    pub body: Bytes,
}

/// A connection in replication mode (`replication=database`): it accepts simple
/// queries (SQL and replication commands) and `START_REPLICATION`.
pub struct ReplicationConnection {
    stream: Transport,
    rbuf: BytesMut,
    wbuf: BytesMut,
    user: String,
    server_version: String,
    backend_pid: i32,
    tls: bool,
    /// The server's `is_superuser` at startup.
    superuser: bool,
    /// The largest message [`Self::try_message`] accepts now.
    max_message: usize,
}

/// A row of a simple query's result, in text form.
pub type Row = Vec<Option<String>>;

impl ReplicationConnection {
    /// Connects, negotiates TLS per `sslmode`, and authenticates.
    pub async fn connect(opts: &PgConnectOptions) -> Result<ReplicationConnection, ReaderError> {
        let timeout = opts.connect_timeout.unwrap_or(Duration::from_secs(30));
        match tokio::time::timeout(timeout, Self::connect_inner(opts)).await {
            Ok(r) => r,
            Err(_) => Err(ReaderError::Connect {
                target: opts.display_target(),
                source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
            }),
        }
    }

    async fn connect_inner(opts: &PgConnectOptions) -> Result<ReplicationConnection, ReaderError> {
        if opts.sslmode == SslMode::Allow && !opts.is_unix_socket() {
            // libpq's `allow`: plain first, TLS when the server refuses that login
            // (including our own refusal to send a password over it).
            return match Self::attempt(opts, false).await {
                Ok(c) => Ok(c),
                Err(plain) if plain.is_precondition() => match Self::attempt(opts, true).await {
                    Ok(c) => Ok(c),
                    Err(ReaderError::Precondition(m)) if m.starts_with(TLS_REFUSED) => Err(plain),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
        }
        Self::attempt(opts, opts.sslmode != SslMode::Disable).await
    }

    /// One connection attempt; `try_tls`: send SSLRequest first.
    async fn attempt(
        opts: &PgConnectOptions,
        try_tls: bool,
    ) -> Result<ReplicationConnection, ReaderError> {
        let connect_err = |source| ReaderError::Connect {
            target: opts.display_target(),
            source,
        };
        let stream = if opts.is_unix_socket() {
            let path = format!("{}/.s.PGSQL.{}", opts.host, opts.port);
            Transport::Unix(UnixStream::connect(path).await.map_err(connect_err)?)
        } else {
            let tcp = TcpStream::connect((opts.connect_host(), opts.port))
                .await
                .map_err(connect_err)?;
            tcp.set_nodelay(true).map_err(ReaderError::Io)?;
            if try_tls {
                Self::negotiate_tls(tcp, opts).await?
            } else {
                Transport::Tcp(tcp)
            }
        };
        let tls = matches!(stream, Transport::Tls(_));
        let mut conn = ReplicationConnection {
            stream,
            rbuf: BytesMut::with_capacity(READ_BUFFER),
            wbuf: BytesMut::with_capacity(8 * 1024),
            user: opts.user.clone(),
            server_version: String::new(),
            backend_pid: 0,
            tls,
            superuser: false,
            max_message: MAX_STARTUP_MESSAGE_LEN,
        };
        conn.startup(opts).await?;
        conn.max_message = MAX_MESSAGE_LEN;
        Ok(conn)
    }

    async fn negotiate_tls(
        mut tcp: TcpStream,
        opts: &PgConnectOptions,
    ) -> Result<Transport, ReaderError> {
        let Some(config) = crate::tls::client_config(opts)? else {
            return Ok(Transport::Tcp(tcp));
        };
        let mut buf = BytesMut::new();
        frontend::ssl_request(&mut buf);
        tcp.write_all(&buf).await?;
        // Exactly one byte: nothing the server sends after it may be read as
        // plaintext (CVE-2021-23222); rustls reads the rest.
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await?;
        match answer[0] {
            b'S' => {
                let name = crate::tls::server_name(opts)?;
                let connector = tokio_rustls::TlsConnector::from(config);
                let tls = connector
                    .connect(name, tcp)
                    .await
                    .map_err(ReaderError::Tls)?;
                Ok(Transport::Tls(Box::new(tls)))
            }
            b'N' => match opts.sslmode {
                SslMode::Disable | SslMode::Allow | SslMode::Prefer => Ok(Transport::Tcp(tcp)),
                mode => Err(ReaderError::Precondition(format!(
                    "{TLS_REFUSED} at {} but sslmode={} requires it: turn TLS on in the server (ssl = on with a certificate in postgresql.conf)",
                    opts.display_target(),
                    mode.as_str()
                ))),
            },
            _ => Err(ReaderError::Protocol(
                "the server answered SSLRequest with neither S nor N".into(),
            )),
        }
    }

    /// The `tls-server-end-point` binding of this connection's server certificate.
    fn server_end_point(&self) -> Option<Vec<u8>> {
        match &self.stream {
            Transport::Tls(t) => {
                let cert = t.get_ref().1.peer_certificates()?.first()?;
                crate::tls::tls_server_end_point(cert.as_ref())
            }
            _ => None,
        }
    }

    /// Refuses to send `method` (cleartext or md5) when the link is not encrypted,
    /// unless `sslmode=disable` was given explicitly (docs/security.md); also when
    /// `channel_binding=require`.
    fn may_send_password(&self, opts: &PgConnectOptions, method: &str) -> Result<(), ReaderError> {
        if opts.channel_binding == ChannelBindingMode::Require {
            return Err(ReaderError::Precondition(format!(
                "channel_binding=require, but Postgres asks user {:?} for a {method} password instead of SCRAM-SHA-256-PLUS: use scram-sha-256 in the server's pg_hba.conf over hostssl",
                opts.user
            )));
        }
        let explicit_plain = opts.sslmode == SslMode::Disable && opts.sslmode_explicit;
        if self.tls || matches!(self.stream, Transport::Unix(_)) || explicit_plain {
            return Ok(());
        }
        Err(ReaderError::Precondition(format!(
            "Postgres asks user {:?} for a {method} password over an unencrypted connection, and outbox-relay does not send a password that way: turn TLS on in the server and use sslmode=verify-full, or use scram-sha-256 in pg_hba.conf",
            opts.user
        )))
    }

    async fn startup(&mut self, opts: &PgConnectOptions) -> Result<(), ReaderError> {
        let params = [
            ("user", opts.user.as_str()),
            ("database", opts.dbname.as_str()),
            ("replication", "database"),
            ("application_name", opts.application_name.as_str()),
            ("client_encoding", "UTF8"),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.wbuf)?;
        self.flush().await?;

        let mut scram: Option<ScramSha256> = None;
        // True once SCRAM-SHA-256-PLUS completed (channel_binding=require needs it).
        let mut bound = false;
        let mut plus = false;
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                b'R' => {
                    let mut body = msg.body.clone();
                    if body.len() < 4 {
                        return Err(ReaderError::Protocol("short authentication request".into()));
                    }
                    let kind = body.get_i32();
                    match kind {
                        0 => {
                            if opts.channel_binding == ChannelBindingMode::Require && !bound {
                                return Err(ReaderError::Precondition(format!(
                                    "channel_binding=require, but Postgres logged user {:?} in without SCRAM-SHA-256-PLUS channel binding (trust or another method in pg_hba.conf): use scram-sha-256 over hostssl",
                                    opts.user
                                )));
                            }
                        }
                        3 => {
                            self.may_send_password(opts, "cleartext")?;
                            let pw = self.password(opts)?;
                            frontend::password_message(pw.as_bytes(), &mut self.wbuf)?;
                            self.flush().await?;
                        }
                        5 => {
                            self.may_send_password(opts, "md5")?;
                            if body.len() < 4 {
                                return Err(ReaderError::Protocol("short md5 salt".into()));
                            }
                            let mut salt = [0u8; 4];
                            salt.copy_from_slice(&body[..4]);
                            let pw = self.password(opts)?;
                            let hash = postgres_protocol::authentication::md5_hash(
                                opts.user.as_bytes(),
                                pw.as_bytes(),
                                salt,
                            );
                            frontend::password_message(hash.as_bytes(), &mut self.wbuf)?;
                            self.flush().await?;
                        }
                        10 => {
                            let mechanisms: Vec<&[u8]> =
                                body.split(|b| *b == 0).filter(|m| !m.is_empty()).collect();
                            let offers_plus = mechanisms.contains(&SCRAM_SHA_256_PLUS.as_bytes());
                            let end_point = if self.tls
                                && opts.channel_binding != ChannelBindingMode::Disable
                            {
                                self.server_end_point()
                            } else {
                                None
                            };
                            let (mechanism, binding) = match end_point {
                                Some(ep) if offers_plus => {
                                    (SCRAM_SHA_256_PLUS, ChannelBinding::tls_server_end_point(ep))
                                }
                                _ if opts.channel_binding == ChannelBindingMode::Require => {
                                    let why = if !offers_plus {
                                        "the server does not offer SCRAM-SHA-256-PLUS (is the connection TLS, and the role's password stored as SCRAM?)"
                                    } else {
                                        "the server certificate's signature algorithm has no tls-server-end-point hash"
                                    };
                                    return Err(ReaderError::Precondition(format!(
                                        "channel_binding=require cannot be met for user {:?}: {why}; use scram-sha-256 over hostssl",
                                        opts.user
                                    )));
                                }
                                _ if !mechanisms.contains(&SCRAM_SHA_256.as_bytes()) => {
                                    let names = mechanisms
                                        .iter()
                                        .map(|m| String::from_utf8_lossy(m).into_owned())
                                        .collect::<Vec<_>>()
                                        .join(", ");
                                    return Err(ReaderError::UnsupportedAuth(format!(
                                        "SASL ({names})"
                                    )));
                                }
                                // Over TLS with binding allowed but not offered: 'y'
                                // (lets the server detect a stripped PLUS offer).
                                _ if self.tls
                                    && !offers_plus
                                    && opts.channel_binding != ChannelBindingMode::Disable =>
                                {
                                    (SCRAM_SHA_256, ChannelBinding::unrequested())
                                }
                                _ => (SCRAM_SHA_256, ChannelBinding::unsupported()),
                            };
                            plus = mechanism == SCRAM_SHA_256_PLUS;
                            let pw = self.password(opts)?;
                            let s = ScramSha256::new(pw.as_bytes(), binding);
                            frontend::sasl_initial_response(
                                mechanism,
                                s.message(),
                                &mut self.wbuf,
                            )?;
                            self.flush().await?;
                            scram = Some(s);
                        }
                        11 => {
                            let s = scram.as_mut().ok_or_else(|| {
                                ReaderError::Protocol("SASL continue without SASL start".into())
                            })?;
                            s.update(&body).map_err(|e| ReaderError::Auth {
                                user: opts.user.clone(),
                                message: format!("SCRAM exchange failed: {e}"),
                            })?;
                            frontend::sasl_response(s.message(), &mut self.wbuf)?;
                            self.flush().await?;
                        }
                        12 => {
                            let s = scram.as_mut().ok_or_else(|| {
                                ReaderError::Protocol("SASL final without SASL start".into())
                            })?;
                            s.finish(&body).map_err(|e| ReaderError::Auth {
                                user: opts.user.clone(),
                                message: format!("the server's SCRAM proof is invalid: {e}"),
                            })?;
                            bound = plus;
                        }
                        2 => return Err(ReaderError::UnsupportedAuth("Kerberos V5".into())),
                        7 | 8 => return Err(ReaderError::UnsupportedAuth("GSSAPI".into())),
                        9 => return Err(ReaderError::UnsupportedAuth("SSPI".into())),
                        other => return Err(ReaderError::UnsupportedAuth(format!("code {other}"))),
                    }
                }
                b'S' => {
                    let mut parts = msg.body.split(|b| *b == 0);
                    let name = parts.next().unwrap_or_default();
                    let value = parts.next().unwrap_or_default();
                    if name == b"server_version" {
                        self.server_version = String::from_utf8_lossy(value).into_owned();
                    }
                    if name == b"is_superuser" {
                        self.superuser = value == b"on";
                    }
                }
                b'K' => {
                    if msg.body.len() >= 4 {
                        self.backend_pid = (&msg.body[..4]).get_i32();
                    }
                }
                b'Z' => {
                    if self.superuser && !SUPERUSER_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "Postgres role {:?} is a superuser: the relay needs only LOGIN REPLICATION and a few grants; connect as the role of sql/role.sql (docs/security.md)",
                            opts.user
                        );
                    }
                    return Ok(());
                }
                b'E' => {
                    return Err(ReaderError::from_server(
                        parse_error(&msg.body),
                        &opts.user,
                        None,
                    ))
                }
                b'N' => {}
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} during startup",
                        other as char
                    )))
                }
            }
        }
    }

    fn password(&self, opts: &PgConnectOptions) -> Result<String, ReaderError> {
        opts.password
            .clone()
            .ok_or_else(|| ReaderError::PasswordRequired(opts.user.clone()))
    }

    /// `server_version` as reported at startup, e.g. "15.19 (Debian 15.19-0+deb12u1)".
    pub fn server_version(&self) -> &str {
        &self.server_version
    }

    /// The backend process id (the walsender's pid once streaming).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// True when the connection is encrypted.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// True when the server reported the session role as a superuser
    /// (`is_superuser`); the first such connection of a process logs a warning.
    pub fn is_superuser(&self) -> bool {
        self.superuser
    }

    /// The user name this connection logged in as.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Sends what is buffered for writing in one write.
    pub(crate) async fn flush(&mut self) -> Result<(), ReaderError> {
        if !self.wbuf.is_empty() {
            self.stream.write_all(&self.wbuf).await?;
            self.wbuf.clear();
        }
        self.stream.flush().await?;
        Ok(())
    }

    /// A complete message already in the read buffer, if any.
    pub(crate) fn try_message(&mut self) -> Result<Option<Message>, ReaderError> {
        if self.rbuf.len() < 5 {
            return Ok(None);
        }
        let tag = self.rbuf[0];
        let len = i32::from_be_bytes([self.rbuf[1], self.rbuf[2], self.rbuf[3], self.rbuf[4]]);
        if len < 4 || len as usize > self.max_message {
            return Err(ReaderError::Protocol(format!(
                "message {:?} with invalid length {len}",
                tag as char
            )));
        }
        let total = 1 + len as usize;
        if self.rbuf.len() < total {
            self.rbuf.reserve(total - self.rbuf.len());
            return Ok(None);
        }
        let mut frame = self.rbuf.split_to(total);
        frame.advance(5);
        Ok(Some(Message {
            tag,
            body: frame.freeze(),
        }))
    }

    /// Reads more bytes into the buffer. Cancel-safe. `Ok(0)` is end of stream.
    pub(crate) async fn fill(&mut self) -> Result<usize, ReaderError> {
        if self.rbuf.capacity() - self.rbuf.len() < 8 * 1024 {
            self.rbuf.reserve(READ_BUFFER);
        }
        let n = self.stream.read_buf(&mut self.rbuf).await?;
        Ok(n)
    }

    /// Reads one whole message.
    pub(crate) async fn read_message(&mut self) -> Result<Message, ReaderError> {
        loop {
            if let Some(m) = self.try_message()? {
                return Ok(m);
            }
            if self.fill().await? == 0 {
                return Err(ReaderError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "Postgres closed the connection",
                )));
            }
        }
    }

    /// Runs a simple query and returns the rows of its (last) result in text form.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Row>, ReaderError> {
        frontend::query(sql, &mut self.wbuf)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                b'T' => rows.clear(),
                b'D' => rows.push(parse_data_row(&msg.body)?),
                b'C' | b'I' | b'N' | b'S' => {}
                b'E' => error = Some(parse_error(&msg.body)),
                b'Z' => break,
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} in a simple query",
                        other as char
                    )))
                }
            }
        }
        match error {
            Some(e) => Err(ReaderError::from_server(e, &self.user, None)),
            None => Ok(rows),
        }
    }

    /// Sends a query that answers with CopyBoth (`START_REPLICATION`) and waits for
    /// that response. `slot` is used to word errors.
    pub(crate) async fn start_copy_both(
        &mut self,
        sql: &str,
        slot: &str,
    ) -> Result<(), ReaderError> {
        frontend::query(sql, &mut self.wbuf)?;
        self.flush().await?;
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                b'W' => return Ok(()),
                b'N' | b'S' => {}
                b'E' => {
                    let e = parse_error(&msg.body);
                    // Drain to ReadyForQuery so the connection stays usable.
                    loop {
                        match self.read_message().await {
                            Ok(m) if m.tag == b'Z' => break,
                            Ok(_) => {}
                            Err(_) => break,
                        }
                    }
                    return Err(ReaderError::from_server(e, &self.user, Some(slot)));
                }
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} instead of CopyBothResponse",
                        other as char
                    )))
                }
            }
        }
    }

    /// Queues a CopyData message carrying `payload` for the next flush.
    pub(crate) fn queue_copy_data(&mut self, payload: &[u8]) {
        self.wbuf.extend_from_slice(b"d");
        self.wbuf
            .extend_from_slice(&((payload.len() + 4) as i32).to_be_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Ends CopyBoth from our side and reads until the server finishes
    /// (CopyDone / CommandComplete / ReadyForQuery), bounded by `timeout`; then
    /// terminates the session.
    pub(crate) async fn finish_copy(&mut self, timeout: Duration) -> Result<(), ReaderError> {
        frontend::copy_done(&mut self.wbuf);
        self.flush().await?;
        let drain = async {
            loop {
                let m = self.read_message().await?;
                match m.tag {
                    b'Z' => return Ok::<(), ReaderError>(()),
                    b'E' => return Err(ReaderError::Server(parse_error(&m.body))),
                    _ => {}
                }
            }
        };
        let _ = tokio::time::timeout(timeout, drain).await;
        self.terminate().await;
        Ok(())
    }

    /// Sends Terminate and closes (best effort).
    pub async fn terminate(&mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush().await;
        let _ = self.stream.shutdown().await;
    }
}

/// Parses the fields of an ErrorResponse / NoticeResponse body.
pub(crate) fn parse_error(body: &[u8]) -> ServerError {
    let mut e = ServerError {
        severity: String::new(),
        code: String::new(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    let mut rest = body;
    while let Some((&kind, after)) = rest.split_first() {
        if kind == 0 {
            break;
        }
        let end = after.iter().position(|b| *b == 0).unwrap_or(after.len());
        let value = String::from_utf8_lossy(&after[..end]).into_owned();
        match kind {
            b'S' => e.severity = value,
            b'C' => e.code = value,
            b'M' => e.message = value,
            b'D' => e.detail = Some(value),
            b'H' => e.hint = Some(value),
            _ => {}
        }
        rest = after.get(end + 1..).unwrap_or_default();
    }
    e
}

fn parse_data_row(body: &Bytes) -> Result<Row, ReaderError> {
    let bad = || ReaderError::Protocol("malformed DataRow".into());
    let mut b = &body[..];
    if b.len() < 2 {
        return Err(bad());
    }
    let n = b.get_i16();
    if n < 0 {
        return Err(bad());
    }
    let mut row = Vec::with_capacity((n as usize).min(b.len() / 4 + 1));
    for _ in 0..n {
        if b.len() < 4 {
            return Err(bad());
        }
        let len = b.get_i32();
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        if b.len() < len {
            return Err(bad());
        }
        row.push(Some(String::from_utf8_lossy(&b[..len]).into_owned()));
        b.advance(len);
    }
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_error_fields() {
        let body = b"SERROR\0C42704\0Mreplication slot \"x\" does not exist\0Hdo it\0\0";
        let e = parse_error(body);
        assert_eq!(e.code, "42704");
        assert_eq!(e.severity, "ERROR");
        assert_eq!(e.hint.as_deref(), Some("do it"));
        // Truncated input does not panic.
        let e = parse_error(b"SERR");
        assert_eq!(e.severity, "ERR");
    }

    #[test]
    fn parses_data_rows_and_rejects_garbage() {
        let body = Bytes::from_static(b"\x00\x02\x00\x00\x00\x02ab\xff\xff\xff\xff");
        assert_eq!(
            parse_data_row(&body).unwrap(),
            vec![Some("ab".into()), None]
        );
        for bad in [&b"\x00"[..], b"\x00\x01\x00\x00\x00\x09ab", b"\xff\xff"] {
            assert!(parse_data_row(&Bytes::copy_from_slice(bad)).is_err());
        }
    }
}
