//! The administration error: one variant per unmet precondition, each displayed as
//! one sentence that names the fix, plus [`AdminError::Sql`] for everything else.

use tokio_postgres::error::SqlState;

/// An administration or precondition failure.
///
/// Callers group the variants by their reaction with [`AdminError::is_precondition`]:
/// an unmet precondition is something the operator must fix (the CLI exits with code 2),
/// anything else is a runtime failure (exit code 1, or retry with backoff).
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// A slot or publication name that Postgres would reject or silently truncate.
    #[error("invalid {kind} name {name:?}: {reason}; use only lowercase letters, digits and underscores, at most 63 characters")]
    InvalidName {
        kind: &'static str,
        name: String,
        reason: &'static str,
    },

    /// A configured table name that cannot name a table.
    #[error("invalid table name {name:?}: {reason}; configure tables as schema.table with names as they appear in pg_class")]
    InvalidTableName { name: String, reason: &'static str },

    #[error("wal_level is '{actual}' but logical replication needs 'logical': set wal_level = logical in postgresql.conf and restart Postgres")]
    WalLevel { actual: String },

    #[error("role \"{role}\" has neither the REPLICATION attribute nor superuser: run ALTER ROLE \"{role}\" REPLICATION as an administrator")]
    NotReplicationRole { role: String },

    #[error(
        "replication slot \"{slot}\" does not exist: create it with `outbox-relay slot create`"
    )]
    SlotMissing { slot: String },

    #[error("replication slot \"{slot}\" already exists: use `outbox-relay slot create --if-not-exists` to keep it, or remove it first with `outbox-relay slot drop`")]
    SlotExists { slot: String },

    #[error("replication slot \"{slot}\" is a {slot_type} slot, not a logical one: choose another slot name in [postgres] slot, or drop it and run `outbox-relay slot create`")]
    SlotNotLogical { slot: String, slot_type: String },

    #[error("replication slot \"{slot}\" uses the output plugin '{plugin}' but the relay needs 'pgoutput': choose another slot name in [postgres] slot, or drop it with `outbox-relay slot drop` and recreate it with `outbox-relay slot create`")]
    SlotWrongPlugin { slot: String, plugin: String },

    #[error("replication slot \"{slot}\" belongs to database \"{slot_database}\" but the relay is connected to \"{database}\": point [postgres] url at database \"{slot_database}\", or choose another slot name in [postgres] slot")]
    SlotOtherDatabase {
        slot: String,
        slot_database: String,
        database: String,
    },

    /// `because`: `""`, or `", <reason>: <what it means>"` (Postgres 17+, [`explain_invalidation`]).
    #[error("replication slot \"{slot}\" has been invalidated (wal_status 'lost'{because}) and the WAL it needed is gone: recreate it with `outbox-relay slot drop` then `outbox-relay slot create`, and recover the missed events with `outbox-relay replay --from-table`")]
    SlotInvalidated { slot: String, because: String },

    /// A warning rather than a failure: the slot still works, for now.
    #[error("replication slot \"{slot}\" is about to be invalidated (wal_status 'unreserved': it retains more WAL than max_slot_wal_keep_size allows): get the relay streaming so the slot catches up, or raise max_slot_wal_keep_size")]
    SlotNearInvalidation { slot: String },

    #[error("replication slot \"{slot}\" is held by another relay (pid {pid}): stop that relay, or take the slot with `outbox-relay slot drop --force`")]
    SlotActive { slot: String, pid: i32 },

    #[error("replication slot \"{slot}\" is still held by pid {pid} after terminating its holder: stop the process that keeps reconnecting to it, then run `outbox-relay slot drop` again")]
    SlotStillActive { slot: String, pid: i32 },

    #[error("cannot terminate pid {pid}, which holds replication slot \"{slot}\": stop that relay yourself, or run `outbox-relay slot drop --force` as the relay's role or a member of pg_signal_backend")]
    TerminateDenied { slot: String, pid: i32 },

    /// `--start-lsn` before the slot's position: Postgres would silently start at
    /// the slot's position instead. Names the replay window when one is kept.
    #[error("cannot start at {requested}: Postgres cannot stream from before the slot's confirmed position; the earliest LSN that can be replayed is {earliest} (pass --start-lsn {earliest} or later){}", replay_hint(*requested, *replay_window))]
    StartLsnTooOld {
        slot: String,
        requested: pgoutput::Lsn,
        earliest: pgoutput::Lsn,
        /// The replay window's start (the anchor slot's position), if one is kept.
        replay_window: Option<pgoutput::Lsn>,
    },

    #[error("all {max} replication slots allowed by max_replication_slots are in use: drop slots nobody reads (see pg_replication_slots), or raise max_replication_slots in postgresql.conf and restart Postgres")]
    SlotsExhausted { max: i64 },

    #[error("max_wal_senders is {max} and {in_use} WAL senders are running, so the relay could not stream: raise max_wal_senders in postgresql.conf and restart Postgres")]
    WalSendersExhausted { max: i64, in_use: i64 },

    #[error("failover slots need Postgres 17 or newer but the server is {version}: upgrade Postgres, or create the slot without --failover")]
    FailoverUnsupported { version: String },

    /// Postgres 13 and older: pgoutput, slot columns and failover handling the relay
    /// relies on were never tested there (docs/compatibility.md).
    #[error("the server runs Postgres {version} but outbox-relay needs Postgres 14 or newer: upgrade Postgres")]
    ServerTooOld { version: String },

    /// `statement` is what `slot create` would run (no `FOR TABLE` without tables:
    /// logical messages only).
    #[error("publication \"{publication}\" does not exist: run `outbox-relay slot create` (creates it) or {statement}")]
    PublicationMissing {
        publication: String,
        statement: String,
    },

    #[error("publication \"{publication}\" does not publish inserts: run ALTER PUBLICATION {publication} SET (publish = 'insert')")]
    PublicationNoInserts { publication: String },

    #[error("cannot create publication \"{publication}\" as role \"{role}\" ({reason}): have the tables' owner run {statement}")]
    PublicationCreateDenied {
        publication: String,
        role: String,
        reason: String,
        statement: String,
    },

    #[error(
        "table {table} does not exist: create it (see sql/outbox.sql) or fix [postgres] tables"
    )]
    TableMissing { table: String },

    #[error("table {table} is not in publication \"{publication}\": run ALTER PUBLICATION {publication} ADD TABLE {table}")]
    TableNotInPublication { table: String, publication: String },

    #[error("table {table} is partitioned and publication \"{publication}\" publishes its partitions under their own names: run ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)")]
    PartitionsNotViaRoot { table: String, publication: String },

    #[error("table {table} has no column \"{column}\": add the column, or set [mapping] {key} to the name of the column that holds the {key}")]
    ColumnMissing {
        table: String,
        column: String,
        key: &'static str,
    },

    #[error("column \"{column}\" of table {table} ([mapping] {key}) is left out of publication \"{publication}\" by its column list: run ALTER PUBLICATION {publication} SET TABLE {table} without a column list, or include the column")]
    ColumnNotPublished {
        table: String,
        column: String,
        key: &'static str,
        publication: String,
    },

    /// Postgres answered something the relay cannot read (a bug or an unsupported
    /// server).
    #[error("unexpected answer from Postgres ({what}): report this as a bug of outbox-relay, with the server version")]
    UnexpectedReply { what: String },

    /// Any other failure of a query; the server's message is kept.
    #[error("{}", sql_message(.0))]
    Sql(#[from] tokio_postgres::Error),
}

impl AdminError {
    /// True when the operator must change something before the relay can work (the
    /// CLI's exit code 2); false for runtime failures (exit code 1, retry).
    pub fn is_precondition(&self) -> bool {
        match self {
            AdminError::Sql(_)
            | AdminError::UnexpectedReply { .. }
            | AdminError::SlotNearInvalidation { .. }
            | AdminError::SlotStillActive { .. }
            | AdminError::TerminateDenied { .. } => false,
            AdminError::InvalidName { .. }
            | AdminError::InvalidTableName { .. }
            | AdminError::WalLevel { .. }
            | AdminError::NotReplicationRole { .. }
            | AdminError::SlotMissing { .. }
            | AdminError::SlotExists { .. }
            | AdminError::SlotNotLogical { .. }
            | AdminError::SlotWrongPlugin { .. }
            | AdminError::SlotOtherDatabase { .. }
            | AdminError::SlotInvalidated { .. }
            | AdminError::SlotActive { .. }
            | AdminError::StartLsnTooOld { .. }
            | AdminError::SlotsExhausted { .. }
            | AdminError::WalSendersExhausted { .. }
            | AdminError::FailoverUnsupported { .. }
            | AdminError::ServerTooOld { .. }
            | AdminError::PublicationMissing { .. }
            | AdminError::PublicationNoInserts { .. }
            | AdminError::PublicationCreateDenied { .. }
            | AdminError::TableMissing { .. }
            | AdminError::TableNotInPublication { .. }
            | AdminError::PartitionsNotViaRoot { .. }
            | AdminError::ColumnMissing { .. }
            | AdminError::ColumnNotPublished { .. } => true,
        }
    }

    /// The SQLSTATE of a server error, if this is one.
    pub fn sql_state(&self) -> Option<&SqlState> {
        match self {
            AdminError::Sql(e) => e.code(),
            _ => None,
        }
    }
}

/// How to re-publish events from before the slot's position (the end of
/// [`AdminError::StartLsnTooOld`]).
fn replay_hint(requested: pgoutput::Lsn, window: Option<pgoutput::Lsn>) -> String {
    match window {
        Some(w) => format!("; the replay window starts at {w}: re-publish events from {requested} with `outbox-relay replay --from-lsn {requested}`"),
        None => "; no replay window is kept: re-publish older events with `outbox-relay replay --from-table`".into(),
    }
}

/// The server's own words for a database error (`ERROR: … (SQLSTATE …)` with detail
/// and hint); the client library's description for anything else. tokio-postgres'
/// own Display only says "db error".
fn sql_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!(
                "Postgres {}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            );
            if let Some(detail) = db.detail() {
                s.push_str("; detail: ");
                s.push_str(detail);
            }
            if let Some(hint) = db.hint() {
                s.push_str("; hint: ");
                s.push_str(hint);
            }
            // Server text is printed and logged: no line breaks or escapes.
            outbox_event::redact::printable(&s).into_owned()
        }
        None => {
            let mut s = format!("Postgres query failed: {e}");
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                s.push_str(": ");
                s.push_str(&cause.to_string());
                source = cause.source();
            }
            s
        }
    }
}

/// What an `invalidation_reason` of `pg_replication_slots` (Postgres 17+) means to an
/// operator, after the reason itself.
pub fn explain_invalidation(reason: &str) -> String {
    let why = match reason {
        "wal_removed" => "it kept more WAL than max_slot_wal_keep_size allows",
        "rows_removed" => {
            "the catalog rows it needed were vacuumed (on a standby: hot_standby_feedback off)"
        }
        "wal_level_insufficient" => "the primary's wal_level is no longer logical",
        "idle_timeout" => "no relay streamed from it for longer than idle_replication_slot_timeout",
        _ => return reason.to_string(),
    };
    format!("{reason}: {why}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precondition_messages_are_one_sentence_naming_the_fix() {
        let errors = [
            AdminError::WalLevel {
                actual: "replica".into(),
            },
            AdminError::SlotMissing { slot: "x".into() },
            AdminError::SlotActive {
                slot: "x".into(),
                pid: 42,
            },
            AdminError::TableNotInPublication {
                table: "public.outbox".into(),
                publication: "p".into(),
            },
        ];
        for e in &errors {
            let msg = e.to_string();
            assert!(e.is_precondition(), "{msg}");
            assert!(msg.contains(": "), "no fix in {msg:?}");
            assert!(!msg.contains('\n'), "multi-line {msg:?}");
            assert!(!msg.ends_with('.'), "{msg:?}");
        }
        assert_eq!(
            errors[0].to_string(),
            "wal_level is 'replica' but logical replication needs 'logical': set wal_level = logical in postgresql.conf and restart Postgres"
        );
        assert_eq!(
            errors[1].to_string(),
            "replication slot \"x\" does not exist: create it with `outbox-relay slot create`"
        );
        assert!(errors[2].to_string().contains("pid 42"));
        assert!(errors[3]
            .to_string()
            .contains("ALTER PUBLICATION p ADD TABLE public.outbox"));
    }

    #[test]
    fn runtime_failures_are_not_preconditions() {
        let e = AdminError::SlotStillActive {
            slot: "x".into(),
            pid: 1,
        };
        assert!(!e.is_precondition());
        assert!(e.sql_state().is_none());
    }
}
