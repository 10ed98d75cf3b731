//! The replication connection: turns a Postgres logical replication slot into an
//! ordered stream of committed outbox events.

pub mod admin;
pub mod assemble;
pub mod conn;
pub mod conninfo;
pub mod error;
pub mod event;
pub mod mapping;
pub mod stream;
pub mod tls;

pub use conninfo::{PgConnectOptions, SslMode};
pub use error::{ReaderError, ServerError};
pub use event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
pub use mapping::{ColumnMapping, TableName};
pub use stream::{ReaderConfig, ReaderExit, StartInfo, WalReader};
