//! RabbitMQ publishing with publisher confirms, and the *acked watermark*.
//!
//! Two targets behind one face ([`Target`]): an exchange over AMQP 0-9-1
//! ([`amqp`]: the relay's own client, one connection per lane) and a RabbitMQ
//! stream over the stream protocol ([`stream`], exactly once). Both take the
//! reader's batches and publish the acked watermark the same way (`progress.rs`).
//!
//! Events come in as [`outbox_event`] types, ready to send (the reader has already
//! decoded the body and chosen the content type): this crate knows RabbitMQ, not
//! Postgres, and does not depend on the reader.
//!
//! # Layout
//!
//! ```text
//!   settings (the file's [rabbitmq], [topology]) ─► amqp::config::PublisherConfig / stream::StreamConfig
//!        │                                              │
//!        ▼                                              ▼
//!   target::Target ─► amqp::Publisher (one lane) or amqp::lanes (N lanes)   stream::StreamPublisher
//!                      session.rs: URLs in order ─► connection/ (the client)   connection.rs (the
//!                      topology.rs: what is declared       │                   stream protocol crate)
//!                      run.rs: the loop ─► engine.rs: every decision
//!                      destinations.rs: exchanges named per event
//!        both: message/ builds what is sent, window.rs the acked watermark,
//!              progress.rs the bookkeeping they share, status.rs what /readyz and
//!              metrics read, watchdog.rs the stall alarm
//! ```
//!
//! - [`settings`]: the configuration file's publisher sections as serde reads them,
//!   and their checks; `settings/topology.rs` the `[topology]` declarations.
//! - `config.rs`: what both targets' configurations share (the flow limit and its
//!   check, the retry and shutdown defaults); `amqp/config.rs`: [`PublisherConfig`],
//!   what the AMQP target runs with, built from the settings (it imports nothing
//!   from them but the topology's types).
//! - [`amqp`]: the exchange target. `connection/` is the AMQP 0-9-1 client (its
//!   `mod.rs` has the file map; it takes `connection::Params`, not the config);
//!   `session.rs` logs in to the first URL that answers; `topology.rs` declares;
//!   `run.rs` (with `run/`) is the publishing loop around `engine.rs`;
//!   `destinations.rs` the exchanges rows choose; `lanes.rs` N channels;
//!   `message.rs` the AMQP message of an event.
//! - [`stream`]: the stream target (exactly once through producer names and
//!   publishing ids; `stream/mod.rs` explains).
//! - [`message`]: what both targets' messages share (the format, the header
//!   profile, CloudEvents, row properties, the headers column, the routing-key and
//!   exchange templates); the AMQP message itself is `amqp/message.rs`
//!   (`OutboundMessage`, `MessageBuilder`).
//! - [`routing`]: a model of the broker's routing for `check --routes`.
//! - [`probe`]: what `check` asks the broker without declaring anything.
//! - `tls.rs`: TLS client configurations and secret files, for both targets.
//! - [`window`], `progress.rs`, [`status`], [`watchdog`], [`trace`], [`error`],
//!   [`backoff`]: shared by both targets.
//!
//! # How progress is tracked
//!
//! [`window`] keeps every message and every commit / keepalive position in arrival
//! order until the watermark passes them. The watermark moves to a position once
//! every message before it is acked, never backwards, and the `watch` is only sent
//! when it advances.

pub mod amqp;
pub mod backoff;
mod config;
pub mod error;
pub mod message;
pub mod status;
pub mod stream;
pub mod trace;
pub mod watchdog;
pub mod window;

pub mod probe;
mod progress;
mod report;
pub mod routing;
pub mod settings;
mod target;
mod tls;

pub use amqp::config::{check_channels, PublisherConfig, DEFAULT_EXCHANGE_TYPE};
pub use amqp::{lanes, Publisher};
pub use config::{
    check_max_in_flight, DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX, DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_SHUTDOWN_TIMEOUT,
};
pub use error::{redact_url, PublishError};
pub use report::PublisherReport;
pub use status::{PoisonMessage, PublisherStatus};
pub use target::{Target, TargetConfig};
pub use tls::{https_client_config, read_password_file, ClientAuth};
