//! Continuing the relay's trace (docs/tracing.md): each delivery's `process` span
//! (kind CONSUMER) is the child of the span whose context the message's `traceparent`
//! header carries — with `[tracing]` on in the relay, its `publish` span; otherwise
//! the producer's own (the relay passes the row's `traceparent` through).
//!
//! The span comes from the global tracer provider: an application installs its own
//! (any exporter); the binary installs [`init_otlp`]'s when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, else none (the
//! API's no-op: the span costs nothing and goes nowhere).

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{SpanKind, Tracer as _, TracerProvider as _};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// A delivery's headers, read by the W3C propagator.
struct Headers<'a>(Option<&'a FieldTable>);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = match self.0?.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?,
            AMQPValue::ShortString(s) => s.as_str(),
            _ => return None,
        };
        // The SDK's propagator takes ids of any length ("00-abc-def-01"); W3C's
        // fields are 2-32-16-2 hex digits.
        if key == "traceparent" && !w3c_shape(value) {
            return None;
        }
        Some(value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .map(|h| h.inner().keys().map(|k| k.as_str()).collect())
            .unwrap_or_default()
    }
}

/// Whether `traceparent` has W3C's field lengths (`00-<32>-<16>-<2>`, a later
/// version may add fields after a dash).
fn w3c_shape(traceparent: &str) -> bool {
    let b = traceparent.as_bytes();
    b.len() >= 55
        && b[2] == b'-'
        && b[35] == b'-'
        && b[52] == b'-'
        && (b.len() == 55 || b[55] == b'-')
}

/// The context the `traceparent` and `tracestate` headers name (a remote parent), or
/// an empty one when they are missing or malformed.
pub fn parent_context(headers: Option<&FieldTable>) -> Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

/// Starts the `process <queue>` span of one delivery, the child of the context its
/// headers carry, with the global tracer.
pub fn start_process_span(
    headers: Option<&FieldTable>,
    queue: &str,
    message_id: &str,
) -> global::BoxedSpan {
    let tracer = global::tracer("inbox-consumer");
    tracer
        .span_builder(format!("process {queue}"))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "rabbitmq"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", queue.to_string()),
            KeyValue::new("messaging.message.id", message_id.to_string()),
        ])
        .start_with_context(&tracer, &parent_context(headers))
}

/// Installs an OTLP/HTTP exporting tracer provider as the global one when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (the
/// exporter reads the other `OTEL_*` variables itself); returns it so that `main` can
/// flush it at exit. Must run inside the Tokio runtime.
pub fn init_otlp() -> anyhow::Result<Option<SdkTracerProvider>> {
    let set = |v: &str| std::env::var(v).is_ok_and(|s| !s.trim().is_empty());
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Http(tokio::runtime::Handle::current()))
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()?;
    // The SDK's batch processor: a thread of its own, a bounded queue.
    let processor = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter).build();
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "inbox-consumer".into());
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    global::set_tracer_provider(provider.clone());
    // The provider's tracer, so that a forgotten global install shows at once.
    let _ = provider.tracer("inbox-consumer");
    Ok(Some(provider))
}

/// OTLP/HTTP requests over hyper's HTTP/1 client (plain `http://`: send to a local
/// Collector or agent, which forwards over TLS). The SDK's batch processor exports
/// from a thread of its own, so the request runs on the application's runtime.
#[derive(Debug)]
struct Http(tokio::runtime::Handle);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Http {
    async fn send_bytes(
        &self,
        request: hyper::Request<bytes::Bytes>,
    ) -> Result<hyper::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let send = async move {
            let uri = request.uri().clone();
            let host = uri
                .host()
                .ok_or("the OTLP endpoint has no host")?
                .to_string();
            if uri.scheme_str() != Some("http") {
                return Err("the example exports over plain http:// only".into());
            }
            let tcp = tokio::net::TcpStream::connect((host.as_str(), uri.port_u16().unwrap_or(80)))
                .await?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
            let driver = tokio::spawn(conn);
            let (mut parts, body) = request.into_parts();
            if let Some(authority) = uri.authority() {
                parts
                    .headers
                    .insert(hyper::header::HOST, authority.as_str().parse()?);
            }
            parts.uri = uri.path_and_query().map_or("/", |p| p.as_str()).parse()?;
            let response = sender
                .send_request(hyper::Request::from_parts(
                    parts,
                    http_body_util::Full::new(body),
                ))
                .await?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::BodyExt::collect(body).await?.to_bytes();
            driver.abort();
            Ok::<_, opentelemetry_http::HttpError>(hyper::Response::from_parts(parts, body))
        };
        // The timer too must be made on the runtime, not on the exporting thread.
        let timed = async move { tokio::time::timeout(Duration::from_secs(10), send).await };
        match self.0.spawn(timed).await? {
            Ok(result) => result,
            Err(_) => Err("the OTLP receiver did not answer within 10 s".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::LongString;
    use opentelemetry::trace::{Span as _, TraceContextExt as _};

    fn headers(pairs: &[(&str, &str)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), AMQPValue::LongString(LongString::from(*v)));
        }
        t
    }

    #[test]
    fn the_parent_is_the_messages_traceparent() {
        let h = headers(&[(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )]);
        let cx = parent_context(Some(&h));
        let parent = cx.span().span_context().clone();
        assert!(parent.is_valid() && parent.is_remote() && parent.is_sampled());
        assert_eq!(
            format!("{:032x}", parent.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(format!("{:016x}", parent.span_id()), "00f067aa0ba902b7");

        // The span of the delivery is its child (with an SDK provider installed).
        let provider = SdkTracerProvider::builder().build();
        let tracer = provider.tracer("test");
        let mut span = tracer
            .span_builder("process q")
            .with_kind(SpanKind::Consumer)
            .start_with_context(&tracer, &cx);
        assert_eq!(span.span_context().trace_id(), parent.trace_id());
        assert_ne!(span.span_context().span_id(), parent.span_id());
        span.end();

        for bad in ["", "00-abc-def-01", "garbage"] {
            let cx = parent_context(Some(&headers(&[("traceparent", bad)])));
            assert!(!cx.span().span_context().is_valid(), "{bad:?}");
        }
        assert!(!parent_context(None).span().span_context().is_valid());
    }
}
