//! The inbox: the consumer's tables, a message as delivered, and the transaction
//! that records it once with its effects ([`Inbox`]).

use super::*;

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
