-- Demo only (docker/compose.yml): gives the least-privilege relay role created by
-- sql/role.sql (run just before this script) the password from RELAY_DB_PASSWORD,
-- so the relay logs in with scram-sha-256 over the network as it would in
-- production. Run by the postgres image's entrypoint on the first start only, with
-- ON_ERROR_STOP: a missing variable stops the initialisation.
\getenv relay_password RELAY_DB_PASSWORD
\if :{?relay_password}
ALTER ROLE outbox_relay PASSWORD :'relay_password';
\else
DO $$ BEGIN RAISE EXCEPTION 'RELAY_DB_PASSWORD is not set on the postgres service'; END $$;
\endif
