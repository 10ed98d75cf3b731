//! The relay's durable acked position: the table `public.outbox_relay_state`, one row
//! per slot (docs/design.md §3, "The stored position").
//!
//! ```text
//!   slot_name         text    PRIMARY KEY
//!   acked_lsn         pg_lsn  every message before it was confirmed by the broker
//!   slot_restart_lsn  pg_lsn  the slot's restart_lsn when `slot create` made it:
//!                             the slot's identity (NULL: unknown)
//!   slot_created_at   timestamptz
//!   updated_at        timestamptz
//!   system_identifier text    the server `acked_lsn` was read from, and its
//!   timeline          integer timeline (NULL: written by a relay before 0.2, or
//!                             by `slot create`); docs/design.md §3
//!   halted            text    why the stream publisher stopped so as not to lose an
//!                             event; `run` refuses to start while it is set
//!                             (docs/recovery.md, "A stream refused an event")
//! ```
//!
//! It is ordinary WAL-logged data, so it survives a crash (Postgres before 17 saves a
//! slot's confirmed position only at checkpoints) and follows a physical failover.
//! It is never in the publication (`slot create` publishes the configured tables
//! only). Writes are single statements in their own transaction; `acked_lsn` only
//! moves forward, except when `slot create` makes a new slot or `run --start-lsn`
//! asks for an earlier start.

use outbox_event::history::Origin;
use outbox_event::Lsn;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// The table, schema-qualified so that every role finds the same one.
pub const TABLE: &str = "public.outbox_relay_state";

/// What running without the table costs (the warning when it cannot be used).
pub const COST: &str = "a Postgres restart or crash can publish again everything since the slot's last checkpoint (Postgres before 17 saves a slot's position only then); create it with `outbox-relay slot create --if-not-exists` or grant access as in sql/role.sql";

const CREATE: &str = "CREATE TABLE IF NOT EXISTS public.outbox_relay_state (
    slot_name         text        PRIMARY KEY,
    acked_lsn         pg_lsn      NOT NULL,
    slot_restart_lsn  pg_lsn,
    slot_created_at   timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT pg_catalog.now(),
    system_identifier text,
    timeline          integer,
    halted            text
)";

/// The history columns, added to a table made by an earlier version.
const ADD_HISTORY: &str = "ALTER TABLE public.outbox_relay_state \
    ADD COLUMN IF NOT EXISTS system_identifier text, \
    ADD COLUMN IF NOT EXISTS timeline integer, \
    ADD COLUMN IF NOT EXISTS halted text";

/// What it costs when the history columns cannot be added.
pub const HISTORY_COST: &str = "the stored position cannot be checked against the server's WAL history after a failover or a restore (it is still checked against the server's WAL and the slot); add the columns as the table's owner: ALTER TABLE public.outbox_relay_state ADD COLUMN IF NOT EXISTS system_identifier text, ADD COLUMN IF NOT EXISTS timeline integer, ADD COLUMN IF NOT EXISTS halted text";

/// The stored row of a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub acked: Lsn,
    /// The slot's `restart_lsn` at creation (its identity), when `slot create` made it.
    pub slot_restart_lsn: Option<Lsn>,
    /// `updated_at`, as Postgres prints it.
    pub updated_at: String,
    /// Where `acked` was read (`None`: not recorded).
    pub origin: Option<Origin>,
    /// Why a stream publisher stopped so as not to lose an event, until an operator
    /// clears it.
    pub halted: Option<String>,
}

/// What the table can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    /// The history columns exist (`system_identifier`, `timeline`).
    pub history: bool,
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

/// Creates the table if it is missing (needs CREATE on schema public), and adds the
/// history columns to a table made by an earlier version when the role owns it.
pub async fn ensure_table(c: &Client) -> Result<Columns, StateError> {
    // IF NOT EXISTS still needs CREATE on the schema: look first, so a role that may
    // only use an existing table (sql/role.sql) is not refused.
    let row = c
        .query_one(
            "SELECT pg_catalog.to_regclass($1::text) IS NOT NULL, \
                    (SELECT pg_catalog.count(*) FROM pg_catalog.pg_attribute \
                      WHERE attrelid = pg_catalog.to_regclass($1::text) AND NOT attisdropped \
                        AND attname IN ('system_identifier', 'timeline', 'halted'))",
            &[&TABLE],
        )
        .await?;
    if row.get::<_, bool>(0) {
        if row.get::<_, i64>(1) == 3 {
            return Ok(Columns { history: true });
        }
        return match c.batch_execute(ADD_HISTORY).await {
            Ok(()) => Ok(Columns { history: true }),
            Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                Ok(Columns { history: false })
            }
            Err(e) => Err(e.into()),
        };
    }
    match c.batch_execute(CREATE).await {
        Ok(()) => Ok(Columns { history: true }),
        // Created concurrently (IF NOT EXISTS is not race-free).
        Err(e)
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION)
                || e.code() == Some(&SqlState::DUPLICATE_TABLE) =>
        {
            Ok(Columns { history: true })
        }
        Err(e) => Err(e.into()),
    }
}

/// The slot's row, `Ok(None)` when there is none.
pub async fn read(c: &Client, slot: &str) -> Result<Option<Stored>, StateError> {
    // The history columns through the row's JSON: the same query reads a table made
    // by an earlier version, without them.
    let row = c
        .query_opt(
            "SELECT acked_lsn::text, slot_restart_lsn::text, updated_at::text, \
                    pg_catalog.to_jsonb(s)->>'system_identifier', pg_catalog.to_jsonb(s)->>'timeline', \
                    pg_catalog.to_jsonb(s)->>'halted' \
               FROM public.outbox_relay_state s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| {
        let system_id = r.get::<_, Option<String>>(3).and_then(|v| v.parse().ok());
        let timeline = r.get::<_, Option<String>>(4).and_then(|v| v.parse().ok());
        Some(Stored {
            acked: parse(r.get(0))?,
            slot_restart_lsn: parse(r.get(1)),
            updated_at: r.get::<_, Option<String>>(2).unwrap_or_default(),
            origin: match (system_id, timeline) {
                (Some(system_id), Some(timeline)) => Some(Origin {
                    system_id,
                    timeline,
                }),
                _ => None,
            },
            halted: r.get::<_, Option<String>>(5),
        })
    }))
}

/// Records why publishing stopped (a refused event the broker would now drop), so
/// that a restarted relay stops too instead of taking the event as stored.
pub async fn halt(c: &Client, slot: &str, reason: &str) -> Result<(), StateError> {
    c.execute(
        "INSERT INTO public.outbox_relay_state (slot_name, acked_lsn, updated_at, halted) \
         VALUES ($1, '0/0', pg_catalog.now(), $2) \
         ON CONFLICT (slot_name) DO UPDATE SET halted = EXCLUDED.halted, updated_at = pg_catalog.now()",
        &[&slot, &reason],
    )
    .await?;
    Ok(())
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
         VALUES ($1, $2::text::pg_lsn, $3::text::pg_lsn, pg_catalog.now(), pg_catalog.now()) \
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
/// moving the stored position back, with where it was read (`origin`, when the table
/// has the history columns). A row made here has no slot identity.
pub async fn save(
    c: &Client,
    slot: &str,
    acked: Lsn,
    origin: Option<Origin>,
) -> Result<(), StateError> {
    match origin {
        Some(o) => {
            c.execute(
                "INSERT INTO public.outbox_relay_state \
                        (slot_name, acked_lsn, updated_at, system_identifier, timeline) \
                 VALUES ($1, $2::text::pg_lsn, pg_catalog.now(), $3, $4) \
                 ON CONFLICT (slot_name) DO UPDATE \
                    SET acked_lsn = GREATEST(outbox_relay_state.acked_lsn, EXCLUDED.acked_lsn), \
                        updated_at = pg_catalog.now(), system_identifier = EXCLUDED.system_identifier, \
                        timeline = EXCLUDED.timeline \
                  WHERE outbox_relay_state.acked_lsn < EXCLUDED.acked_lsn",
                &[
                    &slot,
                    &acked.to_string(),
                    &o.system_id.to_string(),
                    &(o.timeline as i32),
                ],
            )
            .await?
        }
        None => {
            c.execute(
                "INSERT INTO public.outbox_relay_state (slot_name, acked_lsn, updated_at) \
                 VALUES ($1, $2::text::pg_lsn, pg_catalog.now()) \
                 ON CONFLICT (slot_name) DO UPDATE \
                    SET acked_lsn = GREATEST(outbox_relay_state.acked_lsn, EXCLUDED.acked_lsn), \
                        updated_at = pg_catalog.now() \
                  WHERE outbox_relay_state.acked_lsn < EXCLUDED.acked_lsn",
                &[&slot, &acked.to_string()],
            )
            .await?
        }
    };
    Ok(())
}

/// Sets the stored position to exactly `lsn`, even when it is lower (a position that
/// was refused, or `run --start-lsn` asked to publish again from there and a restart
/// must go on doing so), with where it was read.
pub async fn set(
    c: &Client,
    slot: &str,
    lsn: Lsn,
    origin: Option<Origin>,
) -> Result<(), StateError> {
    match origin {
        Some(o) => {
            c.execute(
                "UPDATE public.outbox_relay_state \
                    SET acked_lsn = $2::text::pg_lsn, updated_at = pg_catalog.now(), \
                        system_identifier = $3, timeline = $4 \
                  WHERE slot_name = $1",
                &[&slot, &lsn.to_string(), &o.system_id.to_string(), &(o.timeline as i32)],
            )
            .await?
        }
        None => {
            c.execute(
                "UPDATE public.outbox_relay_state SET acked_lsn = $2::text::pg_lsn, updated_at = pg_catalog.now() \
                  WHERE slot_name = $1",
                &[&slot, &lsn.to_string()],
            )
            .await?
        }
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The column names of a `CREATE TABLE … ( … )` text, in order.
    fn columns(create: &str) -> Vec<String> {
        let body = &create[create.find('(').unwrap() + 1..create.rfind(')').unwrap()];
        body.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("--"))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    }

    /// sql/role.sql makes the table where the relay's role may not (the
    /// least-privileged setup): it must have every column the relay's own CREATE
    /// has, and bring a table of an earlier version up to date, or that setup
    /// silently runs without the history checks (docs/design.md).
    #[test]
    fn role_sql_makes_the_table_the_relay_makes() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../sql/role.sql");
        let sql = std::fs::read_to_string(path).unwrap();
        let start = sql
            .find("CREATE TABLE IF NOT EXISTS public.outbox_relay_state")
            .unwrap();
        let end = start + sql[start..].find(");").unwrap() + 1;
        assert_eq!(columns(&sql[start..end]), columns(CREATE));
        let history: Vec<&str> = ADD_HISTORY
            .split("ADD COLUMN IF NOT EXISTS ")
            .skip(1)
            .map(|c| c.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(history, ["system_identifier", "timeline", "halted"]);
        for column in history {
            assert!(
                sql.contains(&format!("ADD COLUMN IF NOT EXISTS {column} ")),
                "sql/role.sql does not add {column} to an existing table"
            );
        }
    }
}
