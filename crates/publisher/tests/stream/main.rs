//! The stream target against the real broker (stream protocol, port 5552): order,
//! the message, and exactly once across restarts, connection cuts and a second
//! producer. Every test has its own stream, deleted at the end.
#![allow(clippy::unwrap_used)]

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use outbox_event::history::History;
use outbox_event::{Lsn, OutboxEvent, WalBatch, WalItem};
use publisher::stream::identity::publishing_id;
use publisher::stream::{StreamConfig, StreamPublisher, StreamSource};
use publisher::{PublishError, PublisherReport};
use rand::{Rng, SeedableRng};
use support::{init_logs, table, Stream as Tx, JSON, PATIENCE};
use testkit::stream::{read, stream_url, StreamMessage, TestStream, Value};
use testkit::stream_proxy::{AfterRefusal, StreamProxy};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

mod exactly_once;
mod filter;
mod frames;
mod order;

/// Transaction sizes, cycled.
const SIZES: [usize; 4] = [1, 3, 50, 700];

/// `n` events in transactions of cycling sizes: the batches (one per transaction),
/// every event in order, and the commit end LSNs.
struct Input {
    batches: Vec<WalBatch>,
    events: Vec<OutboxEvent>,
    ends: Vec<Lsn>,
}

impl Input {
    /// The input of these batches: their events in order, and the commits' end LSNs.
    fn of(batches: Vec<WalBatch>, ends: Vec<Lsn>) -> Input {
        let events = batches
            .iter()
            .flatten()
            .filter_map(|i| match i {
                WalItem::Event(e) => Some(e.clone()),
                _ => None,
            })
            .collect();
        Input {
            batches,
            events,
            ends,
        }
    }
}

fn input(name: &str, n: usize) -> Input {
    let mut tx = Tx::new(table(name, JSON));
    let mut batches = Vec::new();
    let mut left = n;
    let mut k = 0;
    while left > 0 {
        let size = SIZES[k % SIZES.len()].min(left);
        batches.push(tx.transaction(size));
        left -= size;
        k += 1;
    }
    Input::of(batches, tx.ends)
}

fn id_of(e: &OutboxEvent) -> String {
    String::from_utf8(e.id.clone().unwrap().to_vec()).unwrap()
}

/// A named producer's source on timeline 1 (its producer is `<reference>/tl1`).
fn source(reference: &str) -> StreamSource {
    StreamSource {
        reference: reference.to_string(),
        source: format!("test/{reference}"),
        history: History::first(1),
        // Above every commit LSN of the test input (tests/support).
        server_wal: Lsn(0x2_0000_0000),
    }
}

fn config(stream: &str, reference: Option<&str>) -> StreamConfig {
    let mut c = StreamConfig::new(stream_url(), stream);
    c.source = reference.map(source);
    c.backoff_initial = Duration::from_millis(20);
    c.backoff_max = Duration::from_millis(200);
    c
}

struct Running {
    input: mpsc::Sender<WalBatch>,
    watermark: watch::Receiver<Lsn>,
    task: JoinHandle<Result<PublisherReport, PublishError>>,
}

async fn start(config: StreamConfig) -> Running {
    let publisher = StreamPublisher::connect(config).await.unwrap();
    let (input, rx) = mpsc::channel(64);
    let (tx, watermark) = watch::channel(Lsn::ZERO);
    let task = tokio::spawn(publisher.run(rx, tx, None));
    Running {
        input,
        watermark,
        task,
    }
}

/// Feeds every batch from a task (the input channel is bounded).
fn feed(input: mpsc::Sender<WalBatch>, batches: Vec<WalBatch>) -> JoinHandle<()> {
    tokio::spawn(async move {
        for b in batches {
            if input.send(b).await.is_err() {
                return;
            }
        }
    })
}

async fn wait_watermark(w: &mut watch::Receiver<Lsn>, lsn: Lsn) {
    tokio::time::timeout(PATIENCE, w.wait_for(|v| *v >= lsn))
        .await
        .expect("watermark reached in time")
        .unwrap();
}

/// Runs a publisher over the whole input to completion.
async fn publish_all(config: StreamConfig, input: &Input) -> (PublisherReport, Lsn) {
    let run = start(config).await;
    let feeder = feed(run.input, input.batches.clone());
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    feeder.await.unwrap();
    let watermark = *run.watermark.borrow();
    (report, watermark)
}

/// The message ids of `producer`'s messages (all when `None`), in stream order.
fn ids(messages: &[StreamMessage], producer: Option<&str>) -> Vec<String> {
    messages
        .iter()
        .filter(|m| {
            producer.is_none()
                || m.text("x-outbox-producer") == producer.map(|p| format!("{p}/tl1")).as_deref()
        })
        .map(|m| m.message_id.clone().unwrap())
        .collect()
}

fn expected_ids(events: &[OutboxEvent]) -> Vec<String> {
    events.iter().map(id_of).collect()
}
