//! What `status` warns about a slot and its anchor (docs/operations.md, "Slot safety"),
//! and the sizes and durations it prints.

use std::time::Duration;

use wal_reader::admin::{self, SlotState};

/// Below this much `safe_wal_size`, `status` warns that the slot nears invalidation.
pub const LOW_SAFE_WAL_BYTES: i64 = 1 << 30;

/// `3 h 20 min`, `45 s`.
pub(super) fn human_secs(secs: i64) -> String {
    match secs {
        s if s >= 3600 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{} min {} s", s / 60, s % 60),
        s => format!("{s} s"),
    }
}

/// Human-readable warnings about a slot's health, each naming what to do.
pub fn warnings(s: &SlotState) -> Vec<String> {
    let mut w = Vec::new();
    match s.wal_status.as_deref() {
        Some("extended") => w.push(format!(
            "slot {} retains more WAL than max_wal_size (wal_status extended): make sure a relay is running and keeping up",
            s.slot_name
        )),
        Some("unreserved") => w.push(format!(
            "slot {} is about to be invalidated (wal_status unreserved): start the relay now or raise max_slot_wal_keep_size",
            s.slot_name
        )),
        Some("lost") => w.push(format!(
            "slot {} was invalidated{} and its WAL is gone: recreate it (`slot drop`, `slot create`) and recover with `replay --from-table`",
            s.slot_name,
            s.invalidation_reason
                .as_deref()
                .map(|r| format!(" ({})", admin::explain_invalidation(r)))
                .unwrap_or_default()
        )),
        _ => {}
    }
    if let Some(safe) = s.safe_wal_size {
        if safe < LOW_SAFE_WAL_BYTES && s.wal_status.as_deref() != Some("lost") {
            w.push(format!(
                "only {} of WAL can still be written before slot {} is invalidated: start or speed up the relay, or raise max_slot_wal_keep_size",
                human_bytes(safe),
                s.slot_name
            ));
        }
    }
    if !s.active {
        w.push(format!(
            "no relay is streaming from slot {}: WAL accumulates until one runs",
            s.slot_name
        ));
    }
    if let Some(left) = s.idle_timeout_left_secs {
        w.push(format!(
            "slot {} is invalidated by idle_replication_slot_timeout in {} unless a relay streams from it before: start the relay, or raise the timeout",
            s.slot_name,
            human_secs(left.max(0))
        ));
    }
    w
}

pub(crate) fn human_bytes(b: i64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut v = b as f64;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

/// The warning about the replay window's anchor slot, if its state and the
/// configured window disagree.
pub(super) fn anchor_warning(
    anchor_name: &str,
    anchor: Option<&SlotState>,
    window: Option<Duration>,
) -> Option<String> {
    match (anchor, window) {
        (None, Some(_)) => Some(format!(
            "[relay] replay_window is set but the anchor slot {anchor_name} does not exist: run `outbox-relay slot create --if-not-exists` (or start the relay, which creates it)"
        )),
        (Some(a), _) if a.wal_status.as_deref() == Some("lost") => Some(format!(
            "the anchor slot {anchor_name} was invalidated: the replay window is gone; drop it (`SELECT pg_drop_replication_slot('{anchor_name}')`) so the relay recreates it, and raise max_slot_wal_keep_size"
        )),
        (Some(_), None) => Some(format!(
            "the anchor slot {anchor_name} exists but [relay] replay_window is not set: nothing advances it and it retains WAL; set the window or drop the slot"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::state;
    use super::*;

    #[test]
    fn an_invalidated_slot_names_its_reason_and_an_idle_one_its_deadline() {
        let mut s = state();
        s.wal_status = Some("lost".into());
        s.invalidation_reason = Some("wal_removed".into());
        let w = warnings(&s).join("\n");
        assert!(w.contains("was invalidated (wal_removed: it kept more WAL than max_slot_wal_keep_size allows)"), "{w}");
        let mut s = state();
        s.active = false;
        s.idle_timeout_left_secs = Some(3 * 3600 + 20 * 60);
        let w = warnings(&s).join("\n");
        assert!(
            w.contains("idle_replication_slot_timeout in 3 h 20 min"),
            "{w}"
        );
    }

    #[test]
    fn healthy_slot_has_no_warnings() {
        assert!(warnings(&state()).is_empty());
    }

    #[test]
    fn warns_on_risky_slots() {
        let mut s = state();
        s.wal_status = Some("unreserved".into());
        s.safe_wal_size = Some(1000);
        let w = warnings(&s);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("max_slot_wal_keep_size"));
        s.active = false;
        assert_eq!(warnings(&s).len(), 3);
    }

    #[test]
    fn bytes_are_readable() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 kB");
        assert_eq!(human_bytes(3 << 30), "3.0 GB");
    }
}
