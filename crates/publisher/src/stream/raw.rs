//! The publishing connection for `[rabbitmq] stream_filter_value` (docs/streams.md,
//! "Filter values"): RabbitMQ 3.13 and later store a *filter value* with each message
//! sent in a publish frame of version 2. rabbitmq-stream-client 0.11's `Client::publish`
//! cannot carry one (the message wrapper that holds it is private to the crate), and its
//! `Producer` keeps the publishing ids and frames to itself. The frames themselves are
//! public: the client's own protocol crate, `rabbitmq-stream-protocol` 0.11, encodes
//! every request (publish v2 with filter values included) and decodes every answer.
//! This module drives one stream-protocol connection with it: the handshake
//! (`PeerProperties`, SASL PLAIN, `Tune`, `Open`), the requests the publisher makes,
//! heartbeats, and the broker's confirms, refusals and closes forwarded to the run loop
//! as for the client (`client.rs`). Publishing ids and producer names are the relay's,
//! exactly as on the other connections (docs/design.md §4).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use rabbitmq_stream_client::types::{Message, ResponseCode, ResponseKind};
use rabbitmq_stream_protocol::codec::{Decoder, Encoder};
use rabbitmq_stream_protocol::commands::{
    close::CloseRequest, create_stream::CreateStreamCommand,
    declare_publisher::DeclarePublisherCommand, heart_beat::HeartBeatCommand,
    metadata::MetadataCommand, open::OpenCommand, peer_properties::PeerPropertiesCommand,
    publish::PublishCommand, query_publisher_sequence::QueryPublisherRequest,
    sasl_authenticate::SaslAuthenticateCommand, sasl_handshake::SaslHandshakeCommand,
    tune::TunesCommand,
};
use rabbitmq_stream_protocol::types::PublishedMessage;
use rabbitmq_stream_protocol::{Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Mutex};

use super::endpoint::Endpoint;
use super::events::{BrokerEvent, ClientFailure};

/// The publish frame's version that carries filter values.
pub(crate) const PUBLISH_VERSION_FILTER: u16 = 2;
/// A frame larger than this from the broker is not one this connection expects.
const MAX_INCOMING_FRAME: u32 = 64 << 20;

type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// One connection speaking the stream protocol through `rabbitmq-stream-protocol`.
#[derive(Clone)]
pub(crate) struct RawClient {
    inner: Arc<Inner>,
}

struct Inner {
    writer: Mutex<Writer>,
    next_correlation: AtomicU32,
    /// The broker's side is gone: no answer will come.
    closed: AtomicBool,
    waiting: SyncMutex<HashMap<u32, oneshot::Sender<Response>>>,
    /// Where confirms, refusals and closes go; events before it is set are kept.
    events: SyncMutex<EventSink>,
    tasks: SyncMutex<Vec<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct EventSink {
    tx: Option<mpsc::UnboundedSender<BrokerEvent>>,
    early: Vec<BrokerEvent>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(tasks) = self.tasks.lock() {
            for t in tasks.iter() {
                t.abort();
            }
        }
    }
}

fn failure(text: impl Into<String>) -> ClientFailure {
    ClientFailure {
        code: None,
        text: text.into(),
    }
}

fn refused(code: &ResponseCode, what: &str) -> ClientFailure {
    ClientFailure {
        code: Some(code.clone()),
        text: format!("the broker answered {code:?} to {what}"),
    }
}

/// The bytes of `request` as sent: size, key, version, body.
pub(crate) fn encode(request: &Request) -> Result<Vec<u8>, ClientFailure> {
    let mut bytes = Vec::with_capacity(4 + request.encoded_size() as usize);
    request
        .encode(&mut bytes)
        .map_err(|e| failure(format!("cannot encode a request: {e:?}")))?;
    Ok(bytes)
}

/// A publish frame of version 2: each message with its publishing id and filter value.
pub(crate) fn publish_v2(
    publisher_id: u8,
    messages: Vec<(Message, Option<String>)>,
) -> Result<Request, ClientFailure> {
    let published = messages
        .into_iter()
        .map(|(message, filter)| {
            let id = message
                .publishing_id()
                .copied()
                .ok_or_else(|| failure("a message without a publishing id"))?;
            Ok(PublishedMessage::new(id, message, filter))
        })
        .collect::<Result<Vec<_>, ClientFailure>>()?;
    Ok(PublishCommand::new(publisher_id, published, PUBLISH_VERSION_FILTER).into())
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Response, ClientFailure> {
    let size = r
        .read_u32()
        .await
        .map_err(|e| failure(format!("connection lost: {e}")))?;
    if !(4..=MAX_INCOMING_FRAME).contains(&size) {
        return Err(failure(format!("unexpected frame of {size} bytes")));
    }
    let mut frame = Vec::with_capacity(4 + size as usize);
    frame.extend_from_slice(&size.to_be_bytes());
    frame.resize(4 + size as usize, 0);
    r.read_exact(&mut frame[4..])
        .await
        .map_err(|e| failure(format!("connection lost: {e}")))?;
    Response::decode(&frame)
        .map(|(_, response)| response)
        .map_err(|e| failure(format!("cannot decode a frame from the broker: {e:?}")))
}

async fn write<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    request: &Request,
) -> Result<(), ClientFailure> {
    let bytes = encode(request)?;
    w.write_all(&bytes)
        .await
        .map_err(|e| failure(format!("connection lost: {e}")))?;
    w.flush()
        .await
        .map_err(|e| failure(format!("connection lost: {e}")))
}

/// Sends `request` and reads the next frame as its answer (the handshake: the
/// broker sends nothing else meanwhile).
async fn ask<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    request: Request,
) -> Result<Response, ClientFailure> {
    write(s, &request).await?;
    read_frame(s).await
}

impl RawClient {
    /// Connects to `endpoint` (TLS with `tls`), authenticates with PLAIN, answers the
    /// broker's tune with `frame_max` and `heartbeat` (or its smaller values), and
    /// opens the virtual host.
    pub async fn connect(
        endpoint: &Endpoint,
        tls: Option<Arc<rustls::ClientConfig>>,
        frame_max: u32,
        heartbeat: Duration,
    ) -> Result<RawClient, ClientFailure> {
        let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
            .await
            .map_err(|e| failure(format!("cannot connect: {e}")))?;
        let _ = tcp.set_nodelay(true);
        match tls {
            None => Self::start(tcp, endpoint, frame_max, heartbeat).await,
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(endpoint.host.clone()).map_err(
                    |_| {
                        failure(format!(
                            "{:?} is not a valid TLS server name",
                            endpoint.host
                        ))
                    },
                )?;
                let stream = tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await
                    .map_err(|e| failure(format!("TLS: {e}")))?;
                Self::start(stream, endpoint, frame_max, heartbeat).await
            }
        }
    }

    async fn start<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        mut s: S,
        endpoint: &Endpoint,
        frame_max: u32,
        heartbeat: Duration,
    ) -> Result<RawClient, ClientFailure> {
        let properties = HashMap::from([
            ("product".to_string(), "outbox-relay".to_string()),
            ("connection_name".to_string(), "outbox-relay".to_string()),
        ]);
        let answer = ask(&mut s, PeerPropertiesCommand::new(1, properties).into()).await?;
        expect_code(&answer, "PeerProperties")?;
        let answer = ask(&mut s, SaslHandshakeCommand::new(2).into()).await?;
        expect_code(&answer, "SaslHandshake")?;
        let mut plain = vec![0u8];
        plain.extend_from_slice(endpoint.user.as_bytes());
        plain.push(0);
        plain.extend_from_slice(endpoint.password.as_bytes());
        let answer = ask(
            &mut s,
            SaslAuthenticateCommand::new(3, "PLAIN".into(), plain).into(),
        )
        .await?;
        expect_code(&answer, "SaslAuthenticate")?;
        let tune = loop {
            match read_frame(&mut s).await?.kind() {
                ResponseKind::Tunes(t) => break t,
                ResponseKind::Close(_) => return Err(failure("the broker closed the connection")),
                _ => {}
            }
        };
        let negotiate = |ours: u32, theirs: u32| match (ours, theirs) {
            (0, t) => t,
            (o, 0) => o,
            (o, t) => o.min(t),
        };
        let beat = negotiate(
            heartbeat.as_secs().min(u64::from(u32::MAX)) as u32,
            tune.heartbeat,
        );
        write(
            &mut s,
            &TunesCommand::new(negotiate(frame_max, tune.max_frame_size), beat).into(),
        )
        .await?;
        let answer = ask(&mut s, OpenCommand::new(4, endpoint.vhost.clone()).into()).await?;
        expect_code(&answer, "Open")?;

        let (mut reader, writer) = tokio::io::split(s);
        let inner = Arc::new(Inner {
            writer: Mutex::new(Box::new(writer)),
            next_correlation: AtomicU32::new(5),
            closed: AtomicBool::new(false),
            waiting: SyncMutex::new(HashMap::new()),
            events: SyncMutex::new(EventSink::default()),
            tasks: SyncMutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&inner);
        let read = tokio::spawn(async move {
            loop {
                let next = read_frame(&mut reader).await;
                let Some(inner) = weak.upgrade() else { return };
                match next {
                    Ok(response) => inner.dispatch(response).await,
                    Err(e) => {
                        inner.closed.store(true, Ordering::SeqCst);
                        inner.emit(BrokerEvent::Closed(e.text));
                        inner.waiting.lock().map(|mut w| w.clear()).ok();
                        return;
                    }
                }
            }
        });
        let mut tasks = vec![read.abort_handle()];
        if beat > 0 {
            let weak = Arc::downgrade(&inner);
            let every = Duration::from_secs(u64::from(beat));
            let beats = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(inner) = weak.upgrade() else { return };
                    let mut w = inner.writer.lock().await;
                    if write(&mut *w, &HeartBeatCommand::default().into())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            tasks.push(beats.abort_handle());
        }
        if let Ok(mut t) = inner.tasks.lock() {
            *t = tasks;
        }
        Ok(RawClient { inner })
    }

    async fn call(&self, make: impl FnOnce(u32) -> Request) -> Result<Response, ClientFailure> {
        let correlation = self.inner.next_correlation.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.inner.waiting.lock() {
            w.insert(correlation, tx);
        }
        // Checked after the insert: the reader clears the waiters after setting it.
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(failure("connection closed"));
        }
        {
            let mut w = self.inner.writer.lock().await;
            write(&mut *w, &make(correlation)).await?;
        }
        rx.await.map_err(|_| failure("connection closed"))
    }

    pub async fn close(&self) {
        let _ = self
            .call(|c| CloseRequest::new(c, ResponseCode::Ok, "closing".into()).into())
            .await;
        if let Ok(tasks) = self.inner.tasks.lock() {
            for t in tasks.iter() {
                t.abort();
            }
        }
    }

    pub async fn metadata(
        &self,
        stream: &str,
    ) -> Result<Option<(ResponseCode, String, u32)>, ClientFailure> {
        let answer = self
            .call(|c| MetadataCommand::new(c, vec![stream.to_string()]).into())
            .await?;
        let ResponseKind::Metadata(m) = answer.kind() else {
            return Err(failure("unexpected answer to Metadata"));
        };
        let Some(s) = m.stream_metadata.iter().find(|s| s.stream_name == stream) else {
            return Ok(None);
        };
        let leader = m
            .brokers
            .iter()
            .find(|b| b.reference == s.leader_reference)
            .map(|b| (b.host.clone(), b.port))
            .unwrap_or_default();
        Ok(Some((s.code.clone(), leader.0, leader.1)))
    }

    pub async fn create_stream(
        &self,
        stream: &str,
        arguments: HashMap<String, String>,
    ) -> Result<ResponseCode, ClientFailure> {
        let answer = self
            .call(|c| CreateStreamCommand::new(c, stream.to_string(), arguments).into())
            .await?;
        generic_code(answer, "Create")
    }

    pub async fn declare_publisher(
        &self,
        publisher_id: u8,
        reference: Option<String>,
        stream: &str,
    ) -> Result<ResponseCode, ClientFailure> {
        let answer = self
            .call(|c| {
                DeclarePublisherCommand::new(c, publisher_id, reference, stream.to_string()).into()
            })
            .await?;
        generic_code(answer, "DeclarePublisher")
    }

    pub async fn query_publisher_sequence(
        &self,
        reference: &str,
        stream: &str,
    ) -> Result<u64, ClientFailure> {
        let answer = self
            .call(|c| {
                QueryPublisherRequest::new(c, reference.to_string(), stream.to_string()).into()
            })
            .await?;
        let ResponseKind::QueryPublisherSequence(q) = answer.kind() else {
            return Err(failure("unexpected answer to QueryPublisherSequence"));
        };
        // The crate keeps the answer's code to itself; its encoding has it after the
        // correlation id.
        let mut bytes = Vec::new();
        q.encode(&mut bytes)
            .map_err(|e| failure(format!("cannot read an answer: {e:?}")))?;
        let code = bytes
            .get(4..6)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .and_then(|c| ResponseCode::try_from(c).ok())
            .unwrap_or(ResponseCode::InternalError);
        match code {
            ResponseCode::Ok => Ok(q.from_response()),
            code => Err(refused(&code, "QueryPublisherSequence")),
        }
    }

    /// Publishes `messages` (each with its publishing id set, and its filter value) in
    /// one frame of version 2.
    pub async fn publish(
        &self,
        publisher_id: u8,
        messages: Vec<(Message, Option<String>)>,
    ) -> Result<(), ClientFailure> {
        let request = publish_v2(publisher_id, messages)?;
        let mut w = self.inner.writer.lock().await;
        write(&mut *w, &request).await
    }

    pub async fn forward_events(&self, tx: mpsc::UnboundedSender<BrokerEvent>) {
        if let Ok(mut sink) = self.inner.events.lock() {
            for event in sink.early.drain(..) {
                let _ = tx.send(event);
            }
            sink.tx = Some(tx);
        }
    }
}

impl Inner {
    fn emit(&self, event: BrokerEvent) {
        if let Ok(mut sink) = self.events.lock() {
            match &sink.tx {
                Some(tx) => {
                    let _ = tx.send(event);
                }
                None => sink.early.push(event),
            }
        }
    }

    async fn dispatch(&self, response: Response) {
        if let Some(correlation) = response.correlation_id() {
            let waiter = self
                .waiting
                .lock()
                .ok()
                .and_then(|mut w| w.remove(&correlation));
            if let Some(waiter) = waiter {
                let _ = waiter.send(response);
                return;
            }
        }
        match response.kind() {
            ResponseKind::PublishConfirm(c) => {
                self.emit(BrokerEvent::Confirmed(c.publisher_id, c.publishing_ids))
            }
            ResponseKind::PublishError(e) => self.emit(BrokerEvent::Refused(
                e.publisher_id,
                e.publishing_errors
                    .into_iter()
                    .map(|p| (p.publishing_id, p.error_code))
                    .collect(),
            )),
            ResponseKind::MetadataUpdate(m) => self.emit(BrokerEvent::Closed(format!(
                "the broker reports a change of the stream ({m:?})"
            ))),
            ResponseKind::Close(c) => self.emit(BrokerEvent::Closed(format!(
                "the broker closed the connection ({c:?})"
            ))),
            _ => {}
        }
    }
}

fn expect_code(answer: &Response, what: &str) -> Result<(), ClientFailure> {
    let code = match answer.kind_ref() {
        ResponseKind::PeerProperties(_) => return Ok(()),
        ResponseKind::SaslHandshake(_) => return Ok(()),
        ResponseKind::Generic(g) => g.code(),
        ResponseKind::Open(o) => o.code(),
        ResponseKind::Close(_) => return Err(failure("the broker closed the connection")),
        other => return Err(failure(format!("unexpected answer to {what}: {other:?}"))),
    };
    if code == &ResponseCode::Ok {
        Ok(())
    } else {
        Err(refused(code, what))
    }
}

fn generic_code(answer: Response, what: &str) -> Result<ResponseCode, ClientFailure> {
    match answer.kind() {
        ResponseKind::Generic(g) => Ok(g.code().clone()),
        _ => Err(failure(format!("unexpected answer to {what}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn message(id: u64, body: &[u8]) -> Message {
        Message::builder()
            .body(body.to_vec())
            .publishing_id(id)
            .build()
    }

    /// The frame laid out by hand from the stream protocol's specification (publish,
    /// key 0x0002, version 2: publisher id, count, then per message its publishing id,
    /// its filter value as a string of int16 length and its bytes). The protocol crate
    /// writes no value as length 0, an empty value.
    #[test]
    fn publish_v2_carries_each_filter_value() {
        let a = message(7, b"a");
        let b = message(8, b"bb");
        let request = publish_v2(
            3,
            vec![(a.clone(), Some("order".into())), (b.clone(), None)],
        )
        .unwrap();
        let bytes = encode(&request).unwrap();
        let mut expected = Vec::new();
        let mut body = Vec::new();
        body.extend_from_slice(&0x0002u16.to_be_bytes());
        body.extend_from_slice(&2u16.to_be_bytes());
        body.push(3);
        body.extend_from_slice(&2u32.to_be_bytes());
        for (m, filter) in [(&a, Some("order")), (&b, None)] {
            body.extend_from_slice(&m.publishing_id().unwrap().to_be_bytes());
            match filter {
                Some(f) => {
                    body.extend_from_slice(&(f.len() as i16).to_be_bytes());
                    body.extend_from_slice(f.as_bytes());
                }
                None => body.extend_from_slice(&0i16.to_be_bytes()),
            }
            let mut encoded = Vec::new();
            m.encode(&mut encoded).unwrap();
            body.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
            body.extend_from_slice(&encoded);
        }
        expected.extend_from_slice(&(body.len() as u32).to_be_bytes());
        expected.extend_from_slice(&body);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_message_without_publishing_id_is_refused() {
        let m = Message::builder().body(b"x".to_vec()).build();
        assert!(publish_v2(0, vec![(m, None)]).is_err());
    }
}
