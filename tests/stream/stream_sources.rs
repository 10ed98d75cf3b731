//! The stream target in the deployments operators run (docs/streams.md, "Several
//! sources, one stream"; docs/failover.md, "Asynchronous failover and restores"):
//! clusters of the tests' own (`support::clusters`, Postgres 17 from
//! `scripts/pg-versions.sh`), all on the default slot name `outbox_relay`, publishing
//! into one stream.
//!
//! - two clusters fanning into one stream, the second started after the first has
//!   published, both running: every row of both, exactly once, in each one's commit
//!   order;
//! - a new cluster (a restore to another cluster, a dump/restore) with the same slot
//!   name publishing into a stream an old one filled: nothing skipped;
//! - an asynchronous failover: the standby's timeline diverges below the position
//!   the relay acked, and the new primary's WAL passes that position before the
//!   relay reconnects: nothing committed on the new timeline is skipped, by either
//!   target.
//!
//! A relay that identifies its producer by the slot name alone, or that applies a
//! position from another WAL history, loses rows in each of them (each was seen
//! failing so).
//!
//! And the upgrade from a version that published under `outbox-relay:<slot>` with
//! ids 1, 2, 3, … (docs/streams.md, "Upgrading from a relay that named its producer
//! `outbox-relay:<slot>`"): what that relay left — its messages in the stream, the
//! slot and a state table without the history columns — is built as it left it after
//! a clean stop and after a crash, and the new relay starts on it.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use support::clusters::{ok, Fresh, Pair, Switch, SYNC_WAIT};
use support::scenarios::{distinct, lsn, poll};
use support::stream::{assert_tag_exactly_once, delete_stream, read_stream, stream_url, tagged};
use support::*;

const WAIT: Duration = Duration::from_secs(120);
const QUIET: Duration = Duration::from_secs(2);
/// The default slot name (`[postgres] slot`).
const DEFAULT_SLOT: &str = "outbox_relay";

fn stream_env(stream: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.to_string()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
    ]
}

/// WAL written on `cluster` outside any outbox (a busier cluster's WAL positions).
fn filler(cluster: &support::clusters::Cluster, megabytes: usize) {
    cluster.psql(&format!(
        "CREATE TABLE IF NOT EXISTS filler (x text); \
         INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, {})",
        megabytes * 1000
    ));
}

/// An environment on `cluster` with the default slot name, its slot created.
async fn source(cluster: &support::clusters::Cluster) -> Env {
    let mut env = Env::with_port(cluster.port).await;
    env.slot = DEFAULT_SLOT.to_string();
    env.create_slot();
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clusters_on_the_default_slot_fan_into_one_stream() {
    let a = Fresh::new(17);
    let b = Fresh::new(17);
    // A is the busier cluster: its positions lie above all of B's.
    filler(&a.cluster, 20);
    let env_a = source(&a.cluster).await;
    let env_b = source(&b.cluster).await;
    let stream = testkit::unique_name("fanin");
    let vars = stream_env(&stream);
    let vars = as_refs(&vars);
    let relay_a = env_a.start_env(&[], &vars);
    env_a.insert_tagged("A", 1, 3000);
    read_stream(&stream, 3000, Duration::ZERO, WAIT).await;
    // B starts after A has published, and both go on.
    let relay_b = env_b.start_env(&[], &vars);
    env_b.insert_tagged("B", 1, 3000);
    env_a.insert_tagged("A", 3001, 2000);
    env_b.insert_tagged("B", 3001, 3000);
    let msgs = read_stream(&stream, 11_000, QUIET, WAIT).await;
    let (code_a, log_a) = relay_a.terminate();
    let (code_b, log_b) = relay_b.terminate();
    assert_eq!(code_a, Some(0), "{log_a}");
    assert_eq!(code_b, Some(0), "{log_b}");
    assert_tag_exactly_once(&msgs, "A", 1, 5000);
    assert_tag_exactly_once(&msgs, "B", 1, 6000);
    // Each source under producers of its own.
    let producers = |tag: &str| -> std::collections::BTreeSet<String> {
        msgs.iter()
            .filter(|m| m.prop("aggregate_type") == Some(tag))
            .filter_map(|m| m.prop("x-outbox-producer").map(str::to_string))
            .collect()
    };
    let (pa, pb) = (producers("A"), producers("B"));
    assert_eq!((pa.len(), pb.len()), (1, 1), "{pa:?} {pb:?}");
    assert_ne!(pa, pb);
    delete_stream(&stream).await;
    env_a.cleanup().await;
    env_b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cluster_with_the_same_slot_name_skips_nothing_of_an_old_stream() {
    let stream = testkit::unique_name("restore");
    let vars = stream_env(&stream);
    let vars = as_refs(&vars);
    {
        let old = Fresh::new(17);
        filler(&old.cluster, 20);
        let env = source(&old.cluster).await;
        let relay = env.start_env(&[], &vars);
        env.insert_tagged("old", 1, 2000);
        read_stream(&stream, 2000, Duration::ZERO, WAIT).await;
        let (code, log) = relay.terminate();
        assert_eq!(code, Some(0), "{log}");
        env.cleanup().await;
    }
    // The old cluster is gone; a new one, same database layout and slot name.
    let new = Fresh::new(17);
    let env = source(&new.cluster).await;
    let relay = env.start_env(&[], &vars);
    env.insert_tagged("new", 1, 2000);
    let msgs = read_stream(&stream, 4000, QUIET, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert_tag_exactly_once(&msgs, "old", 1, 2000);
    assert_tag_exactly_once(&msgs, "new", 1, 2000);
    delete_stream(&stream).await;
    env.cleanup().await;
}

/// The standby's copy of `slot` is synced, sync-ready and at or past `target`.
async fn copy_caught_up(pair: &Pair, slot: &str, target: u64) {
    let (p, s) = (&pair.primary, &pair.standby);
    let started = Instant::now();
    loop {
        let copy = s.slot(slot);
        if copy.is_some_and(|(synced, temporary, at)| synced && !temporary && at >= target) {
            return;
        }
        assert!(
            started.elapsed() < SYNC_WAIT,
            "the standby's copy of {slot} is not sync-ready after {SYNC_WAIT:?}: {copy:?}"
        );
        p.psql("SELECT pg_log_standby_snapshot()");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// An asynchronous failover (no `synchronized_standby_slots`): rows 1-1000 reach
/// the standby; it is cut off; rows 1001-1500 are published and acked on the old
/// primary only; the primary crashes, the standby is promoted (timeline 2 diverging
/// below what the relays acked), and rows 2001-2800 are committed there, with
/// enough other WAL that the new primary's WAL passes the old acked position before
/// the relays reconnect. Both targets must publish every new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_failover_skips_nothing_of_the_new_timeline() {
    let pair = Pair::with(17, false);
    let (p, s) = (&pair.primary, &pair.standby);
    let proxy = Switch::start(p.addr()).await;
    let mut env = Env::with_port(p.port).await;
    let url = format!(
        "postgresql://postgres@127.0.0.1:{}/{}",
        proxy.port, env.db.name
    );
    let queue_slot = testkit::unique_name("slot");
    let stream_slot = testkit::unique_name("slot");
    env.slot = queue_slot.clone();
    let queue_config = env.config_file("queue.toml", &url, &testkit::amqp_url(), "");
    env.slot = stream_slot.clone();
    let stream_config = env.config_file("stream.toml", &url, &testkit::amqp_url(), "");
    let stream = testkit::unique_name("failover");
    let vars = stream_env(&stream);
    let vars = as_refs(&vars);
    for config in [&queue_config, &stream_config] {
        let out = env.cli_with(config, "info", &["slot", "create", "--failover"]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let got = env.consumer().await;
    let queue_relay = env.start_with(&queue_config, "info", &[]);
    let stream_relay = env.start_with_env(&stream_config, "info", &vars);
    env.insert_tagged("seq", 1, 1000);
    got.wait_for(1000, WAIT).await;
    read_stream(&stream, 1000, Duration::ZERO, WAIT).await;
    let target = p.wal();
    for slot in [&queue_slot, &stream_slot] {
        poll("the primary's slot to pass the rows", || {
            p.slot(slot).is_some_and(|(_, _, at)| at >= target)
        })
        .await;
        copy_caught_up(&pair, slot, target).await;
    }
    // Cut the standby off, then publish and ack rows it never receives.
    s.psql("ALTER SYSTEM SET primary_conninfo = ''");
    s.psql("SELECT pg_reload_conf()");
    poll("the standby's WAL receiver to stop", || {
        s.psql("SELECT count(*) FROM pg_stat_wal_receiver") == "0"
    })
    .await;
    let diverged_at = lsn(&s.psql("SELECT pg_last_wal_receive_lsn()"));
    env.insert_tagged("seq", 1001, 500);
    got.wait_for(1500, WAIT).await;
    read_stream(&stream, 1500, Duration::ZERO, WAIT).await;
    let acked = p.wal();
    for slot in [&queue_slot, &stream_slot] {
        poll(
            "the primary's slot to ack the rows the standby lacks",
            || p.slot(slot).is_some_and(|(_, _, at)| at >= acked),
        )
        .await;
    }
    assert!(diverged_at < acked);
    // The failover.
    ok(
        p.pg_ctl(&["stop", "-m", "immediate", "-w"]),
        "crash the primary",
    );
    ok(
        s.pg_ctl(&["promote", "-w", "-t", "60"]),
        "promote the standby",
    );
    env.db.port = s.port;
    env.insert_tagged("new", 2001, 800);
    while s.wal() <= acked + 4096 {
        filler(s, 1);
    }
    proxy.switch(s.addr());
    let queued = distinct(&got, 1500 + 800).await;
    let msgs = read_stream(&stream, 2300, QUIET, WAIT).await;
    let queue_log = queue_relay.log_text();
    let (code, stream_log) = stream_relay.terminate();
    assert_eq!(code, Some(0), "{stream_log}");
    drop(queue_relay);
    let new_in_queue: Vec<u64> = queued
        .iter()
        .filter(|m| m.header("aggregate_type").as_deref() == Some("new"))
        .filter_map(|m| m.header("aggregate_id")?.parse().ok())
        .collect();
    let missing: Vec<u64> = (2001..2801).filter(|i| !new_in_queue.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} rows of the new timeline never reached the queue: {:?}…\n{queue_log}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert_tag_exactly_once(&msgs, "new", 2001, 800);
    assert_tag_exactly_once(&msgs, "seq", 1, 1500);
    assert!(tagged(&msgs, "new").len() == 800);
    assert!(
        queue_log.contains("is not used") && queue_log.contains("asynchronous failover"),
        "the refused carried position is logged: {queue_log}"
    );
    delete_stream(&stream).await;
    env.cleanup().await;
    drop(proxy);
    drop(pair);
}

/// The state table as versions before the history columns created it.
const OLD_STATE_TABLE: &str = "DROP TABLE public.outbox_relay_state;
 CREATE TABLE public.outbox_relay_state (
    slot_name        text        PRIMARY KEY,
    acked_lsn        pg_lsn      NOT NULL,
    slot_restart_lsn pg_lsn,
    slot_created_at  timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now())";

/// An earlier relay published rows 1..=600 of `up` under `outbox-relay:<slot>` and
/// confirmed the slot (and stored the position) after row `confirmed`; then the new
/// relay starts and rows 601..=900 follow. Returns the rows of `up` in stream order.
async fn upgrade_after(confirmed: usize) -> Vec<u64> {
    let env = Env::new().await;
    env.create_slot();
    env.db.psql(OLD_STATE_TABLE);
    let stream = testkit::stream::TestStream::create("upgrade").await;
    env.insert_tagged("up", 1, confirmed);
    let acked = env
        .db
        .psql("SELECT pg_current_wal_lsn()::text")
        .trim()
        .to_string();
    env.insert_tagged("up", confirmed + 1, 600 - confirmed);
    let old_reference = format!("outbox-relay:{}", env.slot);
    let old: Vec<testkit::stream::OutMessage> = (1..=600u64)
        .map(|i| {
            testkit::stream::OutMessage::builder()
                .body(format!("{{\"seq\": {i}}}").into_bytes())
                .application_properties()
                .insert("aggregate_type", "up")
                .insert("aggregate_id", i.to_string())
                .insert("x-outbox-producer", old_reference.clone())
                .message_builder()
                .publising_id(i)
                .build()
        })
        .collect();
    testkit::stream::publish_as(&stream.name, Some(&old_reference), old).await;
    env.db.psql(&format!(
        "SELECT pg_replication_slot_advance('{slot}', '{acked}'); \
         INSERT INTO public.outbox_relay_state (slot_name, acked_lsn) VALUES ('{slot}', '{acked}')",
        slot = env.slot
    ));
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.name.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", stream_url()),
    ];
    let relay = env.start_env(&[], &as_refs(&vars));
    env.insert_tagged("up", 601, 300);
    let expected = 600 + (600 - confirmed) + 300;
    let msgs = read_stream(&stream.name, expected, QUIET, WAIT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    // The new relay added the history columns and filled them.
    let origin = env.db.psql(&format!(
        "SELECT system_identifier IS NOT NULL AND timeline IS NOT NULL \
           FROM public.outbox_relay_state WHERE slot_name = '{}'",
        env.slot
    ));
    assert_eq!(
        origin.trim(),
        "t",
        "the stored position has no origin after the upgrade"
    );
    stream.delete().await;
    env.cleanup().await;
    tagged(&msgs, "up")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_after_a_clean_stop_sends_nothing_twice() {
    let rows = upgrade_after(600).await;
    assert_eq!(rows, (1..=900).collect::<Vec<u64>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_after_a_crash_sends_the_unconfirmed_rows_again() {
    let rows = upgrade_after(400).await;
    // The old relay's 600, then the 200 it had not confirmed, again, and the rest.
    let want: Vec<u64> = (1..=600).chain(401..=900).collect();
    assert_eq!(rows, want);
}
