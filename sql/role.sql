-- A least-privilege role for outbox-relay.
--
-- Run as a superuser (or a role with CREATEROLE that may grant REPLICATION), in the
-- application's database, after sql/outbox.sql:
--
--   psql -d app -v ON_ERROR_STOP=1 -f sql/role.sql
--   psql -d app -v ON_ERROR_STOP=1 -v relay_role=my_relay -f sql/role.sql  (another name)
--
-- then give the role a password without it appearing in any file or shell history:
--
--   psql -d app -c '\password outbox_relay'
--
-- and allow it in pg_hba.conf for the one database only, over TLS, with SCRAM. A
-- logical replication connection (`replication=database`) matches ordinary
-- *database* lines, not the `replication` keyword, so this one line is all it needs:
--
--   # TYPE  DATABASE  USER          ADDRESS          METHOD
--   hostssl app       outbox_relay  10.0.0.0/8       scram-sha-256
--
-- Do not add a line with the `replication` keyword for this role: that keyword
-- allows *physical* replication (pg_basebackup, a streaming standby), i.e. a full
-- copy of every database of the cluster. Keep `hostssl` (a plain `host` line lets a
-- misconfigured client send its password unencrypted; outbox-relay itself refuses
-- to send a cleartext or md5 password over a plain link, docs/security.md), and
-- connect with sslmode=verify-full and sslrootcert=… in [postgres] url.
--
-- What REPLICATION allows: with the line above, the role may create and drop
-- logical replication slots in the databases it may connect to, and stream every
-- change of the tables in a publication (pgoutput sends only published tables; but
-- the role could create another slot with another output plugin and read every
-- row change of that database, whatever its table grants). A slot keeps WAL on the
-- server's disk until it is consumed: an abandoned slot can fill the disk (set
-- max_slot_wal_keep_size, docs/operations.md). REPLICATION is not superuser: it
-- grants no table access through SQL, no DDL, no file or program access.
--
-- What the relay needs, and why:
--   LOGIN REPLICATION        open a replication connection, create/drop its slot
--   CONNECT on the database  connect at all
--   USAGE on the schema      see the outbox table
--   SELECT on the outbox     the checks before streaming, `peek`, and
--                            `replay --from-table`
--   DELETE on the outbox     only with `[retention] keep` (commented out below)
--   SELECT, INSERT, UPDATE   the relay's stored acked position, so that a Postgres
--   on outbox_relay_state    restart or crash publishes nothing again
--                            (docs/design.md §3); without it the relay still runs,
--                            with one warning saying what that costs
--
-- The publication: CREATE PUBLICATION … FOR TABLE needs CREATE on the database and
-- ownership of every table in it, which a least-privilege role should not have. So
-- the usual setup is: an administrator (the tables' owner) creates the publication
-- once (sql/outbox.sql does), and the relay role only creates and uses its slot
-- (`outbox-relay slot create` leaves an existing publication as it is). If you do
-- want the relay to create the publication, grant CREATE on the database and make
-- the relay role a member of the table owner's role (commented out below).

\if :{?relay_role}
\else
\set relay_role outbox_relay
\endif

CREATE ROLE :"relay_role" LOGIN REPLICATION;

GRANT CONNECT ON DATABASE :"DBNAME" TO :"relay_role";
GRANT USAGE ON SCHEMA public TO :"relay_role";
GRANT SELECT ON public.outbox TO :"relay_role";

-- The stored acked position (one row per slot; never in the publication). Created
-- here because the role may not create tables in public; `slot create` and `run`
-- create it themselves when they may.
-- system_identifier and timeline say which WAL history acked_lsn belongs to (a
-- position of another cluster or timeline is never applied); halted holds why a
-- stream target stopped rather than lose an event (docs/design.md).
-- Quiet: "already exists, skipping" notices are expected when the script runs again.
SET client_min_messages = warning;
CREATE TABLE IF NOT EXISTS public.outbox_relay_state (
    slot_name         text        PRIMARY KEY,
    acked_lsn         pg_lsn      NOT NULL,
    slot_restart_lsn  pg_lsn,
    slot_created_at   timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    system_identifier text,
    timeline          integer,
    halted            text
);
-- A table made by an earlier version of this script gets the newer columns.
ALTER TABLE public.outbox_relay_state
    ADD COLUMN IF NOT EXISTS system_identifier text,
    ADD COLUMN IF NOT EXISTS timeline integer,
    ADD COLUMN IF NOT EXISTS halted text;
RESET client_min_messages;
GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_state TO :"relay_role";

-- Only with [retention] keep = "…" (docs/retention.md): the relay deletes rows whose
-- events are published and confirmed; `run` refuses to start without this grant.
-- GRANT DELETE ON public.outbox TO :"relay_role";

-- Only if the relay itself should create the publication (`slot create`):
-- GRANT CREATE ON DATABASE :"DBNAME" TO :"relay_role";
-- GRANT <owner of public.outbox> TO :"relay_role";
