//! The failover configuration checked by `status --standby` (issue 52, item 3;
//! docs/failover.md, "What status checks"), on a real Postgres 17 primary and
//! streaming standby of their own (`support::clusters::Pair`): set up right, nothing
//! is named; then each broken case is made on the servers themselves (a setting changed
//! and reloaded) and named with its fix: the standby's `hot_standby_feedback` and
//! `sync_replication_slots` off, its `primary_conninfo` without a database, the
//! primary's `synchronized_standby_slots` naming a slot that does not exist (what a
//! stale entry after a failover looks like), then empty.
#![allow(clippy::unwrap_used)]

use support::clusters::Pair;
use support::*;

/// Sets `name = value` on `cluster` and reloads.
fn set(cluster: &support::clusters::Cluster, name: &str, value: &str) {
    cluster.psql(&format!("ALTER SYSTEM SET {name} = '{value}'"));
    cluster.psql("SELECT pg_reload_conf()");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_each_broken_failover_setting() {
    let pair = Pair::new(17);
    let (p, s) = (&pair.primary, &pair.standby);
    let env = Env::with_port(p.port).await;
    let out = env.cli(&["slot", "create", "--failover"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let standby_url = format!("postgresql://postgres@127.0.0.1:{}/{}", s.port, env.db.name);
    let warnings = || {
        let out = env.cli(&["status", "--json", "--standby", &standby_url]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["warnings"].to_string()
    };
    let broken = [
        "hot_standby_feedback = off",
        "sync_replication_slots = off",
        "primary_conninfo names no dbname",
        "which is not a physical slot there",
        "synchronized_standby_slots is empty on the primary",
        "does not name: its copy",
    ];
    let w = warnings();
    for part in broken {
        assert!(!w.contains(part), "a correct pair draws no {part:?}: {w}");
    }

    set(s, "hot_standby_feedback", "off");
    set(s, "sync_replication_slots", "off");
    set(
        s,
        "primary_conninfo",
        &format!("host=127.0.0.1 port={} user=postgres", p.port),
    );
    set(
        p,
        "synchronized_standby_slots",
        "standby1, gone_after_failover",
    );
    let w = warnings();
    for part in [
        "hot_standby_feedback = off",
        "sync_replication_slots = off",
        "primary_conninfo names no dbname",
        r#"names \"gone_after_failover\", which is not a physical slot there"#,
    ] {
        assert!(w.contains(part), "{part} not named: {w}");
    }
    set(p, "synchronized_standby_slots", "");
    let w = warnings();
    assert!(
        w.contains("synchronized_standby_slots is empty on the primary"),
        "{w}"
    );
    env.cleanup().await;
}
