-- The default outbox table and its publication (docs/operations.md, "Setting up";
-- docs/design.md §5 says what each column becomes).
--
-- Applications insert one row per event in the same transaction as their business
-- change; the relay reads committed inserts from a logical replication slot and
-- publishes them to RabbitMQ. Updates, deletes and truncates of this table are never
-- published, so rows can be deleted at any time (see sql/outbox_insert_then_delete.sql
-- and `[retention] keep`).
--
-- Column names can be changed: tell the relay in its [mapping] section.
--   id             message_id of the published message (consumers deduplicate on it)
--   aggregate_type, aggregate_id, event_type
--                  message headers and routing key fields
--   payload        the message body
--   headers        optional: every key of this JSON object becomes a message header
--   created_at     orders `outbox-relay replay --from-table`
--
-- Run as the owner of the application's schema, e.g.
--   psql -d app -v ON_ERROR_STOP=1 -f sql/outbox.sql

CREATE TABLE outbox (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- Publishes inserts only: pgoutput then sends nothing for updates, deletes and
-- truncates of the table. `outbox-relay slot create` creates this publication when
-- it is missing, provided the relay's role may (see sql/role.sql).
CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert');

-- Optional: only with `[retention] keep` or frequent `replay --from-table`, which
-- select rows by created_at.
-- CREATE INDEX outbox_created_at_idx ON outbox (created_at);
