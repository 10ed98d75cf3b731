//! The database cannot be turned against the relay (docs/security.md, "SQL sessions"):
//! a role that may CREATE in `public` plants functions under the names of the catalog
//! functions the relay calls, each recording `current_user` before doing what the
//! real one does (so nothing looks wrong). Every command that calls one runs, and no
//! planted function may run as the relay's role.
#![allow(clippy::unwrap_used)]

use support::scenarios::{anchor, confirmed, insert_one, lsn, lsn_text, poll, WAIT, WINDOW_ENV};
use support::*;

/// The planted functions: same names as the catalog's, with `text` where the
/// catalog has `name` (Postgres prefers `text` for an untyped argument), each
/// calling the real one, then recording its name and `current_user` in
/// `public.hijack` (a slot cannot be created after a write in its transaction).
/// Postgres 15+ lets only the database owner create in `public`: the test's role
/// owns the database, as an application often does.
const PLANT: &str = r#"
CREATE TABLE public.hijack (fn text, who text);
GRANT INSERT ON public.hijack TO PUBLIC;
CREATE FUNCTION public.pg_create_logical_replication_slot(s text, p text,
    OUT slot_name name, OUT lsn pg_lsn) LANGUAGE plpgsql AS $$
BEGIN
  SELECT r.slot_name, r.lsn INTO slot_name, lsn
    FROM pg_catalog.pg_create_logical_replication_slot(s::name, p::name) r;
  INSERT INTO public.hijack VALUES ('pg_create_logical_replication_slot', current_user);
END $$;
CREATE FUNCTION public.pg_create_logical_replication_slot(s text, p text, t boolean,
    tp boolean, f boolean, OUT slot_name name, OUT lsn pg_lsn) LANGUAGE plpgsql AS $$
BEGIN
  SELECT r.slot_name, r.lsn INTO slot_name, lsn
    FROM pg_catalog.pg_create_logical_replication_slot(s::name, p::name, t, tp, f) r;
  INSERT INTO public.hijack VALUES ('pg_create_logical_replication_slot/5', current_user);
END $$;
CREATE FUNCTION public.pg_drop_replication_slot(s text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_catalog.pg_drop_replication_slot(s::name);
  INSERT INTO public.hijack VALUES ('pg_drop_replication_slot', current_user);
END $$;
CREATE FUNCTION public.pg_replication_slot_advance(s text, l pg_lsn,
    OUT slot_name name, OUT end_lsn pg_lsn) LANGUAGE plpgsql AS $$
BEGIN
  SELECT r.slot_name, r.end_lsn INTO slot_name, end_lsn
    FROM pg_catalog.pg_replication_slot_advance(s::name, l) r;
  INSERT INTO public.hijack VALUES ('pg_replication_slot_advance', current_user);
END $$;
CREATE FUNCTION public.pg_copy_logical_replication_slot(a text, b text,
    OUT slot_name name, OUT lsn pg_lsn) LANGUAGE plpgsql AS $$
BEGIN
  SELECT r.slot_name, r.lsn INTO slot_name, lsn
    FROM pg_catalog.pg_copy_logical_replication_slot(a::name, b::name) r;
  INSERT INTO public.hijack VALUES ('pg_copy_logical_replication_slot', current_user);
END $$;
CREATE FUNCTION public.pg_logical_slot_peek_binary_changes(s text, l pg_lsn, n integer,
    VARIADIC o text[]) RETURNS TABLE (lsn pg_lsn, xid xid, data bytea) LANGUAGE plpgsql AS $$
BEGIN
  RETURN QUERY SELECT * FROM pg_catalog.pg_logical_slot_peek_binary_changes(s::name, l, n, VARIADIC o);
  INSERT INTO public.hijack VALUES ('pg_logical_slot_peek_binary_changes', current_user);
END $$;
CREATE FUNCTION public.format_type(t oid, m text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE r text;
BEGIN
  r := pg_catalog.format_type(t, m::integer);
  INSERT INTO public.hijack VALUES ('format_type', current_user);
  RETURN r;
END $$;
"#;

/// What the planted functions recorded since the last call (and forgets it).
fn planted_ran(env: &Env) -> String {
    let rows = env
        .db
        .psql("SELECT string_agg(DISTINCT fn || ' as ' || who, ', ') FROM public.hijack");
    env.db.psql("DELETE FROM public.hijack");
    rows.trim().to_string()
}

/// Each command a planted function can meet: `slot create` (the slot and the replay
/// window's anchor), `peek`, `run` with `replay_window` (the anchor advanced),
/// `replay --from-lsn` (a copy of the anchor, advanced), `replay --from-table`,
/// `slot skip` and `slot drop`. None runs a planted function.
#[tokio::test]
async fn a_function_planted_in_public_never_runs() {
    let mut env = Env::new().await;
    env.db.psql(PLANT);
    let mut ran: Vec<(String, String)> = Vec::new();
    let mut record = |what: &str, env: &Env| {
        let rows = planted_ran(env);
        if !rows.is_empty() {
            ran.push((what.to_string(), rows));
        }
    };
    let window = [(WINDOW_ENV, "2s")];

    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    record("slot create", &env);

    let got = env.consumer().await;
    insert_one(&env, "a");
    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("aggregate=t/a"), "{}", stdout(&out));
    record("peek", &env);

    // A run with a replay window: the anchor trails the live slot by 2 s.
    let relay = env.start_env(&[], &window);
    let msgs = got.wait_for(1, WAIT).await;
    let commit = lsn(&msgs[0].header("commit_lsn").unwrap());
    poll("the anchor to pass the first commit", || {
        confirmed(&env, &anchor(&env)).unwrap_or(0) > commit
    })
    .await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    record("run with replay_window", &env);

    let from = lsn_text(confirmed(&env, &anchor(&env)).unwrap());
    let out = env.cli_env(&["replay", "--from-lsn", &from], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    record("replay --from-lsn", &env);

    let out = env.cli(&["replay", "--from-table"]);
    assert!(out.status.success(), "{}", stderr(&out));
    record("replay --from-table", &env);

    env.db.psql(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('00000000-0000-0000-0000-0000000000aa', 't', 'skip-me', 'e', '{}')",
    );
    let out = env.cli(&[
        "slot",
        "skip",
        "00000000-0000-0000-0000-0000000000aa",
        "--yes",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    record("slot skip", &env);

    let out = env.cli_env(&["slot", "drop"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    record("slot drop", &env);

    assert!(
        ran.is_empty(),
        "planted functions ran as the relay's role: {ran:#?}"
    );
    env.cleanup().await;
}
