//! The slot's bad days seen before and after the loss (issue 52, item 2;
//! docs/operations.md, "Slot safety"), on fresh clusters of Postgres 17 and 18 of
//! their own (settings that invalidate slots would endanger every other test's):
//!
//! - `max_slot_wal_keep_size = 1MB`, the slot left behind by 48 MB of WAL and a
//!   checkpoint: `status` stops on it naming Postgres's reason (`wal_removed`), and
//!   `check` names the bound as under an hour of WAL;
//! - Postgres 18's `idle_replication_slot_timeout = 1d`: `status` gives the time left
//!   before an idle slot is invalidated, and `check` warns about the timeout.

use support::clusters::Fresh;
use support::*;

fn status_json(env: &Env) -> serde_json::Value {
    let out = env.cli(&["status", "--json"]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", output_text(&out)))
}

/// Sets `name` on the cluster and reloads.
fn set(cluster: &support::clusters::Cluster, name: &str, value: &str) {
    cluster.psql(&format!("ALTER SYSTEM SET {name} = '{value}'"));
    cluster.psql("SELECT pg_reload_conf()");
}

async fn a_slot_left_behind_is_lost_with_its_reason(major: u32) {
    let fresh = Fresh::new(major);
    let c = &fresh.cluster;
    let env = Env::with_port(c.port).await;
    env.create_slot();
    set(c, "max_slot_wal_keep_size", "1MB");
    // 48 MB of WAL in three segments' worth of switches, then a checkpoint that
    // removes what the slot still needs.
    c.psql("CREATE TABLE filler (x bigint, pad text)");
    for _ in 0..3 {
        c.psql("INSERT INTO filler SELECT g, repeat('p', 100) FROM generate_series(1, 100000) g");
        c.psql("SELECT pg_switch_wal()");
    }
    c.psql("CHECKPOINT");
    // Every command that needs the slot stops on it, naming Postgres's reason.
    let out = env.cli(&["status"]);
    let t = output_text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(
            "(wal_status 'lost', wal_removed: it kept more WAL than max_slot_wal_keep_size allows)"
        ),
        "{t}"
    );
    // The bound, weighed against the WAL this server wrote since its statistics began.
    let out = env.cli(&["check"]);
    let t = output_text(&out);
    let keep = t
        .lines()
        .find(|l| l.contains("max_slot_wal_keep_size: "))
        .unwrap_or_else(|| panic!("{t}"));
    assert!(
        keep.starts_with("warn  max_slot_wal_keep_size: 1.0 MB holds only"),
        "{t}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_17_names_why_a_slot_was_lost() {
    a_slot_left_behind_is_lost_with_its_reason(17).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_18_names_why_a_slot_was_lost() {
    a_slot_left_behind_is_lost_with_its_reason(18).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_18_gives_the_time_left_before_an_idle_slot_is_dropped() {
    let fresh = Fresh::new(18);
    let c = &fresh.cluster;
    let env = Env::with_port(c.port).await;
    env.create_slot();
    let v = status_json(&env);
    assert!(
        v["idle_timeout_left_secs"].is_null(),
        "the timeout is off by default: {v}"
    );
    set(c, "idle_replication_slot_timeout", "1d");
    let v = status_json(&env);
    let left = v["idle_timeout_left_secs"]
        .as_i64()
        .unwrap_or_else(|| panic!("{v}"));
    assert!((86_000..=86_400).contains(&left), "{v}");
    let t = output_text(&env.cli(&["status"]));
    assert!(
        t.contains("is invalidated by idle_replication_slot_timeout in 2"),
        "{t}"
    );
    assert!(t.contains("idle_timeout_left:   2"), "{t}");
    let t = output_text(&env.cli(&["check"]));
    assert!(
        t.contains("warn  idle_replication_slot_timeout: 1 d: Postgres invalidates"),
        "{t}"
    );
    env.cleanup().await;
}
