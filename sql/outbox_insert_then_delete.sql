-- The insert-then-delete variant of the outbox (docs/retention.md compares it with
-- `[retention] keep`).
--
-- The application inserts the event and deletes it again in the same transaction as
-- its business change, so the outbox table stays empty and never needs cleaning up:
--
--   BEGIN;
--   UPDATE orders SET status = 'paid' WHERE id = 42;
--   INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
--   VALUES ('6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10', 'order', '42', 'order_paid',
--           '{"order_id": 42}');
--   DELETE FROM outbox WHERE id = '6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10';
--   COMMIT;
--
-- (Generate the id in the application, or take it from INSERT … RETURNING id.) The
-- DELETE must be a separate statement: a DELETE in the same statement as the INSERT
-- (WITH e AS (INSERT … RETURNING id) DELETE … ) does not see the new row, so the row
-- would stay.
--
-- Why this works: logical decoding reads the WAL, not the table. The INSERT is
-- written to the WAL when it happens and decoded when the transaction commits, even
-- though the row is already gone by then; the relay publishes it like any other
-- insert. The publication publishes inserts only, so the DELETE produces nothing.
-- A rolled-back transaction publishes nothing either.
--
-- What you give up: `outbox-relay replay --from-table` has no rows to replay, so
-- recovery after the WAL is lost relies on the replay window (`[relay] replay_window`)
-- instead. `[retention] keep` is pointless here: leave it off.
--
-- The table is the same as in sql/outbox.sql. Without an index on created_at (no
-- retention, no table replay) every write is as cheap as it can be. Autovacuum cleans
-- the dead rows; on a very busy table consider lowering its autovacuum thresholds.
--
--   psql -d app -v ON_ERROR_STOP=1 -f sql/outbox_insert_then_delete.sql

CREATE TABLE outbox (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- Inserts only: the deletes that keep the table empty are not published.
CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert');
