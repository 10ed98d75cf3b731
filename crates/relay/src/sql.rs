//! Ordinary SQL connections to the configured database: the one way the relay
//! opens them (commands, the session's state and slot writes, background tasks).
//!
//! Every connection follows the replication connection's rules (docs/security.md):
//! TLS per `sslmode`, no cleartext or md5 password over a plain link unless
//! `sslmode=disable` is explicit, a size cap before login.

use tokio_postgres::Client;
use wal_reader::tls::SqlConnectError;
use wal_reader::PgConnectOptions;

use crate::config::Config;
use crate::error::CliError;

/// Why [`connect`] failed. It prints in one line with the cause (tokio-postgres
/// alone prints "error connecting to server" or "db error").
#[derive(Debug)]
pub struct ConnectError(pub SqlConnectError);

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            SqlConnectError::Postgres(e) => f.write_str(&describe_pg_error(e)),
            other => write!(f, "{other}"),
        }
    }
}

/// Opens a connection and spawns the task that drives it.
pub async fn connect(opts: &PgConnectOptions) -> Result<Client, ConnectError> {
    let (client, conn) = wal_reader::tls::connect_sql(opts)
        .await
        .map_err(ConnectError)?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "sql connection closed");
        }
    });
    Ok(client)
}

/// A connection for a command: a failure is a [`CliError`] that names the fix
/// (exit 2 for what retrying cannot fix, 1 for an unreachable server).
pub async fn connect_for_command(cfg: &Config) -> Result<Client, CliError> {
    let opts = cfg.pg_options()?;
    connect(&opts).await.map_err(|ConnectError(e)| match e {
        SqlConnectError::Setup(e) => CliError::Precondition(e.to_string()),
        SqlConnectError::Refused(sentence) => CliError::Precondition(sentence),
        SqlConnectError::Connect { .. } => CliError::Runtime(e.to_string()),
        SqlConnectError::Postgres(e) if e.code().is_some() => CliError::from(e),
        SqlConnectError::Postgres(e) => CliError::Runtime(format!(
            "cannot connect to Postgres at {}: {}; check host and port in [postgres] url and that Postgres is running",
            opts.display_target(),
            describe_pg_error(&e)
        )),
    })
}

/// tokio-postgres prints "error connecting to server" or "db error" alone: add the
/// cause (the server's own message for a server error).
pub fn describe_pg_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}
