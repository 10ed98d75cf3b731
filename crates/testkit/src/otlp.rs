//! An OTLP/HTTP trace receiver (`POST /v1/traces`, protobuf) on a local port: what
//! an OpenTelemetry Collector's `otlphttp` receiver does, decoded with the OTLP
//! protobuf definitions (opentelemetry-proto), keeping every span it is sent. For
//! the tracing tests and the bench's traced drain.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use prost::Message as _;
use tokio::net::TcpListener;

/// One span as received, ids in lower-case hex (`parent_span_id` empty for a root).
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    /// OTLP's `SpanKind`: 4 is PRODUCER, 5 CONSUMER.
    pub kind: i32,
    /// Attributes as text (numbers and booleans in their text form).
    pub attributes: BTreeMap<String, String>,
    /// The names of its events, in order.
    pub events: Vec<String>,
    /// The resource's `service.name`.
    pub service_name: String,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
}

#[derive(Default)]
struct State {
    /// Counts the spans without keeping them ([`Receiver::sink`]).
    count_only: bool,
    count: u64,
    spans: Vec<Span>,
    requests: u64,
    /// Headers of the last request (lower-case names).
    headers: BTreeMap<String, String>,
}

/// The receiver; it stops when dropped.
pub struct Receiver {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub async fn start() -> std::io::Result<Receiver> {
        Self::listen(false).await
    }

    /// A receiver that decodes and counts the spans without keeping them (the
    /// bench's: a long run would hold them all).
    pub async fn sink() -> std::io::Result<Receiver> {
        Self::listen(true).await
    }

    async fn listen(count_only: bool) -> std::io::Result<Receiver> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            count_only,
            ..State::default()
        }));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(req, &state).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Receiver { addr, state, task })
    }

    /// The base URL to configure (`[tracing] endpoint` or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`): `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.lock().spans.clone()
    }

    /// Spans received so far (kept or not).
    pub fn span_count(&self) -> u64 {
        self.lock().count
    }

    /// Export requests received so far.
    pub fn requests(&self) -> u64 {
        self.lock().requests
    }

    /// The value of header `name` (lower case) on the last request.
    pub fn last_header(&self, name: &str) -> Option<String> {
        self.lock().headers.get(name).cloned()
    }

    /// Waits until `pred` holds for the spans received (checking every 50 ms), up to
    /// `timeout`; returns them either way.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if pred(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(req: Request<Incoming>, state: &Mutex<State>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/x-protobuf"),
        );
        r
    };
    if req.method() != hyper::Method::POST || req.uri().path() != "/v1/traces" {
        return reply(StatusCode::NOT_FOUND, Vec::new());
    }
    let headers: BTreeMap<String, String> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return reply(StatusCode::BAD_REQUEST, Vec::new()),
    };
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return reply(StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let service_name = resource_spans
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
            .and_then(|kv| kv.value.as_ref())
            .map(text)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for s in scope.spans {
                spans.push(Span {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attributes: attributes(&s.attributes),
                    events: s.events.into_iter().map(|e| e.name).collect(),
                    service_name: service_name.clone(),
                    start_unix_nanos: s.start_time_unix_nano,
                    end_unix_nanos: s.end_time_unix_nano,
                });
            }
        }
    }
    {
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.requests += 1;
        state.headers = headers;
        state.count += spans.len() as u64;
        if !state.count_only {
            state.spans.extend(spans);
        }
    }
    reply(
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            (
                kv.key.clone(),
                kv.value.as_ref().map(text).unwrap_or_default(),
            )
        })
        .collect()
}

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// Lower-case hex; no bytes or all zeros (no parent) give "".
fn hex(bytes: &[u8]) -> String {
    if bytes.iter().all(|b| *b == 0) {
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
