//! Every supported Postgres major, 14 to 18 (docs/compatibility.md): the end-to-end
//! scenarios of `scenarios/` against the cluster of each major that
//! `scripts/pg-versions.sh` runs (port `OUTBOX_TEST_PG<MAJOR>_PORT`, default
//! 55500 + MAJOR; `scripts/test.sh` starts them). One test per major, so a failure
//! names the version; within a test the scenarios run one after the other. A test
//! fails, never skips, when its cluster is not running.
#![allow(clippy::unwrap_used)]

use support::scenarios;

use std::future::Future;
use std::process::Command;
use std::time::Instant;

/// The port of the cluster of `major`, after checking that it answers and runs that
/// major.
pub(crate) fn cluster(major: u32) -> u16 {
    let port = std::env::var(format!("OUTBOX_TEST_PG{major}_PORT"))
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55500 + major as u16);
    let out = Command::new("psql")
        .args(["-XAtq", "-h127.0.0.1", "-Upostgres", "-dpostgres"])
        .args(["-p", &port.to_string(), "-c", "SHOW server_version_num"])
        .output()
        .expect("psql runs");
    assert!(
        out.status.success(),
        "no Postgres {major} on port {port} ({}): start it with `scripts/pg-versions.sh start {major}` (scripts/test.sh does)",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let version: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(
        version / 10000,
        major,
        "port {port} runs Postgres {version}, not {major}"
    );
    port
}

async fn step(major: u32, name: &str, scenario: impl Future<Output = ()>) {
    let started = Instant::now();
    eprintln!("postgres {major}: {name} …");
    scenario.await;
    eprintln!(
        "postgres {major}: {name} ok ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

async fn suite(major: u32) {
    let port = cluster(major);
    let started = Instant::now();
    step(major, "happy path", scenarios::happy_path(port)).await;
    step(major, "SIGKILL + restart", scenarios::sigkill_restart(port)).await;
    step(major, "clean stop", scenarios::clean_stop(port)).await;
    step(
        major,
        "slot create/drop and status --json",
        scenarios::slot_status_and_drop(port, major),
    )
    .await;
    step(major, "peek", scenarios::peek(port)).await;
    step(major, "replay --from-lsn", scenarios::replay_range(port)).await;
    step(major, "idle WAL", scenarios::idle_wal(port)).await;
    eprintln!(
        "postgres {major}: all scenarios ok ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_14() {
    suite(14).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_15() {
    suite(15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_16() {
    suite(16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_17() {
    suite(17).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_18() {
    suite(18).await;
}
