//! An idempotent consumer of outbox-relay messages: the inbox pattern.
//!
//! For every delivery, in one Postgres transaction:
//!
//! 1. `INSERT INTO inbox (message_id, consumer) … ON CONFLICT DO NOTHING`;
//! 2. only if that inserted a row (the message is new), perform the side effect — here
//!    a row in `side_effects`;
//! 3. `COMMIT`;
//!
//! and only then ack the delivery. A duplicate (the INSERT affected no row) commits
//! nothing new and is acked as well. A database error rolls everything back and the
//! delivery is nacked with requeue after a backoff, so it is tried again.
//!
//! [`Inbox::handle`] is the per-delivery logic; [`run`] is the consume loop around it
//! that the binary (`src/main.rs`) runs. See `docs/consumers.md`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio_postgres::{Client, NoTls};

mod inbox;
#[cfg(test)]
mod tests;
pub mod trace;

pub use inbox::{
    check_schema, connect_postgres, init_schema, Inbox, Invalid, Message, Outcome, INBOX_SQL,
    SIDE_EFFECTS_SQL,
};

/// A URL or conninfo with its password replaced by `***`, for logs and errors.
pub fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if let Some((userinfo, host)) = authority.rsplit_once('@') {
            if let Some((user, _password)) = userinfo.split_once(':') {
                return format!("{scheme}://{user}:***@{host}{path}");
            }
        }
        // Passwords can also hide in the query string (?password=…).
        return redact_kv(url, '&');
    }
    redact_kv(url, ' ')
}

/// Replaces the value of `password=` in a `sep`-separated key=value list.
fn redact_kv(s: &str, sep: char) -> String {
    let mut out = String::with_capacity(s.len());
    let mut skipping = false;
    let mut i = 0;
    let lower = s.to_ascii_lowercase();
    while i < s.len() {
        if !skipping && lower[i..].starts_with("password=") {
            out.push_str(&s[i..i + "password=".len()]);
            out.push_str("***");
            i += "password=".len();
            skipping = true;
            continue;
        }
        let c = s[i..].chars().next().unwrap_or(' ');
        if skipping && c == sep {
            skipping = false;
        }
        if !skipping {
            out.push(c);
        }
        i += c.len_utf8();
    }
    out
}

/// How the consumer declares its queue (`--declare`).
#[derive(Debug, Clone)]
pub struct Declare {
    /// Exchange to bind to (declared durable `topic` when missing, like the relay does).
    pub exchange: String,
    /// Binding key (`#` = everything on a topic exchange).
    pub binding: String,
    /// Declare a quorum queue (needed for `x-delivery-limit`).
    pub quorum: bool,
    /// Quorum queues: dead-letter a message after this many failed deliveries.
    pub delivery_limit: Option<u32>,
    /// Where rejected / dead-lettered messages go (`x-dead-letter-exchange`).
    pub dead_letter_exchange: Option<String>,
}

/// Everything [`run`] needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub amqp_url: String,
    pub queue: String,
    pub postgres_url: String,
    pub consumer_name: String,
    /// Unacked deliveries the broker sends ahead (basic.qos).
    pub prefetch: u16,
    pub declare: Option<Declare>,
    /// Create the tables when missing.
    pub init: bool,
    /// Test hook: `process::exit(1)` right after committing the N-th new message,
    /// before acking it — a real crash between commit and ack.
    pub exit_after_commit: Option<u64>,
    /// Return once no delivery arrived for this long (batch runs and tests).
    pub exit_when_idle: Option<Duration>,
}

/// Counters of a run, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Deliveries received.
    pub deliveries: AtomicU64,
    /// New messages whose side effect was committed.
    pub processed: AtomicU64,
    /// Duplicates detected by the inbox (acked, nothing committed).
    pub duplicates: AtomicU64,
    /// Rejected deliveries (no message_id).
    pub rejected: AtomicU64,
    /// Database failures (nacked with requeue).
    pub failed: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64) -> u64 {
        counter.fetch_add(1, Ordering::Relaxed) + 1
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "deliveries={} processed={} duplicates={} rejected={} failed={}",
            self.deliveries.load(Ordering::Relaxed),
            self.processed.load(Ordering::Relaxed),
            self.duplicates.load(Ordering::Relaxed),
            self.rejected.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// Declares the exchange and the queue, and binds them.
async fn declare(channel: &Channel, queue: &str, d: &Declare) -> anyhow::Result<()> {
    channel
        .exchange_declare(
            d.exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| {
            format!(
                "cannot declare exchange {:?} as a durable topic exchange; if it exists with \
                 another type or durability, bind to it yourself and drop --declare",
                d.exchange
            )
        })?;
    let mut args = FieldTable::default();
    if d.quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
    }
    if let Some(limit) = d.delivery_limit {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(limit.into()),
        );
    }
    if let Some(dlx) = &d.dead_letter_exchange {
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(dlx.as_str())),
        );
    }
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .with_context(|| {
            format!(
                "cannot declare queue {queue:?}; if it already exists with other arguments \
                 (type, delivery limit, dead-letter exchange), pass the same ones or drop --declare"
            )
        })?;
    channel
        .queue_bind(
            queue.into(),
            d.exchange.as_str().into(),
            d.binding.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("cannot bind queue {queue:?} to exchange {:?}", d.exchange))?;
    tracing::info!(queue, exchange = %d.exchange, binding = %d.binding, "queue declared and bound");
    Ok(())
}

/// Exponential backoff for database failures: 100 ms doubling up to 5 s.
struct Backoff(u32);

impl Backoff {
    fn next(&mut self) -> Duration {
        let ms = 100u64.saturating_mul(1 << self.0.min(6)).min(5_000);
        self.0 = self.0.saturating_add(1);
        Duration::from_millis(ms)
    }
}

/// Connects to both sides and consumes `config.queue` until `shutdown` resolves, the
/// queue stays idle for `exit_when_idle`, or the broker connection fails (an error:
/// restart the consumer; its unacked deliveries are redelivered).
pub async fn run(
    config: &Config,
    stats: Arc<Stats>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let client = connect_postgres(&config.postgres_url).await?;
    if config.init {
        init_schema(&client)
            .await
            .context("creating the inbox and side_effects tables (--init)")?;
    }
    check_schema(&client).await?;
    let mut inbox = Inbox::new(client, config.consumer_name.clone());

    tracing::info!(url = %redact(&config.amqp_url), "connecting to RabbitMQ");
    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default())
        .await
        .with_context(|| {
            format!(
                "cannot connect to RabbitMQ at {}; check --amqp-url (INBOX_AMQP_URL), the \
                 credentials and that the broker is running",
                redact(&config.amqp_url)
            )
        })?;
    let channel = connection
        .create_channel()
        .await
        .context("opening a channel")?;
    if let Some(d) = &config.declare {
        declare(&channel, &config.queue, d).await?;
    } else {
        channel
            .queue_declare(
                config.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| {
                format!(
                    "queue {:?} does not exist; pass --declare (with --exchange and --binding) \
                     to create it and bind it to the relay's exchange",
                    config.queue
                )
            })?;
    }
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await
        .context("setting the prefetch (basic.qos)")?;
    let tag: ShortString = format!("{}-{}", config.consumer_name, std::process::id()).into();
    let mut consumer = channel
        .basic_consume(
            config.queue.as_str().into(),
            tag,
            BasicConsumeOptions::default(), // manual acks
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("cannot consume from queue {:?}", config.queue))?;
    tracing::info!(
        queue = %config.queue,
        consumer = %config.consumer_name,
        prefetch = config.prefetch,
        "consuming"
    );

    let mut backoff = Backoff(0);
    tokio::pin!(shutdown);
    let result = loop {
        let next = async {
            match config.exit_when_idle {
                Some(idle) => tokio::time::timeout(idle, consumer.next()).await.ok(),
                None => Some(consumer.next().await),
            }
        };
        let delivery = tokio::select! {
            biased;
            () = &mut shutdown => {
                tracing::info!("shutting down; unacked deliveries return to the queue");
                break Ok(());
            }
            next = next => match next {
                None => {
                    tracing::info!(idle = ?config.exit_when_idle, "queue idle; exiting");
                    break Ok(());
                }
                Some(None) => break Err(anyhow::anyhow!(
                    "the broker ended the consumer (queue deleted or connection closed); \
                     restart the consumer"
                )),
                Some(Some(Err(e))) => break Err(anyhow::Error::new(e).context(
                    "lost the RabbitMQ connection; restart the consumer (unacked deliveries \
                     are redelivered and deduplicated by the inbox)"
                )),
                Some(Some(Ok(delivery))) => delivery,
            },
        };
        Stats::add(&stats.deliveries);
        if let Err(e) = dispatch(config, &stats, &mut inbox, &mut backoff, delivery).await {
            break Err(e);
        }
    };
    let _ = connection.close(200, "bye".into()).await;
    result
}

/// Handles one delivery in its `process` span, the child of the relay's `publish`
/// span (`trace`, docs/tracing.md), and acks, nacks or rejects it.
async fn dispatch(
    config: &Config,
    stats: &Stats,
    inbox: &mut Inbox,
    backoff: &mut Backoff,
    delivery: Delivery,
) -> anyhow::Result<()> {
    use opentelemetry::trace::Span as _;
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_default();
    let mut span =
        trace::start_process_span(delivery.properties.headers().as_ref(), &config.queue, &id);
    let result = settle(config, stats, inbox, backoff, &id, delivery).await;
    if let Err(e) = &result {
        span.set_status(opentelemetry::trace::Status::error(format!("{e:#}")));
    }
    span.end();
    result
}

/// Acks, nacks or rejects one delivery after the inbox's verdict.
async fn settle(
    config: &Config,
    stats: &Stats,
    inbox: &mut Inbox,
    backoff: &mut Backoff,
    id: &str,
    delivery: Delivery,
) -> anyhow::Result<()> {
    match inbox.handle(&delivery).await {
        Ok(Outcome::Processed) => {
            *backoff = Backoff(0);
            let n = Stats::add(&stats.processed);
            tracing::debug!(message_id = %id, redelivered = delivery.redelivered, "processed");
            if config.exit_after_commit == Some(n) {
                // Test hook: a crash after COMMIT and before the ack. The broker
                // redelivers this message; the inbox must catch it.
                tracing::warn!(message_id = %id, n, "--exit-after-commit: exiting before the ack");
                std::process::exit(1);
            }
            ack(&delivery).await
        }
        Ok(Outcome::Duplicate) => {
            *backoff = Backoff(0);
            Stats::add(&stats.duplicates);
            tracing::info!(message_id = %id, redelivered = delivery.redelivered, "duplicate: already processed, acking");
            ack(&delivery).await
        }
        Ok(Outcome::Rejected(reason)) => {
            Stats::add(&stats.rejected);
            tracing::error!(reason = %reason, "rejecting the delivery without requeue");
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .context("rejecting a delivery")?;
            Ok(())
        }
        Err(e) => {
            Stats::add(&stats.failed);
            let wait = backoff.next();
            tracing::warn!(
                message_id = %id,
                error = %e,
                retry_in = ?wait,
                "database error; rolled back, the delivery will be requeued"
            );
            tokio::time::sleep(wait).await;
            if inbox.client().is_closed() {
                match connect_postgres(&config.postgres_url).await {
                    Ok(client) => {
                        tracing::info!("reconnected to Postgres");
                        inbox.set_client(client);
                    }
                    Err(e) => tracing::warn!(error = format!("{e:#}"), "Postgres reconnect failed"),
                }
            }
            delivery
                .acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
                .context("nacking a delivery")?;
            Ok(())
        }
    }
}

async fn ack(delivery: &Delivery) -> anyhow::Result<()> {
    delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .context("acking a delivery (it was committed; a redelivery will be a duplicate)")?;
    Ok(())
}
