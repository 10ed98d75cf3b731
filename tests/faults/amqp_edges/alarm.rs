//! A memory alarm while 1 MB messages stall the relay's socket (issue 40: "a CPU
//! spin": with bytes waiting to be written and a broker that stopped reading, the
//! heartbeat timer was re-armed in the past and the runtime thread spun).

use super::*;

/// A transaction of `n` rows `from..from+n` of `mib` MiB each (32 × 32768 hex
/// digits a MiB).
fn rows_of(mib: u64, from: u64, n: u64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'seq', s.n::text, 'big', jsonb_build_object('seq', s.n, 'blob', repeat(md5(s.n::text), 32768 * {mib}))
           FROM generate_series({from}, {}) AS s(n) ORDER BY s.n",
        from + n - 1
    )
}

/// Waits until the broker reports its memory alarm (it takes effect on the memory
/// monitor's next check).
async fn wait_alarm_in_effect() {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut ctl = testkit::rabbitmqctl_command();
        ctl.args(["-q", "eval", "rabbit_alarm:get_alarms()."]);
        let out = tokio::process::Command::from(ctl).output().await.unwrap();
        if String::from_utf8_lossy(&out.stdout).contains("memory") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the broker's memory alarm was not in effect after 15 s"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Mid-drain (10 rows of 1 MiB delivered), the memory alarm is raised
/// (`MemoryAlarm`, restored on drop even on a panic; `BROKER` held for writing);
/// once it is in effect, 100 more rows of 1 MiB are committed: the relay writes
/// them, the broker blocks its connection at the first publish and stops reading,
/// and tens of MB wait in the relay's write buffer for [`ALARM`]. With
/// `heartbeat_secs = 2` a heartbeat is due every second, well inside the window. The
/// relay's CPU time (utime + stime, /proc/<pid>/stat) over the window stays under
/// [`MAX_CPU_SHARE`] of one core; after the alarm every row arrives, in order, within
/// the duplicate bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_alarm_while_1mb_messages_stall_the_socket() {
    alarm_stalls_the_socket(1, 100).await;
}

/// [`memory_alarm_while_1mb_messages_stall_the_socket`] with messages of 48 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_alarm_while_48mb_messages_stall_the_socket() {
    alarm_stalls_the_socket(48, 3).await;
}

/// `burst` rows of `mib` MiB after the alarm (see above).
async fn alarm_stalls_the_socket(mib: u64, burst: u64) {
    const FIRST: u64 = 10;
    const MAX_IN_FLIGHT: usize = 64;
    const ALARM: Duration = Duration::from_secs(10);
    const MAX_CPU_SHARE: f64 = 0.2;
    let _broker = BROKER.write().await;
    let mut w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    w.rabbitmq_extra = "heartbeat_secs = 2".into();
    let relay = w.start();
    w.sql(&rows_of(1, 1, FIRST)).await;
    w.wait_distinct(FIRST as usize, Duration::from_secs(60))
        .await;

    let alarm = MemoryAlarm::raise();
    wait_alarm_in_effect().await;
    for from in (FIRST + 1..=FIRST + burst).step_by(5) {
        w.sql(&rows_of(mib, from, 5.min(FIRST + burst + 1 - from)))
            .await;
    }
    // Let the relay fill its socket and the broker block it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = w.consumer.distinct();
    let cpu0 = cpu_time(relay.pid());
    let t0 = Instant::now();
    // Each second's share, to tell a steady spin from a burst of work.
    let mut per_second = Vec::new();
    let mut last = cpu0;
    while t0.elapsed() < ALARM {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = cpu_time(relay.pid());
        per_second.push(format!("{:.0}%", (now - last).as_secs_f64() * 100.0));
        last = now;
    }
    let cpu = last - cpu0;
    let window = t0.elapsed();
    let after = w.consumer.distinct();
    drop(alarm);
    let share = cpu.as_secs_f64() / window.as_secs_f64();
    eprintln!(
        "relay CPU over {window:?} of memory alarm: {:.1}% of one core (each second: {}); {before} -> {after} of {} rows received over the window",
        share * 100.0,
        per_second.join(" "),
        FIRST + burst
    );
    assert!(
        (after as u64) < FIRST + burst,
        "every row arrived during the memory alarm ({after}): the broker never blocked the relay"
    );
    let report = verify_within(
        &w,
        &relay,
        None,
        Duration::from_secs(120),
        2 * MAX_IN_FLIGHT,
    )
    .await;
    assert_eq!(report.distinct, (FIRST + burst) as usize);
    assert!(
        share < MAX_CPU_SHARE,
        "the relay used {:.0}% of a core while the memory alarm stalled its socket ({window:?}; \
         each second: {}); the bound is {:.0}% (a spinning runtime thread); last log lines:\n{}",
        share * 100.0,
        per_second.join(" "),
        MAX_CPU_SHARE * 100.0,
        tail(&relay.log_text(), 10)
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
