//! The events the WAL reader hands to a publisher: the one vocabulary both sides
//! depend on (docs/design.md §2), and nothing else of either side.
//!
//! For every committed transaction that touched a relayed outbox table the reader
//! emits that transaction's [`OutboxEvent`]s in insert order, then one
//! [`WalItem::Commit`]. Between transactions it emits [`WalItem::Keepalive`] with the
//! server's WAL end, which the relay may confirm when nothing is in flight.
//! Items travel in [`WalBatch`]es: one channel hop per socket read, not per event.
//!
//! An event arrives ready to send: the reader has already interpreted the Postgres
//! types (the message body is decoded, the content type chosen), so a publisher
//! needs no Postgres knowledge. [`Lsn`] is pgoutput's, re-exported here so that the
//! workspace has one `Lsn`, imported as `outbox_event::Lsn`. [`redact`] is the
//! program's one password redaction, shared by the reader, the publisher and the
//! relay; [`suggest`] its one typo suggestion; [`setting`] the refusal every
//! component's settings report. [`history`] says which WAL history a position belongs to (a server's
//! system identifier and timeline history), for the positions carried between
//! sessions.

pub mod history;
pub mod redact;
pub mod secret_file;
pub mod setting;
pub mod suggest;

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
pub use pgoutput::Lsn;

/// A relayed outbox table as the reader last saw it in a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable {
    /// `schema.table`, as in the `outbox_table` header.
    pub qualified_name: String,
    pub schema: String,
    pub name: String,
    /// Type OID of the payload column (the reader derived `content_type` and each
    /// event's `body` from it).
    pub payload_type: u32,
    /// Type OID of the headers column, if the table has one.
    pub headers_type: Option<u32>,
    /// The messages' `content_type` (docs/design.md §5), chosen by the reader from
    /// the payload column's type.
    pub content_type: &'static str,
}

/// One committed outbox insert. Column values are the text form Postgres sends
/// (pgoutput text mode), sliced from the WAL message without copying; `None` = NULL.
/// [`OutboxEvent::body`] is the payload ready to send.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    pub table: Arc<OutboxTable>,
    /// Transaction id of the inserting transaction.
    pub xid: u32,
    /// LSN of the transaction's commit record (the `commit_lsn` header).
    pub commit_lsn: Lsn,
    /// Commit time, microseconds since the Unix epoch.
    pub commit_time_micros: i64,
    /// 0-based position of this event among its transaction's relayed events (the
    /// `tx_index` header): with `commit_lsn` it orders and identifies every event.
    pub index: u64,
    pub id: Option<Bytes>,
    pub aggregate_type: Option<Bytes>,
    pub aggregate_id: Option<Bytes>,
    pub event_type: Option<Bytes>,
    /// The payload column as Postgres renders it (bytea as its `\x…` text), for
    /// display (`peek`).
    pub payload: Option<Bytes>,
    /// The message body (docs/design.md §5): the payload's bytes, bytea decoded to
    /// raw bytes, every other type as is (the same buffer as `payload`, not a
    /// copy); NULL is an empty body.
    pub body: Bytes,
    /// The headers column's JSON text, as is.
    pub headers: Option<Bytes>,
    pub correlation_id: Option<Bytes>,
    /// The exchange column's value (`[mapping] exchange`): the exchange this event
    /// goes to; `None` (or empty) for the configured one (docs/routing.md).
    pub exchange: Option<Bytes>,
    /// The values of the property columns (`[mapping] priority`, …) that are not
    /// NULL, by property name (docs/routing.md, "Properties per event"); empty for
    /// most events, and without an allocation then.
    pub properties: Vec<(&'static str, Bytes)>,
    /// Why this event cannot be published as it is: a logical message whose content
    /// is not the JSON object of docs/messages.md. The publisher treats it as poison
    /// (held, or a notice to the dead-letter exchange), named by its id and LSN, as it
    /// treats a message the broker cannot take. `None` for every table row.
    pub malformed: Option<Arc<str>>,
}

/// End of a committed transaction whose events (possibly none) came before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitMarker {
    pub xid: u32,
    /// LSN of the commit record.
    pub commit_lsn: Lsn,
    /// End of the commit record: the position to confirm (flush) to Postgres once
    /// every event of this transaction and all earlier ones is acked.
    pub end_lsn: Lsn,
    /// Commit time, microseconds since the Unix epoch.
    pub commit_time_micros: i64,
    /// How many outbox events of this transaction were emitted before this marker.
    pub events: u64,
}

/// One item of the reader's ordered output.
///
/// Events are stored inline (not boxed): items travel in `Vec` batches, and a box
/// would cost an allocation per event on the hot path.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum WalItem {
    Event(OutboxEvent),
    Commit(CommitMarker),
    /// The server's WAL end from a keepalive (or an XLogData header) while no
    /// transaction is open: safe to confirm when nothing is in flight.
    Keepalive(Lsn),
}

/// Items from one read of the replication socket, in order.
pub type WalBatch = Vec<WalItem>;

impl fmt::Display for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualified_name)
    }
}
