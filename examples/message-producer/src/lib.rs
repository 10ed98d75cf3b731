//! A producer for outbox-relay without an outbox table (docs/messages.md): the
//! business change and its event in one Postgres transaction, the event written by
//! `outbox_emit` (sql/outbox_messages.sql) as a transactional logical decoding
//! message instead of an outbox row.
//!
//! [`pay_order`] runs, on one connection:
//!
//! ```text
//! BEGIN;
//! UPDATE orders SET status = 'paid', paid_at = now() WHERE id = $1 AND status = 'open'
//!   RETURNING amount_cents;
//! SELECT public.outbox_emit('order', $1::text, 'order_paid', $payload::jsonb, $headers::jsonb)::text;
//! COMMIT;
//! ```
//!
//! The relay (`[postgres] messages = ["outbox"]`) publishes the event once the
//! transaction has committed, in commit order with everything else it relays, with
//! the returned id as its `message_id`. If anything fails before `COMMIT`, the
//! UPDATE and the event are rolled back together and nothing is published.
//!
//! The role the producer connects as needs `UPDATE` on `orders` and membership in
//! the writer role of sql/outbox_messages.sql (`GRANT outbox_writer TO app`); it
//! cannot call `pg_logical_emit_message` itself.

use anyhow::{bail, Context as _};
use tokio_postgres::{Client, NoTls};

/// The example's business table (`message-producer init` creates it). Not an outbox:
/// the events of these changes live only in the WAL.
pub const ORDERS_SQL: &str = "CREATE TABLE IF NOT EXISTS orders (
    id           bigint      PRIMARY KEY,
    status       text        NOT NULL DEFAULT 'open',
    amount_cents bigint      NOT NULL,
    paid_at      timestamptz
)";

/// The aggregate type and event type of [`pay_order`]'s event: with the relay's
/// default routing key `{aggregate_type}.{event_type}` it is published as
/// `order.order_paid`.
pub const AGGREGATE_TYPE: &str = "order";
pub const EVENT_TYPE: &str = "order_paid";

/// Connects to Postgres (`url`: a libpq URL or key=value conninfo) without TLS, as a
/// local example does; a real producer uses its usual pool and TLS settings.
pub async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .context("cannot connect to Postgres; check --postgres-url (PRODUCER_POSTGRES_URL)")?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("Postgres connection closed: {e}");
        }
    });
    Ok(client)
}

/// Creates `orders` if missing and an open order `order_id` for `amount_cents` (an
/// existing order is left as it is).
pub async fn init(client: &Client, order_id: i64, amount_cents: i64) -> anyhow::Result<()> {
    client.batch_execute(ORDERS_SQL).await?;
    client
        .execute(
            "INSERT INTO orders (id, amount_cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
            &[&order_id, &amount_cents],
        )
        .await?;
    Ok(())
}

/// What [`pay_order`] committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paid {
    /// The event's id: the `message_id` the relay publishes it with, and what
    /// consumers deduplicate on.
    pub event_id: String,
    pub amount_cents: i64,
}

/// Marks order `order_id` paid and emits its `order_paid` event, in one
/// transaction. `traceparent`, when given, becomes a header of the published message
/// (a W3C trace context passes through as the `traceparent` header).
///
/// Fails, and commits nothing, when the order is not open or `outbox_emit` refuses
/// the call (no privilege: the role is not a member of the writer role).
pub async fn pay_order(
    client: &mut Client,
    order_id: i64,
    traceparent: Option<&str>,
) -> anyhow::Result<Paid> {
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "UPDATE orders SET status = 'paid', paid_at = now() \
             WHERE id = $1 AND status = 'open' RETURNING amount_cents",
            &[&order_id],
        )
        .await?;
    let Some(row) = row else {
        tx.rollback().await?;
        bail!("order {order_id} is not open (missing or already paid); nothing was emitted");
    };
    let amount_cents: i64 = row.get(0);
    let payload = serde_json::json!({ "order_id": order_id, "amount_cents": amount_cents });
    let headers = traceparent.map(|t| serde_json::json!({ "traceparent": t }).to_string());
    // The event, in the same transaction: written to the WAL now, decoded and
    // published by the relay only if COMMIT succeeds.
    let event_id: String = tx
        .query_one(
            "SELECT public.outbox_emit($1, $2, $3, $4::text::jsonb, $5::text::jsonb)::text",
            &[
                &AGGREGATE_TYPE,
                &order_id.to_string(),
                &EVENT_TYPE,
                &payload.to_string(),
                &headers,
            ],
        )
        .await
        .context(
            "outbox_emit failed; is sql/outbox_messages.sql applied, and is this role \
             granted its writer role (GRANT outbox_writer TO …)?",
        )?
        .get(0);
    tx.commit().await?;
    Ok(Paid {
        event_id,
        amount_cents,
    })
}
