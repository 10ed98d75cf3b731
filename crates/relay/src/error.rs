//! The binary's one error type and its exit codes (docs/design.md §6).
//!
//! ```text
//!   main ─► execute_command(cli) ─► Result<(), CliError> ─► print "error: <sentence>" ─► exit code
//! ```
//!
//! | variant        | exit | meaning                                                   |
//! |----------------|------|-----------------------------------------------------------|
//! | `Usage`        | 2    | the command line asks for something impossible            |
//! | `Config`       | 2    | the configuration is invalid (names the key)              |
//! | `Precondition` | 2    | the environment is not ready: wal_level, slot, table, auth |
//! | `Runtime`      | 1    | anything that went wrong while doing the work             |
//!
//! Clap's own usage errors exit 2 before `execute_command` is reached. Every
//! message is printed as one line through [`crate::config::redact_url`], so no
//! password reaches stderr even if a lower layer quoted a URL.

use std::process::ExitCode;

use tokio_postgres::error::SqlState;

use crate::config::{redact_url, ConfigError};
use outbox_event::redact::printable;

/// Why a command failed. Each message is one sentence that names the fix.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad usage that clap cannot detect (e.g. `--since` after `--until`).
    #[error("{}", printable(.0))]
    Usage(String),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An unmet precondition: wal_level not logical, slot or publication missing,
    /// table or mapped column missing, authentication failed.
    #[error("{}", printable(.0))]
    Precondition(String),
    /// A failure while running.
    #[error("{}", printable(.0))]
    Runtime(String),
}

/// Exit code of a runtime failure.
pub const EXIT_RUNTIME: u8 = 1;
/// Exit code of bad usage, bad configuration or an unmet precondition.
pub const EXIT_USAGE: u8 = 2;

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Config(_) | CliError::Precondition(_) => EXIT_USAGE,
            CliError::Runtime(_) => EXIT_RUNTIME,
        }
    }

    /// The line printed on stderr: `error: <message>`, on one line (a lower layer's
    /// lines joined), passwords redacted, and nothing a server sent reaches the
    /// terminal as a control character ([`printable`]).
    pub fn to_line(&self) -> String {
        let message = match self {
            CliError::Usage(s) | CliError::Precondition(s) | CliError::Runtime(s) => s.clone(),
            // Several configuration errors: one line each, every one with its prefix.
            CliError::Config(e) => {
                return e
                    .each()
                    .iter()
                    .map(|e| one_line(&e.to_string()))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        one_line(&message)
    }

    /// Prints [`CliError::to_line`] on stderr and returns the exit code.
    ///
    /// (Several configuration errors are several such lines.)
    pub fn report(&self) -> ExitCode {
        eprintln!("{}", self.to_line());
        ExitCode::from(self.exit_code())
    }
}

/// `error: <message>` on one line (a lower layer's lines joined), passwords redacted,
/// control characters made visible.
fn one_line(message: &str) -> String {
    let lines: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    printable(&redact_url(&format!("error: {}", lines.join(" ")))).into_owned()
}

// The conversions below classify a lower layer's error once: whatever it calls a
// precondition (or, for the broker, not transient) exits 2, the rest 1.

impl From<wal_reader::admin::AdminError> for CliError {
    /// A slot or catalog check: its preconditions exit 2, the rest 1.
    fn from(e: wal_reader::admin::AdminError) -> CliError {
        if e.is_precondition() {
            CliError::Precondition(e.to_string())
        } else {
            CliError::Runtime(e.to_string())
        }
    }
}

impl From<wal_reader::ReaderError> for CliError {
    /// The replication stream: its preconditions exit 2, the rest 1.
    fn from(e: wal_reader::ReaderError) -> CliError {
        if e.is_precondition() {
            CliError::Precondition(e.to_string())
        } else {
            CliError::Runtime(e.to_string())
        }
    }
}

impl From<publisher::PublishError> for CliError {
    /// The broker: a transient failure exits 1, a refusal (login, vhost, exchange,
    /// configuration) 2.
    fn from(e: publisher::PublishError) -> CliError {
        if e.is_transient() {
            CliError::Runtime(e.to_string())
        } else {
            CliError::Precondition(e.to_string())
        }
    }
}

impl From<wal_reader::conninfo::ConnInfoError> for CliError {
    /// The `[postgres] url` cannot be parsed (the message names the key, never the
    /// password).
    fn from(e: wal_reader::conninfo::ConnInfoError) -> CliError {
        CliError::Precondition(e.to_string())
    }
}

impl From<tokio_postgres::Error> for CliError {
    /// A failure of an SQL connection or statement: authentication and unknown
    /// database are unmet preconditions (exit 2), the rest runtime failures.
    fn from(e: tokio_postgres::Error) -> CliError {
        // tokio-postgres prints a server error as a bare "db error": use the server's
        // own message.
        let text = match e.as_db_error() {
            Some(db) => db.message().to_string(),
            None => e.to_string(),
        };
        match e.code() {
            Some(c) if *c == SqlState::INVALID_PASSWORD || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION => {
                CliError::Precondition(format!(
                    "Postgres refused the login ({text}): check the user and password in [postgres] url and the server's pg_hba.conf"
                ))
            }
            Some(c) if *c == SqlState::INVALID_CATALOG_NAME => CliError::Precondition(format!(
                "{text}: fix the database name in [postgres] url"
            )),
            _ => CliError::Runtime(format!("Postgres: {text}")),
        }
    }
}

impl From<anyhow::Error> for CliError {
    /// Glue for `?` on `anyhow` results: a runtime failure, its causes joined by `: `.
    fn from(e: anyhow::Error) -> CliError {
        CliError::Runtime(format!("{e:#}"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn exit_codes_follow_the_spec() {
        assert_eq!(CliError::Usage("u".into()).exit_code(), 2);
        assert_eq!(CliError::Precondition("p".into()).exit_code(), 2);
        let config = ConfigError::FileNotFound {
            path: "x.toml".into(),
        };
        assert_eq!(CliError::from(config).exit_code(), 2);
        assert_eq!(CliError::Runtime("r".into()).exit_code(), 1);
        assert_eq!(CliError::from(anyhow::anyhow!("boom")).exit_code(), 1);
    }

    #[test]
    fn line_is_single_and_redacted() {
        let e = CliError::Runtime(
            "cannot connect to postgresql://app:s3cret@db/app\n  caused by: refused".into(),
        );
        let line = e.to_line();
        assert_eq!(
            line,
            "error: cannot connect to postgresql://app:***@db/app caused by: refused"
        );
    }

    #[test]
    fn anyhow_chain_is_joined() {
        let e = anyhow::anyhow!("refused").context("cannot connect");
        assert_eq!(
            CliError::from(e).to_line(),
            "error: cannot connect: refused"
        );
    }
}
