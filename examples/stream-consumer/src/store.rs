//! The consumer's database: its schema, the events it applies, and the offset kept
//! with their effects ([`OffsetStore`]).

use super::*;

/// The consumer's tables (idempotent DDL): its position per stream, and the example's
/// side effect.
///
/// `stream_effects` deliberately has no unique key on the offset or the message id,
/// so a consumer that applied a message twice shows up as duplicate rows instead of
/// as an error.
pub const SCHEMA_SQL: &str = "\
CREATE TABLE IF NOT EXISTS stream_offsets (
    consumer    text        NOT NULL,
    stream      text        NOT NULL,
    -- The offset of the last message applied; NULL: none yet (start at the first).
    last_offset bigint,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream)
);
CREATE TABLE IF NOT EXISTS stream_effects (
    id             bigserial   PRIMARY KEY,
    consumer       text        NOT NULL,
    stream         text        NOT NULL,
    stream_offset  bigint      NOT NULL,
    message_id     text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    commit_lsn     text,
    tx_index       bigint,
    payload        jsonb       NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now()
);";

/// One message of the stream, with the fields docs/streams.md describes.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Its offset in the stream.
    pub offset: u64,
    /// The `message-id` property: the outbox row id.
    pub message_id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// The outbox table, `schema.name`.
    pub table: Option<String>,
    /// The transaction's commit position, `X/Y`.
    pub commit_lsn: Option<String>,
    /// The position of the row in its transaction, from 0.
    pub tx_index: Option<u64>,
    pub xid: Option<u64>,
    /// A copy added by `outbox-relay replay` (application property `replay`).
    pub replay: bool,
    /// The body as JSON; a body that is not JSON is kept as a JSON string.
    pub payload: serde_json::Value,
}

/// An application property value as text (strings as they are, numbers printed).
fn text(value: &SimpleValue) -> Option<String> {
    Some(match value {
        SimpleValue::String(s) => s.clone(),
        SimpleValue::Ulong(v) => v.to_string(),
        SimpleValue::Uint(v) => v.to_string(),
        SimpleValue::Long(v) => v.to_string(),
        SimpleValue::Int(v) => v.to_string(),
        SimpleValue::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

impl Event {
    /// Reads the message delivered at `offset`.
    pub fn from_message(offset: u64, message: &Message) -> Event {
        let message_id = message
            .properties()
            .and_then(|p| p.message_id.as_ref())
            .map(|id| {
                // The id's type is not exported by the client, but converts by
                // reference to its variants' types (the relay sends a string).
                if let Ok(s) = <&String>::try_from(id) {
                    s.clone()
                } else if let Ok(n) = <&u64>::try_from(id) {
                    n.to_string()
                } else if let Ok(n) = <&i64>::try_from(id) {
                    n.to_string()
                } else {
                    format!("{id:?}")
                }
            });
        let app = message.application_properties();
        let prop = |key: &str| app.and_then(|a| a.get(key)).and_then(text);
        let body = message.data().unwrap_or_default();
        let payload = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(_) => serde_json::Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        Event {
            offset,
            message_id,
            aggregate_type: prop("aggregate_type"),
            aggregate_id: prop("aggregate_id"),
            event_type: prop("event_type"),
            table: prop("table"),
            commit_lsn: prop("commit_lsn"),
            tx_index: prop("tx_index").and_then(|v| v.parse().ok()),
            xid: prop("xid").and_then(|v| v.parse().ok()),
            replay: prop("replay").as_deref() == Some("true"),
            payload,
        }
    }
}

/// Where the consumer keeps its position in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tracking {
    /// In `stream_offsets`, in the transaction that applies the messages: exactly once.
    Database,
    /// On the broker (`store_offset` under the consumer name, after the commit): at
    /// least once.
    Server,
}

/// What one [`OffsetStore::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// Messages applied (and committed).
    pub applied: u64,
    /// Messages at or below the stored offset: applied before, nothing done.
    pub skipped: u64,
    /// The stored offset after the commit.
    pub last_offset: Option<u64>,
}

/// Inserts the example's side effect of `event`: one `stream_effects` row.
async fn insert_effect(
    tx: &Transaction<'_>,
    consumer: &str,
    stream: &str,
    event: &Event,
) -> Result<(), tokio_postgres::Error> {
    let payload = event.payload.to_string();
    tx.execute(
        "INSERT INTO stream_effects (consumer, stream, stream_offset, message_id, \
           aggregate_type, aggregate_id, event_type, commit_lsn, tx_index, payload) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::text::jsonb)",
        &[
            &consumer,
            &stream,
            &to_i64(event.offset),
            &event.message_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &event.event_type,
            &event.commit_lsn,
            &event.tx_index.map(to_i64),
            &payload,
        ],
    )
    .await?;
    Ok(())
}

/// Offsets and tx indexes fit a bigint (they count messages).
fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The position and the effects of one consumer on one stream, on one Postgres
/// connection.
pub struct OffsetStore {
    client: Client,
    consumer: String,
    stream: String,
}

impl OffsetStore {
    /// Wraps a connected client and makes sure the consumer's `stream_offsets` row
    /// exists (with no offset when new), so that [`OffsetStore::apply`] always has a
    /// row to lock.
    pub async fn open(
        client: Client,
        consumer: impl Into<String>,
        stream: impl Into<String>,
    ) -> Result<OffsetStore, tokio_postgres::Error> {
        let store = OffsetStore {
            client,
            consumer: consumer.into(),
            stream: stream.into(),
        };
        store.ensure_row().await?;
        Ok(store)
    }

    async fn ensure_row(&self) -> Result<(), tokio_postgres::Error> {
        self.client
            .execute(
                "INSERT INTO stream_offsets (consumer, stream) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
                &[&self.consumer, &self.stream],
            )
            .await?;
        Ok(())
    }

    /// The underlying client (e.g. to check `is_closed`).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Replaces a broken connection.
    pub fn set_client(&mut self, client: Client) {
        self.client = client;
    }

    /// The offset of the last applied message, `None` when nothing was applied yet.
    pub async fn last_offset(&self) -> Result<Option<u64>, tokio_postgres::Error> {
        let row = self
            .client
            .query_opt(
                "SELECT last_offset FROM stream_offsets WHERE consumer = $1 AND stream = $2",
                &[&self.consumer, &self.stream],
            )
            .await?;
        let last: Option<i64> = row.and_then(|r| r.get(0));
        Ok(last.and_then(|v| u64::try_from(v).ok()))
    }

    /// Applies the messages of `events` above the stored offset and stores the new
    /// offset, all in one transaction, committed before this returns. On error the
    /// transaction is rolled back (nothing of it remains): call again with the same
    /// events.
    ///
    /// The stored offset is read `FOR UPDATE`: a second instance of the same consumer
    /// applying the same messages at the same time waits for this transaction, then
    /// finds them applied and skips them.
    pub async fn apply(&mut self, events: &[Event]) -> Result<Applied, tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        let select = "SELECT last_offset FROM stream_offsets \
                      WHERE consumer = $1 AND stream = $2 FOR UPDATE";
        let row = match tx
            .query_opt(select, &[&self.consumer, &self.stream])
            .await?
        {
            Some(row) => row,
            None => {
                // Deleted since `open` (a reset by deleting the row): start over.
                tx.execute(
                    "INSERT INTO stream_offsets (consumer, stream) VALUES ($1, $2) \
                     ON CONFLICT DO NOTHING",
                    &[&self.consumer, &self.stream],
                )
                .await?;
                tx.query_one(select, &[&self.consumer, &self.stream])
                    .await?
            }
        };
        let stored: Option<i64> = row.get(0);
        let mut last = stored.and_then(|v| u64::try_from(v).ok());
        let mut done = Applied::default();
        for event in events {
            if last.is_some_and(|l| event.offset <= l) {
                done.skipped += 1;
                continue;
            }
            insert_effect(&tx, &self.consumer, &self.stream, event).await?;
            last = Some(event.offset);
            done.applied += 1;
        }
        if done.applied > 0 {
            tx.execute(
                "UPDATE stream_offsets SET last_offset = $3, updated_at = now() \
                 WHERE consumer = $1 AND stream = $2",
                &[&self.consumer, &self.stream, &last.map(to_i64)],
            )
            .await?;
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        done.last_offset = last;
        Ok(done)
    }

    /// [`Tracking::Server`]: applies every message of `events` in one transaction,
    /// without recording a position (the caller stores it on the broker afterwards).
    pub async fn apply_untracked(&mut self, events: &[Event]) -> Result<(), tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        for event in events {
            insert_effect(&tx, &self.consumer, &self.stream, event).await?;
        }
        tx.commit().await
    }
}

/// Creates `stream_offsets` and `stream_effects` when missing.
pub async fn init_schema(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(SCHEMA_SQL).await
}

/// Fails with a message naming the fix when a table the consumer needs is missing.
pub async fn check_schema(client: &Client) -> anyhow::Result<()> {
    for table in ["stream_offsets", "stream_effects"] {
        let row = client
            .query_one("SELECT to_regclass($1)::text", &[&table])
            .await
            .context("checking the consumer's tables")?;
        let found: Option<String> = row.get(0);
        if found.is_none() {
            bail!(
                "table {table} does not exist in the consumer's database; run once with \
                 --init to create it (or apply the DDL of docs/streams.md yourself)"
            );
        }
    }
    Ok(())
}

/// Connects to Postgres (libpq URL or key=value conninfo); errors name the setting.
pub async fn connect_postgres(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.with_context(|| {
        format!(
            "cannot connect to Postgres at {}; check --postgres-url \
             (STREAM_CONSUMER_POSTGRES_URL) and that the server is running",
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
