//! The replication connection: turns a Postgres logical replication slot into an
//! ordered stream of committed outbox events.
//!
//! # Layout
//!
//! ```text
//!  conninfo ─► conn (startup, auth, TLS, simple query, CopyBoth) ─► stream::WalReader
//!   (URL / key=value)   conn/copy.rs hands on CopyData payloads only  │
//!                                                                    │ XLogData / keepalive
//!                        pgoutput::replication / pgoutput::logical ◄─┘
//!                                        │
//!                         assemble::Assembler (relation cache, column mapping)
//!                                        │
//!                                        ▼
//!          outbox_event::WalItem::{Event, Commit, Keepalive} in WalBatch (mpsc)
//!
//!  admin: slot / publication administration, slot SQL, and every precondition
//!         (also the slot checks WalReader::start runs: admin::StreamStart)
//! ```
//!
//! - [`conninfo`]: connection options; `conninfo/syntax.rs` parses libpq URLs and
//!   key=value strings.
//! - [`conn`]: the replication transport on the official `postgres-protocol` crate
//!   (no crates.io release of tokio-postgres speaks replication): `replication=database`
//!   startup and trust / cleartext / md5 / SCRAM-SHA-256 (`conn/auth.rs`), TLS with
//!   libpq's `sslmode` values ([`tls`]), simple queries, message framing with size
//!   caps (`conn/framing.rs`), and CopyBoth (`conn/copy.rs`): while streaming, the
//!   connection handles ErrorResponse, NoticeResponse, ParameterStatus, CopyDone and
//!   CommandComplete itself and hands the stream only CopyData payloads.
//! - [`tls`]: client configuration and certificate checks per `sslmode`;
//!   `tls/sql.rs` opens ordinary SQL connections (tokio-postgres) under the same rules.
//! - [`stream`]: `START_REPLICATION … LOGICAL` with pgoutput protocol version 1,
//!   backpressure (the socket is read only when the consumer has room), standby
//!   status updates carrying the consumer's acked position, keepalive replies, stall
//!   detection, and a clean stop at a transaction boundary. Its module docs explain
//!   how LSN progress is tracked.
//! - [`assemble`]: pgoutput messages → outbox events and commit markers.
//! - [`messages`]: logical decoding messages as events (docs/messages.md).
//! - [`pgtype`]: what the payload column's Postgres type means for a message (its
//!   body and content type), applied as events are built.
//! - [`admin`]: creating, advancing and dropping slots and publications, reading slot
//!   state, and the precondition checks behind `outbox-relay check` and
//!   [`WalReader::start`]; the one place for slot SQL and name quoting.
//!
//! The events themselves ([`outbox_event`]: `OutboxEvent`, `WalItem`, `Lsn`, …) live
//! in their own crate, which the publisher depends on instead of this one.
//!
//! # Start positions
//!
//! `START_REPLICATION … LOGICAL X` behaves in two surprising ways, so
//! [`WalReader::start`] compares X with the slot first ([`admin::StreamStart`]): Postgres *silently forwards*
//! an X older than the slot's `confirmed_flush_lsn` to that position (the reader
//! refuses such an X with an error naming the earliest possible LSN), and *silently
//! skips* transactions committed before an X newer than it (the reader logs a
//! warning). `0/0`, or no start LSN, resumes from the slot.

pub mod admin;
pub mod assemble;
pub mod conn;
pub mod conninfo;
pub mod error;
pub mod mapping;
pub mod messages;
pub mod pgtype;
pub mod settings;
pub mod stream;
pub mod tls;

/// The program's one password redaction (it lives with the events, which every
/// crate shares).
pub use outbox_event::redact;

pub use conninfo::{PgConnectOptions, SslMode, DEFAULT_CONNECT_TIMEOUT};
pub use error::{ReaderError, ServerError};
pub use mapping::{ColumnMapping, MappingConfig, TableName};
pub use messages::MessageSource;
pub use settings::PostgresConfig;
pub use stream::{
    identify, identify_server, LastEventCommit, OldestUnacked, Prepared, ReaderConfig, ReaderExit,
    StartInfo, WalReader,
};
