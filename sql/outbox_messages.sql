-- The outbox without a table: transactional logical decoding messages
-- (docs/messages.md), and who may write them.
--
-- Creates public.outbox_emit(aggregate_type, aggregate_id, event_type, payload jsonb,
-- headers jsonb DEFAULT NULL) RETURNS uuid. It writes one transactional logical
-- message with the prefix 'outbox' into the WAL, inside the caller's transaction, and
-- returns the event's id (a fresh uuid, the message_id consumers deduplicate on). The
-- relay publishes it when the transaction commits, with `[postgres] messages =
-- ["outbox"]`; a rollback discards it. The content is the JSON object the relay reads:
--
--   {"id": "<uuid>", "aggregate_type": …, "aggregate_id": …, "event_type": …,
--    "payload": <any JSON>, "headers": {…}}          (headers only when given)
--
-- Application code calls it in the same transaction as its business change, by its
-- schema-qualified name and with the payload typed jsonb, so that no other function
-- called outbox_emit (one in a schema earlier on the search_path, or an overload
-- taking text that a untyped literal would prefer) is chosen instead:
--
--   BEGIN;
--   UPDATE orders SET status = 'paid' WHERE id = 42;
--   SELECT public.outbox_emit('order', '42', 'order_paid', '{"order_id": 42}'::jsonb);
--   COMMIT;
--
-- Who may emit. By default every role that can connect to a database may call
-- pg_catalog.pg_logical_emit_message (EXECUTE is granted to PUBLIC), and so write a
-- message with the relay's prefix: an event the relay would publish as if the
-- application had. This script therefore:
--
--   1. creates two NOLOGIN roles when they are missing:
--        outbox_emitter  owns outbox_emit and is the only role granted EXECUTE on
--                        pg_logical_emit_message; nobody logs in as it
--        outbox_writer   may EXECUTE outbox_emit; grant it to your application's
--                        roles
--   2. revokes EXECUTE on every overload of pg_catalog.pg_logical_emit_message from
--      PUBLIC — (boolean, text, text) and (boolean, text, bytea), which Postgres 17+
--      replaced with the same two and a fourth argument `flush boolean` — and
--      grants it to outbox_emitter;
--   3. creates outbox_emit, SECURITY DEFINER (it runs as outbox_emitter) with
--      `search_path = pg_catalog, pg_temp` and every function and operator it calls
--      schema-qualified, so nothing a caller creates can run in its place; resets
--      its privileges (every grant but the owner's revoked: CREATE OR REPLACE keeps
--      those of a function that already existed, such as one pre-created in public
--      by a role that may create there, as every role may on Postgres 14, with
--      EXECUTE granted to whomever it chose) and grants EXECUTE to outbox_writer
--      only.
--
-- It also reports what would let another role emit anyway, as warnings naming the
-- roles: members of the emitter role (they may act as it, and so call
-- pg_logical_emit_message directly; the writer role as a member is refused), other
-- functions named outbox_emit (a planted overload), and PUBLIC's CREATE on schema
-- public (Postgres 14's default: revoke it).
--
-- An application role then needs one grant:
--
--   GRANT outbox_writer TO app;
--
-- Superusers can still call pg_logical_emit_message directly (privileges do not apply
-- to them), and so can roles you granted EXECUTE to yourself: the REVOKE below only
-- takes it from PUBLIC. `outbox-relay check` warns while PUBLIC may still emit.
-- Function privileges are per database: run the script in every database the relay
-- reads messages from.
--
-- Run as a superuser (revoking a privilege on a pg_catalog function needs one), in
-- the application's database, without psql's -1 (the script is one transaction of
-- its own, so there is no moment at which PUBLIC could call the new function):
--
--   psql -d app -v ON_ERROR_STOP=1 -f sql/outbox_messages.sql
--   psql -d app -v ON_ERROR_STOP=1 -v emitter_role=my_emitter -v writer_role=my_writer \
--        -f sql/outbox_messages.sql                               (other role names)
--
-- Running it again changes nothing: roles are created only when missing, the function
-- is replaced with the same text, and its privileges reset to the same ones. Run it
-- again after a major upgrade to Postgres 17 or later: the privileges a dump of 14–16
-- carries name the old overloads, which 17 no longer has, so PUBLIC can emit again on
-- the new server (docs/messages.md, "Security").
--
-- Another prefix: change 'outbox' in the function below and `[postgres] messages`.
-- Postgres 14 or newer (pgoutput streams messages since 14). Writing a message works
-- at any wal_level, but only a logical slot of this database decodes it, and a slot
-- needs wal_level = logical (docs/messages.md).

\if :{?emitter_role}
\else
\set emitter_role outbox_emitter
\endif
\if :{?writer_role}
\else
\set writer_role outbox_writer
\endif

BEGIN;

-- Everything below names pg_catalog objects explicitly; nothing a schema on the
-- caller's search_path holds can stand in for them while a superuser runs this.
SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL client_min_messages = warning;
-- The role names, for the DO blocks (psql substitutes no variables inside them).
SET LOCAL outbox_messages.emitter_role = :'emitter_role';
SET LOCAL outbox_messages.writer_role = :'writer_role';

-- 1. The roles. An existing emitter role that is a superuser would make outbox_emit
-- run with every privilege: refused. One that may log in is allowed, with a warning:
-- whoever logs in as it may emit anything.
DO $roles$
DECLARE
    emitter text := pg_catalog.current_setting('outbox_messages.emitter_role');
    writer  text := pg_catalog.current_setting('outbox_messages.writer_role');
    name    text;
    members text;
BEGIN
    IF emitter OPERATOR(pg_catalog.=) writer THEN
        RAISE EXCEPTION 'emitter_role and writer_role must be two roles, both are %', emitter;
    END IF;
    FOREACH name IN ARRAY ARRAY[emitter, writer] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles r
                        WHERE r.rolname OPERATOR(pg_catalog.=) name) THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', name);
        END IF;
    END LOOP;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles r
                WHERE r.rolname OPERATOR(pg_catalog.=) emitter AND r.rolsuper) THEN
        RAISE EXCEPTION 'role % is a superuser: outbox_emit would run with every privilege', emitter
            USING HINT = 'Name another role with -v emitter_role=…; the script creates it NOLOGIN.';
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles r
                WHERE r.rolname OPERATOR(pg_catalog.=) emitter AND r.rolcanlogin) THEN
        RAISE WARNING 'role % can log in: whoever logs in as it can emit any logical message', emitter;
    END IF;
    -- Its members may act as it (SET ROLE, or its privileges inherited) and so
    -- call pg_logical_emit_message directly. The writer role must not be one:
    -- every application would then emit anything. Others are named (superusers
    -- may emit anyway and are not).
    IF pg_catalog.pg_has_role(writer, emitter, 'MEMBER') THEN
        RAISE EXCEPTION 'role % is a member of %: every role granted it could call pg_logical_emit_message directly', writer, emitter
            USING HINT = pg_catalog.format('REVOKE %I FROM %I, then run the script again.', emitter, writer);
    END IF;
    SELECT pg_catalog.string_agg(r.rolname::text, ', ' ORDER BY r.rolname) INTO members
      FROM pg_catalog.pg_roles r, pg_catalog.pg_roles e
     WHERE e.rolname OPERATOR(pg_catalog.=) emitter
       AND r.oid OPERATOR(pg_catalog.<>) e.oid
       AND NOT r.rolsuper
       AND pg_catalog.pg_has_role(r.oid, e.oid, 'MEMBER');
    IF members IS NOT NULL THEN
        RAISE WARNING 'members of role % may call pg_logical_emit_message directly (any content, any prefix): %', emitter, members
            USING HINT = pg_catalog.format('Unless each is meant to, REVOKE %I FROM each of them.', emitter);
    END IF;
END
$roles$;

-- 2. pg_logical_emit_message: every overload this server has (two before Postgres 17,
-- then two with a `flush` argument), from PUBLIC to the emitter role only.
DO $emit$
DECLARE
    emitter text := pg_catalog.current_setting('outbox_messages.emitter_role');
    args    text;
    found   integer := 0;
BEGIN
    FOR args IN
        SELECT pg_catalog.oidvectortypes(p.proargtypes)
          FROM pg_catalog.pg_proc p
         WHERE p.proname OPERATOR(pg_catalog.=) 'pg_logical_emit_message'
           AND p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(%s) FROM PUBLIC', args);
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(%s) TO %I', args, emitter);
        found := found OPERATOR(pg_catalog.+) 1;
    END LOOP;
    IF found OPERATOR(pg_catalog.=) 0 THEN
        RAISE EXCEPTION 'this server has no pg_catalog.pg_logical_emit_message';
    END IF;
END
$emit$;

-- 3. The function applications call.
CREATE OR REPLACE FUNCTION public.outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    event_id uuid := pg_catalog.gen_random_uuid();
    content  jsonb;
BEGIN
    -- What the outbox table's NOT NULL columns refuse, and a headers value the relay
    -- could not read, are refused here, in the caller's transaction, rather than
    -- reaching the relay as a poison message.
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR event_type IS NULL OR payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id, event_type and payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF headers IS NOT NULL
       AND pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION 'outbox_emit: headers must be a JSON object, not %', pg_catalog.jsonb_typeof(headers)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    content := pg_catalog.jsonb_build_object(
        'id', event_id::text,
        'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id,
        'event_type', event_type,
        'payload', payload);
    IF headers IS NOT NULL THEN
        content := content OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('headers', headers);
    END IF;
    -- transactional = true: decoded at commit, in order with the transaction's rows,
    -- and never if it rolls back.
    PERFORM pg_catalog.pg_logical_emit_message(true, 'outbox', content::text);
    RETURN event_id;
END
$fn$;

ALTER FUNCTION public.outbox_emit(text, text, text, jsonb, jsonb) OWNER TO :"emitter_role";

-- 4. Its privileges from scratch: CREATE OR REPLACE keeps the ACL of a function that
-- already existed, so every grant but the owner's is revoked (CASCADE: with what
-- their grant options passed on) before the writer role's one grant.
DO $acl$
DECLARE
    fn      pg_catalog.regprocedure :=
                'public.outbox_emit(text, text, text, jsonb, jsonb)'::pg_catalog.regprocedure;
    grantee oid;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid OPERATOR(pg_catalog.=) fn
           AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        IF grantee OPERATOR(pg_catalog.=) 0 THEN
            EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC CASCADE', fn);
        ELSE
            EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM %I CASCADE',
                                      fn, pg_catalog.pg_get_userbyid(grantee));
        END IF;
    END LOOP;
END
$acl$;
REVOKE ALL ON FUNCTION public.outbox_emit(text, text, text, jsonb, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION public.outbox_emit(text, text, text, jsonb, jsonb) TO :"writer_role";

-- 5. What could still stand in for it: other functions of its name (a call that
-- matches one of them better runs it instead), and PUBLIC's CREATE on public.
DO $planted$
DECLARE
    others text;
BEGIN
    SELECT pg_catalog.string_agg(
               pg_catalog.format('%s (owner %s)', p.oid::pg_catalog.regprocedure,
                                 pg_catalog.pg_get_userbyid(p.proowner)),
               ', ' ORDER BY p.oid::pg_catalog.regprocedure::text)
      INTO others
      FROM pg_catalog.pg_proc p
     WHERE p.proname OPERATOR(pg_catalog.=) 'outbox_emit'
       AND p.oid OPERATOR(pg_catalog.<>)
           'public.outbox_emit(text, text, text, jsonb, jsonb)'::pg_catalog.regprocedure;
    IF others IS NOT NULL THEN
        RAISE WARNING 'other functions named outbox_emit exist: %', others
            USING HINT = 'Call public.outbox_emit(..., payload::jsonb) qualified and typed, as docs/messages.md does, and drop those you did not create.';
    END IF;
    IF pg_catalog.has_schema_privilege('public', 'public', 'CREATE') THEN
        RAISE WARNING 'every role may create objects in schema public (the default before Postgres 15), so any role can plant functions there'
            USING HINT = 'REVOKE CREATE ON SCHEMA public FROM PUBLIC;';
    END IF;
END
$planted$;

COMMIT;
