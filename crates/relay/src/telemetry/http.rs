//! The OTLP/HTTP client: one HTTP/1.1 request per batch over hyper (already the
//! metrics endpoint's server), TLS by rustls with the system's roots for https.
//! It runs on the export thread's own runtime (`export.rs`), never on the
//! publishers'. Replaces opentelemetry-otlp's reqwest client, a second HTTP stack.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_http::{HttpClient, HttpError};
use tokio::net::TcpStream;

/// Default bound on one request (connect, send, read the answer):
/// `OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT` in milliseconds overrides it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer read (a receiver's answer is a few bytes).
const MAX_RESPONSE: usize = 1024 * 1024;

/// Request headers, name and value.
pub type HeaderList = Vec<(HeaderName, HeaderValue)>;

/// The request headers of `[tracing] headers_file` (credentials), which every
/// export request carries; a reload replaces them (docs/tracing.md).
#[derive(Clone, Default)]
pub struct Headers(Arc<Mutex<Arc<HeaderList>>>);

impl Headers {
    /// Every later request carries `headers` instead.
    pub fn set(&self, headers: HeaderList) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(headers);
    }

    fn get(&self) -> Arc<HeaderList> {
        Arc::clone(&self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[derive(Clone)]
pub struct Client {
    tls: Arc<rustls::ClientConfig>,
    timeout: Duration,
    headers: Headers,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("otlp-http-client")
    }
}

impl Client {
    /// A client trusting the system's roots for https endpoints, whose requests
    /// carry `headers`.
    pub fn new(headers: Headers) -> Result<Client, String> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS for the OTLP export ({e})"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let timeout = [
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
        .map_or(REQUEST_TIMEOUT, Duration::from_millis);
        Ok(Client {
            tls: Arc::new(tls),
            timeout,
            headers,
        })
    }

    async fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let uri = request.uri().clone();
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err("the OTLP endpoint must be an http:// or https:// URL".into()),
        };
        let host = uri
            .host()
            .ok_or("the OTLP endpoint has no host")?
            .to_string();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
        let _ = tcp.set_nodelay(true);
        let (mut parts, body) = request.into_parts();
        for (name, value) in self.headers.get().iter() {
            parts.headers.insert(name.clone(), value.clone());
        }
        if !parts.headers.contains_key(hyper::header::HOST) {
            let authority = uri.authority().map(|a| a.as_str()).unwrap_or(&host);
            // Never the userinfo part of an authority.
            let authority = authority.rsplit('@').next().unwrap_or(authority);
            parts
                .headers
                .insert(hyper::header::HOST, authority.parse()?);
        }
        // HTTP/1.1 wants the path, not the absolute URL.
        parts.uri = uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
            .parse()?;
        let request = Request::from_parts(parts, Full::new(body));
        let response = if https {
            let name =
                rustls::pki_types::ServerName::try_from(host.trim_matches(['[', ']']).to_string())?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(name, tcp)
                .await?;
            exchange(TokioIo::new(tls), request).await?
        } else {
            exchange(TokioIo::new(tcp), request).await?
        };
        Ok(response)
    }
}

/// One request on a fresh HTTP/1.1 connection, and its answer read whole.
async fn exchange<T>(io: T, request: Request<Full<Bytes>>) -> Result<Response<Bytes>, HttpError>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let driver = tokio::spawn(conn);
    let response = sender.send_request(request).await?;
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_RESPONSE)
        .collect()
        .await
        .map_err(|e| HttpError::from(e.to_string()))?
        .to_bytes();
    driver.abort();
    Ok(Response::from_parts(parts, body))
}

#[async_trait::async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        match tokio::time::timeout(self.timeout, self.send(request)).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "the OTLP receiver did not answer within {} ms",
                self.timeout.as_millis()
            )
            .into()),
        }
    }
}
