//! The relay's durable acked position: the table `public.outbox_relay_state`, one row
//! per slot (docs/design.md §3, "The stored position").
//!
//! ```text
//!   slot_name        text    PRIMARY KEY
//!   acked_lsn        pg_lsn  every message before it was confirmed by the broker
//!   slot_restart_lsn pg_lsn  the slot's restart_lsn when `slot create` made it:
//!                            the slot's identity (NULL: unknown)
//!   slot_created_at  timestamptz
//!   updated_at       timestamptz
//! ```
//!
//! It is ordinary WAL-logged data, so it survives a crash (Postgres before 17 saves a
//! slot's confirmed position only at checkpoints) and follows a physical failover.
//! It is never in the publication (`slot create` publishes the configured tables
//! only). Writes are single statements in their own transaction; `acked_lsn` only
//! moves forward, except when `slot create` makes a new slot or `run --start-lsn`
//! asks for an earlier start.

use outbox_event::Lsn;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// The table, schema-qualified so that every role finds the same one.
pub const TABLE: &str = "public.outbox_relay_state";

/// What running without the table costs (the warning when it cannot be used).
pub const COST: &str = "a Postgres restart or crash can publish again everything since the slot's last checkpoint (Postgres before 17 saves a slot's position only then); create it with `outbox-relay slot create --if-not-exists` or grant access as in sql/role.sql";

const CREATE: &str = "CREATE TABLE IF NOT EXISTS public.outbox_relay_state (
    slot_name        text        PRIMARY KEY,
    acked_lsn        pg_lsn      NOT NULL,
    slot_restart_lsn pg_lsn,
    slot_created_at  timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
)";

/// The stored row of a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub acked: Lsn,
    /// The slot's `restart_lsn` at creation (its identity), when `slot create` made it.
    pub slot_restart_lsn: Option<Lsn>,
    /// `updated_at`, as Postgres prints it.
    pub updated_at: String,
}

/// Why the table cannot be used.
#[derive(Debug)]
pub enum StateError {
    /// The table does not exist.
    Missing,
    /// The role may not read, write or create it.
    Denied(String),
    /// The server is a standby (read only): the row can be read, not written.
    ReadOnly,
    /// A statement did not finish in time.
    Timeout(std::time::Duration),
    /// Anything else (connection lost, ...).
    Other(tokio_postgres::Error),
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Missing => write!(f, "table {TABLE} does not exist"),
            StateError::Denied(m) => write!(f, "{m}"),
            StateError::ReadOnly => write!(f, "the server is read only (a standby)"),
            StateError::Timeout(t) => write!(f, "no answer within {t:?}"),
            StateError::Other(e) => match e.as_db_error() {
                Some(db) => write!(f, "{}", db.message()),
                None => write!(f, "{e}"),
            },
        }
    }
}

impl StateError {
    /// The connection is gone: try again later rather than giving up on the table.
    pub fn is_closed(&self) -> bool {
        match self {
            StateError::Timeout(_) => true,
            StateError::Other(e) => e.is_closed() || e.as_db_error().is_none(),
            _ => false,
        }
    }
}

impl From<tokio_postgres::Error> for StateError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.code() {
            Some(c) if *c == SqlState::UNDEFINED_TABLE => StateError::Missing,
            Some(c) if *c == SqlState::INSUFFICIENT_PRIVILEGE => StateError::Denied(
                e.as_db_error()
                    .map(|d| d.message().to_string())
                    .unwrap_or_else(|| e.to_string()),
            ),
            Some(c) if *c == SqlState::READ_ONLY_SQL_TRANSACTION => StateError::ReadOnly,
            _ => StateError::Other(e),
        }
    }
}

fn parse(text: Option<String>) -> Option<Lsn> {
    text.and_then(|t| t.parse().ok())
}

/// Creates the table if it is missing (needs CREATE on schema public).
pub async fn ensure_table(c: &Client) -> Result<(), StateError> {
    // IF NOT EXISTS still needs CREATE on the schema: look first, so a role that may
    // only use an existing table (sql/role.sql) is not refused.
    let row = c
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&TABLE])
        .await?;
    if row.get::<_, bool>(0) {
        return Ok(());
    }
    match c.batch_execute(CREATE).await {
        Ok(()) => Ok(()),
        // Created concurrently (IF NOT EXISTS is not race-free).
        Err(e)
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION)
                || e.code() == Some(&SqlState::DUPLICATE_TABLE) =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The slot's row, `Ok(None)` when there is none.
pub async fn read(c: &Client, slot: &str) -> Result<Option<Stored>, StateError> {
    let row = c
        .query_opt(
            "SELECT acked_lsn::text, slot_restart_lsn::text, updated_at::text \
               FROM public.outbox_relay_state WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| {
        Some(Stored {
            acked: parse(r.get(0))?,
            slot_restart_lsn: parse(r.get(1)),
            updated_at: r.get::<_, Option<String>>(2).unwrap_or_default(),
        })
    }))
}

/// `slot create` made a new slot: its row starts at the slot's consistent point, with
/// the slot's identity (whatever was stored for an older slot of that name is void).
pub async fn record_new_slot(
    c: &Client,
    slot: &str,
    consistent_point: Lsn,
    restart_lsn: Option<Lsn>,
) -> Result<(), StateError> {
    c.execute(
        "INSERT INTO public.outbox_relay_state \
                (slot_name, acked_lsn, slot_restart_lsn, slot_created_at, updated_at) \
         VALUES ($1, $2::text::pg_lsn, $3::text::pg_lsn, now(), now()) \
         ON CONFLICT (slot_name) DO UPDATE \
            SET acked_lsn = EXCLUDED.acked_lsn, slot_restart_lsn = EXCLUDED.slot_restart_lsn, \
                slot_created_at = EXCLUDED.slot_created_at, updated_at = EXCLUDED.updated_at",
        &[
            &slot,
            &consistent_point.to_string(),
            &restart_lsn.map(|l| l.to_string()),
        ],
    )
    .await?;
    Ok(())
}

/// Stores `acked` (a position every message before which the broker confirmed), never
/// moving the stored position back. A row made here has no slot identity.
pub async fn save(c: &Client, slot: &str, acked: Lsn) -> Result<(), StateError> {
    c.execute(
        "INSERT INTO public.outbox_relay_state (slot_name, acked_lsn, updated_at) \
         VALUES ($1, $2::text::pg_lsn, now()) \
         ON CONFLICT (slot_name) DO UPDATE \
            SET acked_lsn = GREATEST(outbox_relay_state.acked_lsn, EXCLUDED.acked_lsn), \
                updated_at = now() \
          WHERE outbox_relay_state.acked_lsn < EXCLUDED.acked_lsn",
        &[&slot, &acked.to_string()],
    )
    .await?;
    Ok(())
}

/// Sets the stored position to `lsn` even when it is lower: `run --start-lsn` asked to
/// publish again from there, and a restart must go on doing so.
pub async fn reset(c: &Client, slot: &str, lsn: Lsn) -> Result<(), StateError> {
    c.execute(
        "UPDATE public.outbox_relay_state SET acked_lsn = $2::text::pg_lsn, updated_at = now() \
          WHERE slot_name = $1",
        &[&slot, &lsn.to_string()],
    )
    .await?;
    Ok(())
}

/// What a session start makes of the stored position (docs/design.md §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Start streaming from the stored position: it is past the slot's.
    Stored(Lsn),
    /// The slot's position is as far (or nothing is stored).
    Slot,
    /// The stored position must not be used; the reason, for a warning.
    Ignored(String),
}

/// Decides where a session starts, from the stored row and the slot as found now.
/// `server_wal` is `pg_current_wal_lsn()` (the replay position on a standby).
pub fn resume(
    stored: Option<&Stored>,
    slot_confirmed: Lsn,
    slot_restart: Option<Lsn>,
    server_wal: Option<Lsn>,
) -> Resume {
    let Some(s) = stored else {
        return Resume::Slot;
    };
    if s.acked <= slot_confirmed {
        return Resume::Slot;
    }
    match server_wal {
        Some(w) if s.acked <= w => {}
        _ => {
            return Resume::Ignored(format!(
                "the stored acked position {} is ahead of this server's WAL ({}): a restored backup or another cluster",
                s.acked,
                server_wal.map(|w| w.to_string()).unwrap_or_else(|| "unknown".into())
            ))
        }
    }
    if let (Some(created), Some(now)) = (s.slot_restart_lsn, slot_restart) {
        if now < created {
            return Resume::Ignored(format!(
                "the stored acked position {} belongs to another slot of that name (the slot's restart_lsn {now} is below {created}, the one it was created with): it was dropped and re-created",
                s.acked
            ));
        }
    }
    Resume::Stored(s.acked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(acked: u64, identity: Option<u64>) -> Stored {
        Stored {
            acked: Lsn(acked),
            slot_restart_lsn: identity.map(Lsn),
            updated_at: String::new(),
        }
    }

    #[test]
    fn starts_from_the_later_position() {
        let s = stored(0x500, Some(0x100));
        assert_eq!(
            resume(Some(&s), Lsn(0x300), Some(Lsn(0x200)), Some(Lsn(0x900))),
            Resume::Stored(Lsn(0x500))
        );
        assert_eq!(
            resume(Some(&s), Lsn(0x500), Some(Lsn(0x200)), Some(Lsn(0x900))),
            Resume::Slot
        );
        assert_eq!(
            resume(Some(&s), Lsn(0x600), Some(Lsn(0x200)), Some(Lsn(0x900))),
            Resume::Slot
        );
        assert_eq!(
            resume(None, Lsn(0x300), None, Some(Lsn(0x900))),
            Resume::Slot
        );
        // No identity stored (a row the relay made for an existing slot): used.
        let s = stored(0x500, None);
        assert_eq!(
            resume(Some(&s), Lsn(0x300), Some(Lsn(0x10)), Some(Lsn(0x500))),
            Resume::Stored(Lsn(0x500))
        );
    }

    #[test]
    fn ignores_a_position_past_the_servers_wal() {
        let s = stored(0x500, Some(0x100));
        let r = resume(Some(&s), Lsn(0x300), Some(Lsn(0x200)), Some(Lsn(0x4FF)));
        assert!(
            matches!(&r, Resume::Ignored(w) if w.contains("ahead of this server's WAL")),
            "{r:?}"
        );
        let r = resume(Some(&s), Lsn(0x300), Some(Lsn(0x200)), None);
        assert!(matches!(r, Resume::Ignored(_)));
    }

    #[test]
    fn ignores_a_position_of_another_slot_incarnation() {
        let s = stored(0x500, Some(0x100));
        let r = resume(Some(&s), Lsn(0x300), Some(Lsn(0xFF)), Some(Lsn(0x900)));
        assert!(
            matches!(&r, Resume::Ignored(w) if w.contains("re-created")),
            "{r:?}"
        );
    }
}
