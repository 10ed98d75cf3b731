//! Publish rate of the publisher against the test broker.
//!
//! ```text
//! cargo run --release -p publisher --example bench_publish [MESSAGES] [WINDOW]
//! ```
//! Publishes MESSAGES (default 100 000) persistent ~300-byte JSON messages in
//! transactions of 100 to a fresh exchange bound to a fresh durable-less queue,
//! with `max_in_flight` = WINDOW (default 10 000), and prints the rate measured
//! from the first send until the watermark reaches the last commit. Cleans up after.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use lapin::options::{
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalItem};
use publisher::{Publisher, PublisherConfig};
use tokio::sync::{mpsc, watch};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let total: usize = args.next().map_or(100_000, |a| a.parse().unwrap());
    let window: usize = args.next().map_or(10_000, |a| a.parse().unwrap());
    let url = testkit::amqp_url();
    let exchange = testkit::unique_name("bench_x");
    let queue = testkit::unique_name("bench_q");

    let admin = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = admin.create_channel().await.unwrap();
    let mut config = PublisherConfig::new(url.clone(), exchange.clone());
    config.max_in_flight = window;
    let publisher = Publisher::connect(config).await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let table = Arc::new(OutboxTable {
        qualified_name: "public.outbox".into(),
        schema: "public".into(),
        name: "outbox".into(),
        payload_type: 0,
        headers_type: None,
        content_type: "application/json",
    });
    let filler = "x".repeat(280); // body ≈ 300 bytes
    let per_tx = 100;
    let mut batches = Vec::new();
    let mut last_end = Lsn::ZERO;
    for tx in 0..total.div_ceil(per_tx) {
        let base = 0x1_0000_0000 + (tx as u64) * 0x1000;
        let mut items = Vec::with_capacity(per_tx + 1);
        for i in 0..per_tx.min(total - tx * per_tx) {
            let n = tx * per_tx + i;
            let body = Bytes::from(format!(r#"{{"n":{n},"pad":"{filler}"}}"#));
            items.push(WalItem::Event(OutboxEvent {
                table: table.clone(),
                xid: tx as u32,
                commit_lsn: Lsn(base + 0x100),
                commit_time_micros: 1_750_000_000_000_000,
                index: i as u64,
                id: Some(Bytes::from(format!("{:032x}", n))),
                aggregate_type: Some(Bytes::from_static(b"order")),
                aggregate_id: Some(Bytes::from(n.to_string())),
                event_type: Some(Bytes::from_static(b"created")),
                payload: Some(body.clone()),
                body,
                headers: None,
                correlation_id: None,
                exchange: None,
                properties: Vec::new(),
                malformed: None,
            }));
        }
        last_end = Lsn(base + 0x200);
        let events = items.len() as u64;
        items.push(WalItem::Commit(CommitMarker {
            xid: tx as u32,
            commit_lsn: Lsn(base + 0x100),
            end_lsn: last_end,
            commit_time_micros: 1_750_000_000_000_000,
            events,
        }));
        batches.push(items);
    }

    let (tx, rx) = mpsc::channel(64);
    let (wm_tx, mut wm_rx) = watch::channel(Lsn::ZERO);
    let started = Instant::now();
    let task = tokio::spawn(publisher.run(rx, wm_tx, None));
    tokio::spawn(async move {
        for batch in batches {
            if tx.send(batch).await.is_err() {
                break;
            }
        }
    });
    wm_rx.wait_for(|w| *w >= last_end).await.unwrap();
    let elapsed = started.elapsed();
    let report = task.await.unwrap().unwrap();
    println!(
        "{total} messages, window {window}: {:.2?}, {:.0} msgs/s (acked {}, retries {})",
        elapsed,
        total as f64 / elapsed.as_secs_f64(),
        report.acked,
        report.retries
    );

    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let _ = admin.close(200, "done".into()).await;
}
