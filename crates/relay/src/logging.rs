//! Logging: `tracing` events to stderr, as text or JSON lines (`--log-format`).
//!
//! The filter comes from `RUST_LOG` (the usual `tracing_subscriber::EnvFilter`
//! syntax, e.g. `RUST_LOG=info,outbox_relay=debug`) and defaults to `info` when it is
//! unset or empty. `RUST_LOG` rather than an `OUTBOX_RELAY_*` variable: that prefix is
//! reserved for configuration keys, and every variable under it must name one.
//! stdout is left to command output (`status`, `peek`, `check`).
//!
//! One event is one line (docs/security.md): text a server sends (an error message
//! with a line break and a forged timestamp) cannot start a line of its own. JSON
//! lines escape it by themselves; for text lines [`OneLine`] escapes every line break
//! and carriage return inside an event, and tracing-subscriber escapes terminal
//! escape sequences in field values.

use std::borrow::Cow;
use std::io::Write;

use outbox_event::redact::{escape_unsafe, Escape};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
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

/// Parses a log filter (`[relay] log_filter`), for the configuration's checks.
pub fn parse_filter(directives: &str) -> Result<EnvFilter, String> {
    EnvFilter::builder()
        .parse(directives.trim())
        .map_err(|e| e.to_string())
}

/// Replaces the installed subscriber's filter (`[relay] log_filter`, at start and on
/// a reload); `""` goes back to `RUST_LOG`'s (or `info`).
type SetFilter = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;
static SET_FILTER: std::sync::OnceLock<SetFilter> = std::sync::OnceLock::new();

/// Sets the log filter of the running process: `directives`, or `RUST_LOG`'s (else
/// `info`) when empty. Fails without changing it on an invalid filter.
pub fn set_filter(directives: &str) -> Result<(), String> {
    let filter = if directives.trim().is_empty() {
        filter(std::env::var(LOG_FILTER_ENV).ok().as_deref()).map_err(|e| e.to_string())?
    } else {
        parse_filter(directives)?
    };
    match SET_FILTER.get() {
        Some(set) => set(filter),
        None => Err("no logger is installed".into()),
    }
}

/// Installs the global subscriber. Call once, before anything logs.
pub fn init(format: LogFormat) -> Result<(), CliError> {
    let value = std::env::var(LOG_FILTER_ENV).ok();
    let filter = filter(value.as_deref())?;
    // Colours only on a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(OneLine {
            ansi,
            json: format == LogFormat::Json,
        })
        .with_ansi(ansi);
    let result = match format {
        LogFormat::Text => {
            let builder = builder.with_filter_reloading();
            let handle = builder.reload_handle();
            let _ = SET_FILTER.set(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
            builder.finish().with(HideCredentials).try_init()
        }
        LogFormat::Json => {
            let builder = builder
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_filter_reloading();
            let handle = builder.reload_handle();
            let _ = SET_FILTER.set(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
            builder.finish().with(HideCredentials).try_init()
        }
    };
    result.map_err(|e| CliError::Runtime(format!("cannot install the logger: {e}")))
}

/// Drops AMQP library trace lines that carry credentials. The relay's own AMQP
/// client logs no frame, and the codec it links (amq-protocol, targets
/// `amq_protocol*`) logs none either; this guards against it starting to (a client
/// that logs every frame it writes at trace level, as lapin does, logs
/// Connection.StartOk's SASL response `\0user\0password` among them; so do
/// Connection.SecureOk and Connection.UpdateSecret). A line saying a frame was
/// hidden takes its place. Only that library's events enabled by the filter (trace
/// level) are looked at, so this costs nothing at the usual levels
/// (docs/security.md).
struct HideCredentials;

/// The AMQP methods whose frames carry a secret.
const CREDENTIAL_FRAMES: &[&str] = &["StartOk", "SecureOk", "UpdateSecret"];

impl<S: Subscriber> Layer<S> for HideCredentials {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        let target = event.metadata().target();
        if !target.starts_with("amq_protocol") {
            return true;
        }
        let mut found = FindCredentials(None);
        event.record(&mut found);
        match found.0 {
            None => true,
            Some(method) => {
                tracing::trace!(target: "outbox_relay::logging", method, "an AMQP frame carrying credentials was not logged");
                false
            }
        }
    }
}

struct FindCredentials(Option<&'static str>);

impl Visit for FindCredentials {
    fn record_debug(&mut self, _field: &Field, value: &dyn std::fmt::Debug) {
        if self.0.is_none() {
            let text = format!("{value:?}");
            self.0 = CREDENTIAL_FRAMES.iter().copied().find(|m| text.contains(m));
        }
    }
}

/// stderr, with every control character, line separator and bidirectional control
/// inside an event escaped (`\\n`, `\\u{202e}`; `\\u202e` in JSON lines, where it
/// stays valid JSON) except the event's final line break, tabs, and, on a terminal,
/// the escape character of the colours tracing-subscriber writes itself
/// (`outbox_event::redact::escape_unsafe`, the one escaping of the program).
/// tracing-subscriber writes each event with one `write_all`, so one call is one
/// event.
#[derive(Debug, Clone, Copy)]
pub struct OneLine {
    pub ansi: bool,
    pub json: bool,
}

impl<'a> MakeWriter<'a> for OneLine {
    type Writer = OneLineWriter<std::io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        OneLineWriter {
            inner: std::io::stderr(),
            ansi: self.ansi,
            json: self.json,
        }
    }
}

/// The writer of [`OneLine`] (generic for tests).
pub struct OneLineWriter<W> {
    inner: W,
    ansi: bool,
    json: bool,
}

impl<W: Write> Write for OneLineWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let (body, end) = match buf.strip_suffix(b"\n") {
            Some(body) => (body, &b"\n"[..]),
            None => (buf, &b""[..]),
        };
        let text = String::from_utf8_lossy(body);
        let ansi = self.ansi;
        let keep = |c: char| c == '\t' || (ansi && c == '\x1b');
        let style = if self.json {
            Escape::Json
        } else {
            Escape::Rust
        };
        match escape_unsafe(&text, keep, style) {
            Cow::Borrowed(_) => self.inner.write_all(buf)?,
            Cow::Owned(escaped) => {
                let mut out = escaped.into_bytes();
                out.extend_from_slice(end);
                self.inner.write_all(&out)?;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
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
    fn an_event_stays_on_one_line() {
        let mut w = OneLineWriter {
            inner: Vec::new(),
            ansi: false,
            json: false,
        };
        w.write_all(b"ts WARN x: refused\n2026-01-01 INFO forged\r\x1b[2J\x07\n")
            .unwrap();
        assert_eq!(
            String::from_utf8(w.inner).unwrap(),
            "ts WARN x: refused\\n2026-01-01 INFO forged\\r\\u{1b}[2J\\u{7}\n"
        );
    }

    #[test]
    fn bidirectional_controls_and_separators_are_escaped_in_text_and_json_lines() {
        let event = "ts WARN x: routing_key=a\u{202e}b\u{2066}c\u{2028}d\u{2029}\u{9b}\u{7f}\n";
        for (json, expected) in [
            (
                false,
                "ts WARN x: routing_key=a\\u{202e}b\\u{2066}c\\u{2028}d\\u{2029}\\u{9b}\\u{7f}\n",
            ),
            (
                true,
                "ts WARN x: routing_key=a\\u202eb\\u2066c\\u2028d\\u2029\\u009b\\u007f\n",
            ),
        ] {
            let mut w = OneLineWriter {
                inner: Vec::new(),
                ansi: true,
                json,
            };
            w.write_all(event.as_bytes()).unwrap();
            assert_eq!(String::from_utf8(w.inner).unwrap(), expected);
        }
    }

    #[test]
    fn invalid_filter_is_a_usage_error() {
        let e = filter(Some("outbox_relay=loud")).expect_err("invalid filter accepted");
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("RUST_LOG"), "{e}");
    }
}
