//! Turning an [`OutboxEvent`] into the AMQP message of docs/design.md §5.
//!
//! The routing-key template is compiled once ([`RoutingKeyTemplate::parse`]); the
//! constant header keys and the operator's extra headers are built once
//! ([`MessageBuilder`]), and per message only the values are filled in.
//!
//! `[message] format` ([`MessageFormat`]) chooses the message's shape: `native`, the
//! headers of docs/design.md §5, or `cloudevents`, the same message with the
//! CloudEvents 1.0 attributes added ([`cloudevents`], docs/cloudevents.md).

pub mod cloudevents;
mod json_headers;
pub mod row_properties;
mod template;

pub(crate) use json_headers::json_headers;
pub(crate) use template::truncate_at_char;
pub use template::{
    ExchangeRule, RoutingKeyError, RoutingKeyTemplate, TemplateFields, DEFAULT_ROUTING_KEY,
    PLACEHOLDERS,
};

use cloudevents::{CloudEvents, CloudEventsFormat};

/// The shape of the messages (`[message] format`, docs/cloudevents.md); both targets
/// honour it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MessageFormat {
    /// The relay's own headers (docs/design.md §5).
    #[default]
    Native,
    /// The native message plus the CloudEvents 1.0 attributes as `cloudEvents:`
    /// headers (binary content mode of the AMQP binding).
    CloudEvents(CloudEventsFormat),
}

impl MessageFormat {
    /// The `[message] format` value that selects it.
    pub fn name(&self) -> &'static str {
        match self {
            MessageFormat::Native => "native",
            MessageFormat::CloudEvents(_) => "cloudevents",
        }
    }

    /// The attribute builder of the `cloudevents` format, `None` for `native`.
    pub(crate) fn builder(&self) -> Option<CloudEvents> {
        match self {
            MessageFormat::Native => None,
            MessageFormat::CloudEvents(f) => Some(CloudEvents::new(f.clone())),
        }
    }
}

/// Which of the relay's own headers every message carries (`[message] headers`,
/// docs/design.md §5). The broker's rate falls with each header it stores
/// (docs/performance.md, "The cost of the message shape"), so `Minimal` keeps only
/// what the relay itself needs and what consumers route and deduplicate by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HeaderProfile {
    /// All of them: `aggregate_type`, `aggregate_id`, `event_type`, `outbox_table`,
    /// `commit_lsn`, `tx_index`, `xid`.
    #[default]
    Full,
    /// `event_type`, `commit_lsn` and `tx_index` only. `commit_lsn` and `tx_index`
    /// are how the relay matches a message the broker returned (and, on a stream,
    /// finds the tail after a restart), so no profile drops them. The properties
    /// (message id, type, content type, timestamp, correlation id) are unchanged,
    /// and so are the headers column's keys and the operator's extra headers.
    Minimal,
}

impl HeaderProfile {
    /// The `[message] headers` value that selects it.
    pub fn name(self) -> &'static str {
        match self {
            HeaderProfile::Full => "full",
            HeaderProfile::Minimal => "minimal",
        }
    }

    /// Whether the descriptive headers (`aggregate_type`, `aggregate_id`,
    /// `outbox_table`/`table`, `xid`) are written.
    pub fn descriptive(self) -> bool {
        self == HeaderProfile::Full
    }
}

/// Header keys of the headers column that are never copied to a message
/// (docs/operations.md, "Reserved headers"): `CC`/`BCC` are routing instructions to
/// RabbitMQ (which closes the channel when they are not arrays), `x-death` and
/// `x-first-death-*`/`x-last-death-*` are the broker's dead-lettering record, and
/// `x-outbox-*`/`x-original-*` are the relay's own dead-letter headers.
pub fn is_reserved_header(key: &str) -> bool {
    matches!(key, "CC" | "BCC" | "x-death")
        || key.starts_with("x-first-death-")
        || key.starts_with("x-last-death-")
        || key.starts_with("x-outbox-")
        || key.starts_with("x-original-")
}

/// The relay's own headers (docs/design.md §5), kept on a dead-letter notice. A
/// row's headers column never sets them, whatever `[message] headers` writes
/// ([`json_headers`]): a consumer takes them for the relay's.
pub(crate) const RELAY_HEADERS: [&str; 7] = [
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "outbox_table",
    "commit_lsn",
    "tx_index",
    "xid",
];

/// Longest AMQP short string (routing keys, property values, header names).
pub(crate) const SHORT_STRING_MAX: usize = 255;

#[cfg(test)]
mod tests;
