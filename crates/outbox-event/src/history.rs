//! Which WAL history a position belongs to (docs/design.md §3, "Positions belong to
//! one history").
//!
//! A WAL position means something only on the server whose WAL it was read from: the
//! same number on another cluster, or on a timeline that branched off before it, names
//! other transactions. The reader learns the server's identity at every session start
//! (`IDENTIFY_SYSTEM`: system identifier and timeline; `TIMELINE_HISTORY`: where each
//! ancestor timeline ended) and every position carried from one session to the next —
//! the acked watermark, the stored position, a stream's producer positions — is
//! checked against it before it is used.
//!
//! ```text
//!   timeline 1 ───────────────●  switch point S1 (timeline 1 ends here)
//!                             └── timeline 2 ──────●  S2
//!                                                  └── timeline 3 (current)
//!   a position p seen on timeline 1 belongs to this history  ⇔  p ≤ S1
//!   a position p seen on timeline 3 belongs to it            ⇔  always (same timeline)
//!   a position seen on any other system or timeline          ⇒  never
//! ```

use std::fmt;

use pgoutput::Lsn;

/// Where a WAL position was seen: the server's system identifier and the timeline it
/// was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Origin {
    pub system_id: u64,
    pub timeline: u32,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "system {} timeline {}", self.system_id, self.timeline)
    }
}

/// A server's WAL history as one session found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct History {
    /// `IDENTIFY_SYSTEM`'s `systemid`.
    pub system_id: u64,
    /// The timeline the server is on now.
    pub timeline: u32,
    /// The ancestors of `timeline`, oldest first: each timeline and the switch point
    /// where it ended (the first position of its child). Empty on timeline 1.
    pub ancestors: Vec<(u32, Lsn)>,
}

/// Why a position does not belong to a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Foreign {
    /// It was seen on another cluster (a restore, a new cluster, a dump/restore).
    OtherSystem { seen: u64, now: u64 },
    /// It was seen on a timeline that is not an ancestor of the current one.
    OtherTimeline { seen: u32, now: u32 },
    /// It lies past the point where its timeline ended in this history: the WAL
    /// after that point was replaced (an asynchronous failover, a point-in-time
    /// restore).
    PastSwitch {
        timeline: u32,
        switch: Lsn,
        lsn: Lsn,
    },
}

impl fmt::Display for Foreign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Foreign::OtherSystem { seen, now } => write!(
                f,
                "it was read from system {seen}, and this server is system {now} (a restored or new cluster)"
            ),
            Foreign::OtherTimeline { seen, now } => write!(
                f,
                "it was read on timeline {seen}, which is not in the history of this server's timeline {now}"
            ),
            Foreign::PastSwitch {
                timeline,
                switch,
                lsn,
            } => write!(
                f,
                "it is {lsn} on timeline {timeline}, which this server left at {switch}: the WAL after that was replaced (an asynchronous failover or a point-in-time restore)"
            ),
        }
    }
}

/// `TIMELINE_HISTORY`'s file could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadHistoryFile(pub String);

impl fmt::Display for BadHistoryFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unreadable timeline history file: {}", self.0)
    }
}

impl std::error::Error for BadHistoryFile {}

impl History {
    /// The history of a server on timeline 1 (no ancestors).
    pub fn first(system_id: u64) -> History {
        History {
            system_id,
            timeline: 1,
            ancestors: Vec::new(),
        }
    }

    /// Reads a timeline history file as `TIMELINE_HISTORY <timeline>` returns it: one
    /// line per ancestor, `<timeline>\t<switch point>\t<reason>`, `#` comments.
    pub fn parse(system_id: u64, timeline: u32, file: &str) -> Result<History, BadHistoryFile> {
        let mut ancestors: Vec<(u32, Lsn)> = Vec::new();
        for line in file.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(tli), Some(switch)) = (fields.next(), fields.next()) else {
                return Err(BadHistoryFile(format!("line {line:?}")));
            };
            let tli: u32 = tli
                .parse()
                .map_err(|_| BadHistoryFile(format!("timeline {tli:?}")))?;
            let switch: Lsn = switch
                .parse()
                .map_err(|_| BadHistoryFile(format!("switch point {switch:?}")))?;
            if tli >= timeline
                || ancestors
                    .last()
                    .is_some_and(|(t, s)| *t >= tli || *s > switch)
            {
                return Err(BadHistoryFile(format!(
                    "timeline {tli} at {switch} out of order"
                )));
            }
            ancestors.push((tli, switch));
        }
        Ok(History {
            system_id,
            timeline,
            ancestors,
        })
    }

    /// Where positions read now come from.
    pub fn origin(&self) -> Origin {
        Origin {
            system_id: self.system_id,
            timeline: self.timeline,
        }
    }

    /// The timeline whose WAL holds a record that starts at `lsn` (a commit record's
    /// `commit_lsn`): the first ancestor that ended after it, else the current one.
    /// Records before a switch point are shared by the timeline and its children.
    pub fn owner(&self, lsn: Lsn) -> u32 {
        self.ancestors
            .iter()
            .find(|(_, switch)| lsn < *switch)
            .map(|(t, _)| *t)
            .unwrap_or(self.timeline)
    }

    /// Checks that a position seen at `origin` (a record boundary: a commit's end, a
    /// keepalive position) belongs to this history.
    pub fn check(&self, origin: Origin, lsn: Lsn) -> Result<(), Foreign> {
        if origin.system_id != self.system_id {
            return Err(Foreign::OtherSystem {
                seen: origin.system_id,
                now: self.system_id,
            });
        }
        if origin.timeline == self.timeline {
            return Ok(());
        }
        match self.ancestors.iter().find(|(t, _)| *t == origin.timeline) {
            Some((_, switch)) if lsn <= *switch => Ok(()),
            Some((timeline, switch)) => Err(Foreign::PastSwitch {
                timeline: *timeline,
                switch: *switch,
                lsn,
            }),
            None => Err(Foreign::OtherTimeline {
                seen: origin.timeline,
                now: self.timeline,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "1\t0/3000060\tno recovery target specified\n\n\
                        # a comment\n2\t0/5000100\tbefore 2026-01-01\n";

    fn history() -> History {
        History::parse(7, 3, FILE).unwrap()
    }

    #[test]
    fn parses_a_history_file() {
        let h = history();
        assert_eq!(h.ancestors, vec![(1, Lsn(0x3000060)), (2, Lsn(0x5000100))]);
        assert!(
            History::parse(7, 2, FILE).is_err(),
            "timeline 2 in its own file"
        );
        assert!(
            History::parse(7, 3, "1 0/5 x\n2 0/4 y").is_err(),
            "switches go back"
        );
        assert!(History::parse(7, 3, "1").is_err());
        assert!(History::parse(7, 3, "x 0/4").is_err());
        assert_eq!(History::parse(7, 1, "").unwrap(), History::first(7));
    }

    #[test]
    fn owner_is_the_timeline_whose_wal_holds_the_record() {
        let h = history();
        assert_eq!(h.owner(Lsn(0x100)), 1);
        assert_eq!(h.owner(Lsn(0x300005F)), 1);
        assert_eq!(h.owner(Lsn(0x3000060)), 2);
        assert_eq!(h.owner(Lsn(0x50000FF)), 2);
        assert_eq!(h.owner(Lsn(0x5000100)), 3);
        assert_eq!(History::first(7).owner(Lsn(u64::MAX)), 1);
    }

    #[test]
    fn positions_of_this_history_only() {
        let h = history();
        let on = |timeline| Origin {
            system_id: 7,
            timeline,
        };
        assert_eq!(h.check(on(3), Lsn(u64::MAX)), Ok(()));
        assert_eq!(
            h.check(on(1), Lsn(0x3000060)),
            Ok(()),
            "at the switch point"
        );
        assert_eq!(h.check(on(2), Lsn(0x4000000)), Ok(()));
        assert!(matches!(
            h.check(on(1), Lsn(0x3000061)),
            Err(Foreign::PastSwitch { timeline: 1, .. })
        ));
        assert!(matches!(
            h.check(on(4), Lsn(0x10)),
            Err(Foreign::OtherTimeline { seen: 4, now: 3 })
        ));
        let other = Origin {
            system_id: 8,
            timeline: 3,
        };
        assert!(matches!(
            h.check(other, Lsn(0x10)),
            Err(Foreign::OtherSystem { seen: 8, now: 7 })
        ));
        let text = h.check(on(1), Lsn(0x4000000)).unwrap_err().to_string();
        assert!(text.contains("asynchronous failover"), "{text}");
    }
}
