//! What the reader checks before `START_REPLICATION`: the same slot checks as
//! [`super::require_slot`] and [`SlotState::check_start_lsn`], read over the
//! replication connection (text rows of a simple query) instead of a SQL client.

use pgoutput::Lsn;

use super::ident::{quote_literal, validate_slot_name};
use super::slot::{anchor_slot_name, check_usable, slot_state_sql, SlotState};
use super::AdminError;

/// What the reader checks before `START_REPLICATION`, read over the replication
/// connection with [`StreamStart::sql`]: the slot's state, the connected database,
/// and the replay window's start.
#[derive(Debug, Clone)]
pub struct StreamStart {
    pub state: SlotState,
    /// `current_database()`.
    pub database: String,
    /// The anchor slot's `confirmed_flush_lsn`, if a replay window is kept.
    pub replay_window: Option<Lsn>,
}

impl StreamStart {
    /// One simple query (a replication connection takes no bind parameters: the
    /// validated name is quoted as a literal); no row means no such slot.
    pub fn sql(version: i32, slot: &str) -> Result<String, AdminError> {
        validate_slot_name(slot)?;
        let extra = format!(
            ", current_database()::text, \
               (SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = {})",
            quote_literal(&anchor_slot_name(slot))
        );
        Ok(slot_state_sql(version, &quote_literal(slot), &extra))
    }

    /// Reads the result of [`Self::sql`] in text form: no row is no such slot.
    pub fn from_rows(slot: &str, rows: &[Vec<Option<String>>]) -> Result<StreamStart, AdminError> {
        let row = rows.first().ok_or_else(|| AdminError::SlotMissing {
            slot: slot.to_string(),
        })?;
        let text = |i: usize| row.get(i).cloned().flatten();
        let bad = |i: usize| AdminError::UnexpectedReply {
            what: format!("column {i} {:?} in pg_replication_slots", text(i)),
        };
        let lsn = |i: usize| {
            text(i)
                .map(|t| t.parse::<Lsn>().map_err(|_| bad(i)))
                .transpose()
        };
        let int = |i: usize| {
            text(i)
                .map(|t| t.parse::<i64>().map_err(|_| bad(i)))
                .transpose()
        };
        let flag = |i: usize| text(i).as_deref() == Some("t");
        let state = SlotState {
            slot_name: text(0).ok_or_else(|| bad(0))?,
            plugin: text(1),
            slot_type: text(2).unwrap_or_default(),
            database: text(3),
            active: flag(4),
            active_pid: int(5)?.map(|p| p as i32),
            confirmed_flush_lsn: lsn(6)?,
            restart_lsn: lsn(7)?,
            wal_status: text(8),
            safe_wal_size: int(9)?,
            two_phase: flag(10),
            failover: flag(11),
            current_wal_lsn: lsn(12)?.unwrap_or(Lsn::ZERO),
            retained_wal_bytes: int(13)?,
            invalidation_reason: text(14),
            idle_timeout_left_secs: int(15)?,
        };
        Ok(StreamStart {
            state,
            database: text(16).unwrap_or_default(),
            replay_window: lsn(17)?,
        })
    }

    /// Checks that the relay can stream from the slot ([`check_usable`], free,
    /// `requested` not before its position) and returns the position to pass to
    /// `START_REPLICATION`: `requested`, or the slot's position when `requested` is
    /// absent, `0/0` or not after it.
    pub fn check(&self, requested: Option<Lsn>) -> Result<Lsn, AdminError> {
        check_usable(&self.state, &self.database)?;
        self.state.check_free()?;
        let confirmed = self.state.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
        match requested {
            Some(l) => {
                self.state.check_start_lsn(l, self.replay_window)?;
                Ok(l.max(confirmed))
            }
            None => Ok(confirmed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::admin::slot::tests::state;

    #[test]
    fn stream_start_reads_text_and_checks_the_slot() {
        let row = |active: &str, window: Option<&str>| -> Vec<Option<String>> {
            [
                Some("s"),
                Some("pgoutput"),
                Some("logical"),
                Some("app"),
                Some(active),
                (active == "t").then_some("77"),
                Some("0/100"),
                Some("0/80"),
                Some("reserved"),
                None,
                Some("f"),
                Some("f"),
                Some("0/100"),
                Some("128"),
                None,
                None,
                Some("app"),
                window,
            ]
            .iter()
            .map(|v| v.map(String::from))
            .collect()
        };
        let found = StreamStart::from_rows("s", &[row("f", None)]).unwrap();
        assert_eq!(found.state, state());
        assert_eq!(found.check(None).unwrap(), Lsn(0x100));
        assert_eq!(found.check(Some(Lsn::ZERO)).unwrap(), Lsn(0x100));
        assert_eq!(found.check(Some(Lsn(0x200))).unwrap(), Lsn(0x200));
        let e = found.check(Some(Lsn(0xFF))).unwrap_err().to_string();
        assert!(
            e.contains("the earliest LSN that can be replayed is 0/100"),
            "{e}"
        );
        assert!(e.contains("replay --from-table"), "{e}");
        let windowed = StreamStart::from_rows("s", &[row("f", Some("0/90"))]).unwrap();
        let e = windowed.check(Some(Lsn(0xFF))).unwrap_err().to_string();
        assert!(e.contains("the replay window starts at 0/90"), "{e}");
        let held = StreamStart::from_rows("s", &[row("t", None)]).unwrap();
        assert!(matches!(
            held.check(None),
            Err(AdminError::SlotActive { pid: 77, .. })
        ));
        let e = StreamStart::from_rows("s", &[]).unwrap_err();
        assert!(matches!(e, AdminError::SlotMissing { .. }));
        assert!(StreamStart::sql(150000, "Bad").is_err());
        assert!(StreamStart::sql(150000, "s")
            .unwrap()
            .contains("'s_anchor'"));
    }
}
