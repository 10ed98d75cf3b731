//! Ordinary SQL connections (tokio-postgres) under the replication connection's
//! rules (docs/security.md): TLS per `sslmode` from [`super::client_config`]
//! (client certificate included), and the guard of `guard.rs` on the server's
//! messages until the session is ready, over TLS or not, which tokio-postgres alone
//! cannot do.

use std::future::Future;
use std::io;

use outbox_event::redact::printable;

use super::guard::{GuardedSocket, GuardedTlsConnect, Shared};
use super::{client_config, TlsSetupError};
use crate::conn::Transport;
use crate::conninfo::PgConnectOptions;

/// A SQL connection could not be opened by [`connect_sql`].
#[derive(Debug, thiserror::Error)]
pub enum SqlConnectError {
    /// The TLS files are unusable (definite).
    #[error(transparent)]
    Setup(#[from] TlsSetupError),
    /// The relay refused to go on (a password asked for in cleartext or md5 over a
    /// plain link, `require_auth` or `channel_binding=require` unmet, a server
    /// without TLS where sslmode requires it, an answer no Postgres server sends, an
    /// oversized message before login): the sentence names the fix (definite).
    #[error("{0}")]
    Refused(String),
    /// The TLS handshake failed: definite when the server's certificate was refused
    /// (`InvalidData`), transient when the link broke.
    #[error("the TLS handshake with Postgres at {target} failed: {reason}; check sslmode, sslrootcert (and sslcert/sslkey) in [postgres] url")]
    Tls {
        target: String,
        kind: io::ErrorKind,
        reason: String,
    },
    /// The TCP connection failed (transient).
    #[error("cannot connect to Postgres at {target}: {source}; check host and port in [postgres] url and that Postgres is running")]
    Connect { target: String, source: io::Error },
    /// Anything tokio-postgres reports (server errors carry their SQLSTATE).
    #[error("{}", describe_pg_error(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

impl SqlConnectError {
    /// The operator must change something (configuration, certificates, the
    /// server's pg_hba.conf) or a man in the middle is at work: retrying will not
    /// help, and `outbox-relay` exits with code 2.
    pub fn is_precondition(&self) -> bool {
        match self {
            SqlConnectError::Setup(_) | SqlConnectError::Refused(_) => true,
            SqlConnectError::Tls { kind, .. } => *kind == io::ErrorKind::InvalidData,
            SqlConnectError::Connect { .. } => false,
            SqlConnectError::Postgres(e) => e
                .code()
                .is_some_and(|c| c.code().starts_with("28") || c.code() == "3D000"),
        }
    }
}

/// tokio-postgres prints "error connecting to server" or "db error" alone: this adds
/// the cause (the server's own message for a server error), as one printable line.
pub fn describe_pg_error(e: &tokio_postgres::Error) -> String {
    let text = match (e.as_db_error(), std::error::Error::source(e)) {
        (Some(db), _) => format!("{}: {}", db.severity(), db.message()),
        (None, Some(cause)) => format!("{e}: {cause}"),
        (None, None) => e.to_string(),
    };
    printable(&text).into_owned()
}

/// Opens an ordinary SQL connection with tokio-postgres under the same rules as the
/// replication connection (docs/security.md): TLS per `sslmode` and `sslrootcert`,
/// the client certificate, `channel_binding`, `require_auth`, no cleartext or md5
/// password over a plain TCP link unless `sslmode=disable` was given explicitly, and
/// the 30000-byte cap on messages before login, over TLS or not. The password is
/// `password` or the password file's, read now. Spawn the returned future: it drives
/// the connection.
pub async fn connect_sql(
    opts: &PgConnectOptions,
) -> Result<
    (
        tokio_postgres::Client,
        impl Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
    ),
    SqlConnectError,
> {
    let config = client_config(opts)?;
    let timeout = opts.connect_limit();
    let connect_err = |source| SqlConnectError::Connect {
        target: opts.display_target(),
        source,
    };
    let timed_out = || io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
    let sock = if opts.is_unix_socket() {
        let path = format!("{}/.s.PGSQL.{}", opts.host, opts.port);
        let s = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path))
            .await
            .map_err(|_| connect_err(timed_out()))?
            .map_err(connect_err)?;
        Transport::Unix(s)
    } else {
        let s = tokio::time::timeout(
            timeout,
            tokio::net::TcpStream::connect((opts.connect_host(), opts.port)),
        )
        .await
        .map_err(|_| connect_err(timed_out()))?
        .map_err(connect_err)?;
        let _ = s.set_nodelay(true);
        Transport::Tcp(s)
    };
    let shared = Shared::default();
    let socket = GuardedSocket::new(sock, opts, shared.clone());
    let tls = GuardedTlsConnect {
        config,
        opts: opts.clone(),
        shared: shared.clone(),
    };
    let config = opts.to_tokio_postgres();
    let connecting = tokio::time::timeout(timeout, config.connect_raw(socket, tls));
    match connecting.await {
        Err(_) => Err(connect_err(timed_out())),
        Ok(Ok((client, conn))) => Ok((client, conn)),
        Ok(Err(e)) => Err(explain(e, opts, &shared)),
    }
}

/// The most useful error for a failed login: what a guard refused, the TLS
/// handshake's failure, a password the server asked for and none was given, else
/// tokio-postgres's error.
fn explain(e: tokio_postgres::Error, opts: &PgConnectOptions, shared: &Shared) -> SqlConnectError {
    let Ok(verdict) = shared.lock() else {
        return SqlConnectError::Postgres(e);
    };
    if let Some(sentence) = &verdict.refusal {
        return SqlConnectError::Refused(sentence.clone());
    }
    if let Some((kind, reason)) = &verdict.tls_error {
        return SqlConnectError::Tls {
            target: opts.display_target(),
            kind: *kind,
            reason: printable(reason).into_owned(),
        };
    }
    if verdict.password_asked && e.code().is_none() && opts.login_password().is_none() {
        return SqlConnectError::Refused(
            crate::ReaderError::PasswordRequired(opts.user.clone()).to_string(),
        );
    }
    SqlConnectError::Postgres(e)
}
