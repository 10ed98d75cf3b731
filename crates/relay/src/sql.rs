//! Ordinary SQL connections to the configured database: the one way the relay
//! opens them (commands, the session's state and slot writes, background tasks).
//!
//! Every connection follows the replication connection's rules (docs/security.md):
//! TLS per `sslmode`, no cleartext or md5 password over a plain link unless
//! `sslmode=disable` is explicit, a size cap before login.

use tokio_postgres::Client;
pub use wal_reader::tls::describe_pg_error;
use wal_reader::tls::SqlConnectError;
use wal_reader::PgConnectOptions;

use crate::config::Config;
use crate::error::CliError;

/// Why [`connect`] failed. It prints in one line with the cause (tokio-postgres
/// alone prints "error connecting to server" or "db error").
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct ConnectError(pub SqlConnectError);

impl ConnectError {
    /// A refusal retrying cannot fix (docs/security.md): exit 2, never retried.
    pub fn is_precondition(&self) -> bool {
        self.0.is_precondition()
    }
}

/// Opens a connection and spawns the task that drives it ([`wal_reader::admin::connect`]).
pub async fn connect(opts: &PgConnectOptions) -> Result<Client, ConnectError> {
    wal_reader::admin::connect(opts).await.map_err(ConnectError)
}

/// A connection for a command: a failure is a [`CliError`] that names the fix
/// (exit 2 for what retrying cannot fix, 1 for an unreachable server).
pub async fn connect_for_command(cfg: &Config) -> Result<Client, CliError> {
    let opts = cfg.pg_options()?;
    connect(&opts).await.map_err(|ConnectError(e)| match e {
        SqlConnectError::Postgres(e) if e.code().is_some() => CliError::from(e),
        e if e.is_precondition() => CliError::Precondition(e.to_string()),
        SqlConnectError::Postgres(e) => CliError::Runtime(format!(
            "cannot connect to Postgres at {}: {}; check host and port in [postgres] url and that Postgres is running",
            opts.display_target(),
            describe_pg_error(&e)
        )),
        e => CliError::Runtime(e.to_string()),
    })
}
