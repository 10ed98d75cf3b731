//! Logical messages as events (docs/messages.md, issue 42) on every supported
//! Postgres major, 14 to 18: `scenarios::logical_messages` against the cluster of each
//! major that `scripts/pg-versions.sh` runs (as `versions` runs its scenarios), one
//! test per major so that a failure names the version. pgoutput sends messages from
//! Postgres 14 on, and since 15 it skips empty transactions, so a transaction of one
//! message alone is decoded differently there. A test fails, never skips, when its
//! cluster is not running; none restarts a cluster.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use support::scenarios;

use crate::versions::cluster;

async fn messages_on(major: u32) {
    let port = cluster(major);
    let started = Instant::now();
    scenarios::logical_messages(port).await;
    eprintln!(
        "postgres {major}: logical messages ok ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_14_logical_messages() {
    messages_on(14).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_15_logical_messages() {
    messages_on(15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_16_logical_messages() {
    messages_on(16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_17_logical_messages() {
    messages_on(17).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_18_logical_messages() {
    messages_on(18).await;
}
