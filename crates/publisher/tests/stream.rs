//! The stream target against the real broker (stream protocol, port 5552): order,
//! the message, and exactly once across restarts, connection cuts and a second
//! producer. Every test has its own stream, deleted at the end.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use outbox_event::{Lsn, OutboxEvent, WalBatch, WalItem};
use publisher::stream::{StreamConfig, StreamPublisher};
use publisher::{PublishError, PublisherReport};
use rand::{Rng, SeedableRng};
use support::{init_logs, table, Stream as Tx, JSON, PATIENCE};
use testkit::stream::{read, stream_url, StreamMessage, TestStream, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Transaction sizes, cycled.
const SIZES: [usize; 4] = [1, 3, 50, 700];

/// `n` events in transactions of cycling sizes: the batches (one per transaction),
/// every event in order, and the commit end LSNs.
struct Input {
    batches: Vec<WalBatch>,
    events: Vec<OutboxEvent>,
    ends: Vec<Lsn>,
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
        ends: tx.ends,
    }
}

fn id_of(e: &OutboxEvent) -> String {
    String::from_utf8(e.id.clone().unwrap().to_vec()).unwrap()
}

fn config(stream: &str, reference: Option<&str>) -> StreamConfig {
    let mut c = StreamConfig::new(stream_url(), stream);
    c.producer_reference = reference.map(str::to_string);
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
    let task = tokio::spawn(publisher.run(rx, tx));
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
        .filter(|m| producer.is_none() || m.text("x-outbox-producer") == producer)
        .map(|m| m.message_id.clone().unwrap())
        .collect()
}

fn expected_ids(events: &[OutboxEvent]) -> Vec<String> {
    events.iter().map(id_of).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_mixed_transactions_in_commit_order_with_the_message_fields() {
    init_logs();
    let stream = TestStream::create("s_order").await;
    let input = input("orders", 5000);
    let mut cfg = config(&stream.name, Some("relay-order"));
    cfg.extra_properties = vec![("origin".into(), "test".into())];
    let started = std::time::Instant::now();
    let (report, watermark) = publish_all(cfg, &input).await;
    let elapsed = started.elapsed();
    eprintln!(
        "5000 events in {elapsed:?} ({:.0}/s)",
        5000.0 / elapsed.as_secs_f64()
    );
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(report.watermark, watermark);
    assert_eq!(report.published, 5000);
    assert_eq!(report.acked, 5000);
    assert_eq!(report.abandoned, 0);

    let messages = stream.read_all().await;
    assert_eq!(messages.len(), 5000);
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    for (k, (m, e)) in messages.iter().zip(&input.events).enumerate() {
        assert_eq!(m.offset, k as u64);
        assert_eq!(m.body, e.body.to_vec());
        assert_eq!(m.content_type.as_deref(), Some(JSON));
        assert_eq!(m.creation_time_ms, Some(e.commit_time_micros / 1000));
        assert_eq!(m.text("aggregate_type"), Some("order"));
        assert_eq!(m.text("aggregate_id"), Some(format!("{}", k % 7).as_str()));
        assert_eq!(m.text("event_type"), Some("created"));
        assert_eq!(m.text("table"), Some("public.orders"));
        assert_eq!(
            m.text("commit_lsn"),
            Some(e.commit_lsn.to_string().as_str())
        );
        assert_eq!(m.number("tx_index"), Some(e.index));
        assert_eq!(m.number("xid"), Some(u64::from(e.xid)));
        // The headers column's keys: a JSON number as its text.
        assert_eq!(m.text("seq"), Some(k.to_string().as_str()));
        assert_eq!(m.text("traceparent"), Some(format!("00-t-{k}-01").as_str()));
        assert_eq!(m.text("origin"), Some("test"));
        assert_eq!(m.text("x-outbox-producer"), Some("relay-order"));
        assert_eq!(m.number("x-outbox-publishing-id"), Some(k as u64 + 1));
        assert_eq!(m.application_properties.len(), 12, "{m:?}");
    }
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_across_publisher_restarts_at_seeded_cut_points() {
    init_logs();
    let stream = TestStream::create("s_restart").await;
    let input = input("orders", 3000);
    let reference = "relay-restart";
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    // Transaction indices after whose commit the publisher is killed; index 6 is
    // just before a 700-event transaction, so the kill lands inside it.
    let mut cuts = vec![6usize];
    for _ in 0..4 {
        cuts.push(rng.gen_range(0..input.ends.len() - 1));
    }
    let mut stored_before = 0;
    for (round, &cut) in cuts.iter().enumerate() {
        let mut cfg = config(&stream.name, Some(reference));
        cfg.max_in_flight = [50, 200, 1000][rng.gen_range(0..3)];
        let mut run = start(cfg).await;
        // The slot re-delivers from an older position: the whole input again.
        let feeder = feed(run.input.clone(), input.batches.clone());
        wait_watermark(&mut run.watermark, input.ends[cut]).await;
        run.task.abort();
        feeder.abort();
        let _ = run.task.await;
        // What is in the stream is always a prefix of the input, each once.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = ids(&stream.read_all().await, Some(reference));
        let want = expected_ids(&input.events);
        assert!(
            got.len() <= want.len(),
            "round {round}: {} stored",
            got.len()
        );
        assert_eq!(got, want[..got.len()], "round {round}: not a prefix");
        let confirmed: usize = input.batches[..=cut]
            .iter()
            .flatten()
            .filter(|i| matches!(i, WalItem::Event(_)))
            .count();
        assert!(
            got.len() >= confirmed,
            "round {round}: confirmed events missing"
        );
        eprintln!(
            "round {round}: cut after transaction {cut} ({confirmed} confirmed), {} stored (before: {stored_before})",
            got.len()
        );
        stored_before = got.len();
    }
    // The last run completes.
    let (report, watermark) = publish_all(config(&stream.name, Some(reference)), &input).await;
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(report.abandoned, 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    let publishing_ids: Vec<u64> = messages
        .iter()
        .map(|m| m.number("x-outbox-publishing-id").unwrap())
        .collect();
    assert_eq!(publishing_ids, (1..=3000).collect::<Vec<u64>>());
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_across_connection_cuts_within_a_session() {
    init_logs();
    let stream = TestStream::create("s_cut").await;
    let target: std::net::SocketAddr = "127.0.0.1:5552".parse().unwrap();
    let proxy = testkit::proxy::Proxy::start(target).await;
    let url = format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    );
    let input = input("orders", 5000);
    let mut cfg = config(&stream.name, Some("relay-cut"));
    cfg.urls = vec![url];
    cfg.max_in_flight = 500;
    let mut run = start(cfg).await;
    let feeder = feed(run.input.clone(), input.batches.clone());
    drop(run.input);
    for &k in &[3usize, 9, 14] {
        let reached =
            tokio::time::timeout(PATIENCE, run.watermark.wait_for(|v| *v >= input.ends[k]))
                .await
                .expect("watermark reached in time")
                .is_ok();
        if !reached {
            panic!("the publisher stopped: {:?}", run.task.await);
        }
        // Cut in the middle of the broker's confirms.
        proxy.cut_after(300);
        tokio::time::timeout(PATIENCE, async {
            while !proxy.is_cut() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("cut reached");
        tokio::time::sleep(Duration::from_millis(100)).await;
        proxy.restore();
    }
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    feeder.await.unwrap();
    assert!(report.reconnects >= 3, "{report:?}");
    assert_eq!(report.watermark, *input.ends.last().unwrap());
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_producer_does_not_confuse_the_tail_query() {
    init_logs();
    let stream = TestStream::create("s_two").await;
    // Producer A stores the first 1000 events of its input, then producer B writes
    // 6000 events after them (more than the first read window before the last chunk),
    // with publishing ids overlapping A's.
    let a_input = input("a_orders", 1500);
    let mut a_first = input("a_orders", 1500);
    let cut = a_first
        .batches
        .iter()
        .scan(0, |n, b| {
            *n += b.iter().filter(|i| matches!(i, WalItem::Event(_))).count();
            Some(*n)
        })
        .position(|n| n >= 1000)
        .unwrap();
    a_first.batches.truncate(cut + 1);
    let a_stored: usize = a_first
        .batches
        .iter()
        .flatten()
        .filter(|i| matches!(i, WalItem::Event(_)))
        .count();
    publish_all(config(&stream.name, Some("relay-a")), &a_first).await;
    let b_input = input("b_orders", 6000);
    publish_all(config(&stream.name, Some("relay-b")), &b_input).await;

    let a = StreamPublisher::connect(config(&stream.name, Some("relay-a")))
        .await
        .unwrap();
    let tail = a.tail().expect("a tail");
    let last_stored = &a_input.events[a_stored - 1];
    assert_eq!(tail.commit_lsn, last_stored.commit_lsn);
    assert_eq!(tail.tx_index, last_stored.index);
    drop(a);
    // A restarts and gets its whole input again.
    publish_all(config(&stream.name, Some("relay-a")), &a_input).await;
    let messages = stream.read_all().await;
    assert_eq!(messages.len(), 1500 + 6000);
    assert_eq!(
        ids(&messages, Some("relay-a")),
        expected_ids(&a_input.events)
    );
    assert_eq!(
        ids(&messages, Some("relay-b")),
        expected_ids(&b_input.events)
    );
    // Stream order: A's first part, B, A's rest.
    let producers: Vec<&str> = messages
        .iter()
        .map(|m| m.text("x-outbox-producer").unwrap())
        .collect();
    assert!(producers[..a_stored].iter().all(|p| *p == "relay-a"));
    assert!(producers[a_stored..a_stored + 6000]
        .iter()
        .all(|p| *p == "relay-b"));
    assert!(producers[a_stored + 6000..].iter().all(|p| *p == "relay-a"));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_producer_reference_a_republish_adds_copies() {
    init_logs();
    let stream = TestStream::create("s_copies").await;
    let input = input("orders", 800);
    let mut cfg = config(&stream.name, None);
    cfg.extra_properties = vec![("replay".into(), "true".into())];
    publish_all(cfg.clone(), &input).await;
    publish_all(cfg, &input).await;
    let messages = read(&stream.name, 0).await;
    assert_eq!(messages.len(), 1600);
    let mut want = expected_ids(&input.events);
    want.extend(expected_ids(&input.events));
    assert_eq!(ids(&messages, None), want);
    assert!(messages.iter().all(|m| m.text("replay") == Some("true")
        && !m.application_properties.contains_key("x-outbox-producer")
        && !m
            .application_properties
            .contains_key("x-outbox-publishing-id")));
    assert!(messages.iter().all(
        |m| m.application_properties.get("aggregate_type") == Some(&Value::Str("order".into()))
    ));
    stream.delete().await;
}
