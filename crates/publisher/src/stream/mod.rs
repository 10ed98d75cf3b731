//! The second publishing target: a RabbitMQ *stream* over the stream protocol
//! (`rabbitmq-stream://`, port 5552), exactly once thanks to the broker's publisher
//! deduplication. [`StreamPublisher`] has the shape of [`crate::Publisher`]
//! (`connect`, `status`, `run`) so the relay can drive either.
//!
//! # What is shared with the AMQP publisher
//!
//! - [`crate::window::Window`]: the same ordered buffer of messages and commit /
//!   keepalive marks, so the watermark rule is literally the same code: it moves to a
//!   mark only once every message before it is confirmed, and `max_in_flight` counts
//!   unconfirmed and not-yet-flushed messages the same way.
//! - [`crate::status::PublisherStatus`] (`/readyz`, metrics) and the metric names.
//! - [`crate::backoff`] for the reconnect delays, [`crate::PublishError`] (one more
//!   variant, [`PublishError::Stream`]), [`crate::PublisherReport`].
//! - The headers column's JSON parsing and reserved-key rule
//!   (`message::json_headers`, [`crate::message::is_reserved_header`]).
//!
//! What is not shared: the AMQP engine (delivery tags, nacks, returns, dead
//! lettering) has no counterpart here: a stream has no routing, and the stream
//! protocol confirms or refuses each publishing id.
//!
//! # The client
//!
//! The official `rabbitmq-stream-client`, version 0.11, and version 0.4 for a broker
//! before RabbitMQ 3.11 (`client.rs`): every version after 0.4 sends
//! `exchange_command_versions` while connecting, which RabbitMQ 3.10 answers by
//! closing the connection. It is used at its raw `Client` level
//! (one connection, one publisher id per producer), not through its `Producer` (in 0.11 the
//! producer's confirm handler panics on an id it does not track and its `Drop`
//! blocks on a network round trip). The raw client sends a message with the publishing id we
//! set on it (`Message::builder().publishing_id(id)`, used as is by
//! `Client::publish`), and reports `PublishConfirm` (ids stored) and `PublishError`
//! (ids refused, with a code) frames to our handler, which forwards them to the run
//! loop. It connects exactly to the URL given; the publisher then moves to the stream's
//! leader only when the broker advertises it as another configured URL
//! (`leader.rs`), so a proxy in front of the broker works. The client never gives up
//! on a silent broker; `liveness.rs` does (docs/design.md §4, *A silent broker*).
//!
//! With `[rabbitmq] stream_filter_value` (RabbitMQ 3.13 and later) the connection is
//! the relay's own, `raw.rs`, on the client's protocol crate: 0.11's `Client::publish`
//! cannot send filter values (docs/streams.md, "Filter values"). The requests, events
//! and publishing ids are the same; only the publish frame is version 2.
//!
//! # Producers, publishing ids, and why it is exactly once
//!
//! With [`StreamConfig::source`] set, every event is published by a *named* producer,
//! and the broker drops every message whose publishing id is not above the highest
//! it stored for that producer (it still confirms it). `identity.rs` derives both the
//! producer reference and the id from the event's place in its source's WAL history:
//! the reference names the source (system identifier, database, slot, or
//! `producer_name`) and the timeline whose WAL holds the event's commit; the id is
//! the commit LSN and the index in the transaction. So:
//!
//! 1. After any restart the slot delivers again every event after its confirmed
//!    position, in the same order, with the same commit LSN and index: the same
//!    producer and the same id. The broker's last stored id of that producer (asked
//!    when the producer is declared, one request) says which of them the leader holds;
//!    the engine sends them all the same (a leader cut off from its replicas reports
//!    writes it will lose), and the broker drops the copies it holds and confirms
//!    them once a majority stored them. Nothing
//!    is read back from the stream, so the start takes the same few requests whatever
//!    other writers do and however much retention removed.
//! 2. Another source, or another WAL history of this one (a failover that replaced
//!    WAL, a restore), publishes under other references: its ids never make the
//!    broker drop ours.
//! 3. Within one `run`, a lost connection or a refusal ends the connection; the next
//!    one declares the producers again and sends everything unconfirmed again in
//!    order.
//!
//! A refused id stays refused until it is confirmed; if the broker then reports a
//! last id at or above it, it stored a later event and would drop this one: the
//! publisher stops with a definite [`PublishError::Stream`] rather than lose it
//! silently (`engine.rs`).
//!
//! With `source = None` (replay) the producer is unnamed: no deduplication, no
//! `x-outbox-producer` / `x-outbox-publishing-id` properties; ids only match
//! confirms, and a republish adds copies.
//!
//! # The message
//!
//! Body: the event's body. Properties: `message-id` (the `id` column),
//! `content-type`, `creation-time` (commit time, ms). Application properties: the
//! headers column's keys (reserved keys dropped), then [`StreamConfig::extra_properties`],
//! then the relay's own, which win a name clash: `aggregate_type`, `aggregate_id`,
//! `event_type` (strings, AMQP null for NULL), `table`, `commit_lsn` (`X/Y`),
//! `tx_index` and `xid` (ulong), `x-outbox-producer`, `x-outbox-publishing-id` (ulong),
//! `x-outbox-source` and `x-outbox-timeline` (ulong).
//!
//! Limits: a publish frame's exact encoded size stays within the frame maximum the
//! connection negotiated (`tune.rs`); a message that does not fit even alone holds the
//! publisher as a poison message (`/poison`, `status`, the metric), and a transaction
//! may carry at most [`identity::MAX_EVENTS_PER_TRANSACTION`] events.

mod client;
mod connection;
mod endpoint;
mod engine;
mod events;
pub mod identity;
mod leader;
mod liveness;
mod message;
mod raw;
mod run;
#[cfg(test)]
mod sim;
mod tune;

use std::path::PathBuf;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

use crate::error::{redact_url, PublishError};
use crate::report::PublisherReport;
use crate::status::PublisherStatus;

pub use identity::StreamSource;
pub use message::{PRODUCER_PROPERTY, PUBLISHING_ID_PROPERTY, SOURCE_PROPERTY, TIMELINE_PROPERTY};

/// Default stream-protocol URL.
pub const DEFAULT_STREAM_URL: &str = "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f";

/// The stream heartbeat when none is configured: the client's and RabbitMQ's default.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(60);

/// Everything the stream publisher needs.
#[derive(Clone)]
pub struct StreamConfig {
    /// `rabbitmq-stream://` or `rabbitmq-stream+tls://` URLs (they contain the
    /// password), tried in order.
    pub urls: Vec<String>,
    pub stream: String,
    /// Create the stream when missing (with the two limits below).
    pub declare_stream: bool,
    pub max_length_bytes: Option<u64>,
    pub max_age: Option<Duration>,
    /// The source the named producers are derived from (deduplication, module docs);
    /// `None`: an unnamed producer, no deduplication (replay).
    pub source: Option<StreamSource>,
    pub max_in_flight: usize,
    /// Application properties added to every message, e.g. `("replay", "true")`.
    pub extra_properties: Vec<(String, String)>,
    /// The messages' shape (`[message] format`, docs/cloudevents.md).
    pub format: crate::message::MessageFormat,
    /// Which of the relay's application properties each message carries
    /// (`[message] headers`).
    pub headers: crate::message::HeaderProfile,
    /// PEM CA for `rabbitmq-stream+tls://`; without it the system's CA bundle.
    pub ca_file: Option<PathBuf>,
    /// A client certificate for `+tls` and a password file that replaces the URLs'
    /// password, read at every connect (`connection.rs`).
    pub auth: crate::ClientAuth,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub shutdown_timeout: Duration,
    /// Events waiting with nothing confirmed this long: the stall is named
    /// (`crate::watchdog`).
    pub stall_after: Duration,
    /// The heartbeat the client proposes, and the interval of the liveness check: a
    /// connection silent for two of them while confirms are outstanding is given up
    /// (`liveness.rs`). The relay sets it from `[rabbitmq] heartbeat_secs`.
    pub heartbeat: Duration,
    /// `[rabbitmq] stream_filter_value`: each message's filter value, rendered per
    /// event (docs/streams.md, "Filter values"); it needs RabbitMQ 3.13 or later and
    /// is sent in publish v2 frames by `raw.rs`. `None`: no filter values.
    pub filter_value: Option<crate::message::RoutingKeyTemplate>,
}

impl StreamConfig {
    /// One URL and stream, the AMQP publisher's defaults, the stream declared when
    /// missing without limits, and no producer reference.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            stream: stream.into(),
            declare_stream: true,
            max_length_bytes: None,
            max_age: None,
            source: None,
            max_in_flight: crate::DEFAULT_MAX_IN_FLIGHT,
            extra_properties: Vec::new(),
            format: crate::message::MessageFormat::Native,
            headers: crate::message::HeaderProfile::Full,
            ca_file: None,
            auth: crate::ClientAuth::default(),
            backoff_initial: crate::DEFAULT_BACKOFF_INITIAL,
            backoff_max: crate::DEFAULT_BACKOFF_MAX,
            shutdown_timeout: crate::DEFAULT_SHUTDOWN_TIMEOUT,
            stall_after: crate::watchdog::DEFAULT_STALL_AFTER,
            heartbeat: DEFAULT_HEARTBEAT,
            filter_value: None,
        }
    }

    fn validate(&self) -> Result<(), PublishError> {
        if self.urls.is_empty() {
            return Err(PublishError::InvalidConfig {
                key: "stream_url",
                reason: "no URL given; set stream_url to a rabbitmq-stream:// URL".into(),
            });
        }
        for url in &self.urls {
            endpoint::Endpoint::parse(url)?;
        }
        if self.stream.is_empty() {
            return Err(PublishError::InvalidConfig {
                key: "stream",
                reason: "empty stream name".into(),
            });
        }
        crate::config::validate_max_in_flight(self.max_in_flight)?;
        if self.source.as_ref().is_some_and(|s| s.reference.is_empty()) {
            return Err(PublishError::InvalidConfig {
                key: "producer_name",
                reason: "empty producer reference".into(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("StreamConfig")
            .field("urls", &urls)
            .field("stream", &self.stream)
            .field("declare_stream", &self.declare_stream)
            .field("max_length_bytes", &self.max_length_bytes)
            .field("max_age", &self.max_age)
            .field("source", &self.source)
            .field("max_in_flight", &self.max_in_flight)
            .field("extra_properties", &self.extra_properties)
            .field("format", &self.format)
            .field("headers", &self.headers)
            .field("ca_file", &self.ca_file)
            .field("auth", &self.auth)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("filter_value", &self.filter_value)
            .finish()
    }
}

/// Whether the stream exists, asked without declaring it (for `check`, through
/// `probe.rs`).
pub(crate) async fn stream_exists(config: &StreamConfig) -> Result<bool, PublishError> {
    use rabbitmq_stream_client::types::ResponseCode;
    let mut config = config.clone();
    config.declare_stream = false;
    config.validate()?;
    let session = connection::connect_any(&config, 0).await?;
    let url = &config.urls[session.url_index];
    let answer = session.client.metadata(&config.stream).await;
    let presence = match answer {
        Ok(metadata) => match metadata.as_ref().map(|(code, _, _)| code) {
            Some(ResponseCode::Ok) => Ok(true),
            Some(ResponseCode::StreamDoesNotExist) | None => Ok(false),
            Some(code) => Err(PublishError::Stream {
                stream: config.stream.clone(),
                reason: format!("the broker answered {code:?} when asked about it"),
            }),
        },
        Err(e) => Err(connection::classify(url, &e)),
    };
    session.close().await;
    presence
}

/// A connected stream publisher; see the module docs.
pub struct StreamPublisher {
    config: StreamConfig,
    session: connection::Session,
    /// The producer declared at connect (publisher id 0) and its last stored id.
    first: Option<(identity::ProducerKey, u64)>,
    status: PublisherStatus,
}

impl StreamPublisher {
    /// Connects to the first reachable URL, declares the stream if asked, and
    /// declares the producer of the server's current timeline (so that a refused
    /// write permission shows at once). Login and vhost problems, a missing stream and
    /// a refused publisher are definite errors; an unreachable broker is transient.
    /// Other producers are declared as their events come.
    pub async fn connect(config: StreamConfig) -> Result<StreamPublisher, PublishError> {
        config.validate()?;
        let session = leader::connect_to_leader(&config, 0, None).await?;
        let (key, reference) = match &config.source {
            Some(source) => {
                let key = source.key(source.server_wal);
                (key, Some(source.reference_of(key)))
            }
            None => (message::UNNAMED, None),
        };
        let last = match session.declare(&config, 0, reference.as_deref()).await {
            Ok(last) => last,
            Err(e) => {
                session.close().await;
                return Err(e);
            }
        };
        tracing::info!(
            node = %redact_url(&config.urls[session.url_index]),
            stream = %config.stream,
            producer = reference.as_deref().unwrap_or("(unnamed)"),
            last_publishing_id = last,
            frame_max = session.frame_max,
            "connected to the rabbitmq stream"
        );
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        Ok(StreamPublisher {
            config,
            session,
            first: Some((key, last)),
            status,
        })
    }

    /// A handle on the publisher's live state (for `/readyz` and metrics).
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }

    /// The producer declared at connect (the current timeline's): its reference and
    /// the broker's last stored publishing id for it (0: none). `None`: unnamed.
    pub fn producer(&self) -> Option<(String, u64)> {
        let source = self.config.source.as_ref()?;
        let (key, last) = self.first?;
        Some((source.reference_of(key), last))
    }

    /// [`crate::Publisher::run`]'s contract on a stream: consumes batches until
    /// `input` closes, publishing every event in order and advancing `watermark` as
    /// confirms arrive; reconnects by itself; returns once the input is closed and
    /// everything is confirmed, or when `shutdown_timeout` has passed since it closed.
    /// `flushed`: the positions sent to Postgres as flushed, as for
    /// [`crate::Publisher::run`].
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<PublisherReport, PublishError> {
        let (status, stall_after) = (self.status.clone(), self.config.stall_after);
        let run = run::Runner::new(self, watermark, flushed).run(input);
        crate::watchdog::alongside(status, stall_after, run).await
    }
}
