//! The AMQP consumer of the queue figures: a fresh exchange with one queue, or several
//! behind a consistent-hash exchange, each with a consumer counting the messages.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use testkit::unique_name;

use super::epoch_secs;

/// A queue bound to a fresh exchange, with a counting consumer; or, from
/// [`Sink::hashed`], several queues behind a consistent-hash exchange, with one counting
/// consumer each.
pub struct Sink {
    pub exchange: String,
    pub queues: Vec<String>,
    /// Messages received, over all the queues.
    pub count: Arc<AtomicUsize>,
    /// When the first message arrived.
    pub first: Arc<OnceLock<Instant>>,
    /// Latencies (seconds) computed from a `t` field (epoch seconds) in the body.
    pub latencies: Arc<Mutex<Vec<f64>>>,
    conn: Connection,
}

/// The header that [`Sink::hashed`]'s exchange hashes: the relay's `aggregate_id`
/// header (one of its default headers, docs/design.md §5), so that every event of
/// an aggregate lands in the same queue, in order.
pub const HASH_HEADER: &str = "aggregate_id";

impl Sink {
    pub async fn new(measure_latency: bool) -> anyhow::Result<Sink> {
        let conn =
            Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
        Self::on(conn, FieldTable::default(), measure_latency).await
    }

    /// A sink on `conn`, its queue declared with `queue_args` (e.g. a quorum queue's).
    pub async fn on(
        conn: Connection,
        queue_args: FieldTable,
        measure_latency: bool,
    ) -> anyhow::Result<Sink> {
        let topic = (ExchangeKind::Topic, FieldTable::default(), "#");
        Self::declare(conn, topic, 1, queue_args, measure_latency).await
    }

    /// `queues` durable classic queues behind an `x-consistent-hash` exchange
    /// (RabbitMQ's plugin `rabbitmq_consistent_hash_exchange`, which
    /// scripts/test-services.sh enables) that hashes the [`HASH_HEADER`] header, each
    /// queue bound with the same weight: the broker-side half of per-aggregate order
    /// (docs/streams.md), which spreads the broker's work over several queue processes.
    pub async fn hashed(queues: usize) -> anyhow::Result<Sink> {
        let conn =
            Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
        let mut args = FieldTable::default();
        args.insert(
            "hash-header".into(),
            lapin::types::AMQPValue::LongString(HASH_HEADER.into()),
        );
        let kind = (ExchangeKind::Custom("x-consistent-hash".into()), args, "1");
        Self::declare(conn, kind, queues, FieldTable::default(), false).await
    }

    /// Declares a fresh exchange of `kind` (its type, arguments and the binding key of
    /// every queue), `queues` queues bound to it, and a counting consumer on each.
    async fn declare(
        conn: Connection,
        (kind, exchange_args, binding): (ExchangeKind, FieldTable, &str),
        queues: usize,
        queue_args: FieldTable,
        measure_latency: bool,
    ) -> anyhow::Result<Sink> {
        let ch = conn.create_channel().await?;
        let exchange = unique_name("bx");
        ch.exchange_declare(
            exchange.as_str().into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            exchange_args,
        )
        .await
        .with_context(|| format!("declare exchange {exchange}"))?;
        let count = Arc::new(AtomicUsize::new(0));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let first = Arc::new(OnceLock::new());
        let mut names = Vec::with_capacity(queues);
        for _ in 0..queues {
            let queue = unique_name("bq");
            ch.queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                queue_args.clone(),
            )
            .await?;
            ch.queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
            let cch = conn.create_channel().await?;
            let mut consumer = cch
                .basic_consume(
                    queue.as_str().into(),
                    "bench".into(),
                    BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            let (c, l, f) = (count.clone(), latencies.clone(), first.clone());
            tokio::spawn(async move {
                let _keep = cch;
                while let Some(Ok(d)) = consumer.next().await {
                    let _ = f.set(Instant::now());
                    if measure_latency {
                        record_latency(&l, &d.data);
                    }
                    c.fetch_add(1, Ordering::Relaxed);
                }
            });
            names.push(queue);
        }
        Ok(Sink {
            exchange,
            queues: names,
            count,
            first,
            latencies,
            conn,
        })
    }

    /// The latencies recorded so far (seconds; with `measure_latency`).
    pub fn latency_samples(&self) -> Vec<f64> {
        self.latencies.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Waits until `n` messages arrived; errors after `timeout`.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.count.load(Ordering::Relaxed) >= n {
                return Ok(Instant::now());
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out with {} of {n} messages",
                    self.count.load(Ordering::Relaxed)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub async fn cleanup(self) {
        if let Ok(ch) = self.conn.create_channel().await {
            for queue in &self.queues {
                let _ = ch
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = ch
                .exchange_delete(self.exchange.as_str().into(), Default::default())
                .await;
        }
        let _ = self.conn.close(200, "bench done".into()).await;
    }
}

/// Adds the latency of a message whose body has a `t` field (epoch seconds) to `into`.
fn record_latency(into: &Mutex<Vec<f64>>, body: &[u8]) {
    let now = epoch_secs();
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if let Some(t) = v.get("t").and_then(|t| t.as_f64()) {
            if let Ok(mut l) = into.lock() {
                l.push(now - t);
            }
        }
    }
}
