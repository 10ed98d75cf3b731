//! The narrow slot queries the relay's background tasks and commands need beside
//! [`super::slot_state`]: one column of a slot's row, the slots sharing a name
//! prefix, a standby's copy of a failover slot, and copying a slot.

use pgoutput::Lsn;
use tokio_postgres::Client;

use super::AdminError;

/// An LSN column read as text, parsed.
fn parse_lsn(text: Option<String>, what: &str) -> Result<Option<Lsn>, AdminError> {
    text.map(|t| {
        t.parse().map_err(|_| AdminError::UnexpectedReply {
            what: format!("{what} {t:?} in pg_replication_slots"),
        })
    })
    .transpose()
}

/// The slot's `confirmed_flush_lsn`; `None` if the slot does not exist (or has none).
pub async fn slot_confirmed_flush(c: &Client, slot: &str) -> Result<Option<Lsn>, AdminError> {
    let row = c
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = $1::name",
            &[&slot],
        )
        .await?;
    match row {
        Some(r) => parse_lsn(r.try_get(0)?, "confirmed_flush_lsn"),
        None => Ok(None),
    }
}

/// The bytes of WAL the slot retains now (the current WAL position minus its
/// `restart_lsn`); `None` when it has no `restart_lsn`. Errors when there is no
/// such slot.
pub async fn slot_retained_wal(c: &Client, slot: &str) -> Result<Option<f64>, AdminError> {
    let text: Option<String> = c
        .query_one(
            "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), restart_lsn)::int8::text \
               FROM pg_catalog.pg_replication_slots WHERE slot_name = $1::name",
            &[&slot],
        )
        .await?
        .try_get(0)?;
    Ok(text.and_then(|b| b.parse::<f64>().ok()))
}

/// Every slot whose name starts with `prefix`, with whether a process holds it.
pub async fn slots_with_prefix(
    c: &Client,
    prefix: &str,
) -> Result<Vec<(String, bool)>, AdminError> {
    let rows = c
        .query(
            "SELECT slot_name::text, active FROM pg_catalog.pg_replication_slots \
              WHERE pg_catalog.left(slot_name::text, pg_catalog.length($1::text)) = $1::text",
            &[&prefix],
        )
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect()
}

/// A standby's copy of a failover slot (Postgres 17+ columns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncedSlot {
    /// Synchronised from the primary by the slot sync worker.
    pub synced: bool,
    /// Not persisted yet: a failover now could not use it.
    pub temporary: bool,
    pub confirmed_flush_lsn: Option<Lsn>,
}

/// The synchronisation columns of the slot on a Postgres 17+ server (a standby);
/// `None` if there is no such slot.
pub async fn synced_slot(c: &Client, slot: &str) -> Result<Option<SyncedSlot>, AdminError> {
    let row = c
        .query_opt(
            "SELECT synced, temporary, confirmed_flush_lsn::text \
               FROM pg_catalog.pg_replication_slots WHERE slot_name = $1::name",
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    Ok(Some(SyncedSlot {
        synced: row.try_get(0)?,
        temporary: row.try_get(1)?,
        confirmed_flush_lsn: parse_lsn(row.try_get(2)?, "confirmed_flush_lsn")?,
    }))
}

/// Creates the logical slot `to` as a copy of `from` (same plugin, same position:
/// `pg_copy_logical_replication_slot`).
pub async fn copy_slot(c: &Client, from: &str, to: &str) -> Result<(), AdminError> {
    c.execute(
        "SELECT pg_catalog.pg_copy_logical_replication_slot($1::name, $2::name)",
        &[&from, &to],
    )
    .await?;
    Ok(())
}
