//! The replication connection: turns a Postgres logical replication slot into an
//! ordered stream of committed outbox events.

pub mod admin;
pub mod event;
pub mod mapping;

pub use event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
pub use mapping::{ColumnMapping, TableName};
