//! What both targets' configurations share (docs/design.md §6): the flow limit
//! `max_in_flight` and its one check, and the retry and shutdown defaults. The
//! AMQP publisher's own configuration is `amqp/config.rs`, the stream's
//! `stream/mod.rs`; the `[rabbitmq]` settings ([`crate::settings`]) build both.

use std::time::Duration;

use crate::error::PublishError;

/// Default `max_in_flight` (docs/design.md §6).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// Default first retry delay.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// Default retry delay cap.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Default bound on the wait for outstanding confirms once the input has closed
/// (both targets; the relay's `[relay] shutdown_timeout_ms` default).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// The one check of the flow limit `max_in_flight` (both targets, and the
/// `[rabbitmq]` settings at load): the reason it is refused, if it is.
pub fn check_max_in_flight(max_in_flight: usize) -> Result<(), &'static str> {
    if max_in_flight == 0 {
        Err("must be at least 1 (0 would never publish): set it to the number of unconfirmed messages to allow, e.g. 10000")
    } else {
        Ok(())
    }
}

/// [`check_max_in_flight`] as the publishers' configuration error.
pub(crate) fn validate_max_in_flight(max_in_flight: usize) -> Result<(), PublishError> {
    check_max_in_flight(max_in_flight).map_err(|reason| PublishError::InvalidConfig {
        key: "max_in_flight",
        reason: reason.into(),
    })
}
