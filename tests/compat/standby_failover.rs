//! Failover on a real standby, Postgres 17 and 18 (docs/failover.md,
//! docs/compatibility.md): a primary and a physical standby of the builds that
//! `scripts/pg-versions.sh` installs, a failover slot synchronised to the standby,
//! the primary crashed (`-m immediate`), the standby promoted, and the relay following
//! through a switchable TCP proxy (the stand-in for a DNS name or virtual IP). Every
//! row arrives in order; duplicates are bounded by how far the standby's copy of the
//! slot lagged: zero when it had caught up (`failover_postgres_NN`), at most the rows
//! published while it was frozen (`failover_postgres_NN_lagging_copy`).
//!
//! Each test creates its own pair of clusters (initdb, base backup with
//! `pg_backup_start`/`pg_backup_stop`) under `failover/` of the builds' folder and removes
//! them afterwards; it fails (never skips) when the builds are not installed.
//! size: one failover scenario: sync, freeze, crash, promote, switch, each on the last one's state
#![allow(clippy::unwrap_used)]

use support::scenarios;

use std::time::{Duration, Instant};

use scenarios::{lsn, poll, stderr, stop};
use support::clusters::{ok, Pair, Switch, SYNC_WAIT};
use support::*;

async fn failover(major: u32, lagging: bool) {
    let started = Instant::now();
    let pair = Pair::new(major);
    let (p, s) = (&pair.primary, &pair.standby);
    eprintln!(
        "postgres {major}: primary :{} and standby :{} up ({:.1} s)",
        p.port,
        s.port,
        started.elapsed().as_secs_f64()
    );
    let proxy = Switch::start(p.addr()).await;
    let mut env = Env::with_port(p.port).await;
    let url = format!(
        "postgresql://postgres@127.0.0.1:{}/{}",
        proxy.port, env.db.name
    );
    let config = env.config_file("failover.toml", &url, &testkit::amqp_url(), "");
    let out = env.cli_with(&config, "info", &["slot", "create", "--failover"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_with(&config, "info", &[]);

    env.insert_seq(1, 1000, 50);
    let target = lsn(&p.psql("SELECT pg_current_wal_lsn()"));
    got.wait_for(1000, scenarios::WAIT).await;
    poll("the primary's slot to pass the last commit", || {
        p.slot(&env.slot).is_some_and(|(_, _, at)| at >= target)
    })
    .await;
    // The standby's copy: synced, no longer temporary (sync-ready), caught up.
    let sync_started = Instant::now();
    loop {
        let copy = s.slot(&env.slot);
        if copy.is_some_and(|(synced, temporary, at)| synced && !temporary && at >= target) {
            break;
        }
        assert!(
            sync_started.elapsed() < SYNC_WAIT,
            "the standby's copy of the slot is not sync-ready after {SYNC_WAIT:?}: {copy:?}"
        );
        // A running-transactions record lets the copy reach a consistent point sooner.
        p.psql("SELECT pg_log_standby_snapshot()");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "postgres {major}: standby's copy sync-ready and caught up after {:.1} s",
        sync_started.elapsed().as_secs_f64()
    );
    // `status --standby` sees the same: sync-ready, no warning about the standby.
    let standby_url = format!("postgresql://postgres@127.0.0.1:{}/{}", s.port, env.db.name);
    let standby_status = |env: &Env| {
        let out = env.cli_with(
            &config,
            "info",
            &["status", "--json", "--standby", &standby_url],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v
    };
    let v = standby_status(&env);
    assert_eq!(v["standbys"][0]["sync_ready"], true, "{v}");
    assert!(
        !v["warnings"].to_string().contains("standby"),
        "no warning about a sync-ready standby: {v}"
    );
    // A server without failover slots (the Postgres 16 cluster of pg-versions.sh)
    // named as a standby is reported and warned about, in the same call.
    let pg16 = std::env::var("OUTBOX_TEST_PG16_PORT").unwrap_or_else(|_| "55516".into());
    let old_url = format!("postgresql://postgres@127.0.0.1:{pg16}/postgres");
    let out = env.cli_with(
        &config,
        "info",
        &[
            "status",
            "--json",
            "--standby",
            &standby_url,
            "--standby",
            &old_url,
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["standbys"][0]["sync_ready"], true, "{v}");
    assert_eq!(v["standbys"][1]["sync_ready"], false, "{v}");
    assert!(
        v["warnings"].to_string().contains("runs Postgres 16"),
        "a standby without failover slots is warned about: {v}"
    );
    // With `lagging`, the copy is frozen (slot sync stopped on the standby) while
    // 500 more rows are published and confirmed on the primary.
    let mut published = 1000;
    if lagging {
        s.psql("ALTER SYSTEM SET sync_replication_slots = off");
        s.psql("SELECT pg_reload_conf()");
        poll("the standby's slot sync worker to stop", || {
            s.psql("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'slotsync worker'")
                == "0"
        })
        .await;
        env.insert_seq(1001, 500, 50);
        published = 1500;
        let target = lsn(&p.psql("SELECT pg_current_wal_lsn()"));
        got.wait_for(published, scenarios::WAIT).await;
        poll("the primary's slot to pass the last commit", || {
            p.slot(&env.slot).is_some_and(|(_, _, at)| at >= target)
        })
        .await;
    }
    let (_, _, copy_at) = s.slot(&env.slot).unwrap();
    let (_, _, primary_at) = p.slot(&env.slot).unwrap();
    if lagging {
        // `status --standby` shows how far the frozen copy trails.
        let v = standby_status(&env);
        let behind = v["standbys"][0]["behind_bytes"].as_u64().unwrap_or(0);
        assert!(behind > 0, "the frozen copy is shown behind: {v}");
    }

    // Crash the primary, promote the standby, move the "name" to it.
    ok(
        p.pg_ctl(&["stop", "-m", "immediate", "-w"]),
        "crash the primary",
    );
    ok(
        s.pg_ctl(&["promote", "-w", "-t", "60"]),
        "promote the standby",
    );
    let copy_lag = primary_at.saturating_sub(copy_at);
    if lagging {
        let (_, _, promoted_at) = s.slot(&env.slot).unwrap();
        assert_eq!(promoted_at, copy_at, "the frozen copy did not move");
        assert!(copy_lag > 0, "the copy lags the primary's slot");
    }
    proxy.switch(s.addr());
    env.db.port = s.port;
    env.insert_seq(published + 1, 1000, 50);
    let total = published + 1000;
    let dups = check_sequence(&scenarios::distinct(&got, total).await, total);
    eprintln!(
        "postgres {major}: copy {copy_lag} bytes behind at the crash; after the failover {total} rows, {dups} duplicates ({:.1} s in all)",
        started.elapsed().as_secs_f64()
    );
    // Only what the copy had not caught up with may come again (and the position the
    // relay stored in Postgres, replicated to the standby, may spare even that).
    let bound = published - 1000;
    assert!(
        dups <= bound,
        "{dups} duplicates after a failover; the copy lagged by {bound} rows"
    );
    let log = relay.log_text();
    stop(relay);
    assert!(
        s.slot(&env.slot).is_some_and(|(_, _, at)| at > copy_at),
        "the relay streams from the promoted standby's slot: {log}"
    );
    env.cleanup().await;
    drop(proxy);
    drop(pair);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_17() {
    failover(17, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_18() {
    failover(18, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_17_lagging_copy() {
    failover(17, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_18_lagging_copy() {
    failover(18, true).await;
}
