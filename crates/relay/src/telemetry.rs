//! OpenTelemetry export of the per-event `publish` spans (docs/tracing.md,
//! docs/design.md §8): `[tracing]` and the standard `OTEL_*` variables choose it,
//! [`start`] installs the publishers' tracer, and [`Telemetry::shutdown`] sends
//! what is queued at exit (bounded).
//!
//! ```text
//!   publisher task ── span.end() ──► on_end: try_send ──► bounded queue ──► export thread
//!   (never waits)                    full: dropped, counted     (max_queue_size)   OTLP/HTTP
//! ```
//!
//! The export runs on its own thread with its own small runtime, so a slow or
//! unreachable receiver never holds the publishing runtime (one thread, main.rs).
//!
//! `[tracing] headers_file` is a secret file (the rule of every secret file,
//! checked at load): its headers go with every request from [`HEADERS`], which a
//! reload refills ([`reload_headers`]), and never in clear beyond loopback unless
//! `allow_insecure_http = true` (docs/security.md).

mod export;
mod http;

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use publisher::trace::EventTracer;

use crate::config::{Config, TracingConfig};
use crate::error::CliError;

pub use export::{SPANS_DROPPED, SPANS_EXPORTED};

/// The default `service.name` when `OTEL_SERVICE_NAME` is not set.
pub const DEFAULT_SERVICE_NAME: &str = "outbox-relay";
/// How long the exit waits for the queued spans to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3);

/// The headers of `[tracing] headers_file` the running export sends; set once the
/// export starts with a headers file.
static HEADERS: OnceLock<http::Headers> = OnceLock::new();

/// Whether tracing is on: an endpoint in `[tracing]` or in an
/// `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` variable, and `OTEL_SDK_DISABLED` not
/// `true`.
pub fn enabled(config: &TracingConfig) -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    !disabled
        && (!config.endpoint.is_empty()
            || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            || set("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// The running export; dropping it without [`Self::shutdown`] loses what is queued.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Sends what is queued (waiting at most a few seconds) and stops the export.
    pub fn shutdown(self) {
        let _ = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
    }
}

/// Starts the export and installs the tracer every publisher takes its spans from
/// (`publisher::trace`); `None` when tracing is off.
pub fn start(cfg: &Config) -> Result<Option<Telemetry>, CliError> {
    match exporter(&cfg.tracing)? {
        Some(exporter) => install(exporter, cfg).map(Some),
        None => Ok(None),
    }
}

/// Everything `run` checks of tracing before it starts, as the exporter is built:
/// the protocol, the endpoint and the headers file. `check` calls it too, so that
/// the two never disagree. `Ok(None)` when tracing is off ([`enabled`]).
pub fn exporter(
    config: &TracingConfig,
) -> Result<Option<opentelemetry_otlp::SpanExporter>, CliError> {
    if !enabled(config) {
        return Ok(None);
    }
    refuse_headers_in_clear(config)?;
    let protocol = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_default();
    if !matches!(protocol.trim(), "" | "http/protobuf") {
        return Err(invalid(
            "tracing.endpoint",
            format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL = \"{}\" is not supported: the relay exports OTLP over HTTP; set it to http/protobuf (or unset it) and point the endpoint at the receiver's HTTP port (4318)",
            outbox_event::redact::printable(protocol.trim())
        )));
    }
    let headers = http::Headers::default();
    if !config.headers_file.is_empty() {
        headers.set(read_headers(&config.headers_file)?);
        let _ = HEADERS.set(headers.clone());
    }
    let client = http::Client::new(headers).map_err(|e| invalid("tracing.endpoint", e))?;
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if !config.endpoint.is_empty() {
        builder = builder.with_endpoint(traces_url(&config.endpoint));
    }
    // Neither the endpoint (it may hold credentials) nor the headers are quoted.
    let exporter = builder.build().map_err(|_| {
        invalid(
            "tracing.endpoint",
            "the OTLP trace exporter cannot be built from it or OTEL_EXPORTER_OTLP_*: set an http:// or https:// URL",
        )
    })?;
    Ok(Some(exporter))
}

/// [`start`] once the exporter is built.
fn install(
    exporter: opentelemetry_otlp::SpanExporter,
    cfg: &Config,
) -> Result<Telemetry, CliError> {
    let config = &cfg.tracing;
    let processor = export::BoundedExport::start(exporter, config.max_queue_size)
        .map_err(|e| CliError::Runtime(format!("cannot start the trace export thread: {e}")))?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string());
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            crate::build_info::VERSION,
        ))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sampling_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer =
        EventTracer::new(provider.tracer("outbox-relay")).with_options(cfg.trace_options());
    EventTracer::install(tracer);
    tracing::info!(
        sampling_ratio = config.sampling_ratio,
        respect_parent_sampled = config.respect_parent_sampled,
        attributes = ?config.attributes,
        max_queue_size = config.max_queue_size,
        "exporting a publish span per event over OTLP/HTTP (docs/tracing.md)"
    );
    Ok(Telemetry { provider })
}

/// `[tracing] endpoint` as the traces URL: a base URL (`http://collector:4318`)
/// gets OTLP's `/v1/traces`, like `OTEL_EXPORTER_OTLP_ENDPOINT`; a URL with a path
/// is used as it is, like `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
pub fn traces_url(endpoint: &str) -> String {
    let endpoint = endpoint.trim();
    let after_scheme = endpoint.find("://").map_or(0, |i| i + 3);
    match endpoint[after_scheme..].find('/') {
        Some(slash) if endpoint.len() > after_scheme + slash + 1 => endpoint.to_string(),
        _ => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
    }
}

/// A `[tracing]` error naming `key` (exit 2).
fn invalid(key: &str, reason: impl Into<String>) -> CliError {
    CliError::Config(crate::config::ConfigError::Invalid {
        key: key.to_string(),
        origin: None,
        reason: reason.into(),
    })
}

/// The effective endpoint (`[tracing] endpoint`, else the `OTEL_*` variables')
/// must not be plain http:// beyond loopback when headers go with it, unless
/// `allow_insecure_http = true`.
fn refuse_headers_in_clear(config: &TracingConfig) -> Result<(), CliError> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let endpoint = Some(config.endpoint.clone())
        .filter(|e| !e.trim().is_empty())
        .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
        .unwrap_or_default();
    let from = if !config.headers_file.is_empty() {
        "tracing.headers_file"
    } else if var("OTEL_EXPORTER_OTLP_TRACES_HEADERS").is_some()
        || var("OTEL_EXPORTER_OTLP_HEADERS").is_some()
    {
        "OTEL_EXPORTER_OTLP_HEADERS"
    } else {
        return Ok(());
    };
    let why = crate::config::tracing_headers_in_clear(&endpoint, config.allow_insecure_http, from);
    match why {
        Some(why) => Err(invalid("tracing.endpoint", why)),
        None => Ok(()),
    }
}

/// Reads `[tracing] headers_file` again (a reload) into the running export's
/// headers; `Ok` without reading when the export runs without a headers file.
pub fn reload_headers(path: &str) -> Result<(), String> {
    let Some(headers) = HEADERS.get() else {
        return Ok(());
    };
    headers.set(read_headers(path).map_err(|e| e.to_line())?);
    Ok(())
}

/// The headers of `[tracing] headers_file`: `key=value` pairs, one per line or
/// comma-separated (the format of `OTEL_EXPORTER_OTLP_HEADERS`); `#` starts a comment
/// line. Errors name the line, never its text (it holds credentials).
pub fn read_headers(path: &str) -> Result<http::HeaderList, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        invalid(
            "tracing.headers_file",
            format!("cannot read {path:?} ({e}): fix the path or its permissions"),
        )
    })?;
    let bad = |line: usize| {
        invalid(
            "tracing.headers_file",
            format!("line {line} of {path:?} is not `key=value`: write one header per line as key=value"),
        )
    };
    let headers = parse_headers(&text).map_err(bad)?;
    let mut out = Vec::with_capacity(headers.len());
    for (key, (value, line)) in headers {
        let name = HeaderName::from_bytes(key.as_bytes()).map_err(|_| bad(line))?;
        let mut value = HeaderValue::from_str(&value).map_err(|_| bad(line))?;
        value.set_sensitive(true);
        out.push((name, value));
    }
    Ok(out)
}

/// [`read_headers`]' parser: each key's value and line; the number of the first
/// bad line on error.
fn parse_headers(text: &str) -> Result<HashMap<String, (String, usize)>, usize> {
    let mut headers = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        for pair in line.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or(n + 1)?;
            let key = key.trim();
            if key.is_empty() || !key.bytes().all(|c| c.is_ascii_graphic() && c != b':') {
                return Err(n + 1);
            }
            headers.insert(key.to_ascii_lowercase(), (value.trim().to_string(), n + 1));
        }
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_endpoint_gets_the_traces_path() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("https://h/otlp/v1/traces"),
            "https://h/otlp/v1/traces"
        );
    }

    #[test]
    fn headers_are_key_value_pairs() {
        let h = parse_headers("# auth\nx-honeycomb-team = abc\n\nA=1,b=2=3\n").expect("valid");
        assert_eq!(h["x-honeycomb-team"], ("abc".to_string(), 2));
        assert_eq!(h["a"].0, "1");
        assert_eq!(h["b"], ("2=3".to_string(), 4));
        assert_eq!(parse_headers("a=1\nsecret-without-equals\n"), Err(2));
        assert_eq!(parse_headers("bad key=1"), Err(1));
    }
}
