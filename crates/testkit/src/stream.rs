//! RabbitMQ streams for tests (stream protocol, `OUTBOX_TEST_STREAM_URL`): a uniquely
//! named stream per test ([`TestStream`]) and reading a whole stream back as plain
//! Rust values ([`read`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use rabbitmq_stream_client::types::{
    Message, MessageResult, OffsetSpecification, ResponseKind, SimpleValue,
};
pub use rabbitmq_stream_client::Client;
use rabbitmq_stream_client::{ClientOptions, TlsConfiguration};
use tokio::sync::mpsc;

/// A message to publish with [`publish_as`].
pub use rabbitmq_stream_client::types::Message as OutMessage;

/// Stream-protocol URL of the test broker.
pub fn stream_url() -> String {
    std::env::var("OUTBOX_TEST_STREAM_URL")
        .unwrap_or_else(|_| "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f".to_string())
}

/// The test broker's stream listener as an address (a proxy's upstream).
pub fn stream_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], crate::port_of(&stream_url(), 5552)))
}

/// An application property value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    Str(String),
    U64(u64),
    I64(i64),
    Bool(bool),
    /// Any other AMQP type, as its debug text.
    Other(String),
}

/// One message read from a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    pub offset: u64,
    /// First offset of the chunk the message came in.
    pub chunk: u64,
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub content_type: Option<String>,
    /// `creation-time`, ms since the Unix epoch.
    pub creation_time_ms: Option<i64>,
    pub application_properties: BTreeMap<String, Value>,
}

impl StreamMessage {
    /// A string application property.
    pub fn text(&self, key: &str) -> Option<&str> {
        match self.application_properties.get(key)? {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An unsigned integer application property.
    pub fn number(&self, key: &str) -> Option<u64> {
        match self.application_properties.get(key)? {
            Value::U64(v) => Some(*v),
            _ => None,
        }
    }
}

/// The client options of a plain `rabbitmq-stream://user:password@host:port/vhost` URL.
fn options_at(url: &str) -> ClientOptions {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (userinfo, rest) = rest.rsplit_once('@').unwrap_or(("guest:guest", rest));
    let (user, password) = userinfo.split_once(':').unwrap_or(("guest", "guest"));
    let hostport = rest.split('/').next().unwrap_or("127.0.0.1:5552");
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5552"));
    let mut tls = TlsConfiguration::default();
    tls.enable(false);
    ClientOptions::builder()
        .tls(tls)
        .host(host)
        .port(port.parse().expect("stream port"))
        .user(user)
        .password(password)
        .v_host("/")
        .build()
}

/// A raw client on the test broker.
pub async fn client() -> Client {
    client_at(&stream_url()).await
}

/// A raw client on the broker (node) of a plain stream URL, e.g. one node of the test
/// cluster (`OUTBOX_TEST_CLUSTER_STREAM_URLS`).
pub async fn client_at(url: &str) -> Client {
    Client::connect(options_at(url))
        .await
        .expect("connect to the RabbitMQ stream port (is rabbitmq_stream enabled?)")
}

/// [`client_at`], or an error after `timeout` (a paused or dead node).
pub async fn try_client_at(url: &str, timeout: Duration) -> Option<Client> {
    tokio::time::timeout(timeout, Client::connect(options_at(url)))
        .await
        .ok()?
        .ok()
}

/// A uniquely named stream, created empty; [`TestStream::delete`] removes it.
pub struct TestStream {
    pub name: String,
}

impl TestStream {
    pub async fn create(prefix: &str) -> TestStream {
        Self::create_with(prefix, HashMap::new()).await
    }

    /// A stream created with `arguments` (e.g. `max-length-bytes`,
    /// `stream-max-segment-size-bytes`).
    pub async fn create_with(prefix: &str, arguments: HashMap<String, String>) -> TestStream {
        let name = crate::unique_name(prefix);
        let client = client().await;
        let response = client
            .create_stream(&name, arguments)
            .await
            .expect("create stream");
        assert!(
            response.is_ok(),
            "create stream {name}: {:?}",
            response.code()
        );
        let _ = client.close().await;
        TestStream { name }
    }

    /// Every message from the first offset.
    pub async fn read_all(&self) -> Vec<StreamMessage> {
        read(&self.name, 0).await
    }

    pub async fn delete(self) {
        delete(&self.name).await;
    }
}

/// Publishes `n` messages of `size` bytes into `stream` as another, unnamed producer,
/// and waits for their confirms.
pub async fn publish_foreign(stream: &str, n: usize, size: usize) {
    let body = vec![b'f'; size];
    let messages = (0..n as u64)
        .map(|i| {
            Message::builder()
                .body(body.clone())
                .publising_id(i + 2)
                .build()
        })
        .collect();
    publish_as(stream, None, messages).await;
}

/// Publishes `messages` (publishing ids set) into `stream` under the producer
/// `reference` (`None`: unnamed), in frames of 100, and waits for every confirm —
/// what another writer, or an earlier version of the relay, left in a stream.
pub async fn publish_as(stream: &str, reference: Option<&str>, messages: Vec<Message>) {
    let n = messages.len();
    let client = client().await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let forward = move |item: MessageResult| {
        let tx = tx.clone();
        async move {
            if let Some(Ok(response)) = item {
                if let ResponseKind::PublishConfirm(c) = response.kind() {
                    let _ = tx.send(c.publishing_ids.len());
                }
            }
            Ok(())
        }
    };
    client.set_handler(forward).await;
    let response = client
        .declare_publisher(9, reference.map(str::to_string), stream)
        .await
        .expect("declare publisher");
    assert!(response.is_ok(), "declare publisher: {:?}", response.code());
    let mut messages = messages.into_iter().peekable();
    while messages.peek().is_some() {
        let batch: Vec<Message> = messages.by_ref().take(100).collect();
        client.publish(9, batch).await.expect("publish");
    }
    let mut confirmed = 0;
    while confirmed < n {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(k)) => confirmed += k,
            _ => panic!("{confirmed} of {n} messages confirmed"),
        }
    }
    let _ = client.close().await;
}

/// The broker's last stored publishing id of producer `reference` on `stream` (0:
/// none).
pub async fn last_publishing_id(reference: &str, stream: &str) -> u64 {
    let client = client().await;
    let last = client
        .query_publisher_sequence(reference, stream)
        .await
        .unwrap_or(0);
    let _ = client.close().await;
    last
}

/// Waits until `stream` holds a message at `offset` (reading only from there): true
/// when one arrived within `timeout`.
pub async fn wait_offset(stream: &str, offset: u64, timeout: Duration) -> bool {
    let client = client().await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let forward = move |item: MessageResult| {
        let tx = tx.clone();
        async move {
            if let Some(Ok(response)) = item {
                if let ResponseKind::Deliver(d) = response.kind() {
                    let _ = tx.send(d.chunk_first_offset + d.messages.len() as u64);
                }
            }
            Ok(())
        }
    };
    client.set_handler(forward).await;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut found = false;
    while !found && tokio::time::Instant::now() < deadline {
        let _ = client.unsubscribe(1).await;
        let subscribed = client
            .subscribe(
                1,
                stream,
                OffsetSpecification::Offset(offset),
                1,
                HashMap::new(),
            )
            .await
            .is_ok_and(|r| r.is_ok());
        if subscribed {
            if let Ok(Some(end)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await
            {
                found = end > offset;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let _ = client.close().await;
    found
}

/// Deletes a stream (missing is fine).
pub async fn delete(name: &str) {
    let client = client().await;
    let _ = client.delete_stream(name).await;
    let _ = client.close().await;
}

/// Reads `stream` from `offset` until nothing more arrives for two seconds (five
/// for the first chunk).
pub async fn read(stream: &str, offset: u64) -> Vec<StreamMessage> {
    read_at(&stream_url(), stream, offset).await
}

/// [`read`] through the node of the plain stream URL `url`.
pub async fn read_at(url: &str, stream: &str, offset: u64) -> Vec<StreamMessage> {
    read_with(url, stream, offset, HashMap::new()).await
}

/// Every message the broker delivers to a subscription filtering on `values`
/// (RabbitMQ 3.13+: the subscription properties `filter.0`, `filter.1`, … and
/// `match-unfiltered`), from the first offset. The broker skips whole chunks whose
/// bloom filter matches none of the values; the chunks it sends may hold other
/// messages too: the caller filters them (docs/streams.md, "Filter values").
pub async fn read_filtered(
    stream: &str,
    values: &[&str],
    match_unfiltered: bool,
) -> Vec<StreamMessage> {
    let mut properties: HashMap<String, String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("filter.{i}"), v.to_string()))
        .collect();
    properties.insert("match-unfiltered".into(), match_unfiltered.to_string());
    read_with(&stream_url(), stream, 0, properties).await
}

async fn read_with(
    url: &str,
    stream: &str,
    offset: u64,
    properties: HashMap<String, String>,
) -> Vec<StreamMessage> {
    let client = client_at(url).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let forward = move |item: MessageResult| {
        let tx = tx.clone();
        async move {
            if let Some(Ok(response)) = item {
                if let ResponseKind::Deliver(d) = response.kind() {
                    let _ = tx.send((d.chunk_first_offset, d.messages));
                }
            }
            Ok(())
        }
    };
    client.set_handler(forward).await;
    // Under load a subscribe can time out or find the stream's replica not yet
    // available: try a few times before calling it a failure. A stream that does
    // not exist yet reads as empty.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let response = client
            .subscribe(
                1,
                stream,
                OffsetSpecification::Offset(offset),
                16,
                properties.clone(),
            )
            .await;
        match response {
            Ok(r) if r.is_ok() => break,
            // Not created yet (the relay declares it when it connects): empty, and
            // a caller waiting for messages reads again.
            Ok(r) if format!("{:?}", r.code()) == "StreamDoesNotExist" => {
                let _ = client.close().await;
                return Vec::new();
            }
            Ok(r) if attempt >= 5 => panic!("subscribe to {stream}: {:?}", r.code()),
            Err(e) if attempt >= 5 => panic!("subscribe to {stream}: {e}"),
            _ => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
    let mut out = Vec::new();
    // The first chunk of a stream holding tens of megabytes can take seconds to
    // come on a loaded machine (a 1-s wait once returned an empty stream); later
    // chunks follow each other closely.
    let mut wait = Duration::from_secs(5);
    while let Ok(Some((first, messages))) = tokio::time::timeout(wait, rx.recv()).await {
        wait = Duration::from_secs(2);
        for (k, message) in messages.iter().enumerate() {
            let at = first + k as u64;
            if at >= offset {
                out.push(convert(at, first, message));
            }
        }
        let _ = client.credit(1, 1).await;
    }
    let _ = client.close().await;
    // Chunks do not always arrive in offset order (seen with client 0.4 on
    // RabbitMQ 3.10): order by offset.
    out.sort_by_key(|m| m.offset);
    out.dedup_by_key(|m| m.offset);
    out
}

fn convert(offset: u64, chunk: u64, message: &Message) -> StreamMessage {
    let properties = message.properties();
    let message_id = properties.and_then(|p| p.message_id.as_ref()).map(|id| {
        // The id's type is not exported by the client: a string id prints as
        // `String("…")`.
        let text = format!("{id:?}");
        text.strip_prefix("String(\"")
            .and_then(|t| t.strip_suffix("\")"))
            .map_or(text.clone(), str::to_string)
    });
    let content_type = properties
        .and_then(|p| p.content_type.as_ref())
        .map(|c| c.to_string());
    // The client's timestamp type exposes no accessor: read its debug text
    // (`Timestamp(2024-01-01T00:00:00.123Z)`).
    let creation_time_ms = properties
        .and_then(|p| p.creation_time.as_ref())
        .and_then(|t| {
            let text = format!("{t:?}");
            let inner = text.strip_prefix("Timestamp(")?.strip_suffix(')')?;
            chrono::DateTime::parse_from_rfc3339(inner)
                .ok()
                .map(|d| d.timestamp_millis())
        });
    let application_properties = message
        .application_properties()
        .map(|app| {
            app.iter()
                .map(|(k, v)| {
                    let value = match v {
                        SimpleValue::Null => Value::Null,
                        SimpleValue::String(s) => Value::Str(s.clone()),
                        SimpleValue::Ulong(v) => Value::U64(*v),
                        SimpleValue::Uint(v) => Value::U64(u64::from(*v)),
                        SimpleValue::Long(v) => Value::I64(*v),
                        SimpleValue::Int(v) => Value::I64(i64::from(*v)),
                        SimpleValue::Boolean(b) => Value::Bool(*b),
                        other => Value::Other(format!("{other:?}")),
                    };
                    (k.clone(), value)
                })
                .collect()
        })
        .unwrap_or_default();
    StreamMessage {
        offset,
        chunk,
        body: message.data().map(<[u8]>::to_vec).unwrap_or_default(),
        message_id,
        content_type,
        creation_time_ms,
        application_properties,
    }
}
