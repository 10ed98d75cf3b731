//! The second publishing target: a RabbitMQ *stream* over the stream protocol
//! (`rabbitmq-stream://`, port 5552), exactly once thanks to the broker's publisher
//! deduplication. [`StreamPublisher`] has the shape of [`crate::Publisher`]
//! (`connect`, `status`, `run`, `run_with_flushed`) so the relay can drive either.
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
//! The official `rabbitmq-stream-client`, version 0.4: every later version sends
//! `exchange_command_versions` while connecting, which RabbitMQ before 3.13 (3.10
//! here) answers by closing the connection. It is used at its raw `Client` level
//! (one connection, publisher id 1), not through its `Producer` (in 0.11 the
//! producer's confirm handler panics on an id it does not track and its `Drop`
//! blocks on a network round trip). The raw client sends a message with the publishing id we
//! set on it (`Message::builder().publising_id(id)` in 0.4, used as is by
//! `Client::publish`), and reports `PublishConfirm` (ids stored) and `PublishError`
//! (ids refused, with a code) frames to our handler, which forwards them to the run
//! loop. It connects exactly to the URL given (no advertised-host lookup), so a
//! proxy in front of the broker works.
//!
//! # Publishing ids and why it is exactly once
//!
//! With [`StreamConfig::producer_reference`] `= Some(r)` the publisher is the *named*
//! producer `r`, and the broker drops every message whose publishing id is not above
//! the highest it stored for `r` (it still confirms it).
//!
//! 1. At connect, the broker is asked for `r`'s last publishing id `last` (0: never
//!    published). If `last > 0` the stream is read from its end backwards
//!    (`tail.rs`: the last chunk, then windows of offsets doubling in size, down to
//!    the first offset) until the message of producer `r` with
//!    `x-outbox-publishing-id = last` is found; its `(commit_lsn, tx_index)` is the
//!    *tail*. Other producers' messages are skipped by `x-outbox-producer`.
//! 2. Every event at or below the tail (compared as `(commit_lsn, tx_index)`) is
//!    already in the stream: it is not sent and counts as confirmed at once. Every
//!    later event gets the next id, `last + 1, last + 2, …`, in arrival order, which
//!    is commit order.
//! 3. The relay confirms to Postgres only positions whose events are all confirmed,
//!    so after any restart the slot re-delivers every event after the tail, in the
//!    same order with the same `(commit_lsn, tx_index)`: they get the same ids again.
//!    Events at or below the tail are skipped, so nothing is stored twice; events
//!    above it were never stored (ids above `last`), so nothing is lost. Neither
//!    record LSNs (they interleave across transactions) nor `commit_lsn` arithmetic
//!    is used: only the order of arrival.
//! 4. Within one `run`, a lost connection or a refusal ends the session; after the
//!    backoff, a new connection asks `last` again: buffered messages with ids up to
//!    `last` are confirmed at once, the others are sent again with the ids they were
//!    given, in order (the broker drops any it stored meanwhile).
//!
//! Publish errors: the broker refuses ids with a code (stream gone, publisher
//! unknown, access refused) for a whole publish frame, but frames after a refused
//! one on the same connection could in principle be stored (for example once the
//! stream's leader is back), which would make `last` jump over a refused id. So a
//! refusal ends the session at once (the connection is closed), and the reconnect
//! checks that `last` is below the lowest refused id: if it is not, a refused event
//! lies below `last`, the broker would drop it as a duplicate, and the publisher
//! stops with [`PublishError::Stream`] rather than lose it silently. A `last` above
//! every id this process assigned means a second writer uses the same reference
//! (two relays on one slot): also a [`PublishError::Stream`].
//!
//! With `producer_reference = None` (replay) the producer is unnamed: no query, no
//! tail, no `x-outbox-producer` / `x-outbox-publishing-id` properties; ids are only
//! used to match confirms, and a republish adds copies.
//!
//! # The message
//!
//! Body: the event's body. Properties: `message-id` (the `id` column),
//! `content-type`, `creation-time` (commit time, ms). Application properties: the
//! headers column's keys (reserved keys dropped), then [`StreamConfig::extra_properties`],
//! then the relay's own, which win a name clash: `aggregate_type`, `aggregate_id`,
//! `event_type` (strings, AMQP null for NULL), `table`, `commit_lsn` (`X/Y`),
//! `tx_index` and `xid` (ulong), `x-outbox-producer`, `x-outbox-publishing-id` (ulong).
//!
//! Limits: one message must fit in a stream-protocol frame (1 MiB, negotiated with
//! the broker); messages are sent in publish frames of at most 512 KiB.

mod connection;
mod message;
mod run;
mod tail;

use std::path::PathBuf;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

use crate::error::{redact_url, PublishError};
use crate::status::PublisherStatus;
use crate::PublisherReport;

pub use tail::Tail;

/// Default stream-protocol URL.
pub const DEFAULT_STREAM_URL: &str = "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f";

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
    /// The named producer (deduplication); `None`: an unnamed producer, no
    /// deduplication (replay).
    pub producer_reference: Option<String>,
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
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub shutdown_timeout: Duration,
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
            producer_reference: None,
            max_in_flight: crate::DEFAULT_MAX_IN_FLIGHT,
            extra_properties: Vec::new(),
            format: crate::message::MessageFormat::Native,
            headers: crate::message::HeaderProfile::Full,
            ca_file: None,
            backoff_initial: crate::DEFAULT_BACKOFF_INITIAL,
            backoff_max: crate::DEFAULT_BACKOFF_MAX,
            shutdown_timeout: crate::DEFAULT_SHUTDOWN_TIMEOUT,
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
            connection::Endpoint::parse(url)?;
        }
        if self.stream.is_empty() {
            return Err(PublishError::InvalidConfig {
                key: "stream",
                reason: "empty stream name".into(),
            });
        }
        if self.max_in_flight == 0 {
            return Err(PublishError::InvalidConfig {
                key: "max_in_flight",
                reason: "0 would never publish; set a positive number such as 10000".into(),
            });
        }
        if self.producer_reference.as_deref() == Some("") {
            return Err(PublishError::InvalidConfig {
                key: "producer_reference",
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
            .field("producer_reference", &self.producer_reference)
            .field("max_in_flight", &self.max_in_flight)
            .field("extra_properties", &self.extra_properties)
            .field("format", &self.format)
            .field("headers", &self.headers)
            .field("ca_file", &self.ca_file)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish()
    }
}

/// A connected stream publisher; see the module docs.
pub struct StreamPublisher {
    config: StreamConfig,
    session: connection::Session,
    /// `(commit_lsn, tx_index)` of the producer's last stored message, if any.
    tail: Option<Tail>,
    status: PublisherStatus,
}

impl StreamPublisher {
    /// Connects to the first reachable URL, declares the stream if asked, declares
    /// the publisher and, for a named producer, finds the tail (module docs).
    /// Login and vhost problems, a missing stream and a tail that cannot be found
    /// are definite errors; an unreachable broker is transient.
    pub async fn connect(config: StreamConfig) -> Result<StreamPublisher, PublishError> {
        config.validate()?;
        let session = connection::connect_any(&config, 0).await?;
        let tail = match (&config.producer_reference, session.last_id) {
            (Some(reference), last) if last > 0 => {
                Some(tail::find(&config, session.url_index, reference, last).await?)
            }
            _ => None,
        };
        tracing::info!(
            node = %redact_url(&config.urls[session.url_index]),
            stream = %config.stream,
            producer = ?config.producer_reference,
            last_publishing_id = session.last_id,
            tail = ?tail,
            "connected to the rabbitmq stream"
        );
        let status = PublisherStatus::new(Lsn::ZERO);
        status.set_connected(true);
        Ok(StreamPublisher {
            config,
            session,
            tail,
            status,
        })
    }

    /// A handle on the publisher's live state (for `/readyz` and metrics).
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }

    /// The producer's last stored message found at connect (`None`: unnamed, or
    /// nothing published yet).
    pub fn tail(&self) -> Option<Tail> {
        self.tail
    }

    /// [`crate::Publisher::run`]'s contract on a stream: consumes batches until
    /// `input` closes, publishing every event in order and advancing `watermark` as
    /// confirms arrive; reconnects by itself; returns once the input is closed and
    /// everything is confirmed, or when `shutdown_timeout` has passed since it closed.
    pub async fn run(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        run::Runner::new(self, watermark, None).run(input).await
    }

    /// [`StreamPublisher::run`] with the positions sent to Postgres as flushed, as
    /// [`crate::Publisher::run_with_flushed`].
    pub async fn run_with_flushed(
        self,
        input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: watch::Receiver<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        run::Runner::new(self, watermark, Some(flushed))
            .run(input)
            .await
    }
}
