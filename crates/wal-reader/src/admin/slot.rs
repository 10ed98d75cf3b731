//! Replication slots: reading a slot's state, checking that it is usable by the
//! relay, creating and dropping it.
//!
//! A slot is usable when it exists, is logical, decodes with `pgoutput`, belongs to
//! the database the relay connects to (a logical slot only decodes its own database's
//! WAL), and has not been invalidated (`wal_status = 'lost'`: the WAL it needed was
//! removed, typically because `max_slot_wal_keep_size` was exceeded). Whether another
//! process holds it (`active_pid`) is a separate check, [`check_slot_free`], because
//! `run` waits for a held slot (high availability) while `slot drop` refuses.

use std::time::{Duration, Instant};

use pgoutput::Lsn;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use super::ident::validate_slot_name;
use super::server::{check_replication_role, check_wal_level, server_version, Capacity};
use super::{server_version_num, AdminError};

/// How long `drop_slot(.., force = true)` keeps terminating the holder and retrying.
pub const FORCE_DROP_TIMEOUT: Duration = Duration::from_secs(10);
const FORCE_DROP_RETRY: Duration = Duration::from_millis(100);

/// One row of `pg_replication_slots`, plus the server's current WAL position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotState {
    pub slot_name: String,
    /// Output plugin; `None` for a physical slot.
    pub plugin: Option<String>,
    /// `logical` or `physical`.
    pub slot_type: String,
    /// Database of a logical slot.
    pub database: Option<String>,
    /// Whether a process streams from the slot now.
    pub active: bool,
    /// The process holding the slot, when active.
    pub active_pid: Option<i32>,
    /// Position up to which the consumer confirmed; streaming resumes here.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// Oldest WAL position the slot keeps.
    pub restart_lsn: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` (about to be invalidated) or `lost`.
    pub wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is invalidated;
    /// `None` when `max_slot_wal_keep_size` is unlimited.
    pub safe_wal_size: Option<i64>,
    /// WAL the slot retains: current WAL position minus `restart_lsn`.
    pub retained_wal_bytes: Option<i64>,
    /// Created with two-phase decoding (Postgres 14+).
    pub two_phase: bool,
    /// A failover slot, synchronised to standbys (Postgres 17+).
    pub failover: bool,
    /// The server's current WAL position (replay position on a standby).
    pub current_wal_lsn: Lsn,
    /// Why the slot was invalidated (Postgres 17+: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, `idle_timeout` on 18); `None` while it is usable.
    pub invalidation_reason: Option<String>,
    /// Seconds until Postgres 18's `idle_replication_slot_timeout` invalidates the
    /// slot, while no process streams from it; `None` when the timeout is off (0),
    /// the server has none (before 18), or the slot is in use.
    pub idle_timeout_left_secs: Option<i64>,
}

impl SlotState {
    /// Errors if another process holds the slot.
    pub fn check_free(&self) -> Result<(), AdminError> {
        match self.holder() {
            Some(pid) => Err(AdminError::SlotActive {
                slot: self.slot_name.clone(),
                pid,
            }),
            None => Ok(()),
        }
    }

    /// Errors if streaming from `start` would silently skip to the slot's position:
    /// Postgres cannot stream from before `confirmed_flush_lsn` (it forwards without
    /// a word). `0/0` means "from the slot" and is always fine. `replay_window`, the
    /// anchor slot's position if a replay window is kept, goes into the message.
    pub fn check_start_lsn(
        &self,
        start: Lsn,
        replay_window: Option<Lsn>,
    ) -> Result<(), AdminError> {
        match self.confirmed_flush_lsn {
            Some(earliest) if start != Lsn::ZERO && start < earliest => {
                Err(AdminError::StartLsnTooOld {
                    slot: self.slot_name.clone(),
                    requested: start,
                    earliest,
                    replay_window,
                })
            }
            _ => Ok(()),
        }
    }

    /// Errors (a warning for `status` and `check`) when the slot retains more WAL
    /// than `max_slot_wal_keep_size` allows and will be invalidated at the next
    /// checkpoint unless its consumer catches up.
    pub fn check_wal_reserved(&self) -> Result<(), AdminError> {
        if self.wal_status.as_deref() == Some("unreserved") {
            Err(AdminError::SlotNearInvalidation {
                slot: self.slot_name.clone(),
            })
        } else {
            Ok(())
        }
    }

    /// The pid of the process holding the slot, if any.
    pub fn holder(&self) -> Option<i32> {
        if self.active {
            Some(self.active_pid.unwrap_or(0))
        } else {
            None
        }
    }
}

/// Errors if another process holds the slot (see [`SlotState::check_free`]).
pub async fn check_slot_free(state: &SlotState) -> Result<(), AdminError> {
    state.check_free()
}

/// The slot's row of `pg_replication_slots`, or `None` if there is no such slot.
pub async fn slot_state(c: &Client, slot: &str) -> Result<Option<SlotState>, AdminError> {
    validate_slot_name(slot)?;
    let version = server_version_num(c).await?;
    let row = c
        .query_opt(&slot_state_sql(version, "$1", ""), &[&slot])
        .await?;
    let Some(row) = row else { return Ok(None) };
    let lsn = |i: usize| -> Result<Option<Lsn>, AdminError> {
        let text: Option<String> = row.try_get(i)?;
        text.map(|t| {
            t.parse().map_err(|_| AdminError::UnexpectedReply {
                what: format!("LSN {t:?} in pg_replication_slots"),
            })
        })
        .transpose()
    };
    Ok(Some(SlotState {
        slot_name: row.try_get(0)?,
        plugin: row.try_get(1)?,
        slot_type: row.try_get(2)?,
        database: row.try_get(3)?,
        active: row.try_get(4)?,
        active_pid: row.try_get(5)?,
        confirmed_flush_lsn: lsn(6)?,
        restart_lsn: lsn(7)?,
        wal_status: row.try_get(8)?,
        safe_wal_size: row.try_get(9)?,
        two_phase: row.try_get(10)?,
        failover: row.try_get(11)?,
        current_wal_lsn: lsn(12)?.unwrap_or(Lsn::ZERO),
        retained_wal_bytes: row.try_get(13)?,
        invalidation_reason: row.try_get(14)?,
        idle_timeout_left_secs: row.try_get(15)?,
    }))
}

/// The state query for a server version: columns added after Postgres 13 are read
/// as constants on older servers. `slot` is the slot name as SQL (`$1`, or a quoted
/// literal for a simple query); `extra` adds columns after the state's 16.
pub(super) fn slot_state_sql(version: i32, slot: &str, extra: &str) -> String {
    let reason = if version >= 170000 {
        "s.invalidation_reason"
    } else {
        "NULL::text"
    };
    // The timeout in seconds (pg_settings gives its unit), minus how long the slot
    // has been idle (`inactive_since`, set while no process holds it).
    let idle_left = if version >= 180000 {
        "(SELECT CASE WHEN t.secs > 0 AND NOT s.active AND s.inactive_since IS NOT NULL \
                     THEN t.secs - EXTRACT(EPOCH FROM pg_catalog.now() - s.inactive_since)::int8 END \
            FROM (SELECT CASE unit WHEN 'min' THEN setting::int8 * 60 ELSE setting::int8 END AS secs \
                    FROM pg_catalog.pg_settings WHERE name = 'idle_replication_slot_timeout') t)"
    } else {
        "NULL::int8"
    };
    let two_phase = if version >= 140000 {
        "s.two_phase"
    } else {
        "false"
    };
    let failover = if version >= 170000 {
        "s.failover"
    } else {
        "false"
    };
    format!(
        "SELECT s.slot_name::text, s.plugin::text, s.slot_type, s.database::text, \
                s.active, s.active_pid, s.confirmed_flush_lsn::text, s.restart_lsn::text, \
                s.wal_status, s.safe_wal_size, {two_phase}, {failover}, w.lsn::text, \
                pg_catalog.pg_wal_lsn_diff(w.lsn, s.restart_lsn)::int8, {reason}, {idle_left}{extra} \
           FROM pg_catalog.pg_replication_slots s, \
                LATERAL (SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() \
                                     ELSE pg_catalog.pg_current_wal_lsn() END AS lsn) w \
          WHERE s.slot_name = {slot}"
    )
}

/// The name of the replay window's anchor slot for `slot` (`<slot>_anchor`,
/// docs/design.md §7).
pub fn anchor_slot_name(slot: &str) -> String {
    format!("{slot}_anchor")
}

/// Moves the idle slot `slot` forward to `to` (`pg_replication_slot_advance`, which
/// decodes the WAL in between). Does nothing, and returns false, when a process
/// holds the slot, it already is at or past `to`, or it does not exist.
pub async fn advance_slot(c: &Client, slot: &str, to: Lsn) -> Result<bool, AdminError> {
    let n = c
        .execute(
            "SELECT pg_catalog.pg_replication_slot_advance($1::name, $2::text::pg_lsn) \
               FROM pg_catalog.pg_replication_slots \
              WHERE slot_name = $1::name AND NOT active AND confirmed_flush_lsn < $2::text::pg_lsn",
            &[&slot, &to.to_string()],
        )
        .await?;
    Ok(n > 0)
}

/// The slot, if the relay can stream from it: it exists, is logical, uses `pgoutput`,
/// belongs to the connected database, and has not been invalidated. Whether it is
/// free is left to [`check_slot_free`].
pub async fn require_slot(c: &Client, slot: &str) -> Result<SlotState, AdminError> {
    let state = slot_state(c, slot)
        .await?
        .ok_or_else(|| AdminError::SlotMissing {
            slot: slot.to_string(),
        })?;
    let row = c
        .query_one("SELECT pg_catalog.current_database()::text", &[])
        .await?;
    let database: String = row.try_get(0)?;
    check_usable(&state, &database)?;
    Ok(state)
}

/// Errors unless the relay can stream from the slot: logical, `pgoutput`, of
/// `database`, not invalidated.
pub fn check_usable(state: &SlotState, database: &str) -> Result<(), AdminError> {
    let slot = || state.slot_name.clone();
    if state.slot_type != "logical" {
        return Err(AdminError::SlotNotLogical {
            slot: slot(),
            slot_type: state.slot_type.clone(),
        });
    }
    if state.plugin.as_deref() != Some("pgoutput") {
        return Err(AdminError::SlotWrongPlugin {
            slot: slot(),
            plugin: state.plugin.clone().unwrap_or_default(),
        });
    }
    if let Some(slot_database) = &state.database {
        if slot_database != database {
            return Err(AdminError::SlotOtherDatabase {
                slot: slot(),
                slot_database: slot_database.clone(),
                database: database.to_string(),
            });
        }
    }
    if state.wal_status.as_deref() == Some("lost") {
        return Err(AdminError::SlotInvalidated {
            slot: slot(),
            because: state
                .invalidation_reason
                .as_deref()
                .map(|r| format!(", {}", super::error::explain_invalidation(r)))
                .unwrap_or_default(),
        });
    }
    Ok(())
}

/// What [`create_slot`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCreated {
    /// False when the slot already existed (`if_not_exists`).
    pub created: bool,
    /// For a new slot, the consistent point Postgres reported: decoding starts at
    /// the first transaction committing after it. For an existing slot, its
    /// `confirmed_flush_lsn`.
    pub consistent_point: Lsn,
    /// The slot's `restart_lsn` (read right after creating it, for a new slot). A
    /// slot saves its state to disk when it is created and its `restart_lsn` only
    /// moves forward afterwards, also across crashes and in a failover copy, so a
    /// slot whose `restart_lsn` is below this one is another slot of the same name
    /// (the relay's stored position names the slot by it, docs/design.md §3).
    pub restart_lsn: Option<Lsn>,
}

/// Creates the logical slot `slot` with the `pgoutput` plugin in the connected
/// database. With `if_not_exists`, an existing slot is kept if the relay can use it.
/// `failover` asks Postgres 17+ to synchronise the slot to standbys.
///
/// Checks first, so the operator gets the fix rather than a server error: the name,
/// the server version (for `failover`), `wal_level`, the role, and room for one more
/// slot and WAL sender. Creating a logical slot waits for transactions already
/// running to finish (Postgres needs a consistent snapshot), so a long transaction
/// delays it.
pub async fn create_slot(
    c: &Client,
    slot: &str,
    if_not_exists: bool,
    failover: bool,
) -> Result<SlotCreated, AdminError> {
    validate_slot_name(slot)?;
    let version = server_version_num(c).await?;
    if failover && version < 170000 {
        return Err(AdminError::FailoverUnsupported {
            version: server_version(c).await?,
        });
    }
    check_wal_level(c).await?;
    check_replication_role(c).await?;
    if let Some(existing) = existing_slot(c, slot, if_not_exists).await? {
        return Ok(existing);
    }
    let capacity = Capacity::read(c).await?;
    capacity.check_room_for_slot()?;

    let sql = if version >= 170000 {
        "SELECT lsn::text FROM pg_catalog.pg_create_logical_replication_slot($1::name, 'pgoutput'::name, false, false, $2::boolean)"
    } else {
        "SELECT lsn::text FROM pg_catalog.pg_create_logical_replication_slot($1::name, 'pgoutput'::name)"
    };
    let result = if version >= 170000 {
        c.query_one(sql, &[&slot, &failover]).await
    } else {
        c.query_one(sql, &[&slot]).await
    };
    match result {
        Ok(row) => {
            let text: String = row.try_get(0)?;
            let consistent_point = text.parse().map_err(|_| AdminError::UnexpectedReply {
                what: format!("consistent point {text:?}"),
            })?;
            let restart_lsn = slot_state(c, slot).await?.and_then(|s| s.restart_lsn);
            Ok(SlotCreated {
                created: true,
                consistent_point,
                restart_lsn,
            })
        }
        Err(e) if e.code() == Some(&SqlState::DUPLICATE_OBJECT) => {
            // Created concurrently by someone else since the check above.
            existing_slot(c, slot, if_not_exists)
                .await?
                .ok_or(AdminError::Sql(e))
        }
        Err(e) if e.code() == Some(&SqlState::CONFIGURATION_LIMIT_EXCEEDED) => {
            Err(AdminError::SlotsExhausted {
                max: capacity.max_replication_slots,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// `Ok(None)` if there is no slot `slot`; the existing slot if `if_not_exists` and
/// the relay can use it; otherwise the reason it cannot be created.
async fn existing_slot(
    c: &Client,
    slot: &str,
    if_not_exists: bool,
) -> Result<Option<SlotCreated>, AdminError> {
    if slot_state(c, slot).await?.is_none() {
        return Ok(None);
    }
    if !if_not_exists {
        return Err(AdminError::SlotExists {
            slot: slot.to_string(),
        });
    }
    let state = require_slot(c, slot).await?;
    Ok(Some(SlotCreated {
        created: false,
        consistent_point: state.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
        restart_lsn: state.restart_lsn,
    }))
}

/// Drops the slot. Returns false if it did not exist and `if_exists` was given.
///
/// While a process holds the slot, refuses with [`AdminError::SlotActive`] unless
/// `force`: then terminates the holder (`pg_terminate_backend`) and retries until
/// the slot is released, for at most [`FORCE_DROP_TIMEOUT`] (a holder that keeps
/// reconnecting is reported as [`AdminError::SlotStillActive`]).
pub async fn drop_slot(
    c: &Client,
    slot: &str,
    if_exists: bool,
    force: bool,
) -> Result<bool, AdminError> {
    validate_slot_name(slot)?;
    let deadline = Instant::now() + FORCE_DROP_TIMEOUT;
    let missing = || {
        if if_exists {
            Ok(false)
        } else {
            Err(AdminError::SlotMissing {
                slot: slot.to_string(),
            })
        }
    };
    loop {
        let Some(state) = slot_state(c, slot).await? else {
            return missing();
        };
        if let Some(pid) = state.holder() {
            if !force {
                return Err(AdminError::SlotActive {
                    slot: slot.to_string(),
                    pid,
                });
            }
            if Instant::now() >= deadline {
                return Err(AdminError::SlotStillActive {
                    slot: slot.to_string(),
                    pid,
                });
            }
            terminate(c, slot, pid).await?;
            tokio::time::sleep(FORCE_DROP_RETRY).await;
            continue;
        }
        match c
            .execute(
                "SELECT pg_catalog.pg_drop_replication_slot($1::name)",
                &[&slot],
            )
            .await
        {
            Ok(_) => return Ok(true),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => return missing(),
            // Taken between the state read and the drop: look again.
            Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) && Instant::now() < deadline => {
                tokio::time::sleep(FORCE_DROP_RETRY).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn terminate(c: &Client, slot: &str, pid: i32) -> Result<(), AdminError> {
    match c
        .execute(
            "SELECT pg_catalog.pg_terminate_backend($1::integer)",
            &[&pid],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            Err(AdminError::TerminateDenied {
                slot: slot.to_string(),
                pid,
            })
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A usable, idle slot (shared by the admin module's unit tests).
    pub(crate) fn state() -> SlotState {
        SlotState {
            slot_name: "s".into(),
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            database: Some("app".into()),
            active: false,
            active_pid: None,
            confirmed_flush_lsn: Some(Lsn(0x100)),
            restart_lsn: Some(Lsn(0x80)),
            wal_status: Some("reserved".into()),
            safe_wal_size: None,
            retained_wal_bytes: Some(0x80),
            two_phase: false,
            failover: false,
            current_wal_lsn: Lsn(0x100),
            invalidation_reason: None,
            idle_timeout_left_secs: None,
        }
    }

    #[test]
    fn usable_slot() {
        assert!(check_usable(&state(), "app").is_ok());
        assert!(state().check_free().is_ok());
    }

    #[test]
    fn unusable_slots_say_why() {
        let mut physical = state();
        physical.slot_type = "physical".into();
        physical.plugin = None;
        physical.database = None;
        assert!(matches!(
            check_usable(&physical, "app"),
            Err(AdminError::SlotNotLogical { .. })
        ));

        let mut other_plugin = state();
        other_plugin.plugin = Some("wal2json".into());
        let e = check_usable(&other_plugin, "app").expect_err("plugin");
        assert!(e.to_string().contains("'wal2json'"), "{e}");

        let e = check_usable(&state(), "other").expect_err("database");
        assert!(matches!(e, AdminError::SlotOtherDatabase { .. }));
        assert!(
            e.to_string()
                .contains("point [postgres] url at database \"app\""),
            "{e}"
        );

        let mut lost = state();
        lost.wal_status = Some("lost".into());
        let e = check_usable(&lost, "app").expect_err("lost");
        assert!(e.to_string().contains("replay --from-table"), "{e}");
    }

    #[test]
    fn held_slot_names_the_holder() {
        let mut held = state();
        held.active = true;
        held.active_pid = Some(4242);
        let e = held.check_free().expect_err("held");
        assert!(e.is_precondition());
        let msg = e.to_string();
        assert!(msg.contains("pid 4242") && msg.contains("--force"), "{msg}");
    }

    #[test]
    fn unreserved_wal_is_a_warning() {
        assert!(state().check_wal_reserved().is_ok());
        let mut s = state();
        s.wal_status = Some("unreserved".into());
        let e = s.check_wal_reserved().expect_err("unreserved");
        assert!(!e.is_precondition());
        assert!(e.to_string().contains("max_slot_wal_keep_size"), "{e}");
    }

    #[test]
    fn start_lsn_before_the_slot_is_refused() {
        let s = state();
        assert!(s.check_start_lsn(Lsn::ZERO, None).is_ok());
        assert!(s.check_start_lsn(Lsn(0x100), None).is_ok());
        assert!(s.check_start_lsn(Lsn(0x200), None).is_ok());
        let e = s.check_start_lsn(Lsn(0xFF), None).expect_err("too old");
        assert!(e.is_precondition());
        assert!(e.to_string().contains("--start-lsn 0/100"), "{e}");
    }

    #[test]
    fn state_query_fits_the_server_version() {
        let sql = |v| slot_state_sql(v, "$1", "");
        assert!(sql(150000).contains("s.two_phase"));
        assert!(!sql(150000).contains("s.failover"));
        assert!(sql(170000).contains("s.failover"));
        assert!(!sql(130000).contains("s.two_phase"));
        assert!(!sql(160000).contains("s.invalidation_reason"));
        assert!(sql(170000).contains("s.invalidation_reason"));
        assert!(!sql(170000).contains("idle_replication_slot_timeout"));
        assert!(sql(180000).contains("idle_replication_slot_timeout"));
    }
}
