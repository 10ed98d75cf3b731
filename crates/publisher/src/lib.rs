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

pub use amqp::{lanes, Publisher};
pub use config::{
    check_channels, check_max_in_flight, PublisherConfig, DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX, DEFAULT_EXCHANGE_TYPE, DEFAULT_MAX_IN_FLIGHT, DEFAULT_SHUTDOWN_TIMEOUT,
};
pub use error::{redact_url, PublishError};
pub use report::PublisherReport;
pub use status::{PoisonMessage, PublisherStatus};
pub use target::{Target, TargetConfig};
pub use tls::{https_client_config, read_password_file, ClientAuth};
