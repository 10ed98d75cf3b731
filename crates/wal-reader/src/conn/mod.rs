//! A minimal Postgres frontend for replication connections: startup with
//! `replication=database`, authentication, TLS per `sslmode` (docs/security.md),
//! simple queries, and the CopyBoth sub-protocol used by `START_REPLICATION`.
//! Message encoding and most parsing come from `postgres-protocol`.
//!
//! ```text
//!  mod.rs        ReplicationConnection: connect (TCP / Unix / TLS, libpq's `allow`
//!                retry), simple queries, the read and write buffers
//!  transport.rs  the byte stream (TCP, Unix socket, TLS)
//!  coalesce.rs   the socket's receive low-water mark while streaming: one wake-up
//!                per batch of the walsender's messages
//!  auth.rs       startup packet, trust / cleartext / md5 / SCRAM(-PLUS)
//!  policy.rs     what the server may ask for (plain-link passwords, require_auth,
//!                channel_binding=require); the SQL connection's guard asks it too
//!  framing.rs    messages off the read buffer, size caps, ErrorResponse fields
//!  copy.rs       CopyBoth: START_REPLICATION's response, CopyData in and out,
//!                everything else the server sends while streaming
//! ```
//!
//! Reads go through one growable buffer: a single `read` syscall typically brings in
//! many replication messages, and each CopyData payload is handed out as a `Bytes`
//! slice of that buffer without copying. Writes are collected in a buffer and sent
//! with one `write_all` + `flush`.

mod auth;
mod coalesce;
mod copy;
mod framing;
pub(crate) mod policy;
mod transport;

use std::io;

use bytes::BytesMut;
use futures_util::FutureExt;
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::conninfo::{PgConnectOptions, SslMode};
use crate::error::ReaderError;
use framing::{
    parse_error, split_frame, text_row, Frame, FILL_TARGET, MAX_MESSAGE_LEN,
    MAX_STARTUP_MESSAGE_LEN, READ_BUFFER,
};
pub(crate) use transport::Transport;

/// How the "TLS refused" precondition starts (the `allow` retry recognises it).
const TLS_REFUSED: &str = "Postgres does not accept TLS";

/// The refusal of a server that answers SSLRequest with `N` while `sslmode`
/// requires TLS; it never suggests a weaker mode.
pub(crate) fn tls_refused(target: &str, mode: SslMode) -> String {
    format!(
        "{TLS_REFUSED} at {target} but sslmode={} requires it: turn TLS on in the server (ssl = on with a certificate in postgresql.conf)",
        mode.as_str()
    )
}

/// The refusal of an answer to SSLRequest that is neither `S` nor `N`: no Postgres
/// server sends one, and a client that read it as "no TLS" (tokio-postgres does under
/// `sslmode=prefer`) would log in over plain TCP (docs/security.md).
pub(crate) fn not_postgres_answer(answer: u8, target: &str) -> String {
    format!(
        "{target} answered the TLS request with byte {answer:#04x} instead of S or N: this is not a Postgres server, or something in between tampers with the connection; check host and port in [postgres] url"
    )
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
    /// The largest message [`Self::try_frame`] accepts now.
    max_message: usize,
    /// The slot being streamed, once `START_REPLICATION` succeeded (words errors).
    streaming_slot: Option<String>,
    /// A read error met after `fill` had bytes to return; the next `fill` returns it.
    read_error: Option<io::Error>,
    /// The socket's receive low-water mark while streaming (coalesce.rs).
    coalesce: coalesce::Coalesce,
}

/// A row of a simple query's result, in text form.
pub type Row = Vec<Option<String>>;

impl ReplicationConnection {
    /// Connects, negotiates TLS per `sslmode`, and authenticates.
    pub async fn connect(opts: &PgConnectOptions) -> Result<ReplicationConnection, ReaderError> {
        let timeout = opts.connect_limit();
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
            streaming_slot: None,
            read_error: None,
            coalesce: coalesce::Coalesce::default(),
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
                mode => Err(ReaderError::Precondition(tls_refused(
                    &opts.display_target(),
                    mode,
                ))),
            },
            other => Err(ReaderError::Precondition(not_postgres_answer(
                other,
                &opts.display_target(),
            ))),
        }
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
    fn try_frame(&mut self) -> Result<Option<Frame>, ReaderError> {
        split_frame(&mut self.rbuf, self.max_message)
    }

    /// Reads more bytes into the buffer: waits for one `read`, then takes whatever
    /// else is readable at once (up to [`FILL_TARGET`] bytes), however many messages
    /// that brings. Over TLS one read returns one record's plaintext — a single small
    /// message when the walsender flushes each one — so without the second step the
    /// stream would decode and hand on one message per wake-up (docs/performance.md,
    /// "TLS on loopback"). Cancel-safe: the only await comes before anything is read.
    /// `Ok(0)` is end of stream.
    pub(crate) async fn fill(&mut self) -> Result<usize, ReaderError> {
        if let Some(e) = self.read_error.take() {
            return Err(e.into());
        }
        self.reserve_read();
        let mut n = self.read_once().await?;
        if n == 0 {
            return Ok(0);
        }
        while self.rbuf.len() < FILL_TARGET {
            self.reserve_read();
            match self.stream.read_buf(&mut self.rbuf).now_or_never() {
                // End of stream: the next `fill` reads 0 again.
                Some(Ok(0)) | None => break,
                // Kept for the next `fill`, after the bytes read so far are used.
                Some(Err(e)) => {
                    self.read_error = Some(e);
                    break;
                }
                Some(Ok(k)) => n += k,
            }
        }
        Ok(n)
    }

    /// One read. While streaming busily over TCP it waits for [`coalesce::LOW_WATER`]
    /// bytes for up to [`coalesce::WAIT`], then takes what is there (coalesce.rs).
    /// Cancel-safe as `read_buf` is; the deadline outlives a cancelled call.
    async fn read_once(&mut self) -> io::Result<usize> {
        let fd = match self.streaming_slot {
            Some(_) => self.stream.tcp_fd(),
            None => None,
        };
        let Some(fd) = fd else {
            return self.stream.read_buf(&mut self.rbuf).await;
        };
        let n = match self.coalesce.before_read(fd) {
            None => self.stream.read_buf(&mut self.rbuf).await?,
            Some(deadline) => {
                let read = self.stream.read_buf(&mut self.rbuf);
                match tokio::time::timeout_at(deadline, read).await {
                    Ok(r) => r?,
                    Err(_) => {
                        self.coalesce.lower(fd);
                        self.stream.read_buf(&mut self.rbuf).await?
                    }
                }
            }
        };
        self.coalesce.read_done();
        Ok(n)
    }

    fn reserve_read(&mut self) {
        if self.rbuf.capacity() - self.rbuf.len() < 8 * 1024 {
            self.rbuf.reserve(READ_BUFFER);
        }
    }

    /// Reads one whole message.
    async fn read_frame(&mut self) -> Result<Frame, ReaderError> {
        loop {
            if let Some(m) = self.try_frame()? {
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
            let frame = self.read_frame().await?;
            match frame.tag() {
                b'E' => error = Some(parse_error(frame.body())),
                b'N' => {}
                b'D' => match frame.parse() {
                    Ok(Message::DataRow(row)) => rows.push(text_row(&row)?),
                    _ => return Err(ReaderError::Protocol("malformed DataRow".into())),
                },
                b'T' | b'C' | b'I' | b'S' | b'Z' => match frame.parse()? {
                    Message::RowDescription(_) => rows.clear(),
                    Message::ReadyForQuery(_) => break,
                    _ => {}
                },
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

    /// Sends Terminate and closes (best effort).
    pub async fn terminate(&mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush().await;
        let _ = self.stream.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that is streaming over `tcp`, as after `START_REPLICATION`.
    fn streaming(tcp: TcpStream) -> ReplicationConnection {
        ReplicationConnection {
            stream: Transport::Tcp(tcp),
            rbuf: BytesMut::with_capacity(READ_BUFFER),
            wbuf: BytesMut::new(),
            user: "u".into(),
            server_version: String::new(),
            backend_pid: 0,
            tls: false,
            superuser: false,
            max_message: MAX_MESSAGE_LEN,
            streaming_slot: Some("s".into()),
            read_error: None,
            coalesce: coalesce::Coalesce::default(),
        }
    }

    /// A peer writes 100-byte pieces, then after a pause one last piece, far below the
    /// mark. The stream is counted busy before every read (on a loaded machine the
    /// reads' own timing may not show it), so each read raises the socket's low-water
    /// mark; every byte must still be read — the last piece only through the lowering
    /// after 1 ms (coalesce.rs). Without the lowering `fill` waits for bytes that never
    /// come.
    #[tokio::test]
    async fn a_busy_streams_tail_below_the_low_water_mark_is_read() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        const PIECES: usize = 500;
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let (mut peer, _) = listener.accept().unwrap();
            peer.set_nodelay(true).unwrap();
            for _ in 0..PIECES - 1 {
                peer.write_all(&[7u8; 100]).unwrap();
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            peer.write_all(&[7u8; 100]).unwrap();
            // Kept open: the tail must be read before any end of stream.
            std::thread::sleep(std::time::Duration::from_secs(15));
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut conn = streaming(tcp);
        let read_all = async {
            while conn.rbuf.len() < PIECES * 100 {
                conn.coalesce.set_busy();
                assert!(conn.fill().await.unwrap() > 0);
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), read_all)
            .await
            .expect("every byte read, the tail below the mark included");
        assert_eq!(conn.rbuf.len(), PIECES * 100);
        assert!(conn.coalesce.raises > 0, "the mark was never raised");
        drop(conn);
        let _ = writer;
    }
}
