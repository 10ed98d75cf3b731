//! Logging: `tracing` events to stderr, as text or JSON lines (`--log-format`).
//!
//! The filter comes from `RUST_LOG` (the usual `tracing_subscriber::EnvFilter`
//! syntax, e.g. `RUST_LOG=info,outbox_relay=debug`) and defaults to `info` when it is
//! unset or empty. `RUST_LOG` rather than an `OUTBOX_RELAY_*` variable: that prefix is
//! reserved for configuration keys, and every variable under it must name one.
//! stdout is left to command output (`status`, `peek`, `check`).

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;
use crate::error::CliError;

/// The environment variable holding the log filter.
pub const LOG_FILTER_ENV: &str = "RUST_LOG";
/// The filter used when `RUST_LOG` is unset or empty.
pub const DEFAULT_LOG_FILTER: &str = "info";

/// The filter for `RUST_LOG`'s value (`None`: unset).
pub fn filter(value: Option<&str>) -> Result<EnvFilter, CliError> {
    let directives = match value.map(str::trim) {
        Some(v) if !v.is_empty() => v,
        _ => DEFAULT_LOG_FILTER,
    };
    EnvFilter::builder().parse(directives).map_err(|e| {
        CliError::Usage(format!(
            "{LOG_FILTER_ENV} is not a valid log filter ({e}): set it to a level such as info or debug, or unset it"
        ))
    })
}

/// Installs the global subscriber. Call once, before anything logs.
pub fn init(format: LogFormat) -> Result<(), CliError> {
    let value = std::env::var(LOG_FILTER_ENV).ok();
    let filter = filter(value.as_deref())?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: log files and collectors get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    result.map_err(|e| CliError::Runtime(format!("cannot install the logger: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_info() {
        for v in [None, Some(""), Some("  ")] {
            let f = filter(v).expect("default filter");
            assert_eq!(f.to_string(), "info");
        }
    }

    #[test]
    fn custom_filter_is_kept() {
        let f = filter(Some("warn,outbox_relay=debug")).expect("valid filter");
        let s = f.to_string();
        assert!(
            s.contains("outbox_relay=debug") && s.contains("warn"),
            "{s}"
        );
    }

    #[test]
    fn invalid_filter_is_a_usage_error() {
        let e = filter(Some("outbox_relay=loud")).expect_err("invalid filter accepted");
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("RUST_LOG"), "{e}");
    }
}
