//! `stalled`: a drain of 2 MiB messages to a broker that stops reading, and to one
//! that reads every publish and confirms none (issue 49, docs/design.md §4 "Bytes in
//! flight"): the relay's RSS meanwhile, then the drain's completion once the broker
//! answers again. The first is bounded by the unwritten bytes the connection keeps
//! and the batches between reader and publisher; the second only by
//! `max_in_flight_bytes` (before it, by the window's message count).

use super::*;

/// The size of each event's payload: the 2 MiB message of the issue.
const BODY: usize = 2 * 1024 * 1024;

/// Events of the scenario: more bodies than the default `max_in_flight_bytes` (256 MiB)
/// holds, so that the bound, not the backlog, decides what the relay keeps.
const EVENTS: usize = 400;
const QUICK_EVENTS: usize = 160;

/// How long the broker reads nothing while the relay's RSS is sampled.
const STALL: Duration = Duration::from_secs(20);
const QUICK_STALL: Duration = Duration::from_secs(5);

/// How the broker misbehaves.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stall {
    /// It reads nothing (as RabbitMQ does while an alarm blocks the connection).
    NotReading,
    /// It reads everything and its answers (confirms, heartbeats) never arrive.
    NotAnswering,
}

impl Stall {
    pub(super) fn name(self) -> &'static str {
        match self {
            Stall::NotReading => "broker not reading",
            Stall::NotAnswering => "broker not confirming",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Stall::NotReading => "the broker reading nothing",
            Stall::NotAnswering => "the broker reading all and no answer reaching the relay",
        }
    }
}

/// `stalled`: both ways the broker misbehaves, one after the other.
pub(super) async fn stalled_scenarios(args: &Args, bin: &std::path::Path, report: &mut Report) {
    if !wants(args, "stalled") {
        return;
    }
    for how in [Stall::NotReading, Stall::NotAnswering] {
        let name = how.name();
        let rss = format!("{name}: relay RSS meanwhile");
        let rest = format!("{name}: the rest delivered after it answers again");
        report.expect(&[&rss, &rest]);
        if let Err(e) = stalled(args, bin, how, report).await {
            report.fail("stalled", &e);
        }
    }
}

pub(super) async fn stalled(
    args: &Args,
    bin: &std::path::Path,
    how: Stall,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (n, stall) = if args.quick {
        (QUICK_EVENTS, QUICK_STALL)
    } else {
        (EVENTS, STALL)
    };
    let db = BenchDb::new();
    let slot = db.create_slot();
    let name = db.db.name.clone();
    // Ten events per transaction; each payload a 2 MiB JSON string (TOAST compresses it
    // in the table and the WAL; the relay decodes and publishes the whole of it).
    tokio::task::spawn_blocking(move || {
        for first in (1..=n).step_by(10) {
            testkit::psql(
                &name,
                &format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'bench', n::text, 'big', jsonb_build_object('n', n, 'pad', repeat('x', {BODY}))
                       FROM generate_series({first}, {}) AS s(n)",
                    (first + 9).min(n)
                ),
            );
        }
    })
    .await?;
    let sink = Sink::new(false).await?;
    let broker: std::net::SocketAddr = testkit::amqp_url()
        .split('@')
        .nth(1)
        .and_then(|h| h.split('/').next())
        .context("the test broker's URL names no host")?
        .parse()
        .context("the test broker's URL names no literal address")?;
    let proxy = testkit::proxy::Proxy::start(broker).await;
    let mut relay = RelayProc::start(
        bin,
        &db,
        &slot,
        Target::Via(&sink.exchange, proxy.port()),
        args.window,
    )?;
    // The relay is connected and publishing: then the broker stops reading.
    wait_relay(&sink.count, 2, wait(args), &mut relay).await?;
    match how {
        Stall::NotReading => proxy.stop_reading(),
        Stall::NotAnswering => proxy.stop_answering(),
    }
    let stalled_at = Instant::now();
    let mut peak: f64 = 0.0;
    while stalled_at.elapsed() < stall {
        peak = peak.max(relay.rss_mb());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received_during = sink.count.load(std::sync::atomic::Ordering::SeqCst);
    proxy.restore();
    let restored = Instant::now();
    let end = wait_relay(&sink.count, n, wait(args), &mut relay).await?;
    let cond = format!(
        "{n} events of 2 MiB, {} for {} s after the 2nd, max_in_flight_bytes default \
         (256 MiB), window {}; {received_during} received by the end of the stall",
        how.describe(),
        stall.as_secs(),
        args.window
    );
    let name = how.name();
    report.add(format!("{name}: relay RSS meanwhile"), peak, "MB", &cond);
    report.add(
        format!("{name}: the rest delivered after it answers again"),
        (end - restored).as_secs_f64(),
        "s",
        &cond,
    );
    report.add(
        format!("{name}: relay peak RSS"),
        relay.peak_rss_mb(),
        "MB",
        &cond,
    );
    relay.stop();
    drop(proxy);
    sink.cleanup().await;
    Ok(())
}
