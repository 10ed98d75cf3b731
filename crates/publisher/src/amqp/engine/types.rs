//! The engine's vocabulary: what identifies an event, where a publish went, why a
//! channel fails, what the shell must send next and what settled.

use std::fmt;

use outbox_event::Lsn;

use super::Seq;

/// What identifies an event among everything the relay publishes: its transaction's
/// commit LSN and its index in that transaction (the `commit_lsn` / `tx_index`
/// headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventKey {
    pub commit_lsn: Lsn,
    pub index: u64,
}

/// A message the engine can identify in a return.
pub(crate) trait Keyed {
    fn key(&self) -> EventKey;
    /// Its body's size, for `max_in_flight_bytes`.
    fn bytes(&self) -> usize {
        0
    }
}

/// Where a publish went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    /// The configured exchange.
    Exchange,
    /// The dead-letter exchange.
    DeadLetter,
}

/// Why a message goes to the dead-letter exchange (its `x-outbox-error` header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DeadLetterReason {
    /// Returned unroutable from the main exchange.
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    /// The broker refused the message itself (closed the channel for its content).
    Refused { reason: String },
}

/// A returned message as the shell read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Returned {
    /// From the message's headers; `None` if they were unreadable.
    pub key: Option<EventKey>,
    /// Which exchange returned it.
    pub target: Target,
    pub exchange: String,
    pub routing_key: String,
}

/// Why the channel must be dropped and publishing restarted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    Nack,
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    /// A copy sent to the dead-letter exchange came back unroutable.
    DeadLetterUnroutable {
        exchange: String,
    },
    /// A return no publish of this channel matches (never expected).
    UnknownReturn,
    /// The channel failed: closed by the broker (`code`), a write or confirm error.
    Channel {
        code: Option<u16>,
        text: String,
    },
    /// The connection failed.
    Connection(String),
}

impl Failure {
    /// A channel the broker closed because of a message's content.
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(
            self,
            Failure::Channel {
                code: Some(406),
                ..
            }
        )
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Nack => f.write_str("the broker nacked a message"),
            Failure::Unroutable {
                exchange,
                routing_key,
            } => write!(
                f,
                "a message was unroutable (exchange {exchange:?}, routing key {routing_key:?}): bind a queue or set dead_letter_exchange"
            ),
            Failure::DeadLetterUnroutable { exchange } => write!(
                f,
                "the dead-letter exchange {exchange:?} routed a copy nowhere: bind a queue to it"
            ),
            Failure::UnknownReturn => {
                f.write_str("the broker returned a message no publish of this channel matches")
            }
            Failure::Channel {
                code: Some(code),
                text,
            } => write!(f, "channel closed by the broker ({code}): {text}"),
            Failure::Channel { code: None, text } => write!(f, "channel error: {text}"),
            Failure::Connection(text) => write!(f, "connection error: {text}"),
        }
    }
}

/// A message the broker refuses, with no dead-letter exchange to take a notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Poison {
    pub seq: Seq,
    pub reason: String,
}

/// The next publish the shell must make, in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outgoing {
    /// The window entry `seq` to the configured exchange.
    Main { seq: Seq },
    /// A copy (or, for a refused message, a notice) of `seq` to the dead-letter
    /// exchange.
    DeadLetter { seq: Seq, reason: DeadLetterReason },
}

impl Outgoing {
    pub(crate) fn seq(&self) -> Seq {
        match self {
            Outgoing::Main { seq } | Outgoing::DeadLetter { seq, .. } => *seq,
        }
    }

    pub(crate) fn target(&self) -> Target {
        match self {
            Outgoing::Main { .. } => Target::Exchange,
            Outgoing::DeadLetter { .. } => Target::DeadLetter,
        }
    }
}

/// What happened when a publish settled (for counters, latency and traces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settled<M> {
    /// Done: the message (or its dead-letter copy, `target`) was acked.
    Acked {
        message: M,
        target: Target,
    },
    Returned {
        seq: Seq,
    },
}
