//! sql/outbox_messages.sql against what another role may have prepared, on every
//! supported Postgres major, 14 to 18 (docs/messages.md, "Security"; issue 50): a
//! `public.outbox_emit` pre-created with EXECUTE granted to a role of the creator's
//! choosing keeps no grant; the emitter role's members are named (the writer role as
//! one is refused); and a planted `public.outbox_emit(text, text, text, text)` never
//! runs for the call docs/messages.md shows. On Postgres 14 every role may create in
//! `public`, so the planting role needs nothing; from 15 on the test grants it
//! CREATE there (a database whose owner opened `public`, or one upgraded from 14).
//!
//! One test per major, so a failure names the version, each in a database and with
//! roles of its own on the cluster of `scripts/pg-versions.sh` (as `versions` uses
//! them). A test fails, never skips, when its cluster is not running.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use testkit::{unique_name, TestDb};

use crate::versions::cluster;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../sql/outbox_messages.sql");
const DOCS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/messages.md");

/// The call docs/messages.md tells applications to make: schema-qualified, the
/// payload typed jsonb.
const DOCUMENTED_CALL: &str =
    r#"SELECT public.outbox_emit('order', '42', 'order_paid', '{"order_id": 42}'::jsonb);"#;

/// Drops a test's roles on its cluster (their objects in its database first), also
/// when the test fails.
struct Roles {
    port: u16,
    db: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        for role in &self.names {
            let _ = testkit::try_psql(self.port, &self.db, &format!("DROP OWNED BY {role}"));
            let _ = testkit::try_psql(
                self.port,
                "postgres",
                &format!("DROP ROLE IF EXISTS {role}"),
            );
        }
    }
}

/// `psql` as `user` on `db`, with `args`: its output whatever the exit.
fn psql_as(port: u16, db: &str, user: &str, args: &[&str]) -> Output {
    Command::new("psql")
        .args(["-XAtq", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"])
        .args(["-p", &port.to_string(), "-U", user, "-d", db])
        .args(args)
        .output()
        .expect("psql runs")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// One major's database and roles: the script's two, the planting role and the
/// role it grants EXECUTE to, an application granted the writer role, and a role
/// made a member of the emitter role beforehand.
struct World {
    port: u16,
    major: u32,
    // Dropped before the database (fields drop in declaration order).
    _roles: Roles,
    db: TestDb,
    emitter: String,
    writer: String,
    mallory: String,
    accomplice: String,
    app: String,
    member: String,
}

impl World {
    fn new(major: u32) -> World {
        let port = cluster(major);
        let db = TestDb::new_at(port, "emit_compat");
        let [emitter, writer, mallory, accomplice, app, member] = [
            "emitter",
            "writer",
            "mallory",
            "accomplice",
            "app",
            "member",
        ]
        .map(unique_name);
        let roles = Roles {
            port,
            db: db.name.clone(),
            names: [&app, &member, &mallory, &accomplice, &writer, &emitter]
                .map(|r| r.to_string())
                .to_vec(),
        };
        testkit::psql_at(
            port,
            "postgres",
            &format!(
                "CREATE ROLE {mallory} LOGIN; CREATE ROLE {accomplice} LOGIN; \
                 CREATE ROLE {app} LOGIN; CREATE ROLE {member} LOGIN;"
            ),
        );
        World {
            port,
            major,
            _roles: roles,
            db,
            emitter,
            writer,
            mallory,
            accomplice,
            app,
            member,
        }
    }

    /// Runs the script with this world's role names: its output (warnings included).
    fn apply_script(&self) -> Output {
        psql_as(
            self.port,
            &self.db.name,
            "postgres",
            &[
                "-v",
                &format!("emitter_role={}", self.emitter),
                "-v",
                &format!("writer_role={}", self.writer),
                "-f",
                SCRIPT,
            ],
        )
    }

    /// Lets the planting role create in `public`: Postgres 14's default for every
    /// role, granted from 15 on.
    fn let_mallory_create_in_public(&self) {
        let anyone = self
            .db
            .psql("SELECT has_schema_privilege('public', 'public', 'CREATE')");
        assert_eq!(anyone == "t", self.major == 14, "PUBLIC's CREATE on public");
        if self.major > 14 {
            self.db.psql(&format!(
                "GRANT CREATE ON SCHEMA public TO {}",
                self.mallory
            ));
        }
    }

    /// SQL as the planting role, which must succeed.
    fn as_mallory(&self, sql: &str) {
        let out = psql_as(self.port, &self.db.name, &self.mallory, &["-c", sql]);
        assert!(out.status.success(), "as {}: {}", self.mallory, text(&out));
    }

    /// Grants the writer role to the application, which then makes the call
    /// docs/messages.md shows: its answer (the event's id).
    fn documented_call_as_app(&self) -> String {
        testkit::psql_at(
            self.port,
            "postgres",
            &format!("GRANT {} TO {}", self.writer, self.app),
        );
        let out = psql_as(
            self.port,
            &self.db.name,
            &self.app,
            &["-c", DOCUMENTED_CALL],
        );
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn may_execute(&self, role: &str) -> bool {
        self.db.psql(&format!(
            "SELECT has_function_privilege('{role}', \
               'public.outbox_emit(text, text, text, jsonb, jsonb)', 'EXECUTE')"
        )) == "t"
    }
}

/// A `public.outbox_emit` pre-created with the script's signature and EXECUTE
/// granted to an unrelated role: after the script, that role (and its creator)
/// may not execute it; only the owner and the writer role hold a privilege.
/// (CREATE OR REPLACE keeps the ACL of a function that exists: the break this
/// catches.)
fn a_pre_created_function_keeps_no_foreign_grant(major: u32) {
    let w = World::new(major);
    w.let_mallory_create_in_public();
    w.as_mallory(&format!(
        // The script's very signature, argument names and default included (CREATE
        // OR REPLACE refuses to change those, which would stop the script).
        "CREATE FUNCTION public.outbox_emit(aggregate_type text, aggregate_id text, \
           event_type text, payload jsonb, headers jsonb DEFAULT NULL) \
           RETURNS uuid LANGUAGE sql AS 'SELECT NULL::uuid'; \
         GRANT EXECUTE ON FUNCTION public.outbox_emit(text, text, text, jsonb, jsonb) TO {};",
        w.accomplice
    ));
    assert!(
        w.may_execute(&w.accomplice),
        "the premise: the grant exists"
    );
    let out = w.apply_script();
    assert!(out.status.success(), "{}", text(&out));
    for role in [&w.accomplice, &w.mallory] {
        assert!(
            !w.may_execute(role),
            "postgres {major}: {role} may still execute outbox_emit after the script"
        );
    }
    let acl = w.db.psql(
        "SELECT proacl::text FROM pg_proc \
          WHERE oid = 'public.outbox_emit(text, text, text, jsonb, jsonb)'::regprocedure",
    );
    let expected = format!("{{{e}=X/{e},{wr}=X/{e}}}", e = w.emitter, wr = w.writer);
    assert_eq!(acl, expected, "postgres {major}");
    // The function is the script's, not its creator's: it returns an id.
    let id = w.documented_call_as_app();
    assert_eq!(id.len(), 36, "{id}");
    if major == 14 {
        assert!(text(&w.apply_script()).contains("REVOKE CREATE ON SCHEMA public FROM PUBLIC"));
    }
}

/// Members of an existing emitter role may act as it: the script names them in a
/// warning, and refuses when the writer role is one (every application could then
/// call pg_logical_emit_message directly).
fn the_emitter_roles_members_are_named(major: u32) {
    let w = World::new(major);
    testkit::psql_at(
        w.port,
        "postgres",
        &format!(
            "CREATE ROLE {e} NOLOGIN; GRANT {e} TO {m};",
            e = w.emitter,
            m = w.member
        ),
    );
    let out = w.apply_script();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let warning = said
        .lines()
        .find(|l| l.contains("WARNING") && l.contains("members of role"))
        .unwrap_or_else(|| panic!("postgres {major}: no warning naming the members:\n{said}"));
    assert!(warning.contains(&w.member), "{warning}");
    testkit::psql_at(
        w.port,
        "postgres",
        &format!("GRANT {} TO {}", w.emitter, w.writer),
    );
    let out = w.apply_script();
    let said = text(&out);
    assert!(!out.status.success(), "postgres {major}: accepted:\n{said}");
    assert!(
        said.contains(&format!("role {} is a member of {}", w.writer, w.emitter)),
        "{said}"
    );
}

/// A `public.outbox_emit(text, text, text, text)` planted by another role (before
/// or after the script) never runs for the documented call: qualified, with the
/// payload typed jsonb. The unqualified call with an untyped payload that the docs
/// once showed runs the planted one (text is preferred for an untyped literal):
/// what the docs must not say. The script names the planted overload.
fn a_planted_text_overload_does_not_win_the_documented_call(major: u32) {
    let docs = std::fs::read_to_string(DOCS).unwrap();
    assert!(
        docs.contains(DOCUMENTED_CALL),
        "docs/messages.md does not show {DOCUMENTED_CALL}"
    );
    let w = World::new(major);
    w.let_mallory_create_in_public();
    w.as_mallory(&format!(
        "CREATE TABLE public.hijack (who text); GRANT INSERT ON public.hijack TO PUBLIC; \
         CREATE FUNCTION public.outbox_emit(text, text, text, text) RETURNS uuid \
           LANGUAGE sql AS $$ INSERT INTO public.hijack VALUES (current_user); \
           SELECT '00000000-0000-4000-8000-000000000000'::uuid $$; \
         GRANT EXECUTE ON FUNCTION public.outbox_emit(text, text, text, text) TO {};",
        w.app
    ));
    let out = w.apply_script();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(
            "other functions named outbox_emit exist: public.outbox_emit(text,text,text,text)"
        ) && said.contains(&w.mallory),
        "postgres {major}: the planted overload is not named:\n{said}"
    );
    let id = w.documented_call_as_app();
    assert_ne!(
        id, "00000000-0000-4000-8000-000000000000",
        "postgres {major}"
    );
    assert_eq!(w.db.psql("SELECT count(*) FROM public.hijack"), "0");
    // The contrast: an untyped payload goes to the planted function.
    let old = r#"SELECT outbox_emit('order', '42', 'order_paid', '{"order_id": 42}');"#;
    let out = psql_as(w.port, &w.db.name, &w.app, &["-c", old]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(w.db.psql("SELECT count(*) FROM public.hijack"), "1");
}

fn emit_on(major: u32) {
    a_pre_created_function_keeps_no_foreign_grant(major);
    the_emitter_roles_members_are_named(major);
    a_planted_text_overload_does_not_win_the_documented_call(major);
    eprintln!("postgres {major}: sql/outbox_messages.sql against prepared roles ok");
}

#[test]
fn postgres_14_emit_script_against_prepared_roles() {
    emit_on(14);
}

#[test]
fn postgres_15_emit_script_against_prepared_roles() {
    emit_on(15);
}

#[test]
fn postgres_16_emit_script_against_prepared_roles() {
    emit_on(16);
}

#[test]
fn postgres_17_emit_script_against_prepared_roles() {
    emit_on(17);
}

#[test]
fn postgres_18_emit_script_against_prepared_roles() {
    emit_on(18);
}
