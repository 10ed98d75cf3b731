//! Who may write the relay's logical messages (docs/messages.md, "Security"):
//! sql/outbox_messages.sql against the real test Postgres. By default every role may
//! call `pg_logical_emit_message` and so inject events; after the script only
//! `outbox_emit` may, for the roles granted the writer role, and what it writes is a
//! transactional message in the WAL that a rollback discards.
//!
//! Each test has its own database and its own role names (the script takes them as
//! psql variables): roles are cluster-wide, privileges on `pg_catalog` functions are
//! per database, so the tests run in parallel without meeting.
#![allow(clippy::unwrap_used)]

use support::DropRole;
use testkit::{pg_port, unique_name, TestDb};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../sql/outbox_messages.sql");

/// The prefix `outbox_emit` writes (sql/outbox_messages.sql).
const PREFIX: &str = "outbox";

/// One test's database and roles: the script's two (under unique names), an
/// application role granted the writer role, and a plain role granted nothing.
struct World {
    /// Drops the roles (their objects in `db` first); declared before `db`, so
    /// dropped before it (fields drop in declaration order).
    _roles: Vec<DropRole>,
    db: TestDb,
    emitter: String,
    writer: String,
    app: String,
    plain: String,
}

impl World {
    fn new() -> World {
        let db = TestDb::new("emit");
        let emitter = unique_name("emitter");
        let writer = unique_name("writer");
        let app = unique_name("app");
        let plain = unique_name("plain");
        // The script creates emitter and writer; the guards drop all four, also
        // when a test fails.
        let roles = [&app, &plain, &writer, &emitter]
            .iter()
            .map(|r| DropRole {
                role: r.to_string(),
                db: db.name.clone(),
            })
            .collect();
        testkit::psql(
            "postgres",
            &format!("CREATE ROLE {app} LOGIN; CREATE ROLE {plain} LOGIN;"),
        );
        // A business table the application updates in the same transaction.
        db.psql(&format!(
            "CREATE TABLE public.accounts (id int PRIMARY KEY, balance int NOT NULL);
             INSERT INTO public.accounts VALUES (1, 100);
             GRANT SELECT, UPDATE ON public.accounts TO {app};"
        ));
        World {
            _roles: roles,
            db,
            emitter,
            writer,
            app,
            plain,
        }
    }

    /// Runs sql/outbox_messages.sql with this world's role names.
    fn apply_script(&self) {
        testkit::psql_file_at(
            pg_port(),
            &self.db.name,
            SCRIPT,
            &[
                ("emitter_role", self.emitter.as_str()),
                ("writer_role", self.writer.as_str()),
            ],
        );
    }

    /// `GRANT <writer> TO <app>`, as docs/messages.md tells an operator to.
    fn grant_writer_to_app(&self) {
        testkit::psql(
            "postgres",
            &format!("GRANT {} TO {}", self.writer, self.app),
        );
    }

    /// A connection to this database as `role` (trust on 127.0.0.1 in the test
    /// cluster's pg_hba.conf).
    async fn connect_as(&self, role: &str) -> Client {
        let conninfo = format!(
            "host=127.0.0.1 port={} user={role} dbname={}",
            pg_port(),
            self.db.name
        );
        let (client, conn) = tokio_postgres::connect(&conninfo, NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }
}

/// Every overload of `pg_catalog.pg_logical_emit_message` on this server: its
/// signature and a call of exactly it (explicit casts), e.g.
/// `pg_catalog.pg_logical_emit_message(true, 'outbox'::text, '{}'::bytea, false)`.
async fn overloads(client: &Client) -> Vec<(String, String)> {
    let rows = client
        .query(
            "SELECT p.oid::regprocedure::text,
                    ARRAY(SELECT pg_catalog.format_type(t, NULL)
                            FROM pg_catalog.unnest(p.proargtypes::oid[]) WITH ORDINALITY AS a(t, i)
                           ORDER BY i)
               FROM pg_catalog.pg_proc p
              WHERE p.proname = 'pg_logical_emit_message'
                AND p.pronamespace = 'pg_catalog'::regnamespace
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let calls: Vec<(String, String)> = rows
        .iter()
        .map(|row| {
            let signature: String = row.get(0);
            let types: Vec<String> = row.get(1);
            let args: Vec<String> = types
                .iter()
                .enumerate()
                .map(|(i, t)| match (i, t.as_str()) {
                    (0, "boolean") => "true".to_string(),
                    (1, "text") => format!("'{PREFIX}'::text"),
                    (2, "text") => "'{}'::text".to_string(),
                    (2, "bytea") => "'\\x7b7d'::bytea".to_string(),
                    (3, "boolean") => "false".to_string(),
                    _ => panic!("{signature}: unexpected argument {i} of type {t}"),
                })
                .collect();
            let call = format!("pg_catalog.pg_logical_emit_message({})", args.join(", "));
            (signature, call)
        })
        .collect();
    // (boolean, text, text) and (boolean, text, bytea); Postgres 17 added `flush`
    // to both.
    assert_eq!(calls.len(), 2, "{calls:?}");
    calls
}

/// Whether PUBLIC may execute each overload (what `outbox-relay check` asks).
async fn public_may_emit(client: &Client) -> Vec<(String, bool)> {
    client
        .query(
            "SELECT p.oid::regprocedure::text,
                    pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')
               FROM pg_catalog.pg_proc p
              WHERE p.proname = 'pg_logical_emit_message'
                AND p.pronamespace = 'pg_catalog'::regnamespace
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

fn is_permission_denied(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE)
}

/// Before the script any role may emit, through every overload (the reason for
/// the script: this is what the test would see if it revoked nothing); after it, a
/// plain role may call no overload and not `outbox_emit` either, and PUBLIC holds
/// EXECUTE on none of them.
#[tokio::test]
async fn only_the_script_stops_public_from_emitting() {
    let w = World::new();
    let admin = w.db.client().await;
    let plain = w.connect_as(&w.plain).await;
    let calls = overloads(&admin).await;

    for (signature, call) in &calls {
        plain
            .query_one(&format!("SELECT {call}"), &[])
            .await
            .unwrap_or_else(|e| panic!("before the script, {signature} as a plain role: {e}"));
    }
    assert!(
        public_may_emit(&admin).await.iter().all(|(_, may)| *may),
        "the default this test relies on: PUBLIC may emit"
    );

    w.apply_script();

    for (signature, call) in &calls {
        match plain.query_one(&format!("SELECT {call}"), &[]).await {
            Ok(_) => panic!("a plain role still calls {signature} after the script"),
            Err(e) => assert!(is_permission_denied(&e), "{signature}: {e}"),
        }
    }
    let public = public_may_emit(&admin).await;
    assert!(
        public.iter().all(|(_, may)| !*may),
        "PUBLIC may still emit: {public:?}"
    );
    let err = plain
        .query_one("SELECT public.outbox_emit('t', '1', 'e', '{}')", &[])
        .await
        .expect_err("a plain role called outbox_emit");
    assert!(is_permission_denied(&err), "{err}");
    // Only the emitter role holds EXECUTE on pg_logical_emit_message; the writer
    // role and the application only reach it through outbox_emit.
    for (role, expected) in [(&w.emitter, true), (&w.writer, false), (&w.plain, false)] {
        let row = admin
            .query_one(
                "SELECT bool_and(pg_catalog.has_function_privilege($1::text, p.oid, 'EXECUTE'))
                   FROM pg_catalog.pg_proc p
                  WHERE p.proname = 'pg_logical_emit_message'
                    AND p.pronamespace = 'pg_catalog'::regnamespace",
                &[role],
            )
            .await
            .unwrap();
        let may: bool = row.get(0);
        assert_eq!(
            may, expected,
            "EXECUTE on pg_logical_emit_message for {role}"
        );
    }
}

/// A role granted the writer role gets a uuid from `outbox_emit`, and still cannot
/// call `pg_logical_emit_message` itself: the only content it can write is the
/// one `outbox_emit` builds.
#[tokio::test]
async fn a_writer_emits_through_outbox_emit_only() {
    let w = World::new();
    w.apply_script();
    w.grant_writer_to_app();
    let admin = w.db.client().await;
    let app = w.connect_as(&w.app).await;

    let row = app
        .query_one(
            "SELECT public.outbox_emit('order', '42', 'order_paid', '{\"order_id\": 42}')::text",
            &[],
        )
        .await
        .unwrap();
    let id: String = row.get(0);
    let parsed = uuid::Uuid::parse_str(&id).unwrap();
    assert_eq!(parsed.get_version_num(), 4, "{id}");

    for (signature, call) in overloads(&admin).await {
        let err = app
            .query_one(&format!("SELECT {call}"), &[])
            .await
            .expect_err("a writer called pg_logical_emit_message directly");
        assert!(is_permission_denied(&err), "{signature}: {err}");
    }
}

/// One decoded `M` message of pgoutput (protocol 1, not streamed).
#[derive(Debug)]
struct Message {
    transactional: bool,
    prefix: String,
    content: serde_json::Value,
}

/// pgoutput's Message: 'M', flags (1 = transactional), LSN, prefix (C string),
/// length, content. `None` for any other message.
fn parse_message(data: &[u8]) -> Option<Message> {
    let (&tag, rest) = data.split_first()?;
    if tag != b'M' {
        return None;
    }
    let flags = rest[0];
    let rest = &rest[1 + 8..];
    let nul = rest.iter().position(|&b| b == 0).unwrap();
    let prefix = String::from_utf8(rest[..nul].to_vec()).unwrap();
    let rest = &rest[nul + 1..];
    let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
    let content = &rest[4..4 + len];
    assert_eq!(rest.len(), 4 + len, "the message ends with its content");
    Some(Message {
        transactional: flags & 1 == 1,
        prefix,
        content: serde_json::from_slice(content).unwrap(),
    })
}

/// The pgoutput messages pending on `slot` (peeked, not consumed), as their type
/// byte and, for `M`, the decoded message.
async fn peek(admin: &Client, slot: &str, publication: &str) -> Vec<(char, Option<Message>)> {
    admin
        .query(
            "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
            &[&slot, &publication],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let data: Vec<u8> = row.get(0);
            (data[0] as char, parse_message(&data))
        })
        .collect()
}

/// What `outbox_emit` writes is a transactional message with the prefix `outbox`
/// in the WAL, decoded by a pgoutput slot inside its transaction after the
/// business UPDATE written before it, carrying the returned id and the fields the
/// relay reads; the call of a rolled-back transaction leaves nothing to decode.
#[tokio::test]
async fn the_message_is_in_the_wal_and_a_rollback_leaves_none() {
    let w = World::new();
    w.apply_script();
    w.grant_writer_to_app();
    let admin = w.db.client().await;
    let slot = unique_name("slot");
    let publication = unique_name("pub");
    // Two statements, two transactions: a slot cannot be created after a write in
    // its transaction.
    admin
        .batch_execute(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE public.accounts"
        ))
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();

    let mut app = w.connect_as(&w.app).await;
    let emit = "SELECT public.outbox_emit($1, $2, $3, $4::text::jsonb, $5::text::jsonb)::text";

    // Committed: the business change, then the event.
    let tx = app.transaction().await.unwrap();
    tx.execute(
        "UPDATE public.accounts SET balance = balance - 10 WHERE id = 1",
        &[],
    )
    .await
    .unwrap();
    let committed: String = tx
        .query_one(
            emit,
            &[
                &"account",
                &"1",
                &"debited",
                &"{\"amount\": 10}",
                &Some("{\"traceparent\": \"00-abc-def-01\"}"),
            ],
        )
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();

    // Rolled back: nothing of it may reach the slot.
    let tx = app.transaction().await.unwrap();
    let rolled_back: String = tx
        .query_one(emit, &[&"account", &"1", &"debited", &"{}", &None::<&str>])
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();

    // Committed after the rollback (so the peek reads past it), without headers.
    let later: String = app
        .query_one(
            emit,
            &[&"account", &"2", &"opened", &"[1, 2]", &None::<&str>],
        )
        .await
        .unwrap()
        .get(0);

    let changes = peek(&admin, &slot, &publication).await;
    let kinds: String = changes.iter().map(|(k, _)| *k).collect();
    // Begin, Relation, Update, Message, Commit; then Begin, Message, Commit. (Postgres
    // 14 also sends transactions with nothing published, e.g. an autoanalyze: "BC".)
    assert_eq!(
        kinds.replace("BC", ""),
        "BRUMCBMC",
        "pgoutput messages in the slot"
    );
    let messages: Vec<&Message> = changes.iter().filter_map(|(_, m)| m.as_ref()).collect();
    let ids: Vec<&str> = messages
        .iter()
        .map(|m| m.content["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [committed.as_str(), later.as_str()]);
    assert!(
        !ids.contains(&rolled_back.as_str()),
        "the rolled-back event was decoded"
    );
    for m in &messages {
        assert!(m.transactional, "{m:?}");
        assert_eq!(m.prefix, PREFIX);
    }
    assert_eq!(
        messages[0].content,
        serde_json::json!({
            "id": committed,
            "aggregate_type": "account",
            "aggregate_id": "1",
            "event_type": "debited",
            "payload": {"amount": 10},
            "headers": {"traceparent": "00-abc-def-01"},
        })
    );
    assert_eq!(
        messages[1].content,
        serde_json::json!({
            "id": later,
            "aggregate_type": "account",
            "aggregate_id": "2",
            "event_type": "opened",
            "payload": [1, 2],
        })
    );

    // Slots hold WAL: drop it now (TestDb's drop would too, also on failure).
    admin
        .execute("SELECT pg_catalog.pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
}

/// What the relay would take for poison is refused in the caller's transaction:
/// a NULL field, headers that are not a JSON object.
#[tokio::test]
async fn outbox_emit_refuses_what_the_relay_could_not_read() {
    let w = World::new();
    w.apply_script();
    w.grant_writer_to_app();
    let app = w.connect_as(&w.app).await;
    for (call, expected) in [
        (
            "SELECT public.outbox_emit('t', NULL, 'e', '{}')",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT public.outbox_emit('t', '1', 'e', NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT public.outbox_emit('t', '1', 'e', '{}', '[\"not\", \"an object\"]')",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
    ] {
        let err = app.query_one(call, &[]).await.expect_err(call);
        assert_eq!(err.code(), Some(&expected), "{call}: {err}");
    }
}

/// Functions a caller plants under the names `outbox_emit` calls never run in its
/// place: it runs as the emitter role with `search_path = pg_catalog, pg_temp` and
/// names every catalog function.
#[tokio::test]
async fn functions_planted_by_a_caller_never_run_inside_outbox_emit() {
    let w = World::new();
    w.apply_script();
    w.grant_writer_to_app();
    w.db.psql(&format!("GRANT CREATE ON SCHEMA public TO {}", w.app));
    let app = w.connect_as(&w.app).await;
    app.batch_execute(
        "CREATE TABLE public.hijack (fn text, who text);
         GRANT INSERT ON public.hijack TO PUBLIC;
         CREATE FUNCTION public.gen_random_uuid() RETURNS uuid LANGUAGE sql AS $$
           INSERT INTO public.hijack VALUES ('gen_random_uuid', current_user);
           SELECT '00000000-0000-4000-8000-000000000000'::uuid $$;
         CREATE FUNCTION public.pg_logical_emit_message(boolean, text, text) RETURNS pg_lsn
           LANGUAGE sql AS $$
           INSERT INTO public.hijack VALUES ('pg_logical_emit_message', current_user);
           SELECT '0/0'::pg_lsn $$;
         CREATE FUNCTION public.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$
           INSERT INTO public.hijack VALUES ('jsonb_typeof', current_user);
           SELECT 'object' $$;
         SET search_path = public, pg_catalog;",
    )
    .await
    .unwrap();
    let id: String = app
        .query_one(
            "SELECT outbox_emit('t', '1', 'e', '{}', '{\"k\": \"v\"}')::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_ne!(id, "00000000-0000-4000-8000-000000000000");
    let ran: i64 = app
        .query_one("SELECT count(*) FROM public.hijack", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(ran, 0, "a planted function ran inside outbox_emit");
}

/// The ACLs of `pg_logical_emit_message` and `outbox_emit`, one line.
async fn acl(admin: &Client) -> String {
    admin
        .query_one(
            "SELECT string_agg(p.oid::regprocedure::text || ' ' || p.proacl::text, '; '
                               ORDER BY p.oid::regprocedure::text)
               FROM pg_catalog.pg_proc p
              WHERE p.proname IN ('pg_logical_emit_message', 'outbox_emit')",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The script may run again (an upgrade, a second operator): it succeeds and the
/// privileges stay as the first run left them.
#[tokio::test]
async fn the_script_runs_twice() {
    let w = World::new();
    w.apply_script();
    let admin = w.db.client().await;
    let first = acl(&admin).await;
    w.apply_script();
    assert_eq!(acl(&admin).await, first);
    // A PUBLIC entry is one with no grantee: "{=X/…" or ",=X/…".
    assert!(!first.contains("{=") && !first.contains(",="), "{first}");
    w.grant_writer_to_app();
    let app = w.connect_as(&w.app).await;
    app.query_one("SELECT public.outbox_emit('t', '1', 'e', '{}')", &[])
        .await
        .unwrap();
    // The roles it made cannot log in.
    let login: bool = admin
        .query_one(
            "SELECT bool_or(rolcanlogin) FROM pg_catalog.pg_roles WHERE rolname IN ($1, $2)",
            &[&w.emitter, &w.writer],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!login, "the script's roles may log in");
}
