//! The stream target against the real broker (stream protocol, port 5552): order,
//! the message, and exactly once across restarts, connection cuts and a second
//! producer. Every test has its own stream, deleted at the end.
#![allow(clippy::unwrap_used)]

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
        assert_eq!(m.text("x-outbox-producer"), Some("relay-order/tl1"));
        assert_eq!(
            m.number("x-outbox-publishing-id"),
            Some(publishing_id(e.commit_lsn, e.index).unwrap())
        );
        assert_eq!(m.text("x-outbox-source"), Some("test/relay-order"));
        assert_eq!(m.number("x-outbox-timeline"), Some(1));
        assert_eq!(m.application_properties.len(), 14, "{m:?}");
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
    let want: Vec<u64> = input
        .events
        .iter()
        .map(|e| publishing_id(e.commit_lsn, e.index).unwrap())
        .collect();
    assert_eq!(publishing_ids, want);
    assert!(want.windows(2).all(|w| w[0] < w[1]));
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
async fn a_second_producer_does_not_affect_the_first() {
    init_logs();
    let stream = TestStream::create("s_two").await;
    // Producer A stores the first 1000 events of its input, then producer B writes
    // 6000 events after them, with the same commit LSNs (another source's WAL): the
    // same publishing ids under another reference.
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
    // A restarts and gets its whole input again: it sends it all again (the broker's
    // last id may name writes a cut-off leader would lose), and the broker stores
    // only what it did not hold.
    let (report, _) = publish_all(config(&stream.name, Some("relay-a")), &a_input).await;
    assert_eq!(report.published, 1500);
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
    assert!(producers[..a_stored].iter().all(|p| *p == "relay-a/tl1"));
    assert!(producers[a_stored..a_stored + 6000]
        .iter()
        .all(|p| *p == "relay-b/tl1"));
    assert!(producers[a_stored + 6000..]
        .iter()
        .all(|p| *p == "relay-a/tl1"));
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

/// Transactions of small events with some of `big` bytes among them.
fn mixed_input(name: &str, transactions: usize, big: &[usize]) -> Input {
    let mut tx = Tx::new(table(name, JSON));
    let mut batches = Vec::new();
    let mut k = 0;
    for t in 0..transactions {
        let mut items = Vec::new();
        for i in 0..(t % 5 + 1) {
            let size = if (t + i) % 3 == 0 {
                big[k % big.len()]
            } else {
                100
            };
            k += 1;
            let payload = format!("{{\"pad\": \"{}\"}}", "x".repeat(size));
            items.push(WalItem::Event(tx.event(Some(bytes::Bytes::from(payload)))));
        }
        batches.push(tx.commit(items));
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

fn stream_target() -> std::net::SocketAddr {
    let url = stream_url();
    let hostport = url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or("127.0.0.1:5552")
        .to_string();
    hostport.parse().unwrap()
}

/// Events of 700 to 900 KiB among small ones through a broker that enforces a 1 MiB
/// frame maximum: every publish frame fits (none is refused by the broker), every
/// event is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_stay_within_an_enforced_frame_maximum() {
    init_logs();
    let stream = TestStream::create("s_frames").await;
    let proxy = StreamProxy::start(stream_target()).await;
    proxy.set_frame_max(Some(1 << 20));
    let input = mixed_input("big", 30, &[700 << 10, 800 << 10, 900 << 10]);
    let mut cfg = config(&stream.name, Some("relay-frames"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    let (report, watermark) = publish_all(cfg, &input).await;
    assert_eq!(watermark, *input.ends.last().unwrap());
    assert_eq!(proxy.oversized(), 0, "a frame went over the maximum");
    assert_eq!(
        proxy.agreed_frame_max(),
        1 << 20,
        "the proxy enforced the maximum"
    );
    assert_eq!(report.reconnects, 0, "{report:?}");
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

/// An event larger than the frame maximum holds the publisher as a poison message
/// (reported in its status) until the broker's limit is raised; then everything is
/// stored once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_frame_maximum_waits_until_the_limit_is_raised() {
    init_logs();
    let stream = TestStream::create("s_poison").await;
    let proxy = StreamProxy::start(stream_target()).await;
    proxy.set_frame_max(Some(300 << 10));
    let input = mixed_input("poison", 12, &[500 << 10]);
    let mut cfg = config(&stream.name, Some("relay-poison"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.backoff_max = Duration::from_millis(300);
    let publisher = StreamPublisher::connect(cfg).await.unwrap();
    let status = publisher.status();
    let (tx, rx) = mpsc::channel(64);
    let (wtx, _watermark) = watch::channel(Lsn::ZERO);
    let task = tokio::spawn(publisher.run(rx, wtx));
    let feeder = feed(tx, input.batches.clone());
    let poison = tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(p) = status.poison() {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the big event is reported");
    let first_big = input
        .events
        .iter()
        .find(|e| e.body.len() > 300 << 10)
        .unwrap();
    assert_eq!(poison.message_id, id_of(first_big));
    assert_eq!(poison.commit_lsn, first_big.commit_lsn);
    assert!(poison.reason.contains("frame_max"), "{poison:?}");
    assert!(!status.ready());
    // Nothing after it is stored while it waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = stream.read_all().await;
    let k = input
        .events
        .iter()
        .position(|e| e.id == first_big.id)
        .unwrap();
    assert_eq!(ids(&before, None), expected_ids(&input.events[..k]));
    proxy.set_frame_max(Some(1 << 20));
    let report = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .unwrap();
    feeder.await.unwrap();
    assert_eq!(report.abandoned, 0, "{report:?}");
    assert_eq!(status.poison(), None);
    assert_eq!(proxy.oversized(), 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}

/// The broker refuses a publish frame and stores the ones after it: the refused
/// events can no longer be stored under the producer, so the publisher stops with
/// a definite error instead of retrying (which would skip them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_below_a_stored_id_halts() {
    init_logs();
    let stream = TestStream::create("s_refuse").await;
    let proxy = StreamProxy::start(stream_target()).await;
    let input = input("refuse", 3000);
    let mut cfg = config(&stream.name, Some("relay-refuse"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.max_in_flight = 400;
    let mut run = start(cfg).await;
    let feeder = feed(run.input.clone(), input.batches.clone());
    wait_watermark(&mut run.watermark, input.ends[3]).await;
    proxy.refuse_next_publish(AfterRefusal::Pass);
    let result = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher stopped in time")
        .unwrap();
    feeder.abort();
    let e = result.expect_err("a halt");
    assert!(e.is_halt(), "{e}");
    assert!(e.to_string().contains("outbox-relay replay"), "{e}");
    assert_eq!(proxy.refused_frames(), 1);
    stream.delete().await;
}

/// A refused frame with nothing stored after it (the connection ends) is sent again
/// and stored; the refusal is then forgotten: later reconnects raise no alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_then_a_resend_goes_on_exactly_once() {
    init_logs();
    let stream = TestStream::create("s_resend").await;
    let proxy = StreamProxy::start(stream_target()).await;
    let input = input("resend", 4000);
    let mut cfg = config(&stream.name, Some("relay-resend"));
    cfg.urls = vec![format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    )];
    cfg.max_in_flight = 300;
    let mut run = start(cfg).await;
    let feeder = feed(run.input.clone(), input.batches.clone());
    drop(run.input);
    for (n, k) in [3usize, 9].into_iter().enumerate() {
        wait_watermark(&mut run.watermark, input.ends[k]).await;
        proxy.refuse_next_publish(AfterRefusal::Cut);
        while proxy.refused_frames() <= n as u64 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let report = tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("publisher finished in time")
        .unwrap()
        .expect("no halt");
    feeder.await.unwrap();
    assert!(report.reconnects >= 2, "{report:?}");
    assert_eq!(report.abandoned, 0);
    let messages = stream.read_all().await;
    assert_eq!(ids(&messages, None), expected_ids(&input.events));
    stream.delete().await;
}
