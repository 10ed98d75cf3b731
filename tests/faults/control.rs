//! Incident levers (issue 44, docs/operations.md "Incident levers"): `ctl pause`
//! during a load holds the slot (a standby does not take over) and publishes nothing
//! more until `ctl resume`, which delivers the rest in order without a duplicate; a
//! pause survives a broker restart; `ctl drain --wait` stops the relay cleanly with
//! everything read confirmed.
//!
//! The broker restart holds `BROKER` for writing, the others for reading (faults.rs).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::harness::*;
use support::{bin, Relay};

/// `outbox-relay ctl args` against the relay of `w` whose endpoint is on `listen`.
fn ctl(w: &World, listen: &str, args: &[&str]) -> Output {
    Command::new(bin())
        .arg("--config")
        .arg(w.config())
        .arg("ctl")
        .args(args)
        .env("RUST_LOG", "warn")
        .env("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `ctl status --json`.
fn status(w: &World, listen: &str) -> serde_json::Value {
    let out = ctl(w, listen, &["status", "--json"]);
    assert!(out.status.success(), "ctl status: {}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs `ctl args`, asserting success.
fn ctl_ok(w: &World, listen: &str, args: &[&str]) -> String {
    let out = ctl(w, listen, args);
    assert!(out.status.success(), "ctl {args:?}: {}", text(&out));
    text(&out)
}

/// Waits until the pause took effect: paused, nothing in flight, and the
/// consumer has seen every message the broker took (its count stays put for 3 s).
async fn settle_paused(w: &World, listen: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = status(w, listen);
        if s["state"] == "paused" && s["in_flight"] == 0 && s["acked_lsn"] == s["confirmed_lsn"] {
            break;
        }
        assert!(Instant::now() < deadline, "the pause never settled: {s}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut last = w.consumer.total();
    let mut still = Instant::now();
    while still.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = w.consumer.total();
        if now != last {
            last = now;
            still = Instant::now();
        }
        assert!(Instant::now() < deadline, "deliveries never stopped");
    }
}

/// The slot's `active_pid` (the walsender serving it), `None` while inactive.
async fn slot_holder(w: &World) -> Option<String> {
    let pid = w
        .sql(&format!(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{}' AND active",
            w.env.slot
        ))
        .await;
    Some(pid.trim().to_string()).filter(|p| !p.is_empty())
}

/// The walsender of `pid` serves a connection from the relay process `relay_pid`
/// (its client port is one of that process's sockets).
async fn served_by(w: &World, walsender: &str, relay_pid: u32) -> bool {
    let port = w
        .sql(&format!(
            "SELECT client_port FROM pg_stat_activity WHERE pid = {walsender}"
        ))
        .await;
    let port: u16 = match port.trim().parse() {
        Ok(p) => p,
        Err(_) => return false,
    };
    let out = Command::new("ss")
        .args(["-tnpH", "state", "established"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.contains(&format!(":{port} ")) && l.contains(&format!("pid={relay_pid},")))
}

fn unpublished_rows(total_rows: &str, distinct: usize) -> bool {
    total_rows.trim().parse::<usize>().unwrap() > distinct
}

/// A pause during a 20,000-row load: after it settles nothing more is published and
/// the confirmed position stays, the slot stays active and held by this relay's
/// connection, a standby started on the slot stands by for 30 s without taking
/// over; `/readyz` says paused and `outbox_relay_paused` is 1. Resume delivers every
/// row, in order, without a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_mid_load_holds_the_slot_and_resume_delivers_in_order() {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let relay = w.start_env(&[("OUTBOX_RELAY_RELAY_METRICS_LISTEN", &listen)]);
    let load = w.load(1, 20_000, 50, Duration::from_millis(25));
    w.wait_distinct(2_000, WAIT).await;
    let said = ctl_ok(&w, &listen, &["pause"]);
    assert!(said.contains("state: paused since"), "{said}");
    settle_paused(&w, &listen).await;

    let published = w.consumer.total();
    let confirmed = w.confirmed().await;
    let holder = slot_holder(&w)
        .await
        .expect("the paused relay holds the slot");
    assert!(
        served_by(&w, &holder, relay.pid()).await,
        "walsender {holder} is not the relay's"
    );
    let (code, body) = support::http_get(&listen, "/readyz").await.unwrap();
    assert_eq!((code, body.trim()), (503, "not ready: paused"));
    let (_, metrics) = support::http_get(&listen, "/metrics").await.unwrap();
    assert!(metrics.contains("\noutbox_relay_paused 1"), "{metrics}");

    // A standby on the same slot: it stands by and does not take over.
    let standby = w.start();
    standby
        .wait_log("standing by", Duration::from_secs(60))
        .await;
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(w.consumer.total(), published, "published while paused");
        assert_eq!(
            w.confirmed().await,
            confirmed,
            "the confirmed position moved while paused"
        );
        assert_eq!(
            slot_holder(&w).await.as_deref(),
            Some(holder.as_str()),
            "the slot changed hands"
        );
    }
    assert!(
        !standby.log_text().contains("taking over"),
        "{}",
        standby.log_text()
    );
    let rows = w.sql("SELECT count(*) FROM outbox").await;
    assert!(
        unpublished_rows(&rows, w.consumer.distinct()),
        "the load ended before the pause: {rows} rows"
    );
    assert_eq!(status(&w, &listen)["state"], "paused");
    drop(standby);

    let said = ctl_ok(&w, &listen, &["resume"]);
    assert!(said.contains("state: running"), "{said}");
    load.await.unwrap();
    let report = w.verify(0).await;
    assert_eq!(report.duplicates, 0);
    assert_eq!(report.distinct, 20_000);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        log.contains("reader paused at a transaction boundary") && log.contains("reader resumed"),
        "{log}"
    );
    w.cleanup().await;
}

/// A paused relay across `rabbitmqctl stop_app` / `start_app`: it reconnects as
/// usual and stays paused (nothing published, the confirmed position held) until
/// `ctl resume`, which delivers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_survives_a_broker_restart() {
    let _broker = BROKER.write().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let relay = w.start_env(&[("OUTBOX_RELAY_RELAY_METRICS_LISTEN", &listen)]);
    let load = w.load(1, 6_000, 10, Duration::from_millis(20));
    w.wait_distinct(500, WAIT).await;
    ctl_ok(&w, &listen, &["pause"]);
    settle_paused(&w, &listen).await;
    let confirmed = w.confirmed().await;
    {
        let _stopped = BrokerStopped::stop();
        tokio::time::sleep(Duration::from_secs(15)).await;
        let s = status(&w, &listen);
        assert_eq!(s["state"], "paused", "{s}");
    }
    // Reconnected, still paused.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = status(&w, &listen);
        assert_eq!(s["state"], "paused", "{s}");
        if s["connected"] == true {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never reconnected: {s}\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // What the broker had taken before the pause reaches the consumer (it
    // reconnects too); then nothing more arrives.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let distinct = w.consumer.distinct();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(w.consumer.distinct(), distinct, "published while paused");
    assert_eq!(
        w.confirmed().await,
        confirmed,
        "the confirmed position moved while paused"
    );
    let rows = w.sql("SELECT count(*) FROM outbox").await;
    assert!(
        unpublished_rows(&rows, distinct),
        "the load ended before the pause: {rows} rows"
    );
    ctl_ok(&w, &listen, &["resume"]);
    load.await.unwrap();
    w.verify(2 * MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup_after_broker_restart().await;
}

/// `ctl drain --wait` during a load returns once the relay has stopped, with exit
/// code 0; everything it read was confirmed, so the next relay publishes the rest
/// without a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_stops_cleanly_with_everything_read_confirmed() {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let mut relay = w.start_env(&[("OUTBOX_RELAY_RELAY_METRICS_LISTEN", &listen)]);
    let load = w.load(1, 8_000, 50, Duration::from_millis(10));
    w.wait_distinct(1_000, WAIT).await;
    // Bounded, so a drain that never stops fails the test instead of hanging it.
    let said = ctl_ok(&w, &listen, &["drain", "--wait", "--timeout", "120s"]);
    assert!(
        said.contains("state: draining") && said.contains("stopped"),
        "{said}"
    );
    // `--wait` returned: the process is gone (or exiting), with code 0.
    assert_eq!(
        relay.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        relay.log_text()
    );
    let log = relay.log_text();
    assert!(
        log.contains("drain requested") && log.contains("stopped cleanly"),
        "{log}"
    );
    assert!(slot_holder(&w).await.is_none(), "the slot is still held");
    let out = ctl(&w, &listen, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    load.await.unwrap();
    let relay = w.start();
    let report = w.verify(0).await;
    assert_eq!(report.duplicates, 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// `run --paused` starts paused: the slot is held and nothing is published until
/// `ctl resume`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_paused_starts_paused() {
    let _broker = BROKER.read().await;
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    w.insert(1, 200, 20).await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let config = w.config();
    let log = w.env.dir.join("paused.log");
    let child = Command::new(bin())
        .arg("--config")
        .arg(&config)
        .args(["run", "--paused"])
        .env("RUST_LOG", "info")
        .env("OUTBOX_RELAY_RELAY_METRICS_LISTEN", &listen)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let relay = Relay { child, log };
    relay
        .wait_log(
            "reader paused at a transaction boundary",
            Duration::from_secs(120),
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(w.consumer.total(), 0, "published while started paused");
    assert!(slot_holder(&w).await.is_some(), "the slot is not held");
    assert_eq!(status(&w, &listen)["state"], "paused");
    ctl_ok(&w, &listen, &["resume"]);
    let report = w.verify(0).await;
    assert_eq!(report.distinct, 200);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
