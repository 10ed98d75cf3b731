//! Drains a slot with the reader into a counting consumer, as the harness's `reader`
//! scenario does (bench/src/scenarios/drain.rs), without the harness around it: one
//! process whose system calls and instructions can be counted (`strace -c -f`,
//! `valgrind --tool=callgrind`) while it reads the replication stream.
//!
//! ```text
//! cargo run --release -p wal-reader --example drain -- CONNINFO SLOT PUBLICATION END_LSN [ACK]
//! ```
//!
//! Reads until a commit ending at or after `END_LSN`, prints events, transactions,
//! seconds and rows/s. Without `ACK` (any fourth argument) it never acknowledges, so
//! the slot does not move and the same WAL can be drained again.

use std::time::{Duration, Instant};

use outbox_event::{Lsn, WalItem};
use tokio::sync::{mpsc, watch};
use wal_reader::{ColumnMapping, PgConnectOptions, ReaderConfig, TableName, WalReader};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [conninfo, slot, publication, end, rest @ ..] = args.as_slice() else {
        return Err("usage: drain CONNINFO SLOT PUBLICATION END_LSN [ACK]".into());
    };
    let end: Lsn = end.parse()?;
    let ack = !rest.is_empty();
    let cfg = ReaderConfig {
        conn: PgConnectOptions::parse(conninfo)?,
        slot: slot.clone(),
        publication: publication.clone(),
        tables: vec![TableName::parse("public.outbox").ok_or("table")?],
        messages: Vec::new(),
        mapping: ColumnMapping::default(),
        start_lsn: None,
        status_interval: Duration::from_secs(1),
        max_in_flight: 10_000,
    };
    let start = Instant::now();
    let reader = WalReader::start(cfg).await?;
    let streaming = Instant::now();
    let (tx, mut rx) = mpsc::channel(64);
    let (acked, acked_rx) = watch::channel(Lsn::ZERO);
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(reader.run(tx, acked_rx, stop_rx));
    let (mut events, mut commits, mut batches) = (0usize, 0usize, 0usize);
    'outer: while let Some(batch) = rx.recv().await {
        batches += 1;
        for item in batch {
            match item {
                WalItem::Event(_) => events += 1,
                WalItem::Commit(c) => {
                    commits += 1;
                    if c.end_lsn >= end {
                        if ack {
                            let _ = acked.send(c.end_lsn);
                        }
                        break 'outer;
                    }
                }
                WalItem::Keepalive(_) => {}
            }
        }
    }
    let elapsed = start.elapsed();
    let streamed = streaming.elapsed();
    let switches = thread_switches();
    let _ = stop.send(true);
    while rx.recv().await.is_some() {}
    drop(acked);
    let _ = task.await;
    println!(
        "events {events} commits {commits} batches {batches} total {:.3}s ({:.0} rows/s) streaming {:.3}s ({:.0} rows/s)",
        elapsed.as_secs_f64(),
        events as f64 / elapsed.as_secs_f64(),
        streamed.as_secs_f64(),
        events as f64 / streamed.as_secs_f64(),
    );
    println!("{switches}");
    Ok(())
}

/// Context switches of each thread so far (name: voluntary/involuntary), from /proc.
fn thread_switches() -> String {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for task in dir.flatten() {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            out.push(format!(
                "{}: {}/{}",
                field("Name:"),
                field("voluntary_ctxt_switches:"),
                field("nonvoluntary_ctxt_switches:")
            ));
        }
    }
    format!(
        "context switches (voluntary/involuntary) {}",
        out.join(", ")
    )
}
