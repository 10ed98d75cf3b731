//! Helpers for the publisher's tests against the real RabbitMQ (testkit's broker).
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use outbox_event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
use publisher::{Publisher, PublisherConfig, PublisherReport};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Generous bound for anything that waits on the broker (not a timing assertion:
/// it only turns a hang into a failure).
pub const PATIENCE: Duration = Duration::from_secs(60);

pub fn config(exchange: &str) -> PublisherConfig {
    let mut c = PublisherConfig::new(testkit::amqp_url(), exchange);
    c.connection_name = testkit::unique_name("pubtest");
    c.backoff_initial = Duration::from_millis(20);
    c.backoff_max = Duration::from_millis(300);
    c
}

/// The test's own connection and channel for declaring, consuming and cleaning up.
pub struct Broker {
    pub connection: Connection,
    pub channel: Channel,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Broker {
    pub async fn new() -> Broker {
        let connection = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        Broker {
            connection,
            channel,
            queues: Vec::new(),
            exchanges: Vec::new(),
        }
    }

    pub async fn exchange(&mut self, name: &str, kind: ExchangeKind) {
        self.channel
            .exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        self.exchanges.push(name.to_string());
    }

    /// Remembers an exchange the publisher declares, for cleanup.
    pub fn forget_exchange_later(&mut self, name: &str) {
        self.exchanges.push(name.to_string());
    }

    /// Declares a queue (expiring on its own if a test dies before cleanup).
    pub async fn queue(&mut self, name: &str, mut arguments: FieldTable) {
        arguments.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        self.channel
            .queue_declare(name.into(), QueueDeclareOptions::default(), arguments)
            .await
            .unwrap();
        self.queues.push(name.to_string());
    }

    pub async fn bind(&self, queue: &str, exchange: &str, key: &str) {
        self.channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }

    /// Declares a durable topic exchange named `{prefix}_x_…`.
    pub async fn topic_exchange(&mut self, prefix: &str) -> String {
        let exchange = testkit::unique_name(&format!("{prefix}_x"));
        self.exchange(&exchange, ExchangeKind::Topic).await;
        exchange
    }

    /// Declares a queue named `{prefix}_q_…` (with `arguments`) bound to `exchange`
    /// with `#` (everything).
    pub async fn bound_queue(
        &mut self,
        prefix: &str,
        exchange: &str,
        arguments: FieldTable,
    ) -> String {
        let queue = testkit::unique_name(&format!("{prefix}_q"));
        self.queue(&queue, arguments).await;
        self.bind(&queue, exchange, "#").await;
        queue
    }

    /// A topic exchange and a plain queue bound to it with `#`: `(exchange, queue)`.
    pub async fn topic_queue(&mut self, prefix: &str) -> (String, String) {
        let exchange = self.topic_exchange(prefix).await;
        let queue = self
            .bound_queue(prefix, &exchange, FieldTable::default())
            .await;
        (exchange, queue)
    }

    /// A consumer on its own channel that needs no acks (fast).
    pub async fn fast_consumer(&self, queue: &str) -> Consumer {
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .basic_consume(
                queue.into(),
                testkit::unique_name("c").into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
    }

    /// A consumer on its own channel with the given prefetch (manual acks).
    pub async fn consumer(&self, queue: &str, prefetch: u16) -> Consumer {
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .unwrap();
        channel
            .basic_consume(
                queue.into(),
                testkit::unique_name("c").into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap()
    }

    pub async fn cleanup(self) {
        for q in &self.queues {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for e in &self.exchanges {
            let _ = self
                .channel
                .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.connection.close(200, "done".into()).await;
    }
}

/// The next delivery, failing after [`PATIENCE`] of silence (`got` of `n` so far).
async fn next_delivery(consumer: &mut Consumer, got: usize, n: usize) -> Delivery {
    tokio::time::timeout(PATIENCE, consumer.next())
        .await
        .unwrap_or_else(|_| panic!("only {got} of {n} messages arrived"))
        .unwrap()
        .unwrap()
}

/// Receives `n` deliveries from a [`Broker::fast_consumer`].
pub async fn receive_fast(consumer: &mut Consumer, n: usize) -> Vec<Delivery> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.push(next_delivery(consumer, out.len(), n).await);
    }
    out
}

/// Receives `n` deliveries (acking each), failing after [`PATIENCE`] of silence.
pub async fn receive(consumer: &mut Consumer, n: usize) -> Vec<Delivery> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let delivery = next_delivery(consumer, out.len(), n).await;
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
        out.push(delivery);
    }
    out
}

pub fn header<'a>(d: &'a Delivery, key: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(key)
}

pub fn header_text(d: &Delivery, key: &str) -> String {
    match header(d, key) {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("header {key} is not a string: {other:?}"),
    }
}

pub fn message_id(d: &Delivery) -> String {
    d.properties.message_id().as_ref().unwrap().to_string()
}

/// `content_type` of a JSON payload column (the reader chooses it).
pub const JSON: &str = "application/json";

/// A table as the reader describes it (the publisher reads only its name and the
/// content type the reader chose; the type OIDs are left 0).
pub fn table(name: &str, content_type: &'static str) -> Arc<OutboxTable> {
    Arc::new(OutboxTable {
        qualified_name: format!("public.{name}"),
        schema: "public".into(),
        name: name.into(),
        payload_type: 0,
        headers_type: None,
        content_type,
    })
}

/// Builds transactions of events with increasing LSNs, like the reader does.
pub struct Stream {
    pub table: Arc<OutboxTable>,
    lsn: u64,
    xid: u32,
    pub events: u64,
    /// Commit end LSN of every transaction built so far, in order.
    pub ends: Vec<Lsn>,
    /// For each message id, the end LSN of its transaction.
    pub end_of: HashMap<String, Lsn>,
}

pub const COMMIT_TIME_MICROS: i64 = 1_750_000_000_000_000;

impl Stream {
    pub fn new(table: Arc<OutboxTable>) -> Stream {
        Stream {
            table,
            lsn: 0x1_0000_0000,
            xid: 1000,
            events: 0,
            ends: Vec::new(),
            end_of: HashMap::new(),
        }
    }

    /// An event whose payload is `payload` (the reader's body of it: NULL is empty).
    pub fn event(&mut self, payload: Option<Bytes>) -> OutboxEvent {
        let n = self.events;
        self.events += 1;
        OutboxEvent {
            table: self.table.clone(),
            xid: self.xid,
            commit_lsn: Lsn(self.lsn + 0x100),
            commit_time_micros: COMMIT_TIME_MICROS + n as i64,
            // Set by `commit`, which knows the event's place in its transaction.
            index: 0,
            id: Some(Bytes::from(format!("id-{n:08}"))),
            aggregate_type: Some(Bytes::from_static(b"order")),
            aggregate_id: Some(Bytes::from(format!("{}", n % 7))),
            event_type: Some(Bytes::from_static(b"created")),
            body: payload.clone().unwrap_or_default(),
            payload,
            headers: Some(Bytes::from(format!(
                r#"{{"seq":{n},"traceparent":"00-t-{n}-01"}}"#
            ))),
            correlation_id: Some(Bytes::from(format!("corr-{n}"))),
            exchange: None,
            properties: Vec::new(),
            malformed: None,
        }
    }

    /// One transaction of `n` JSON events: its items, ending with the commit.
    pub fn transaction(&mut self, n: usize) -> WalBatch {
        let mut items = Vec::with_capacity(n + 1);
        for _ in 0..n {
            let payload = Bytes::from(format!(r#"{{"n": {}}}"#, self.events));
            items.push(WalItem::Event(self.event(Some(payload))));
        }
        self.commit(items)
    }

    /// Appends the commit marker of the current transaction to `items`.
    pub fn commit(&mut self, mut items: Vec<WalItem>) -> WalBatch {
        let events = items
            .iter()
            .filter(|i| matches!(i, WalItem::Event(_)))
            .count();
        let end = Lsn(self.lsn + 0x200);
        let mut index = 0;
        for item in &mut items {
            if let WalItem::Event(e) = item {
                e.index = index;
                index += 1;
                let id = String::from_utf8(e.id.clone().unwrap().to_vec()).unwrap();
                self.end_of.insert(id, end);
            }
        }
        items.push(WalItem::Commit(CommitMarker {
            xid: self.xid,
            commit_lsn: Lsn(self.lsn + 0x100),
            end_lsn: end,
            commit_time_micros: COMMIT_TIME_MICROS,
            events: events as u64,
        }));
        self.ends.push(end);
        self.lsn += 0x1000;
        self.xid += 1;
        items
    }
}

/// A running publisher: its input, its watermark and its task.
pub struct Running {
    pub input: Option<mpsc::Sender<WalBatch>>,
    pub watermark: watch::Receiver<Lsn>,
    pub status: publisher::PublisherStatus,
    pub task: JoinHandle<Result<PublisherReport, publisher::PublishError>>,
    /// Every watermark value seen, in order (recorded by a watcher task).
    pub seen: Arc<std::sync::Mutex<Vec<Lsn>>>,
}

/// Logs go to the test's captured output (shown when it fails); `RUST_LOG` filters.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "publisher=info".into()),
        )
        .with_test_writer()
        .try_init();
}

pub async fn start(config: PublisherConfig) -> Running {
    init_logs();
    let publisher = Publisher::connect(config).await.unwrap();
    let status = publisher.status();
    let (tx, rx) = mpsc::channel(16);
    let (wm_tx, wm_rx) = watch::channel(Lsn::ZERO);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut watcher = wm_rx.clone();
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while watcher.changed().await.is_ok() {
            let lsn = *watcher.borrow_and_update();
            seen2.lock().unwrap().push(lsn);
        }
    });
    let task = tokio::spawn(publisher.run(rx, wm_tx, None));
    Running {
        input: Some(tx),
        watermark: wm_rx,
        status,
        task,
        seen,
    }
}

impl Running {
    pub async fn send(&self, batch: WalBatch) {
        self.input.as_ref().unwrap().send(batch).await.unwrap();
    }

    /// Waits until the watermark reaches at least `lsn`.
    pub async fn wait_watermark(&mut self, lsn: Lsn) {
        let reached = tokio::time::timeout(PATIENCE, self.watermark.wait_for(|w| *w >= lsn))
            .await
            .is_ok();
        assert!(
            reached,
            "watermark stuck at {} waiting for {lsn}",
            *self.watermark.borrow()
        );
    }

    /// Closes the input and waits for `run` to return.
    pub async fn finish(mut self) -> PublisherReport {
        self.input = None;
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("run returns after its input closes")
            .unwrap()
            .unwrap()
    }

    /// Checks that the watermark only took commit end LSNs, increasing.
    pub fn assert_watermarks_valid(&self, ends: &[Lsn]) {
        let seen = self.seen.lock().unwrap();
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "watermark went backwards: {seen:?}"
        );
        for w in seen.iter() {
            assert!(ends.contains(w), "watermark {w} is not a commit end LSN");
        }
    }
}
