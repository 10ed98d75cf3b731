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

/// `sql/inbox.sql`: the processed-messages table (idempotent DDL).
pub const INBOX_SQL: &str = include_str!("../../../sql/inbox.sql");

/// The example's side effect: one row per processed message. Deliberately without a
/// unique key on `message_id`, so a consumer that was not idempotent would show up as
/// duplicate rows here instead of as an error.
pub const SIDE_EFFECTS_SQL: &str = "\
CREATE TABLE IF NOT EXISTS side_effects (
    id           bigserial   PRIMARY KEY,
    message_id   text        NOT NULL,
    consumer     text        NOT NULL,
    aggregate_id text,
    event_type   text,
    payload      jsonb       NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now()
);";

/// The fields of a delivery the consumer uses (docs/design.md §5 message format).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The `message_id` property: the outbox row id, stable across redeliveries.
    pub message_id: String,
    /// The `aggregate_id` header, if present.
    pub aggregate_id: Option<String>,
    /// The `event_type` header, or else the `type` property.
    pub event_type: Option<String>,
    /// The body as JSON; a body that is not JSON is kept as a JSON string.
    pub payload: serde_json::Value,
}

/// Why a delivery cannot be processed at all (retrying would not help).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Message {
    /// Reads a delivery's properties, headers and body.
    pub fn from_delivery(delivery: &Delivery) -> Result<Message, Invalid> {
        Message::from_parts(&delivery.properties, &delivery.data)
    }

    /// Reads the message from AMQP properties and a body.
    pub fn from_parts(properties: &BasicProperties, body: &[u8]) -> Result<Message, Invalid> {
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                Invalid(
                    "the message has no message_id property, so it cannot be deduplicated; \
                     publish it with message_id set (outbox-relay always does)"
                        .to_string(),
                )
            })?;
        let headers = properties.headers().as_ref();
        let header = |key: &str| headers.and_then(|h| h.inner().get(key)).and_then(text);
        let payload = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(_) => serde_json::Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        Ok(Message {
            message_id,
            aggregate_id: header("aggregate_id"),
            event_type: header("event_type")
                .or_else(|| properties.kind().as_ref().map(|t| t.as_str().to_string())),
            payload,
        })
    }
}

/// A header value as text (strings as-is, numbers and booleans printed).
fn text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        _ => return None,
    })
}

/// What handling one delivery did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// New message: its inbox row and its side effect were committed. Ack it.
    Processed,
    /// Processed before (same message_id and consumer): nothing new committed. Ack it.
    Duplicate,
    /// Cannot be processed (no message_id). Reject it without requeue, so it goes to
    /// the queue's dead-letter exchange if one is configured.
    Rejected(String),
}

/// The inbox of one logical consumer on one Postgres connection.
pub struct Inbox {
    client: Client,
    consumer: String,
}

impl Inbox {
    /// Wraps a connected client; `consumer` is the name recorded in `inbox.consumer`.
    pub fn new(client: Client, consumer: impl Into<String>) -> Inbox {
        Inbox {
            client,
            consumer: consumer.into(),
        }
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The underlying client (e.g. to check `is_closed`).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Replaces a broken connection.
    pub fn set_client(&mut self, client: Client) {
        self.client = client;
    }

    /// Handles one delivery: see [`Inbox::handle_message`]. Does not ack.
    pub async fn handle(&mut self, delivery: &Delivery) -> Result<Outcome, tokio_postgres::Error> {
        match Message::from_delivery(delivery) {
            Ok(message) => self.handle_message(&message).await,
            Err(invalid) => Ok(Outcome::Rejected(invalid.0)),
        }
    }

    /// Records the message in the inbox and, only if it is new, performs the side
    /// effect — both in one transaction, committed before this returns. On error the
    /// transaction is rolled back (nothing of it remains) and the caller should retry
    /// later (nack with requeue).
    pub async fn handle_message(
        &mut self,
        message: &Message,
    ) -> Result<Outcome, tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        // The unique key (message_id, consumer) decides. A concurrent transaction that
        // inserted the same key makes this statement wait for it: 0 rows if it
        // committed, 1 row if it rolled back. Never SELECT-then-INSERT instead.
        let inserted = tx
            .execute(
                "INSERT INTO inbox (message_id, consumer) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
                &[&message.message_id, &self.consumer],
            )
            .await?;
        if inserted == 0 {
            // Dropping the transaction rolls it back; there is nothing to keep.
            tx.rollback().await?;
            return Ok(Outcome::Duplicate);
        }
        // The side effect, in the same transaction as the inbox row.
        let payload = message.payload.to_string();
        tx.execute(
            "INSERT INTO side_effects (message_id, consumer, aggregate_id, event_type, payload) \
             VALUES ($1, $2, $3, $4, $5::text::jsonb)",
            &[
                &message.message_id,
                &self.consumer,
                &message.aggregate_id,
                &message.event_type,
                &payload,
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(Outcome::Processed)
    }
}

/// Creates `inbox` (from `sql/inbox.sql`) and `side_effects` when missing.
pub async fn init_schema(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(INBOX_SQL).await?;
    client.batch_execute(SIDE_EFFECTS_SQL).await
}

/// Fails with a message naming the fix when a table the consumer needs is missing.
pub async fn check_schema(client: &Client) -> anyhow::Result<()> {
    for table in ["inbox", "side_effects"] {
        let row = client
            .query_one("SELECT to_regclass($1)::text", &[&table])
            .await
            .context("checking the consumer's tables")?;
        let found: Option<String> = row.get(0);
        if found.is_none() {
            bail!(
                "table {table} does not exist in the consumer's database; run once with \
                 --init to create it (or apply sql/inbox.sql and the side_effects DDL yourself)"
            );
        }
    }
    Ok(())
}

/// Connects to Postgres (libpq URL or key=value conninfo); errors name the setting.
pub async fn connect_postgres(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.with_context(|| {
        format!(
            "cannot connect to Postgres at {}; check --postgres-url (INBOX_POSTGRES_URL) \
             and that the server is running",
            redact(url)
        )
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "Postgres connection closed");
        }
    });
    Ok(client)
}

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

/// Handles one delivery and acks, nacks or rejects it.
async fn dispatch(
    config: &Config,
    stats: &Stats,
    inbox: &mut Inbox,
    backoff: &mut Backoff,
    delivery: Delivery,
) -> anyhow::Result<()> {
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_default();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact("postgresql://app:p%40ss@db:5432/app?sslmode=require"),
            "postgresql://app:***@db:5432/app?sslmode=require"
        );
        assert_eq!(
            redact("postgresql://postgres@127.0.0.1:5432/app"),
            "postgresql://postgres@127.0.0.1:5432/app"
        );
        assert_eq!(
            redact("host=db user=app password=hunter2 dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
        assert_eq!(
            redact("postgresql://db/app?user=app&password=hunter2&sslmode=require"),
            "postgresql://db/app?user=app&password=***&sslmode=require"
        );
    }

    #[test]
    fn reads_relay_messages() {
        let mut headers = FieldTable::default();
        headers.insert(
            "aggregate_id".into(),
            AMQPValue::LongString(LongString::from("42")),
        );
        headers.insert(
            "event_type".into(),
            AMQPValue::LongString(LongString::from("order_paid")),
        );
        headers.insert("xid".into(), AMQPValue::LongLongInt(7));
        let props = BasicProperties::default()
            .with_message_id("abc".into())
            .with_headers(headers);
        let m = Message::from_parts(&props, br#"{"a":1}"#).expect("valid");
        assert_eq!(m.message_id, "abc");
        assert_eq!(m.aggregate_id.as_deref(), Some("42"));
        assert_eq!(m.event_type.as_deref(), Some("order_paid"));
        assert_eq!(m.payload, serde_json::json!({"a": 1}));

        let m = Message::from_parts(&props, b"plain text").expect("valid");
        assert_eq!(m.payload, serde_json::json!("plain text"));

        let err = Message::from_parts(&BasicProperties::default(), b"{}").expect_err("no id");
        assert!(err.0.contains("message_id"), "{err}");
    }

    #[test]
    fn backoff_grows_and_caps() {
        let mut b = Backoff(0);
        let waits: Vec<u64> = (0..10).map(|_| b.next().as_millis() as u64).collect();
        assert_eq!(waits[0], 100);
        assert_eq!(waits[1], 200);
        assert_eq!(*waits.last().expect("some"), 5_000);
    }
}
