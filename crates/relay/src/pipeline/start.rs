//! Where a session starts (docs/design.md §3): one decision from what the session
//! found — the slot (read once, over the replication connection, with the server's
//! WAL history), the stored position (the state table's row) and the position the
//! previous session carried — made by [`plan`], a pure function.
//!
//! ```text
//!   slot's confirmed position ─────────────┐
//!   stored position   ── checked ──┐       ├─ max ─▶ START_REPLICATION … LOGICAL from
//!   carried position  ── checked ──┴───────┘
//!   `run --start-lsn` (first session only) ── wins, as asked
//! ```
//!
//! A carried or stored position is used only if it belongs to the server's history
//! (same system, and not past the switch point of its timeline), is not past the
//! server's WAL, and (stored) was saved for this incarnation of the slot. Otherwise
//! the session falls back to the slot's own position: what the server still has
//! after it is sent again (duplicates, never loss), and the fallback is logged and
//! counted (`outbox_relay_position_fallbacks_total`).

use std::fmt;

use outbox_event::history::{History, Origin};
use outbox_event::Lsn;

use crate::state::Stored;

/// A position carried from one session to the next: the acked watermark and where it
/// was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    pub lsn: Lsn,
    pub origin: Origin,
}

/// What a session start found.
#[derive(Debug)]
pub struct Found<'a> {
    /// `run --start-lsn`, for the first session only.
    pub explicit: Option<Lsn>,
    /// The slot's `confirmed_flush_lsn`.
    pub slot_confirmed: Lsn,
    /// The slot's `restart_lsn`.
    pub slot_restart: Option<Lsn>,
    /// The server's WAL end (the replay position on a standby).
    pub server_wal: Lsn,
    /// The server's WAL history (`None`: unknown, e.g. `status` without replication
    /// access; the history checks are then skipped).
    pub history: Option<&'a History>,
    pub carried: Option<Carried>,
    /// The state table's row, when the table is usable and has one.
    pub stored: Option<&'a Stored>,
    /// The state table is usable (its row can be written).
    pub table: bool,
}

/// Which position a session starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Slot,
    Stored,
    Carried,
    Explicit,
}

/// What to write to the state table's row before streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Nothing,
    /// No row yet: insert one at this position.
    Insert(Lsn),
    /// Set the row to exactly this position (and the current origin).
    Set(Lsn),
}

/// A carried or stored position that was not used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// `stored` or `carried` (the metric's label).
    pub position: &'static str,
    pub lsn: Lsn,
    pub why: String,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} acked position {} is not used: {}",
            self.position, self.lsn, self.why
        )
    }
}

/// Where a session starts, and what to store first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartPlan {
    /// The `START_REPLICATION` position; `None`: the slot's.
    pub from: Option<Lsn>,
    /// The position the session starts at (`from`, or the slot's).
    pub start: Lsn,
    pub source: Source,
    pub store: Store,
    pub fallbacks: Vec<Fallback>,
}

/// Decides where a session starts (module docs).
pub fn plan(found: &Found<'_>) -> StartPlan {
    let confirmed = found.slot_confirmed;
    let current = found.history.map(History::origin);
    let mut fallbacks = Vec::new();
    if let Some(explicit) = found.explicit {
        // `run --start-lsn` wins for the first session and is stored exactly, so that
        // a restart goes on re-publishing from there.
        let store = match found.stored {
            Some(row) if row.acked != explicit || row.origin != current => Store::Set(explicit),
            Some(_) => Store::Nothing,
            None if found.table => Store::Insert(explicit),
            None => Store::Nothing,
        };
        return StartPlan {
            from: Some(explicit),
            start: explicit.max(confirmed),
            source: Source::Explicit,
            store,
            fallbacks,
        };
    }
    let mut start = confirmed;
    let mut source = Source::Slot;
    let stored_ok = found.stored.and_then(|row| match check_stored(row, found) {
        Ok(()) => Some(row.acked),
        Err(why) => {
            fallbacks.push(Fallback {
                position: "stored",
                lsn: row.acked,
                why,
            });
            None
        }
    });
    if let Some(lsn) = stored_ok.filter(|l| *l > start) {
        start = lsn;
        source = Source::Stored;
    }
    if let Some(carried) = found.carried {
        match check_carried(carried, found) {
            Ok(()) if carried.lsn > start => {
                start = carried.lsn;
                source = Source::Carried;
            }
            Ok(()) => {}
            Err(why) => fallbacks.push(Fallback {
                position: "carried",
                lsn: carried.lsn,
                why,
            }),
        }
    }
    let store = match found.stored {
        // A refused row is reset; a valid one moves up to the start, and gets the
        // current origin.
        Some(row) if stored_ok.is_none() || row.acked < start || row.origin != current => {
            Store::Set(start)
        }
        Some(_) => Store::Nothing,
        None if found.table => Store::Insert(start),
        None => Store::Nothing,
    };
    StartPlan {
        from: (start > confirmed).then_some(start),
        start,
        source,
        store,
        fallbacks,
    }
}

fn check_stored(row: &Stored, found: &Found<'_>) -> Result<(), String> {
    if let (Some(origin), Some(history)) = (row.origin, found.history) {
        history
            .check(origin, row.acked)
            .map_err(|e| e.to_string())?;
    }
    if row.acked > found.server_wal {
        return Err(format!(
            "it is ahead of this server's WAL ({}): a restored backup or another cluster",
            found.server_wal
        ));
    }
    if let (Some(created), Some(now)) = (row.slot_restart_lsn, found.slot_restart) {
        if now < created {
            return Err(format!(
                "it belongs to another slot of that name (the slot's restart_lsn {now} is below {created}, the one it was created with): it was dropped and re-created"
            ));
        }
    }
    Ok(())
}

fn check_carried(carried: Carried, found: &Found<'_>) -> Result<(), String> {
    if let Some(history) = found.history {
        history
            .check(carried.origin, carried.lsn)
            .map_err(|e| e.to_string())?;
    }
    if carried.lsn > found.server_wal {
        return Err(format!(
            "it is ahead of this server's WAL ({}): the server lacks what was acked (a failover to a standby that had not received it)",
            found.server_wal
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSTEM: u64 = 7;

    fn history() -> History {
        History::first(SYSTEM)
    }

    fn on(timeline: u32) -> Origin {
        Origin {
            system_id: SYSTEM,
            timeline,
        }
    }

    fn stored(acked: u64, identity: Option<u64>, origin: Option<Origin>) -> Stored {
        Stored {
            acked: Lsn(acked),
            slot_restart_lsn: identity.map(Lsn),
            updated_at: String::new(),
            origin,
            halted: None,
        }
    }

    fn found<'a>(history: &'a History, stored: Option<&'a Stored>) -> Found<'a> {
        Found {
            explicit: None,
            slot_confirmed: Lsn(0x300),
            slot_restart: Some(Lsn(0x200)),
            server_wal: Lsn(0x900),
            history: Some(history),
            carried: None,
            stored,
            table: true,
        }
    }

    #[test]
    fn starts_from_the_later_position() {
        let h = history();
        let row = stored(0x500, Some(0x100), Some(on(1)));
        let p = plan(&found(&h, Some(&row)));
        assert_eq!(
            (p.from, p.source, p.store),
            (Some(Lsn(0x500)), Source::Stored, Store::Nothing)
        );
        let mut f = found(&h, Some(&row));
        f.slot_confirmed = Lsn(0x600);
        let p = plan(&f);
        assert_eq!((p.from, p.source), (None, Source::Slot));
        assert_eq!(p.store, Store::Set(Lsn(0x600)), "the row follows the slot");
        let p = plan(&found(&h, None));
        assert_eq!((p.from, p.store), (None, Store::Insert(Lsn(0x300))));
        let mut f = found(&h, None);
        f.table = false;
        assert_eq!(plan(&f).store, Store::Nothing);
        // No identity stored (a row the relay made for an existing slot): used.
        let row = stored(0x500, None, Some(on(1)));
        let mut f = found(&h, Some(&row));
        f.slot_restart = Some(Lsn(0x10));
        assert_eq!(plan(&f).from, Some(Lsn(0x500)));
        // A row of an earlier version (no origin) gets the current one.
        let row = stored(0x500, None, None);
        let p = plan(&found(&h, Some(&row)));
        assert_eq!(
            (p.from, p.store),
            (Some(Lsn(0x500)), Store::Set(Lsn(0x500)))
        );
    }

    #[test]
    fn the_carried_position_counts_when_it_is_of_this_history() {
        let h = history();
        let row = stored(0x500, None, Some(on(1)));
        let mut f = found(&h, Some(&row));
        f.carried = Some(Carried {
            lsn: Lsn(0x700),
            origin: on(1),
        });
        let p = plan(&f);
        assert_eq!(
            (p.from, p.source, p.store),
            (Some(Lsn(0x700)), Source::Carried, Store::Set(Lsn(0x700)))
        );
        assert!(p.fallbacks.is_empty());
    }

    #[test]
    fn positions_past_the_servers_wal_fall_back() {
        let h = history();
        let row = stored(0x500, Some(0x100), Some(on(1)));
        let mut f = found(&h, Some(&row));
        f.server_wal = Lsn(0x4FF);
        f.carried = Some(Carried {
            lsn: Lsn(0x600),
            origin: on(1),
        });
        let p = plan(&f);
        assert_eq!((p.from, p.source), (None, Source::Slot));
        assert_eq!(p.store, Store::Set(Lsn(0x300)), "the refused row is reset");
        let kinds: Vec<&str> = p.fallbacks.iter().map(|b| b.position).collect();
        assert_eq!(kinds, ["stored", "carried"]);
        assert!(
            p.fallbacks[0].why.contains("ahead of this server's WAL"),
            "{:?}",
            p.fallbacks
        );
    }

    #[test]
    fn a_position_of_another_slot_incarnation_falls_back() {
        let h = history();
        let row = stored(0x500, Some(0x100), Some(on(1)));
        let mut f = found(&h, Some(&row));
        f.slot_restart = Some(Lsn(0xFF));
        let p = plan(&f);
        assert_eq!(p.from, None);
        assert!(p.fallbacks[0].why.contains("re-created"));
    }

    #[test]
    fn positions_of_another_history_fall_back() {
        // Timeline 1 ended at 0/400; the relay acked 0/700 there (an asynchronous
        // failover), and the new primary's WAL has passed it.
        let h = History::parse(SYSTEM, 2, "1\t0/400\tpromoted\n").unwrap();
        let mut f = found(&h, None);
        f.carried = Some(Carried {
            lsn: Lsn(0x700),
            origin: on(1),
        });
        let p = plan(&f);
        assert_eq!((p.from, p.source), (None, Source::Slot));
        assert!(
            p.fallbacks[0].why.contains("asynchronous failover"),
            "{:?}",
            p.fallbacks
        );
        // Before the switch point it is the same WAL: used.
        f.carried = Some(Carried {
            lsn: Lsn(0x380),
            origin: on(1),
        });
        assert_eq!(plan(&f).from, Some(Lsn(0x380)));
        // A stored position of another system (a restored or new cluster).
        let other = Origin {
            system_id: 8,
            timeline: 2,
        };
        let row = stored(0x500, None, Some(other));
        let p = plan(&found(&h, Some(&row)));
        assert_eq!((p.from, p.store), (None, Store::Set(Lsn(0x300))));
        assert!(
            p.fallbacks[0].why.contains("new cluster"),
            "{:?}",
            p.fallbacks
        );
    }

    #[test]
    fn an_explicit_start_wins_and_is_stored_exactly() {
        let h = history();
        let row = stored(0x500, None, Some(on(1)));
        let mut f = found(&h, Some(&row));
        f.explicit = Some(Lsn(0x400));
        let p = plan(&f);
        assert_eq!(
            (p.from, p.source, p.store),
            (Some(Lsn(0x400)), Source::Explicit, Store::Set(Lsn(0x400)))
        );
        f.stored = None;
        assert_eq!(plan(&f).store, Store::Insert(Lsn(0x400)));
    }
}
