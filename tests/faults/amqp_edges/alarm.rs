//! A memory alarm while 1 MB messages stall the relay's socket (issue 40: "a CPU
//! spin": with bytes waiting to be written and a broker that stopped reading, the
//! heartbeat timer was re-armed in the past and the runtime thread spun).

use super::*;

/// 60 rows of 1 MiB; the memory alarm (`MemoryAlarm`, restored on drop even on a
/// panic; `BROKER` held for writing) raised once a few have arrived, for
/// [`ALARM`]. With `heartbeat_secs = 2` the heartbeat is due every second, well
/// inside the window. The relay's CPU time (utime + stime, /proc/<pid>/stat) over the
/// window stays under [`MAX_CPU_SHARE`] of one core; after the alarm every row
/// arrives, in order, within the duplicate bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_alarm_while_1mb_messages_stall_the_socket() {
    const ROWS: u64 = 60;
    const MAX_IN_FLIGHT: usize = 64;
    const ALARM: Duration = Duration::from_secs(10);
    const MAX_CPU_SHARE: f64 = 0.2;
    let _broker = BROKER.write().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    w.rabbitmq_extra = "heartbeat_secs = 2".into();
    let relay = w.start();
    // 1 MiB each (32 × 32768 hex digits), in transactions of 5.
    for from in (1..=ROWS).step_by(5) {
        w.sql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'seq', s.n::text, 'big', jsonb_build_object('seq', s.n, 'blob', repeat(md5(s.n::text), 32768))
               FROM generate_series({from}, {}) AS s(n) ORDER BY s.n",
            from + 4
        ))
        .await;
    }
    w.wait_distinct(3, Duration::from_secs(60)).await;

    let (share, window, before, after) = {
        let _alarm = MemoryAlarm::raise();
        // Let the socket fill: the broker stops reading once it has blocked.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = w.consumer.distinct();
        let cpu0 = cpu_time(relay.pid());
        let t0 = Instant::now();
        tokio::time::sleep(ALARM).await;
        let cpu = cpu_time(relay.pid()) - cpu0;
        let window = t0.elapsed();
        let after = w.consumer.distinct();
        (
            cpu.as_secs_f64() / window.as_secs_f64(),
            window,
            before,
            after,
        )
    };
    eprintln!(
        "relay CPU over {window:?} of memory alarm: {:.1}% of one core; {before} -> {after} of {ROWS} rows received",
        share * 100.0
    );
    assert!(
        (after as u64) < ROWS,
        "the drain finished before the alarm window ended ({after} of {ROWS} rows): nothing was stalled"
    );
    let report = verify_within(
        &w,
        &relay,
        None,
        Duration::from_secs(120),
        2 * MAX_IN_FLIGHT,
    )
    .await;
    assert_eq!(report.distinct, ROWS as usize);
    assert!(
        share < MAX_CPU_SHARE,
        "the relay used {:.0}% of a core while the memory alarm stalled its socket ({window:?}); \
         the bound is {:.0}% (a spinning runtime thread); last log lines:\n{}",
        share * 100.0,
        MAX_CPU_SHARE * 100.0,
        tail(&relay.log_text(), 10)
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
