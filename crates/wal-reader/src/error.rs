//! The reader's errors, grouped by what the caller does next: a *precondition*
//! (exit 2: the operator must change something, the message says what), a
//! *transient* failure (reconnect with backoff), or anything else (a bug or a
//! corrupted stream: stop).

use std::io;
use std::time::Duration;

use crate::admin::AdminError;
use crate::tls::TlsSetupError;

/// An ErrorResponse from the server, with its SQLSTATE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.code)?;
        if let Some(h) = &self.hint {
            write!(f, "; hint: {h}")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    #[error("cannot connect to Postgres at {target}: {source}; check host and port in [postgres] url and that Postgres is running")]
    Connect { target: String, source: io::Error },
    #[error("connection to Postgres lost: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    TlsSetup(#[from] TlsSetupError),
    #[error(
        "TLS handshake with Postgres failed: {0}; check sslmode and sslrootcert in [postgres] url"
    )]
    Tls(io::Error),
    #[error("Postgres does not accept TLS but sslmode={0} requires it: enable ssl on the server or use sslmode=prefer")]
    TlsRefused(&'static str),
    #[error("Postgres refused the login of user {user:?}: {message}; check the user and password in [postgres] url and the server's pg_hba.conf")]
    Auth { user: String, message: String },
    #[error("Postgres asks for a password for user {0:?} but [postgres] url has none: add it to the URL or set PGPASSWORD")]
    PasswordRequired(String),
    #[error("Postgres asks for authentication method {0}, which outbox-relay does not support: use scram-sha-256, md5, password or trust in pg_hba.conf")]
    UnsupportedAuth(String),
    /// An unmet precondition; the sentence names the fix.
    #[error("{0}")]
    Precondition(String),
    /// The slot is held by another process: another relay is active (HA standby waits).
    #[error("replication slot {slot:?} is in use by process {pid}: another relay holds it (this one waits and takes over when it stops), or stop that process")]
    SlotInUse { slot: String, pid: i32 },
    #[error("Postgres error: {0}")]
    Server(ServerError),
    #[error("unexpected message from Postgres: {0}")]
    Protocol(String),
    #[error("cannot decode a replication message: {0}")]
    Decode(#[from] pgoutput::DecodeError),
    #[error("Postgres sent nothing for {0:?} even when asked to reply: the connection is stalled; reconnecting")]
    Timeout(Duration),
}

impl ReaderError {
    /// The operator must change something (configuration, server settings, grants):
    /// retrying will not help. `outbox-relay` exits with code 2.
    pub fn is_precondition(&self) -> bool {
        match self {
            ReaderError::TlsSetup(_)
            | ReaderError::TlsRefused(_)
            | ReaderError::Auth { .. }
            | ReaderError::PasswordRequired(_)
            | ReaderError::UnsupportedAuth(_)
            | ReaderError::Precondition(_) => true,
            ReaderError::Tls(e) => e.kind() == io::ErrorKind::InvalidData,
            _ => false,
        }
    }

    /// Reconnecting later may succeed (network, restart, failover, slot in use).
    pub fn is_transient(&self) -> bool {
        match self {
            ReaderError::Connect { .. }
            | ReaderError::Io(_)
            | ReaderError::Timeout(_)
            | ReaderError::SlotInUse { .. } => true,
            ReaderError::Tls(e) => e.kind() != io::ErrorKind::InvalidData,
            ReaderError::Server(e) => {
                e.code.starts_with("08")
                    || e.code.starts_with("57P")
                    || e.code == "53300"
                    || e.code == "40001"
            }
            _ => false,
        }
    }

    /// Turns a server error into the most useful variant: known preconditions get a
    /// sentence naming the fix.
    pub(crate) fn from_server(e: ServerError, user: &str, slot: Option<&str>) -> ReaderError {
        let msg = e.message.as_str();
        match e.code.as_str() {
            "28P01" | "28000" => ReaderError::Auth {
                user: user.to_string(),
                message: e.message,
            },
            "3D000" => ReaderError::Precondition(format!(
                "{msg}: fix the database name in [postgres] url"
            )),
            "55000" if msg.contains("wal_level") => ReaderError::Precondition(
                "logical decoding needs wal_level = logical: set it in postgresql.conf and restart Postgres".into(),
            ),
            "55000" if msg.contains("invalidated") || msg.contains("required WAL") => {
                ReaderError::Precondition(format!(
                    "{msg}: the slot lost its WAL; drop and recreate it (`outbox-relay slot drop` then `slot create`) and recover missed events with `outbox-relay replay --from-table`"
                ))
            }
            "42704" if msg.contains("replication slot") => ReaderError::Precondition(format!(
                "{msg}: create it with `outbox-relay slot create`"
            )),
            "42704" if msg.contains("publication") => ReaderError::Precondition(format!(
                "{msg}: create it with `outbox-relay slot create` (or CREATE PUBLICATION … FOR TABLE …)"
            )),
            "42501" if msg.contains("replication") || msg.contains("walsender") => {
                ReaderError::Precondition(format!(
                    "role {user:?} may not start replication ({msg}): run ALTER ROLE {user} REPLICATION as a superuser"
                ))
            }
            "55006" => {
                let pid = msg
                    .rsplit(' ')
                    .next()
                    .and_then(|p| p.trim_end_matches('.').parse().ok())
                    .unwrap_or(0);
                ReaderError::SlotInUse {
                    slot: slot.unwrap_or("?").to_string(),
                    pid,
                }
            }
            _ => ReaderError::Server(e),
        }
    }
}

/// The admin checks the reader runs before streaming ([`crate::admin::StreamStart`]):
/// a held slot is [`ReaderError::SlotInUse`] (a standby waits), another unmet
/// precondition keeps its sentence, anything else is an unexpected answer.
impl From<AdminError> for ReaderError {
    fn from(e: AdminError) -> ReaderError {
        match e {
            AdminError::SlotActive { slot, pid } => ReaderError::SlotInUse { slot, pid },
            e if e.is_precondition() => ReaderError::Precondition(e.to_string()),
            e => ReaderError::Protocol(e.to_string()),
        }
    }
}
