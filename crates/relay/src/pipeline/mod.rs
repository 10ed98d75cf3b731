//! The relay pipeline: reader → publisher → LSN feedback, with reconnects. The path
//! of one outbox row through it, file by file, is the diagram of docs/design.md §2.
//!
//! One *session* is a reader and a publisher running together (`session.rs`), in
//! four phases:
//!
//! ```text
//!   plan    the replication connection reads the slot and the server's WAL history;
//!           the state table's row is read; start::plan decides where to start and
//!           what to store (a slot held by another relay: stand by and retry)
//!   wire    START_REPLICATION; the reader runs at once (the walsender is answered
//!           from now on), then the publisher connects; the state writer owns the
//!           flushed-and-stored bound
//!   run     until a stop is requested or one side ends
//!   finish  the acked watermark is carried to the next session and stored
//! ```
//!
//! The reader owns the replication connection and reads only while the bounded
//! channel has room; the publisher owns the broker connection, keeps up to
//! `max_in_flight` messages in flight and publishes the acked watermark, which the
//! reader reports to Postgres as the flush position (promptly when it moves, and on
//! a timer).
//!
//! Every way a session ends badly is a [`SessionError`], and one function,
//! [`policy`], decides what follows: retry with backoff (the reconnect metric's label
//! is the error's side), or stop with exit code 2:
//! - broker side (nack, return, channel or connection loss): the publisher retries
//!   from its buffer of unacked messages by itself, in order; the session goes on.
//!   A refusal after the first connection (530 while a node boots, 403 while a vhost
//!   or its permissions are restored) is retried like an unreachable broker
//!   (docs/reliability.md); a stream publisher that halted so as not to lose an event
//!   stops the relay.
//! - Postgres side (connection lost, server restart, crash, failover): the reader
//!   ends; the publisher drains what it has (bounded by the shutdown timeout), and
//!   the next session starts from the later of the slot's, the stored and the
//!   carried position — each checked against the server's WAL history first
//!   (`start.rs`, docs/design.md §3).
//! - an unmet precondition (bad password, missing slot, renamed column, a refused
//!   certificate): the relay stops with exit code 2 and a sentence that names the fix.
//! - slot held by another relay: this one is a standby; it waits and takes over
//!   when the slot is released.
//!
//! Files: `session.rs` runs one session; `start.rs` decides where it starts;
//! `stored.rs` reads and writes the stored position; `sink.rs` chooses the target
//! published to ([`publisher::Target`]: an exchange, or a stream exactly once) and
//! names the stream producers' source.

mod session;
pub mod sink;
pub mod start;
mod stored;

use std::fmt;
use std::time::Duration;

use publisher::PublishError;
use tracing::{error, warn};
use wal_reader::{ReaderConfig, ReaderError};

use crate::control::Control;
use crate::error::CliError;
use crate::health::Health;
use crate::shutdown::Shutdown;
use crate::state::StateError;
use publisher::TargetConfig;

/// Counts positions that a session start refused (docs/design.md §3), by `position`.
pub const POSITION_FALLBACKS: &str = "outbox_relay_position_fallbacks_total";

const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Everything a pipeline needs.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub reader: ReaderConfig,
    pub publisher: TargetConfig,
    /// Bound on a clean stop: finishing the open transaction and awaiting confirms.
    pub shutdown_timeout: Duration,
}

/// Why a session ended without a stop being requested.
#[derive(Debug)]
pub(crate) enum SessionError {
    /// The replication connection or stream.
    Postgres(ReaderError),
    /// The replication stream ended without an error.
    ReplicationEnded,
    /// The session's SQL connection (state table) could not be opened.
    StateConnect(crate::sql::ConnectError),
    /// The state table did not answer in time, or its connection was lost.
    State(StateError),
    /// The broker.
    Broker(PublishError),
    /// The publisher returned without an error before its input ended.
    PublisherEnded,
    /// A task of the session panicked or was cancelled.
    Task(&'static str, String),
    /// A previous run stopped publishing so as not to lose an event, and the mark
    /// it left in the state table is still there.
    Halted(String),
}

impl From<ReaderError> for SessionError {
    fn from(e: ReaderError) -> Self {
        SessionError::Postgres(e)
    }
}

impl From<PublishError> for SessionError {
    fn from(e: PublishError) -> Self {
        SessionError::Broker(e)
    }
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Postgres(e) => write!(f, "{e}"),
            SessionError::ReplicationEnded => f.write_str("replication ended"),
            SessionError::StateConnect(e) => write!(f, "cannot connect to Postgres: {e}"),
            SessionError::State(e) => write!(f, "the state table: {e}"),
            SessionError::Broker(e) => write!(f, "{e}"),
            SessionError::PublisherEnded => f.write_str("publisher ended"),
            SessionError::Task(task, e) => write!(f, "the {task} task failed: {e}"),
            SessionError::Halted(reason) => write!(
                f,
                "a previous run stopped publishing so as not to lose an event ({reason}); once the refused events are re-published, clear the mark with `UPDATE public.outbox_relay_state SET halted = NULL WHERE slot_name = '<slot>'` (docs/recovery.md, \"A stream refused an event\")"
            ),
        }
    }
}

impl SessionError {
    /// The side it happened on: the `side` label of the reconnect metric.
    fn side(&self) -> &'static str {
        match self {
            SessionError::Broker(_) | SessionError::PublisherEnded => "rabbitmq",
            SessionError::Task("publisher", _) => "rabbitmq",
            _ => "postgres",
        }
    }
}

impl From<SessionError> for CliError {
    fn from(e: SessionError) -> CliError {
        match e {
            SessionError::Postgres(e) => e.into(),
            SessionError::Broker(e) => e.into(),
            SessionError::StateConnect(e) if e.is_precondition() => {
                CliError::Precondition(e.to_string())
            }
            SessionError::Halted(_) => CliError::Precondition(e.to_string()),
            other => CliError::Runtime(other.to_string()),
        }
    }
}

/// What follows a failed session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Start a new session after a backoff.
    Retry,
    /// Stop the relay: retrying cannot fix it (exit code 2).
    Stop,
}

/// The one error policy of the session loop. `broker_connected`: a publisher of
/// this process has connected before (a broker refusal is then a node restarting,
/// not a configuration error).
pub(crate) fn policy(e: &SessionError, broker_connected: bool) -> Policy {
    match e {
        SessionError::Postgres(e) if e.is_precondition() => Policy::Stop,
        // A refusal retrying cannot fix (docs/security.md).
        SessionError::StateConnect(e) if e.is_precondition() => Policy::Stop,
        SessionError::Broker(e) if e.is_halt() || e.is_security_refusal() => Policy::Stop,
        SessionError::Halted(_) => Policy::Stop,
        SessionError::Broker(e) if !e.is_transient() && !broker_connected => Policy::Stop,
        _ => Policy::Retry,
    }
}

/// Runs sessions, one after another, until a stop is requested. Returns an error
/// only for problems that retrying cannot fix (exit code 2) or a bug (exit code 1).
pub async fn run_sessions(
    cfg: PipelineConfig,
    shutdown: Shutdown,
    health: Health,
    control: &Control,
) -> Result<(), CliError> {
    let mut sessions = session::Sessions::new(cfg, shutdown, health, control.pause_watch());
    let mut attempt: u32 = 0;
    loop {
        if sessions.stop_requested() {
            return Ok(());
        }
        let e = match sessions.run_one().await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if policy(&e, sessions.broker_connected()) == Policy::Stop {
            if let SessionError::Broker(halt) = &e {
                if halt.is_halt() {
                    sessions.record_halt(&halt.to_string()).await;
                }
            }
            return Err(e.into());
        }
        if let SessionError::Postgres(r) = &e {
            if !r.is_transient() {
                // Decoding or protocol errors: a new session starts over from the slot.
                error!(error = %e, "replication stream failed");
            }
        }
        let side = e.side();
        metrics::counter!("outbox_relay_reconnects_total", "side" => side).increment(1);
        attempt = attempt.saturating_add(1);
        let wait = publisher::backoff::delay(BACKOFF_INITIAL, BACKOFF_MAX, attempt);
        warn!(error = %e, side, retry_in = ?wait, "session ended; reconnecting");
        sessions.pause(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_stops_only_on_what_retrying_cannot_fix() {
        let halted = PublishError::Halted {
            stream: "s".into(),
            reason: "refused but stored".into(),
        };
        assert_eq!(policy(&SessionError::Broker(halted), true), Policy::Stop);
        let refused = || PublishError::AuthenticationRefused {
            url: "amqp://h".into(),
            reason: "no".into(),
        };
        assert_eq!(
            policy(&SessionError::Broker(refused()), false),
            Policy::Stop
        );
        assert_eq!(
            policy(&SessionError::Broker(refused()), true),
            Policy::Retry
        );
        let gone = PublishError::Unreachable {
            url: "amqp://h".into(),
            reason: "down".into(),
        };
        assert_eq!(policy(&SessionError::Broker(gone), false), Policy::Retry);
        let missing = ReaderError::Precondition("no slot".into());
        assert_eq!(policy(&SessionError::Postgres(missing), true), Policy::Stop);
        let lost = ReaderError::Timeout(Duration::from_secs(1));
        assert_eq!(policy(&SessionError::Postgres(lost), true), Policy::Retry);
        assert_eq!(policy(&SessionError::ReplicationEnded, true), Policy::Retry);
        assert_eq!(SessionError::PublisherEnded.side(), "rabbitmq");
        assert_eq!(SessionError::ReplicationEnded.side(), "postgres");
    }
}
