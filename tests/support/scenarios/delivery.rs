//! Delivery: every committed row once and in order, through clean stops, SIGKILL and
//! restarts, and the slot kept moving while only unpublished tables are written.

use super::*;

/// Transactions of 1 and 100 rows, a rolled-back one, one of 20,000 rows (more than
/// max_in_flight) and a last row: exactly those messages, in commit and insert
/// order, with the rows' ids as message ids and one commit LSN per transaction.
pub async fn happy_path(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    // (first row number, rows) of each committed transaction.
    let txs = [(1, 1), (2, 100), (102, 20_000), (20_102, 1)];
    insert_numbered(&env, 1, 1);
    insert_numbered(&env, 2, 100);
    env.db.psql(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                SELECT 'seq', 'rolled-back', 'tick', '{}' FROM generate_series(1, 10);
         ROLLBACK;",
    );
    insert_numbered(&env, 102, 20_000);
    insert_numbered(&env, 20_102, 1);
    let total = 20_102;
    got.wait_for(total, WAIT).await;
    // Nothing else trickles in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs = got.snapshot();
    assert_eq!(msgs.len(), total, "exactly the committed rows");
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.message_id(), numbered_id(i + 1), "message {i}");
        assert_eq!(m.header("aggregate_id"), Some((i + 1).to_string()));
    }
    let mut previous = 0;
    for (first, rows) in txs {
        let tx = &msgs[first - 1..first - 1 + rows];
        let commit = lsn(&tx[0].header("commit_lsn").unwrap());
        assert!(
            commit > previous,
            "commit LSNs increase across transactions"
        );
        assert!(
            tx.iter()
                .all(|m| m.header("commit_lsn") == tx[0].header("commit_lsn")
                    && m.header("xid") == tx[0].header("xid")),
            "one commit LSN and xid for the transaction starting at row {first}"
        );
        previous = commit;
    }
    stop(relay);
    env.cleanup().await;
}

/// SIGTERM while a backlog flows, then a restart: every row once, 0 duplicates.
pub async fn clean_stop(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 3000, 100);
    // Stop while the stream may still be flowing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop(relay);
    let before = got.len();

    let relay = env.start(&[]);
    env.insert_seq(3001, 1000, 100);
    let dups = check_sequence(&distinct(&got, 4000).await, 4000);
    assert_eq!(
        dups, 0,
        "a clean stop publishes nothing twice (first run delivered {before})"
    );
    stop(relay);
    env.cleanup().await;
}

/// SIGKILL mid-stream, then a restart: every row, first occurrences in order,
/// duplicates within max_in_flight (1000).
pub async fn sigkill_restart(port: u16) {
    let mut env = Env::with_port(port).await;
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 5000, 50);
    // Kill once something has arrived but (likely) not everything.
    got.wait_for(100, WAIT).await;
    relay.kill();
    let relay = env.start(&[]);
    let dups = check_sequence(&distinct(&got, 5000).await, 5000);
    assert!(dups <= 1000, "duplicates {dups} exceed max_in_flight");
    stop(relay);
    env.cleanup().await;
}

/// With traffic only on an unpublished table and in another database, the slot's
/// confirmed_flush_lsn follows the server's WAL within seconds (docs/design.md §1.4).
pub async fn idle_wal(port: u16) {
    let mut env = Env::with_port(port).await;
    env.db
        .psql("CREATE TABLE busy (id serial primary key, v text)");
    env.create_slot();
    let _got = env.consumer().await;
    let relay = env.start(&[]);
    let other = TestDb::new_at(port, "other");
    other.psql("CREATE TABLE t (v text)");
    for _ in 0..5 {
        env.db
            .psql("INSERT INTO busy (v) SELECT repeat('x', 200) FROM generate_series(1, 2000)");
        other.psql("INSERT INTO t SELECT repeat('y', 200) FROM generate_series(1, 2000)");
    }
    // Within a few seconds the slot's confirmed position is close to the server's.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lag = env.slot_lag_bytes();
    while lag >= 1_000_000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        lag = env.slot_lag_bytes();
    }
    assert!(lag < 1_000_000, "slot lag {lag} bytes");
    stop(relay);
    env.cleanup().await;
}
