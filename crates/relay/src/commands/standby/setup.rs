//! The failover configuration around a failover slot (Postgres 17+, docs/failover.md),
//! as `status --standby` checks it: what each standby needs to keep a usable copy, and
//! what the primary's `synchronized_standby_slots` must name.
//!
//! ```text
//!   standby   sync_replication_slots = on      (else no copy is kept)
//!             hot_standby_feedback = on        (else the copy is invalidated: rows_removed)
//!             primary_conninfo with dbname     (the slot sync worker needs a database)
//!             primary_slot_name listed in the primary's synchronized_standby_slots
//!   primary   synchronized_standby_slots set   (else the relay may confirm WAL the
//!                                               standby lacks: a failover loses it)
//!             each name a physical slot there  (else logical decoding waits for it:
//!                                               the relay stalls)
//! ```

/// A standby's settings that its copy of a failover slot depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandbySetup {
    pub sync_replication_slots: bool,
    pub hot_standby_feedback: bool,
    /// Whether `primary_conninfo` names a database; `None` when this role may not
    /// read it (it can hold a password: superusers and pg_read_all_settings only).
    pub conninfo_has_dbname: Option<bool>,
    /// `primary_slot_name` ("" when unset).
    pub primary_slot_name: String,
}

/// The primary's side: `synchronized_standby_slots` and its physical slots.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrimarySync {
    pub synchronized: Vec<String>,
    pub physical: Vec<String>,
}

/// Reads a Postgres 17+ standby's settings; `None` when they cannot be read.
pub async fn read_standby(client: &tokio_postgres::Client) -> Option<StandbySetup> {
    let row = client
        .query_one(
            "SELECT pg_catalog.current_setting('sync_replication_slots') = 'on', \
                    pg_catalog.current_setting('hot_standby_feedback') = 'on', \
                    pg_catalog.current_setting('primary_slot_name')",
            &[],
        )
        .await
        .ok()?;
    let conninfo = client
        .query_one("SELECT pg_catalog.current_setting('primary_conninfo')", &[])
        .await
        .ok()
        .map(|r| r.get::<_, String>(0));
    Some(StandbySetup {
        sync_replication_slots: row.get(0),
        hot_standby_feedback: row.get(1),
        conninfo_has_dbname: conninfo.as_deref().map(names_dbname),
        primary_slot_name: row.get(2),
    })
}

/// Reads a Postgres 17+ primary's `synchronized_standby_slots` and physical slots;
/// `None` before 17 or when they cannot be read.
pub async fn read_primary(client: &tokio_postgres::Client) -> Option<PrimarySync> {
    let row = client
        .query_one(
            "SELECT pg_catalog.current_setting('synchronized_standby_slots', true), \
                    ARRAY(SELECT slot_name::text FROM pg_catalog.pg_replication_slots \
                           WHERE slot_type = 'physical' ORDER BY 1)",
            &[],
        )
        .await
        .ok()?;
    let listed: Option<String> = row.get(0);
    Some(PrimarySync {
        synchronized: listed?
            .split(',')
            .map(|s| s.trim().trim_matches('"').to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        physical: row.get(1),
    })
}

/// Whether a conninfo (key=value or URL) names a database.
fn names_dbname(conninfo: &str) -> bool {
    let c = conninfo.trim();
    if c.starts_with("postgres://") || c.starts_with("postgresql://") {
        let rest = c.split_once("://").map_or("", |(_, r)| r);
        let path = rest.split_once('/').map_or("", |(_, p)| p);
        let db = path.split(['?', '#']).next().unwrap_or("");
        return !db.is_empty() || c.contains("dbname=");
    }
    c.split_whitespace().any(|kv| {
        kv.strip_prefix("dbname=")
            .is_some_and(|v| !v.is_empty() && v != "''")
    })
}

/// The warnings about the failover configuration, each with its fix. `standbys`:
/// each standby's name and the settings read from it.
pub fn warnings(
    slot: &str,
    failover: bool,
    primary: Option<&PrimarySync>,
    standbys: &[(&str, &StandbySetup)],
) -> Vec<String> {
    let mut w = Vec::new();
    if let Some(p) = primary {
        for name in &p.synchronized {
            if !p.physical.contains(name) {
                w.push(format!(
                    "synchronized_standby_slots on the primary names {name:?}, which is not a physical slot there: logical decoding waits for it, so the relay stalls; remove it from synchronized_standby_slots (a stale entry after a failover) or create the standby's slot"
                ));
            }
        }
        if failover && !standbys.is_empty() && p.synchronized.is_empty() {
            w.push(format!(
                "synchronized_standby_slots is empty on the primary: the relay may confirm positions of slot {slot} that no standby received, and a failover then loses those events; set it to the standbys' physical slots (their primary_slot_name)"
            ));
        }
    }
    for (target, s) in standbys {
        if !s.sync_replication_slots {
            w.push(format!(
                "standby {target} has sync_replication_slots = off: it keeps no copy of slot {slot}; set it on"
            ));
        }
        if !s.hot_standby_feedback {
            w.push(format!(
                "standby {target} has hot_standby_feedback = off: the primary may vacuum rows its copy of slot {slot} needs, which invalidates the copy (rows_removed); set it on"
            ));
        }
        if s.conninfo_has_dbname == Some(false) {
            w.push(format!(
                "standby {target}'s primary_conninfo names no dbname: its slot sync worker cannot run; add dbname=<any database> to primary_conninfo"
            ));
        }
        let listed = primary.is_some_and(|p| p.synchronized.contains(&s.primary_slot_name));
        if failover && primary.is_some_and(|p| !p.synchronized.is_empty()) && !listed {
            w.push(format!(
                "standby {target} streams through physical slot {:?}, which the primary's synchronized_standby_slots does not name: its copy of slot {slot} may trail what the relay confirmed; add it",
                s.primary_slot_name
            ));
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> StandbySetup {
        StandbySetup {
            sync_replication_slots: true,
            hot_standby_feedback: true,
            conninfo_has_dbname: Some(true),
            primary_slot_name: "standby1".into(),
        }
    }

    fn primary(listed: &[&str], physical: &[&str]) -> PrimarySync {
        PrimarySync {
            synchronized: listed.iter().map(|s| s.to_string()).collect(),
            physical: physical.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn a_correct_setup_draws_nothing() {
        let p = primary(&["standby1"], &["standby1"]);
        assert!(warnings("s", true, Some(&p), &[("sb", &good())]).is_empty());
    }

    #[test]
    fn each_broken_case_is_named_with_its_fix() {
        let p = primary(&["gone"], &["standby1"]);
        let mut s = good();
        s.sync_replication_slots = false;
        s.hot_standby_feedback = false;
        s.conninfo_has_dbname = Some(false);
        let w = warnings("s", true, Some(&p), &[("sb", &s)]).join("\n");
        for part in [
            "names \"gone\", which is not a physical slot there",
            "sync_replication_slots = off",
            "hot_standby_feedback = off",
            "names no dbname",
            "does not name: its copy",
        ] {
            assert!(w.contains(part), "{part}: {w}");
        }
        let empty = primary(&[], &["standby1"]);
        let w = warnings("s", true, Some(&empty), &[("sb", &good())]).join("\n");
        assert!(w.contains("synchronized_standby_slots is empty"), "{w}");
        // Not a failover slot: the copy-related advice does not apply.
        assert!(warnings("s", false, Some(&empty), &[("sb", &good())]).is_empty());
    }

    #[test]
    fn conninfo_databases_are_found_in_both_forms() {
        assert!(names_dbname("host=p port=5432 user=r dbname=postgres"));
        assert!(!names_dbname("host=p port=5432 user=r"));
        assert!(names_dbname("postgresql://r@p:5432/app?sslmode=require"));
        assert!(!names_dbname("postgresql://r@p:5432"));
        assert!(names_dbname("postgresql://r@p:5432?dbname=app"));
    }
}
