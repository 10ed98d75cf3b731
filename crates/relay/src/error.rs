//! The binary's one error type and its exit codes (docs/design.md §6).
//!
//! ```text
//!   main ─► run(cli) ─► Result<(), CliError> ─► print "error: <sentence>" ─► exit code
//! ```
//!
//! | variant        | exit | meaning                                                   |
//! |----------------|------|-----------------------------------------------------------|
//! | `Usage`        | 2    | the command line asks for something impossible            |
//! | `Config`       | 2    | the configuration is invalid (names the key)              |
//! | `Precondition` | 2    | the environment is not ready: wal_level, slot, table, auth |
//! | `Runtime`      | 1    | anything that went wrong while doing the work             |
//!
//! Clap's own usage errors exit 2 before `run` is reached. Every message is printed
//! as one line through [`crate::config::redact_url`], so no password reaches stderr even
//! if a lower layer quoted a URL.

use std::process::ExitCode;

use crate::config::{redact_url, ConfigError};

/// Why a command failed. Each message is one sentence that names the fix.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad usage that clap cannot detect (e.g. `--since` after `--until`).
    #[error("{0}")]
    Usage(String),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An unmet precondition: wal_level not logical, slot or publication missing,
    /// table or mapped column missing, authentication failed.
    #[error("{0}")]
    Precondition(String),
    /// A failure while running.
    #[error("{0}")]
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

    /// The line printed on stderr: `error: <message>`, on one line, passwords redacted.
    pub fn to_line(&self) -> String {
        let message = self.to_string();
        let one_line: Vec<&str> = message
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        redact_url(&format!("error: {}", one_line.join(" ")))
    }

    /// Prints [`CliError::to_line`] on stderr and returns the exit code.
    pub fn report(&self) -> ExitCode {
        eprintln!("{}", self.to_line());
        ExitCode::from(self.exit_code())
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
