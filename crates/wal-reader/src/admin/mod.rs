//! Slot and publication administration, and every precondition the relay checks
//! before it streams.
//!
//! All functions run over an ordinary SQL connection (`tokio_postgres::Client`) that
//! the caller opens with [`connect`] (bounded by the connection string's
//! `connect_timeout`, [`crate::DEFAULT_CONNECT_TIMEOUT`] without one); the
//! replication connection is not involved. Every query on `pg_replication_slots`
//! of the program (the relay and its commands) is here. Each unmet
//! precondition is an [`AdminError`] variant whose message is one sentence naming the
//! fix, and [`AdminError::is_precondition`] separates those (exit code 2) from runtime
//! failures (exit code 1).
//!
//! What is checked, and why:
//!
//! | check | verifies | why |
//! |---|---|---|
//! | [`check_server_version`] | Postgres 14 or newer | 14–18 are the versions tested (docs/compatibility.md) |
//! | [`check_wal_level`] | `wal_level = logical` | logical decoding is impossible otherwise; changing it needs a restart |
//! | [`check_replication_role`] | REPLICATION attribute or superuser | needed to open a replication connection and to create/drop slots |
//! | [`check_publication`] | publication exists, publishes inserts, contains every configured table (a partitioned one via its root) | pgoutput silently sends nothing for a table outside the publication, and names a partition instead of the configured table unless the publication publishes via the root |
//! | [`check_columns`] | table exists, mapped columns exist (and their types) | the reader finds columns by name; a typo would yield empty events |
//! | [`check_published_columns`] | a publication column list (PG 15+) keeps every mapped column | a column left out never reaches the reader |
//! | [`require_slot`] | slot exists, logical, `pgoutput`, this database, not `lost` | a slot of another plugin or database cannot be decoded; a lost slot has no WAL |
//! | [`check_slot_free`] | no other process holds the slot | one reader per slot; `run` waits, `slot drop` refuses unless forced |
//! | [`SlotState::check_start_lsn`] | `--start-lsn` is not before `confirmed_flush_lsn` | Postgres would silently start later |
//! | [`StreamStart::check`] | all of the slot checks above, over the replication connection | what `WalReader::start` checks before `START_REPLICATION` |
//! | [`create_slot`] | also: room under `max_replication_slots`/`max_wal_senders`, Postgres 17+ for failover slots | fail with the setting to change, before Postgres does |
//!
//! [`Preflight`] runs them all in that order and returns one result per check.
//!
//! Safety: slot and publication names are validated (lowercase letters, digits,
//! underscores, ≤ 63 characters) before they reach the server; values are passed as
//! bind parameters, and identifiers in DDL are quoted ([`ident`]). Messages never
//! contain connection strings: only names and the server's own error text.

mod columns;
mod connect;
mod error;
pub mod ident;
mod preflight;
mod publication;
mod server;
mod slot;
mod slot_query;
mod stream_start;

pub use columns::{check_columns, check_published_columns, ColumnInfo, TableColumns};
pub use connect::connect;
pub use error::{explain_invalidation, AdminError};
pub use preflight::{CheckResult, CheckStatus, Preflight};
pub use publication::{check_publication, ensure_publication};
pub use server::{
    check_replication_role, check_server_version, check_version, check_wal_level, server_version,
    server_version_num, wal_level, Capacity, MIN_SERVER_VERSION_NUM,
};
pub use slot::{
    advance_slot, anchor_slot_name, check_slot_free, check_usable, create_slot, drop_slot,
    require_slot, slot_state, SlotCreated, SlotState, FORCE_DROP_TIMEOUT,
};
pub use slot_query::{
    copy_slot, slot_confirmed_flush, slot_retained_wal, slots_with_prefix, synced_slot, SyncedSlot,
};
pub use stream_start::StreamStart;
