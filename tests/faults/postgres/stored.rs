//! The stored acked position (docs/design.md §3): backlogs through restarts, crashes
//! and killed walsenders, the skip rule, a position of another slot or cluster, a
//! cut inside a transaction; and the same on every supported Postgres.

use super::*;

/// What breaks Postgres while a backlog drains.
#[derive(Clone, Copy, Debug)]
enum PgFault {
    /// `pg_ctlcluster … restart -m fast`.
    Fast,
    /// `pg_ctlcluster … restart -m immediate` (a crash).
    Crash,
    /// `pg_terminate_backend` of the walsender.
    KillWalsender,
}

async fn inflict(w: &World, cluster: Cluster, fault: PgFault) {
    match fault {
        PgFault::Fast => cluster.restart("fast").await,
        PgFault::Crash => cluster.restart("immediate").await,
        PgFault::KillWalsender => {
            let killed = w
                .sql(&format!(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                      WHERE slot_name = '{}' AND active_pid IS NOT NULL",
                    w.env.slot
                ))
                .await;
            assert_eq!(killed, "t", "the walsender was running");
        }
    }
}

const BACKLOG: u64 = 20_000;

/// 20,000 rows committed before the relay starts, from two connections at once (so
/// transactions interleave in the WAL), in transactions of 100.
async fn preload(w: &World) {
    let a = w.load(1, BACKLOG / 2, 100, Duration::ZERO);
    let b = w.load(BACKLOG / 2 + 1, BACKLOG / 2, 100, Duration::ZERO);
    a.await.unwrap();
    b.await.unwrap();
}

/// The Postgres fault at about a third of a 20,000-row backlog, with no CHECKPOINT
/// since the slot was created (Postgres 15 brings the slot back to its creation):
/// nothing is published again, nothing is missing, order is kept.
async fn backlog_fault(fault: PgFault) {
    let _pg = FAULT_PG.lock().await;
    backlog_fault_on(Cluster::Fault, fault).await;
}

async fn backlog_fault_on(cluster: Cluster, fault: PgFault) {
    backlog_fault_with(cluster, fault, 500).await;
}

async fn backlog_fault_with(cluster: Cluster, fault: PgFault, max_in_flight: usize) {
    let _broker = BROKER.read().await;
    let w = World::new(cluster, Proxies::default(), max_in_flight).await;
    preload(&w).await;
    let mut relay = start_with_args(&w, &[]);
    w.wait_distinct(BACKLOG as usize / 3, WAIT).await;
    let at_fault = w.consumer.distinct();
    inflict(&w, cluster, fault).await;
    w.insert_retrying(BACKLOG + 1, 500, 50).await;
    wait_all_running(&w, &mut relay).await;
    let report = w.verify(usize::MAX).await;
    eprintln!(
        "{fault:?} during a {BACKLOG}-row backlog: {} duplicates ({at_fault} received before the fault, {} distinct)",
        report.duplicates, report.distinct
    );
    // Nothing is published again: acked transactions are below the carried and
    // stored position, and the transaction cut mid-stream (100 rows, within the
    // reader's hold of max_in_flight events) was never handed on without its commit.
    assert_eq!(report.duplicates, 0, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains(" ERROR "), "{log}");
    w.cleanup().await;
}

/// docs/design.md §1.5: a fast restart while a backlog drains re-sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fast_restart_during_a_backlog_resends_nothing() {
    backlog_fault(PgFault::Fast).await;
}

/// docs/design.md §1.5: a crash (`-m immediate`) while a backlog drains re-sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_during_a_backlog_resends_nothing() {
    backlog_fault(PgFault::Crash).await;
}

/// docs/design.md §1.5: the walsender killed while a backlog drains re-sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn walsender_killed_during_a_backlog_resends_nothing() {
    backlog_fault(PgFault::KillWalsender).await;
}

/// The walsender killed while the publisher's window is full of acked events whose
/// position was not yet sent to Postgres (100-row transactions, a window of 50): the
/// reader is gone and will never send it, so the publisher must drain what it holds
/// bounded by the stored position, and the session reconnect. It once waited for that
/// flush for ever: nothing but the stall watchdog's ERROR every minute (CI, PG 14).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn walsender_killed_with_a_full_window_stalls_nothing() {
    let _pg = FAULT_PG.lock().await;
    backlog_fault_with(Cluster::Fault, PgFault::KillWalsender, 50).await;
}

/// The relay SIGKILLed and Postgres crashed together while a backlog drains: the new
/// relay process knows nothing; the stored position keeps the duplicates within
/// `max_in_flight` (the slot alone would send everything since its creation again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_killed_and_postgres_crashed_together() {
    let _pg = FAULT_PG.lock().await;
    relay_killed_and_postgres_crashed_on(Cluster::Fault).await;
}

async fn relay_killed_and_postgres_crashed_on(cluster: Cluster) {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(cluster, Proxies::default(), MAX_IN_FLIGHT).await;
    preload(&w).await;
    let relay = start_with_args(&w, &[]);
    w.wait_distinct(BACKLOG as usize / 3, WAIT).await;
    relay.kill();
    let at_fault = w.consumer.distinct();
    cluster.restart("immediate").await;
    let mut relay = start_with_args(&w, &[]);
    w.insert_retrying(BACKLOG + 1, 500, 50).await;
    wait_all_running(&w, &mut relay).await;
    let report = w.verify(usize::MAX).await;
    eprintln!(
        "relay SIGKILL + Postgres crash during a {BACKLOG}-row backlog: {} duplicates ({at_fault} received before, max_in_flight {MAX_IN_FLIGHT})",
        report.duplicates
    );
    assert!(report.duplicates <= MAX_IN_FLIGHT, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// `xid % 2^32` of the transaction that runs `sql` (one psql call: one transaction).
async fn insert_returning_xid(w: &World, from: u64, to: u64) -> String {
    w.sql(&format!(
        "{}; SELECT txid_current() % 4294967296",
        insert_sql(from, to)
    ))
    .await
    .lines()
    .last()
    .unwrap()
    .to_string()
}

/// The rule the stored position relies on (docs/design.md §3): streaming from P
/// skips exactly the transactions whose commit record starts before P. With P the
/// end of transaction B's commit: B and the one before it are not sent; T, which
/// began before B and committed after it, is sent whole (its rows written before P
/// too); so is everything after. `status` shows P beside the slot's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stored_position_at_a_commit_end_skips_exactly_what_ended_there() {
    skip_rule_on(Cluster::Test).await;
}

async fn skip_rule_on(cluster: Cluster) {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(cluster, Proxies::default(), MAX_IN_FLIGHT).await;
    // C (1..50) commits first.
    insert_returning_xid(&w, 1, 50).await;
    // T (101..200) starts, writes half, waits, writes the rest and commits after B.
    let (port, name) = (w.env.db.port, w.env.db.name.clone());
    let t = tokio::task::spawn_blocking(move || {
        testkit::psql_at(
            port,
            &name,
            &format!(
                "BEGIN; {}; SELECT pg_sleep(2); {}; COMMIT;",
                insert_sql(101, 150),
                insert_sql(151, 200)
            ),
        )
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    // B (51..100) commits while T is open.
    let b_xid = insert_returning_xid(&w, 51, 100).await;
    t.await.unwrap();
    // D (201..250) after.
    insert_returning_xid(&w, 201, 250).await;

    // B's commit end LSN, from its pgoutput Commit message ('C', flags, commit LSN,
    // end LSN, time), peeked without consuming.
    let end_hex = w
        .sql(&format!(
            "SELECT encode(substr(data, 11, 8), 'hex') \
               FROM pg_logical_slot_peek_binary_changes('{}', NULL, NULL, \
                    'proto_version', '1', 'publication_names', '{}') \
              WHERE get_byte(data, 0) = 67 AND xid::text = '{b_xid}'",
            w.env.slot, w.env.publication
        ))
        .await;
    let end = u64::from_str_radix(end_hex.trim(), 16).expect("B's commit end");
    let end_lsn = format!("{:X}/{:X}", end >> 32, end & 0xFFFF_FFFF);
    w.sql(&format!(
        "UPDATE outbox_relay_state SET acked_lsn = '{end_lsn}' WHERE slot_name = '{}'",
        w.env.slot
    ))
    .await;

    let cli = |args: &[&str]| {
        Command::new(bin())
            .arg("--config")
            .arg(w.config())
            .args(args)
            .output()
            .unwrap()
    };
    let status = cli(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["stored_position"]["acked_lsn"], end_lsn.as_str(), "{v}");
    assert_eq!(v["stored_position"]["used"], true, "{v}");
    assert_eq!(v["resumes_at_lsn"], end_lsn.as_str(), "{v}");
    let text = String::from_utf8_lossy(&cli(&["status"]).stdout).into_owned();
    assert!(
        text.contains(&format!("stored_acked_lsn:    {end_lsn}")),
        "{text}"
    );

    let relay = start_with_args(&w, &[]);
    w.wait_distinct(150, WAIT).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seqs: Vec<i64> = w
        .consumer
        .snapshot()
        .iter()
        .filter(|r| r.marker.is_none())
        .map(|r| r.seq)
        .collect();
    let expected: Vec<i64> = (101..=250).collect();
    assert_eq!(seqs, expected, "exactly T then D, once each, in order");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("resuming from the stored acked position"),
        "{log}"
    );
    // The clean stop stored the final watermark: at least D's end.
    let stored = parse_lsn(
        &w.sql(&format!(
            "SELECT acked_lsn FROM outbox_relay_state WHERE slot_name = '{}'",
            w.env.slot
        ))
        .await,
    )
    .unwrap();
    assert!(stored > end, "stored {stored:X} after the stop");
    w.cleanup().await;
}

/// A stored position that cannot be this slot's is ignored with a warning: one
/// past the server's WAL (a restored backup, another cluster), and one whose slot
/// identity is newer than the slot (the slot was dropped and re-created). Everything
/// is delivered from the slot's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stored_position_of_another_slot_or_cluster_is_ignored() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    for (set, warning) in [
        ("acked_lsn = 'FF/0'", "ahead of this server's WAL"),
        (
            "acked_lsn = pg_current_wal_lsn(), slot_restart_lsn = 'FF/0'",
            "dropped and re-created",
        ),
    ] {
        let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
        w.insert(1, 300, 30).await;
        w.sql(&format!(
            "UPDATE outbox_relay_state SET {set} WHERE slot_name = '{}'",
            w.env.slot
        ))
        .await;
        let mut relay = start_with_args(&w, &[]);
        wait_all_running(&w, &mut relay).await;
        let report = w.verify(0).await;
        assert_eq!(report.distinct, 300);
        let (code, log) = relay.terminate();
        assert_eq!(code, Some(0), "{log}");
        assert!(log.contains(warning), "{log}");
        w.cleanup().await;
    }
}

/// The replication connection cut at an exact byte in the middle of a 400-row
/// transaction (about 6.4 MB of pgoutput data; the proxy forwards 3 MB of it, then
/// closes): the reader held the transaction back waiting for its Commit (400 events
/// ≤ the hold of `max_in_flight`), so nothing of it was published, and the next
/// session sends it whole: 0 duplicates, nothing missing, order kept
/// (docs/design.md §3). Without the hold this test sees about 190 duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_cut_inside_a_transaction_publishes_it_once() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 1000;
    let proxies = Proxies {
        postgres: true,
        amqp: false,
    };
    let w = World::new(Cluster::Test, proxies, MAX_IN_FLIGHT).await;
    let mut relay = w.start();
    w.insert(1, 10, 10).await;
    w.wait_distinct(10, WAIT).await;
    let proxy = w.pg_proxy.as_ref().unwrap();
    proxy.cut_after(3 << 20);
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n, 'pad', repeat('x', 16000))
           FROM generate_series(11, 410) AS s(n) ORDER BY s.n",
    )
    .await;
    let deadline = Instant::now() + WAIT;
    while !proxy.is_cut() {
        assert!(Instant::now() < deadline, "the cut was never reached");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before_reconnect = w.consumer.total();
    proxy.restore();
    w.insert(411, 40, 10).await;
    wait_all_running(&w, &mut relay).await;
    let report = w.verify(usize::MAX).await;
    eprintln!(
        "cut inside a 400-row transaction: {} duplicates ({before_reconnect} received before the reconnect)",
        report.duplicates
    );
    assert_eq!(report.distinct, 450, "{report:?}");
    assert_eq!(report.duplicates, 0, "{report:?}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("reconnecting"),
        "the cut ended a session: {log}"
    );
    w.cleanup().await;
}

// ---------------------------------------------------------------------------------
// The stored position on every supported Postgres (docs/compatibility.md)

/// One version test at a time: each runs four 20,000-row backlogs with restarts and
/// crashes of its own cluster; side by side they would starve the rest of the suite.
static VERSIONS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// On the cluster of `major`: a fast restart and a crash while a 20,000-row backlog
/// drains (0 duplicates each), the relay SIGKILLed together with a crash (at most
/// `max_in_flight`), and the skip rule at a commit end. What a version changes is
/// what a restart or a crash does to the slot; a killed walsender is the same on
/// every version and is tested on the fault cluster (above), which keeps this
/// serial chain of five clusters within CI's time.
async fn stored_position_on(major: u32) {
    let _one = VERSIONS.lock().await;
    let cluster = Cluster::Version(major);
    for fault in [PgFault::Fast, PgFault::Crash] {
        eprintln!("postgres {major}: {fault:?} during a backlog");
        backlog_fault_on(cluster, fault).await;
    }
    eprintln!("postgres {major}: relay SIGKILL + crash");
    relay_killed_and_postgres_crashed_on(cluster).await;
    eprintln!("postgres {major}: the skip rule at a commit end");
    skip_rule_on(cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_14_restarts_resend_nothing() {
    stored_position_on(14).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_15_restarts_resend_nothing() {
    stored_position_on(15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_16_restarts_resend_nothing() {
    stored_position_on(16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_17_restarts_resend_nothing() {
    stored_position_on(17).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_18_restarts_resend_nothing() {
    stored_position_on(18).await;
}
