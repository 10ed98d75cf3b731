//! A 1M-row transaction streams through the reader in bounded memory: events go on
//! as they are decoded, nothing is collected per transaction.
#![allow(clippy::unwrap_used)]

mod support;

use outbox_event::WalItem;
use support::*;

/// Peak resident set size of this process (VmHWM), in kB.
fn peak_rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_million_row_transaction_streams_in_bounded_memory() {
    const ROWS: u64 = 1_000_000;
    let f = Fixture::new();
    let mut r = spawn_reader(f.config()).await;
    let before = peak_rss_kb();
    let db = f.db.name.clone();
    let insert = tokio::task::spawn_blocking(move || {
        testkit::psql(
            &db,
            &format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'bulk', n::text, 'row', jsonb_build_object('n', n, 'pad', repeat('x', 100))
                   FROM generate_series(1, {ROWS}) AS s(n)"
            ),
        );
    });
    // A consumer that only counts (and checks order), acking at the commit.
    let mut events = 0u64;
    let mut last = 0u64;
    let commit = loop {
        let batch = r.rx.recv().await.expect("stream open");
        let mut done = None;
        for item in batch {
            match item {
                WalItem::Event(e) => {
                    events += 1;
                    let n: u64 = text(&e.aggregate_id).parse().unwrap();
                    assert_eq!(n, last + 1, "insert order");
                    last = n;
                }
                WalItem::Commit(c) if c.events > 0 => done = Some(c),
                _ => {}
            }
        }
        if let Some(c) = done {
            break c;
        }
    };
    insert.await.unwrap();
    assert_eq!(events, ROWS);
    assert_eq!(commit.events, ROWS);
    r.acked.send(commit.end_lsn).unwrap();
    let exit = r.stop().await;
    assert_eq!(exit.flushed, commit.end_lsn);
    let growth_mb = peak_rss_kb().saturating_sub(before) / 1024;
    eprintln!(
        "1M-row transaction: peak RSS grew by {growth_mb} MB (before: {} MB)",
        before / 1024
    );
    // Collecting the transaction would take several hundred MB (each event holds
    // ~200 bytes of struct plus its share of the read buffers).
    assert!(growth_mb < 150, "peak RSS grew by {growth_mb} MB");
}
