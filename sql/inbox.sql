-- The consumer-side inbox: which messages a consumer has already processed
-- (docs/consumers.md, "The inbox pattern", explains it).
--
-- The relay delivers at least once: after a relay crash up to `max_in_flight`
-- messages are published again, and a Postgres crash can roll the slot back to its
-- last checkpoint. RabbitMQ redelivers every message a consumer had not acked when
-- its channel closed. Every message keeps its `message_id` (the outbox row id) across
-- all of these, so a consumer that remembers the ids it processed can turn
-- at-least-once delivery into an effect that happens exactly once.
--
-- Run as the owner of the consumer's schema, e.g.
--   psql -d app -v ON_ERROR_STOP=1 -f sql/inbox.sql
-- (idempotent: safe to run again; the example consumer applies it with --init).

CREATE TABLE IF NOT EXISTS inbox (
    -- The AMQP `message_id` property of the delivery (the outbox row id as text).
    message_id   text        NOT NULL,
    -- The logical consumer (service / handler) that processed it. Several consumers
    -- of the same message can share one inbox table: each records its own row.
    consumer     text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, consumer)
);

-- How to use it: one transaction per delivery, and ack only after COMMIT.
--
--   BEGIN;
--   INSERT INTO inbox (message_id, consumer) VALUES ($1, 'billing')
--   ON CONFLICT DO NOTHING;
--   -- rows affected = 1: new message → perform the side effect HERE, in this
--   --                    transaction, e.g.
--   --   UPDATE accounts SET balance = balance + 10 WHERE id = 7;
--   -- rows affected = 0: processed before (a duplicate) → do nothing.
--   COMMIT;
--   -- then basic.ack the delivery (a duplicate is acked as well).
--
-- * The inbox row and the side effect commit or roll back together, so a crash at
--   any point either leaves neither (the redelivery does the work) or both (the
--   redelivery is recognised as a duplicate).
-- * Check the rows affected by the INSERT (tokio-postgres `execute` returns it,
--   JDBC `executeUpdate`, psycopg `cursor.rowcount`, `INSERT … RETURNING` gives a
--   row only when new). Do not SELECT first and INSERT later: two deliveries of the
--   same message handled concurrently would both see "not there yet".
-- * Concurrent duplicates are safe under the default READ COMMITTED isolation: the
--   second INSERT waits for the first transaction's row lock on the primary key,
--   then affects 0 rows if the first committed, or 1 row if it rolled back.
-- * Ack after COMMIT, never before: acking first and crashing before COMMIT loses
--   the message. A crash between COMMIT and ack only causes a redelivery, which the
--   inbox catches.
-- * A side effect outside this database (HTTP call, e-mail, payment) cannot join
--   the transaction: give it an idempotency key derived from message_id instead
--   (docs/consumers.md).

-- Pruning. The table grows by one row per message and consumer. A row is needed as
-- long as a duplicate of its message can still arrive: redeliveries from the broker
-- and from relay crashes arrive within minutes, but `outbox-relay replay`
-- (--from-lsn over the replay window, or --from-table over rows still in the outbox)
-- can re-publish much older messages. Keep rows longer than the longest replay you
-- would run (e.g. the relay's `replay_window` or outbox `[retention] keep`, plus a
-- margin), then delete in small batches, e.g. from cron or pg_cron:
--
--   DELETE FROM inbox
--   WHERE ctid IN (SELECT ctid FROM inbox
--                  WHERE processed_at < now() - interval '30 days'
--                  LIMIT 10000);
--
-- (repeat until it deletes 0 rows). This needs an index on processed_at:
--
--   CREATE INDEX IF NOT EXISTS inbox_processed_at_idx ON inbox (processed_at);
--
-- Do not partition this table by processed_at to drop old partitions: a primary key
-- on a partitioned table must include the partition column, so it would no longer
-- catch a duplicate that arrives in a later partition than its first delivery.
