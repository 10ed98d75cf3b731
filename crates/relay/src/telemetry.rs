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

mod export;
mod http;

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use publisher::trace::EventTracer;

use crate::config::TracingConfig;
use crate::error::CliError;

pub use export::{SPANS_DROPPED, SPANS_EXPORTED};

/// The default `service.name` when `OTEL_SERVICE_NAME` is not set.
pub const DEFAULT_SERVICE_NAME: &str = "outbox-relay";
/// How long the exit waits for the queued spans to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3);

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
pub fn start(config: &TracingConfig) -> Result<Option<Telemetry>, CliError> {
    match exporter(config)? {
        Some(exporter) => install(exporter, config).map(Some),
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
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(http::Client::new().map_err(|e| invalid("tracing.endpoint", e))?)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if !config.endpoint.is_empty() {
        builder = builder.with_endpoint(traces_url(&config.endpoint));
    }
    if !config.headers_file.is_empty() {
        builder = builder.with_headers(read_headers(&config.headers_file)?);
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
    config: &TracingConfig,
) -> Result<Telemetry, CliError> {
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
    EventTracer::install(EventTracer::new(provider.tracer("outbox-relay")));
    tracing::info!(
        sampling_ratio = config.sampling_ratio,
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

/// The headers of `[tracing] headers_file`: `key=value` pairs, one per line or
/// comma-separated (the format of `OTEL_EXPORTER_OTLP_HEADERS`); `#` starts a comment
/// line. Errors name the line, never its text (it holds credentials).
pub fn read_headers(path: &str) -> Result<HashMap<String, String>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        invalid(
            "tracing.headers_file",
            format!("cannot read {path:?} ({e}): fix the path or its permissions"),
        )
    })?;
    parse_headers(&text).map_err(|line| {
        invalid(
            "tracing.headers_file",
            format!("line {line} of {path:?} is not `key=value`: write one header per line as key=value"),
        )
    })
}

/// [`read_headers`]' parser: the number of the first bad line on error.
fn parse_headers(text: &str) -> Result<HashMap<String, String>, usize> {
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
            headers.insert(key.to_ascii_lowercase(), value.trim().to_string());
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
        assert_eq!(h["x-honeycomb-team"], "abc");
        assert_eq!(h["a"], "1");
        assert_eq!(h["b"], "2=3");
        assert_eq!(parse_headers("a=1\nsecret-without-equals\n"), Err(2));
        assert_eq!(parse_headers("bad key=1"), Err(1));
    }
}
