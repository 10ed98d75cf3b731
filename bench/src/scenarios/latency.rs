//! Latency under a steady load (`steady`, `steady-high`): the relay's commit → delivery,
//! and beside it, in the same run, at the same rate by the same number of producers,
//! the two limits under it (issue #40):
//!
//! - `pg_recvlogical`'s commit → receipt: the producers insert the same rows into a
//!   database of their own, `pg_recvlogical` streams its own slot (pgoutput, as the
//!   relay reads it) to the harness, which notes when the bytes of each row arrive.
//! - a raw lapin publisher's publish → delivery: one confirm-mode channel (as the
//!   relay publishes), the producers publishing the relay's message shape on it, the
//!   consumer of the relay's sink noting when each arrives.
//!
//! Every latency is measured as the relay's is: from a `t` field in the body (epoch
//! seconds: `clock_timestamp()` in the inserted row, or the publisher's clock just
//! before it publishes) to the moment the harness holds the message. The relay's own
//! share is its p99 less the larger of the two baselines' p99s.

use std::future::Future;
use std::io::Read;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;

/// Seconds each baseline runs in a quick run (the relay's phase keeps `--seconds`):
/// the smoke run only checks they work.
const QUICK_BASELINE_SECONDS: u32 = 1;

/// The row every producer commits, alone in its transaction: the time of its insert
/// in `t` (the relay's body is the payload).
const INSERT_SQL: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
     VALUES ('bench', $1, 'tick', jsonb_build_object(
        't', extract(epoch from clock_timestamp()), 'pad', repeat('x', 240)))";

/// The percentiles reported of every latency.
const PERCENTILES: [(&str, f64); 3] = [("p50", 0.50), ("p99", 0.99), ("p99.9", 0.999)];

/// The figure names of one load's latencies.
struct Names {
    relay: String,
    recvlogical: String,
    raw: String,
    own_share: String,
}

impl Names {
    fn new(prefix: &str) -> Names {
        Names {
            relay: format!("{prefix} latency"),
            recvlogical: format!("{prefix} pg_recvlogical latency"),
            raw: format!("{prefix} raw publisher latency"),
            own_share: own_share_name(prefix),
        }
    }
}

/// The relay's p99 less the larger baseline p99 (ms), under the load of `prefix`.
pub(super) fn own_share_name(prefix: &str) -> String {
    format!("{prefix} relay own share p99")
}

/// The two loads: the base rate (default 1000/s by 4 producers) and ten times
/// it by twice the producers ("steady-high"); each with its baselines.
pub(super) async fn steady_scenarios(args: &Args, bin: &std::path::Path, report: &mut Report) {
    let high = (args.rate * 10, args.clients * 2, "steady high");
    for (scenario, (rate, clients, prefix)) in [
        ("steady", (args.rate, args.clients, "steady")),
        ("steady-high", high),
    ] {
        if !wants(args, scenario) {
            continue;
        }
        let names = Names::new(prefix);
        let mut expected = vec![
            format!("{prefix} relay CPU share"),
            format!("{prefix} relay RSS"),
        ];
        for name in [&names.relay, &names.recvlogical, &names.raw] {
            expected.push(format!("{name} p50"));
            expected.push(format!("{name} p99"));
        }
        report.expect(&expected.iter().map(String::as_str).collect::<Vec<_>>());
        if let Err(e) = steady(args, bin, report, rate, clients, prefix).await {
            report.fail(scenario, &e);
        }
    }
}

/// The relay under `rate` single-row transactions a second by `clients` producers,
/// then its two baselines at the same load, and the relay's own share of the p99.
pub(super) async fn steady(
    args: &Args,
    bin: &std::path::Path,
    report: &mut Report,
    rate: u32,
    clients: u32,
    prefix: &str,
) -> anyhow::Result<()> {
    let names = Names::new(prefix);
    let load = Load::new(rate, clients, args.seconds);
    let relay_p99 = steady_relay(args, bin, report, load, &names.relay, prefix).await?;
    let load = Load {
        seconds: if args.quick {
            QUICK_BASELINE_SECONDS.min(args.seconds)
        } else {
            args.seconds
        },
        ..load
    };
    let mut limits = Vec::new();
    match recvlogical_latency(args, load).await {
        Ok((lat, secs)) => {
            let cond = format!(
                "commit → receipt by pg_recvlogical (pgoutput, its own slot), {}",
                load.conditions(secs, "single-row transactions")
            );
            limits.push(add_percentiles(report, &names.recvlogical, lat, &cond));
        }
        Err(e) => report.fail(format!("{prefix}: pg_recvlogical baseline"), &e),
    }
    match raw_latency(args, load).await {
        Ok((lat, secs)) => {
            let cond = format!(
                "publish → delivery, the relay's message, one confirm-mode channel that the \
                 producers share, window {}, {}",
                args.window,
                load.conditions(secs, "one message each")
            );
            limits.push(add_percentiles(report, &names.raw, lat, &cond));
        }
        Err(e) => report.fail(format!("{prefix}: raw publisher baseline"), &e),
    }
    if let [a, b] = limits[..] {
        report.add(
            &names.own_share,
            relay_p99 - a.max(b),
            "ms",
            format!(
                "relay p99 {relay_p99:.2} − max(pg_recvlogical p99 {a:.2}, raw publisher p99 {b:.2}), same run"
            ),
        );
    }
    Ok(())
}

/// The relay's phase: its commit → delivery percentiles (named `name`), CPU share and
/// RSS; returns its p99 in ms.
async fn steady_relay(
    args: &Args,
    bin: &std::path::Path,
    report: &mut Report,
    load: Load,
    name: &str,
    prefix: &str,
) -> anyhow::Result<f64> {
    let (db, sink, mut relay) = relay_to_sink(args, bin, true, Duration::from_secs(2)).await?;
    let cpu0 = relay.cpu_seconds();
    let started = Instant::now();
    let insert_secs = insert_rows(&db, load).await?;
    wait_relay(&sink.count, load.total(), wait(args), &mut relay).await?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = relay.cpu_seconds() - cpu0;
    let rss = relay.rss_mb();
    let cond = load.conditions(insert_secs, "single-row transactions");
    let p99 = add_percentiles(report, name, sink.latency_samples(), &cond);
    report.add(
        format!("{prefix} relay CPU share"),
        cpu / wall,
        "cores",
        &cond,
    );
    report.add(format!("{prefix} relay RSS"), rss, "MB", &cond);
    relay.stop();
    sink.cleanup().await;
    Ok(p99)
}

/// Reports the [`PERCENTILES`] of `lat` (seconds) as `{name} p50` etc. in ms; returns
/// the p99.
fn add_percentiles(report: &mut Report, name: &str, mut lat: Vec<f64>, cond: &str) -> f64 {
    lat.sort_by(|a, b| a.total_cmp(b));
    for (q_name, q) in PERCENTILES {
        report.add(
            format!("{name} {q_name}"),
            percentile(&lat, q) * 1000.0,
            "ms",
            cond,
        );
    }
    percentile(&lat, 0.99) * 1000.0
}

/// A steady load: `clients` producers, each at `per_client` a second for `seconds`.
#[derive(Debug, Clone, Copy)]
struct Load {
    rate: u32,
    clients: u32,
    per_client: u32,
    seconds: u32,
}

impl Load {
    fn new(rate: u32, clients: u32, seconds: u32) -> Load {
        let clients = clients.max(1);
        Load {
            rate,
            clients,
            per_client: (rate / clients).max(1),
            seconds,
        }
    }

    /// What each producer sends.
    fn per_producer(&self) -> u32 {
        self.per_client * self.seconds
    }

    fn total(&self) -> usize {
        (self.per_producer() * self.clients) as usize
    }

    /// The figures' conditions, the producers having taken `secs` to send `what`.
    fn conditions(&self, secs: f64, what: &str) -> String {
        format!(
            "{} events/s offered by {} clients for {}s (achieved {:.0}/s), {what}",
            self.rate,
            self.clients,
            self.seconds,
            self.total() as f64 / secs
        )
    }
}

/// Runs `make(k)` for each of the load's producers `k` at once; returns the seconds
/// until all were done.
async fn producers<F, Fut>(load: Load, make: F) -> anyhow::Result<f64>
where
    F: Fn(u32) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let started = Instant::now();
    let tasks: Vec<_> = (0..load.clients).map(|k| tokio::spawn(make(k))).collect();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// A producer's clock: `per_second` ticks a second, late ones caught up at once.
fn pacer(per_second: u32) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(per_second)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    tick
}

/// The load's producers, each on its own connection, committing [`INSERT_SQL`] rows
/// into `db`; returns the seconds they took.
async fn insert_rows(db: &BenchDb, load: Load) -> anyhow::Result<f64> {
    let conninfo = db.db.conninfo();
    producers(load, move |_| {
        let conninfo = conninfo.clone();
        async move {
            let (client, conn) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            let stmt = client.prepare(INSERT_SQL).await?;
            let mut tick = pacer(load.per_client);
            for i in 0..load.per_producer() {
                tick.tick().await;
                client.execute(&stmt, &[&i.to_string()]).await?;
            }
            Ok(())
        }
    })
    .await
}

/// The raw publisher's phase: the load's producers publish the relay's message with
/// `t` in its body on one confirm-mode channel into a fresh sink; returns the
/// publish → delivery latencies (s) and the seconds the producers took.
async fn raw_latency(args: &Args, load: Load) -> anyhow::Result<(Vec<f64>, f64)> {
    let sink = Sink::new(true).await?;
    let result = async {
        let conn =
            Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let window = args.window / load.clients as usize;
        let exchange = sink.exchange.clone();
        let secs = producers(load, move |k| {
            publish_at(ch.clone(), exchange.clone(), k, load, window)
        })
        .await?;
        sink.wait_for(load.total(), wait(args)).await?;
        let _ = conn.close(200, "done".into()).await;
        Ok((sink.latency_samples(), secs))
    }
    .await;
    sink.cleanup().await;
    result
}

/// Producer `k` of the raw publisher: its share of the load, paced, at most `window`
/// of its messages unconfirmed.
async fn publish_at(
    ch: lapin::Channel,
    exchange: String,
    k: u32,
    load: Load,
    window: usize,
) -> anyhow::Result<()> {
    let pad = "x".repeat(240);
    let mut confirms = Confirms::new(window);
    let mut tick = pacer(load.per_client);
    for j in 0..load.per_producer() {
        tick.tick().await;
        let i = (k * load.per_producer() + j) as usize;
        let body = format!("{{\"t\": {:.6}, \"pad\": \"{pad}\"}}", epoch_secs());
        let confirm = publish_one(&ch, &exchange, i, Shape::Full, body.as_bytes()).await?;
        confirms.push(confirm).await?;
    }
    confirms.finish().await
}

/// `pg_recvlogical` on its own slot, killed when dropped.
struct Recvlogical(Child);

impl Drop for Recvlogical {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The pg_recvlogical phase: the load's producers insert into a database of their own
/// while `pg_recvlogical` streams its slot to the harness; returns the commit →
/// receipt latencies (s) and the seconds the producers took.
async fn recvlogical_latency(args: &Args, load: Load) -> anyhow::Result<(Vec<f64>, f64)> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    // No fsync of the output (-F 0): the bytes go to a pipe the harness reads.
    let child = recvlogical(&db, &slot)
        .args(["-f", "-", "-F", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("run pg_recvlogical")?;
    let mut recv = Recvlogical(child);
    let out = recv.0.stdout.take().context("pg_recvlogical's stdout")?;
    let count = Arc::new(AtomicUsize::new(0));
    let reader = {
        let count = count.clone();
        std::thread::spawn(move || read_latencies(out, &count))
    };
    wait_streaming(&db, &slot, &mut recv.0).await?;
    let secs = insert_rows(&db, load).await?;
    wait_child(
        &count,
        load.total(),
        wait(args),
        &mut recv.0,
        "pg_recvlogical",
    )
    .await?;
    // Its output ends: the reader sees the end of the pipe.
    drop(recv);
    let lat = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the reader of pg_recvlogical's output panicked"))?;
    Ok((lat, secs))
}

/// Waits until `child` streams `slot` (the slot is active), so that no row waits
/// for it to start.
async fn wait_streaming(db: &BenchDb, slot: &str, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let sql = format!("SELECT active FROM pg_replication_slots WHERE slot_name = '{slot}'");
    while db.db.psql(&sql) != "t" {
        if let Some(status) = child.try_wait()? {
            bail!("pg_recvlogical exited ({status}) before it streamed");
        }
        if Instant::now() > deadline {
            bail!("pg_recvlogical did not start streaming within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Reads pg_recvlogical's output until it ends: for every row, the time its bytes were
/// read less its `t`; `count` counts them as they come.
fn read_latencies(mut out: impl Read, count: &AtomicUsize) -> Vec<f64> {
    let mut lat = Vec::new();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    while let Ok(n) = out.read(&mut chunk) {
        if n == 0 {
            break;
        }
        let now = epoch_secs();
        buf.extend_from_slice(&chunk[..n]);
        let before = lat.len();
        scan_times(&mut buf, |t| lat.push(now - t));
        count.fetch_add(lat.len() - before, Ordering::Relaxed);
    }
    lat
}

/// The key of the insert time in a row's payload, as jsonb prints it.
const T_KEY: &[u8] = b"\"t\": ";

/// Calls `found` with the number of every complete `"t": <number>` in `buf` (the
/// payloads inside pgoutput's binary messages), then drops from `buf` all but a key or
/// number that the end of the read cut.
fn scan_times(buf: &mut Vec<u8>, mut found: impl FnMut(f64)) {
    let mut pos = 0;
    let keep = loop {
        let Some(at) = buf[pos..].windows(T_KEY.len()).position(|w| w == T_KEY) else {
            break buf.len().saturating_sub(T_KEY.len() - 1).max(pos);
        };
        let start = pos + at + T_KEY.len();
        let len = buf[start..]
            .iter()
            .take_while(|b| b.is_ascii_digit() || **b == b'.')
            .count();
        if start + len == buf.len() {
            break pos + at;
        }
        if let Some(t) = std::str::from_utf8(&buf[start..start + len])
            .ok()
            .and_then(|s| s.parse().ok())
        {
            found(t);
        }
        pos = start + len;
    };
    buf.drain(..keep);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(buf: &mut Vec<u8>) -> Vec<f64> {
        let mut out = Vec::new();
        scan_times(buf, |t| out.push(t));
        out
    }

    #[test]
    fn scan_finds_times_across_reads() {
        let whole = b"\x00I\x00\x00{\"t\": 1765000000.123456, \"pad\": \"xx\"}\nC\x00{\"t\": 1765000001.5, \"pad\": \"x\"}\n";
        for cut in 0..whole.len() {
            let mut buf = whole[..cut].to_vec();
            let mut got = scan(&mut buf);
            buf.extend_from_slice(&whole[cut..]);
            got.extend(scan(&mut buf));
            assert_eq!(got, vec![1765000000.123456, 1765000001.5], "cut at {cut}");
            assert!(buf.len() < T_KEY.len(), "cut at {cut}: {buf:?}");
        }
    }
}
