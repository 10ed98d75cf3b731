//! Slot and publication administration and the precondition checks, against the
//! tests' own Postgres cluster (`scripts/test-services.sh`), plus the machine's main
//! Postgres on port 5432 (read-only) for a server whose wal_level is not logical.
//! Every test uses a fresh database; roles created here are dropped at the end.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_event::Lsn;
use testkit::{pg_port, unique_name, TestDb};
use tokio_postgres::{Client, NoTls};
use wal_reader::admin::{
    self, check_columns, check_publication, check_published_columns, check_replication_role,
    check_slot_free, check_wal_level, create_slot, drop_slot, ensure_publication, require_slot,
    slot_state, AdminError, CheckStatus, Preflight,
};
use wal_reader::pgtype::oid;
use wal_reader::{ColumnMapping, TableName};

// ------------------------------------------------------------------ helpers

fn sql_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../sql")
        .join(name)
}

/// Applies a file of `sql/` with psql (stopping at the first error), with psql
/// variables; returns psql's stderr on failure.
fn apply_sql_file(db: &TestDb, name: &str, vars: &[(&str, &str)]) -> Result<(), String> {
    let mut cmd = Command::new("psql");
    cmd.args([
        "-X",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-h",
        "127.0.0.1",
        "-U",
        "postgres",
    ])
    .args(["-p", &pg_port().to_string(), "-d", &db.name]);
    for (k, v) in vars {
        cmd.args(["-v", &format!("{k}={v}")]);
    }
    let out = cmd.arg("-f").arg(sql_file(name)).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    // psql reports errors on stderr; a clean script writes nothing there.
    if out.status.success() && stderr.trim().is_empty() {
        Ok(())
    } else {
        Err(stderr)
    }
}

/// A database with the default outbox table and publication (sql/outbox.sql).
fn outbox_db(prefix: &str) -> TestDb {
    let db = TestDb::new(prefix);
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    db
}

async fn connect(conninfo: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(conninfo, NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

async fn connect_as(db: &TestDb, role: &str) -> Client {
    connect(&format!(
        "host=127.0.0.1 port={} user={role} dbname={}",
        pg_port(),
        db.name
    ))
    .await
}

fn outbox_table() -> Vec<TableName> {
    vec![TableName::parse("public.outbox").unwrap()]
}

/// A role created for one test, dropped (with its privileges) at the end.
struct TestRole {
    name: String,
    db: String,
}

impl TestRole {
    fn create(db: &TestDb, options: &str) -> TestRole {
        let name = unique_name("admin_role");
        db.psql(&format!("CREATE ROLE {name} {options}"));
        TestRole {
            name,
            db: db.name.clone(),
        }
    }

    /// A role that sql/role.sql created under this name.
    fn adopt(db: &TestDb, name: String) -> TestRole {
        TestRole {
            name,
            db: db.name.clone(),
        }
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args(["-XAtq", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &pg_port().to_string(), "-d", &self.db])
            .args(["-c", &format!("DROP OWNED BY {}", self.name)])
            .args(["-c", &format!("DROP ROLE IF EXISTS {}", self.name)])
            .output();
    }
}

/// `pg_recvlogical` streaming from a slot: a replication connection holding it
/// active, killed on drop.
struct SlotHolder {
    child: Child,
}

impl SlotHolder {
    async fn start(c: &Client, db: &TestDb, slot: &str) -> SlotHolder {
        let mut child = Command::new("pg_recvlogical")
            .args(["-d", &db.conninfo(), "--slot", slot, "--start", "--no-loop"])
            .args([
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=outbox_relay",
            ])
            .args(["-f", "/dev/null"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = slot_state(c, slot).await.unwrap().unwrap();
            if state.active {
                break;
            }
            if let Some(status) = child.try_wait().unwrap() {
                let out = child.wait_with_output().unwrap();
                panic!(
                    "pg_recvlogical exited ({status}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                Instant::now() < deadline,
                "pg_recvlogical never took the slot"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        SlotHolder { child }
    }

    /// Whether the process has exited.
    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }
}

impl Drop for SlotHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------ slots

#[tokio::test]
async fn create_slot_reports_its_state() {
    let db = outbox_db("admin_create");
    let c = db.client().await;
    let slot = unique_name("slot");

    let created = create_slot(&c, &slot, false, false).await.unwrap();
    assert!(created.created);
    assert!(created.consistent_point > Lsn::ZERO);

    let s = slot_state(&c, &slot).await.unwrap().expect("slot exists");
    assert_eq!(s.slot_name, slot);
    assert_eq!(s.plugin.as_deref(), Some("pgoutput"));
    assert_eq!(s.slot_type, "logical");
    assert_eq!(s.database.as_deref(), Some(db.name.as_str()));
    assert!(!s.active);
    assert_eq!(s.active_pid, None);
    let confirmed = s.confirmed_flush_lsn.expect("confirmed_flush_lsn");
    assert_eq!(confirmed, created.consistent_point);
    let restart = s.restart_lsn.expect("restart_lsn");
    assert!(restart <= confirmed);
    assert_eq!(s.wal_status.as_deref(), Some("reserved"));
    assert_eq!(s.safe_wal_size, None, "max_slot_wal_keep_size is unlimited");
    assert!(!s.two_phase);
    assert!(!s.failover);
    assert!(s.current_wal_lsn >= confirmed);
    assert_eq!(
        s.retained_wal_bytes,
        Some((s.current_wal_lsn.0 - restart.0) as i64)
    );

    // The slot is usable and free.
    let required = require_slot(&c, &slot).await.unwrap();
    assert_eq!(required.slot_name, slot);
    check_slot_free(&required).await.unwrap();
    assert!(slot_state(&c, "no_such_slot").await.unwrap().is_none());
}

#[tokio::test]
async fn create_if_not_exists_keeps_the_slot() {
    let db = outbox_db("admin_create_ine");
    let c = db.client().await;
    let slot = unique_name("slot");

    let first = create_slot(&c, &slot, true, false).await.unwrap();
    assert!(first.created);
    let again = create_slot(&c, &slot, true, false).await.unwrap();
    assert!(!again.created);
    let state = slot_state(&c, &slot).await.unwrap().unwrap();
    assert_eq!(Some(again.consistent_point), state.confirmed_flush_lsn);
}

#[tokio::test]
async fn create_twice_is_a_clear_error() {
    let db = outbox_db("admin_create_twice");
    let c = db.client().await;
    let slot = unique_name("slot");

    create_slot(&c, &slot, false, false).await.unwrap();
    let e = create_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::SlotExists { slot: s } if *s == slot),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(msg.contains(&format!("\"{slot}\" already exists")), "{msg}");
    assert!(msg.contains("--if-not-exists"), "{msg}");
}

#[tokio::test]
async fn if_not_exists_still_refuses_a_slot_of_another_plugin() {
    let db = outbox_db("admin_ine_plugin");
    let c = db.client().await;
    let slot = unique_name("slot");
    db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"
    ));
    let e = create_slot(&c, &slot, true, false).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotWrongPlugin { .. }), "{e:?}");
}

#[tokio::test]
async fn failover_needs_postgres_17() {
    let db = outbox_db("admin_failover");
    let c = db.client().await;
    let slot = unique_name("slot");
    let version = admin::server_version_num(&c).await.unwrap();

    let result = create_slot(&c, &slot, false, true).await;
    if version >= 170000 {
        assert!(result.unwrap().created);
        assert!(slot_state(&c, &slot).await.unwrap().unwrap().failover);
    } else {
        let e = result.unwrap_err();
        assert!(matches!(e, AdminError::FailoverUnsupported { .. }), "{e:?}");
        assert!(e.is_precondition());
        let msg = e.to_string();
        assert!(msg.contains("Postgres 17"), "{msg}");
        assert!(msg.contains("without --failover"), "{msg}");
        assert!(
            slot_state(&c, &slot).await.unwrap().is_none(),
            "nothing created"
        );
    }
}

#[tokio::test]
async fn invalid_names_are_refused_before_the_server() {
    let db = outbox_db("admin_names");
    let c = db.client().await;
    for bad in [
        "Upper",
        "a-b",
        "x'); DROP TABLE outbox; --",
        &"s".repeat(64),
    ] {
        let e = create_slot(&c, bad, false, false).await.unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
        assert!(e.is_precondition());
        let e = drop_slot(&c, bad, true, false).await.unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
        let e = check_publication(&c, bad, &outbox_table())
            .await
            .unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
    }
    // The outbox survived.
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "0");
}

#[tokio::test]
async fn drop_slot_and_drop_if_exists() {
    let db = outbox_db("admin_drop");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();

    assert!(drop_slot(&c, &slot, false, false).await.unwrap());
    assert!(slot_state(&c, &slot).await.unwrap().is_none());

    assert!(!drop_slot(&c, &slot, true, false).await.unwrap());
    let e = drop_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotMissing { .. }), "{e:?}");
    assert!(e.to_string().contains("outbox-relay slot create"));
}

#[tokio::test]
async fn drop_refuses_a_held_slot_unless_forced() {
    let db = outbox_db("admin_drop_held");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let mut holder = SlotHolder::start(&c, &db, &slot).await;

    let state = slot_state(&c, &slot).await.unwrap().unwrap();
    assert!(state.active);
    let pid = state.active_pid.expect("active pid");

    // The state says who holds it …
    let e = check_slot_free(&state).await.unwrap_err();
    assert!(
        matches!(e, AdminError::SlotActive { pid: p, .. } if p == pid),
        "{e:?}"
    );
    // … and a plain drop refuses, naming the holder and --force.
    let e = drop_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(
        matches!(e, AdminError::SlotActive { pid: p, .. } if p == pid),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(msg.contains(&format!("pid {pid}")), "{msg}");
    assert!(msg.contains("slot drop --force"), "{msg}");
    assert!(
        slot_state(&c, &slot).await.unwrap().is_some(),
        "still there"
    );

    // Forced: the holder is terminated and the slot dropped.
    assert!(drop_slot(&c, &slot, false, true).await.unwrap());
    assert!(slot_state(&c, &slot).await.unwrap().is_none());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holder.exited() {
        assert!(Instant::now() < deadline, "pg_recvlogical survived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A role may drop its own relay's slot by force, but not terminate a process of
/// a superuser: the error says what to do instead.
#[tokio::test]
async fn force_drop_without_permission_to_terminate() {
    let db = outbox_db("admin_drop_denied");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let pid = slot_state(&c, &slot)
        .await
        .unwrap()
        .unwrap()
        .active_pid
        .unwrap();

    let role = TestRole::create(&db, "LOGIN REPLICATION");
    let rc = connect_as(&db, &role.name).await;
    let e = drop_slot(&rc, &slot, false, true).await.unwrap_err();
    assert!(
        matches!(e, AdminError::TerminateDenied { pid: p, .. } if p == pid),
        "{e:?}"
    );
    assert!(!e.is_precondition());
    assert!(e.to_string().contains("pg_signal_backend"), "{e}");
    assert!(
        slot_state(&c, &slot).await.unwrap().unwrap().active,
        "holder untouched"
    );
}

#[tokio::test]
async fn require_slot_missing() {
    let db = outbox_db("admin_req_missing");
    let c = db.client().await;
    let slot = unique_name("slot");
    let e = require_slot(&c, &slot).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotMissing { .. }), "{e:?}");
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        format!(
            "replication slot \"{slot}\" does not exist: create it with `outbox-relay slot create`"
        )
    );
}

#[tokio::test]
async fn require_slot_with_another_plugin() {
    let db = outbox_db("admin_req_plugin");
    let c = db.client().await;
    let slot = unique_name("slot");
    db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"
    ));
    let e = require_slot(&c, &slot).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::SlotWrongPlugin { plugin, .. } if plugin == "test_decoding"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("'test_decoding'") && msg.contains("'pgoutput'"),
        "{msg}"
    );
    assert!(msg.contains("outbox-relay slot drop"), "{msg}");
}

#[tokio::test]
async fn require_slot_of_another_database() {
    let home = outbox_db("admin_req_home");
    let other = outbox_db("admin_req_other");
    let slot = unique_name("slot");
    create_slot(&home.client().await, &slot, false, false)
        .await
        .unwrap();

    let c = other.client().await;
    let e = require_slot(&c, &slot).await.unwrap_err();
    match &e {
        AdminError::SlotOtherDatabase {
            slot_database,
            database,
            ..
        } => {
            assert_eq!(slot_database, &home.name);
            assert_eq!(database, &other.name);
        }
        _ => panic!("{e:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "point [postgres] url at database \"{}\"",
            home.name
        )),
        "{msg}"
    );
}

// ------------------------------------------------------------------ server

#[tokio::test]
async fn wal_level_logical_passes() {
    let db = TestDb::new("admin_wal");
    let c = db.client().await;
    assert_eq!(admin::wal_level(&c).await.unwrap(), "logical");
    check_wal_level(&c).await.unwrap();
}

/// The machine's main Postgres (127.0.0.1:5432) runs with wal_level = replica; only
/// read from it.
#[tokio::test]
async fn wal_level_replica_is_refused() {
    let c = connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres").await;
    let level = admin::wal_level(&c).await.unwrap();
    assert_ne!(
        level, "logical",
        "this test needs a server without logical WAL"
    );
    let e = check_wal_level(&c).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::WalLevel { actual } if *actual == level),
        "{e:?}"
    );
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        format!(
            "wal_level is '{level}' but logical replication needs 'logical': \
             set wal_level = logical in postgresql.conf and restart Postgres"
        )
    );
}

#[tokio::test]
async fn capacity_reads_the_limits() {
    let db = outbox_db("admin_capacity");
    let c = db.client().await;
    let capacity = admin::Capacity::read(&c).await.unwrap();
    let show = |setting: &str| db.psql(&format!("SHOW {setting}")).parse::<i64>().unwrap();
    assert_eq!(
        capacity.max_replication_slots,
        show("max_replication_slots")
    );
    assert_eq!(capacity.max_wal_senders, show("max_wal_senders"));
    assert!(capacity.slots_in_use >= 0 && capacity.wal_senders_in_use >= 0);

    // A held slot counts as a running WAL sender.
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let capacity = admin::Capacity::read(&c).await.unwrap();
    assert!(capacity.slots_in_use >= 1 && capacity.wal_senders_in_use >= 1);
}

#[tokio::test]
async fn role_without_replication_is_refused() {
    let db = outbox_db("admin_role");
    let role = TestRole::create(&db, "LOGIN");
    {
        let c = connect_as(&db, &role.name).await;
        let e = check_replication_role(&c).await.unwrap_err();
        assert!(matches!(e, AdminError::NotReplicationRole { .. }), "{e:?}");
        assert!(e.is_precondition());
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("ALTER ROLE \"{}\" REPLICATION", role.name)),
            "{msg}"
        );
        // Creating a slot is refused the same way, before the server's own error.
        let e = create_slot(&c, &unique_name("slot"), false, false)
            .await
            .unwrap_err();
        assert!(matches!(e, AdminError::NotReplicationRole { .. }), "{e:?}");
    }
    // With the attribute it passes; so does a superuser.
    db.psql(&format!("ALTER ROLE {} REPLICATION", role.name));
    check_replication_role(&connect_as(&db, &role.name).await)
        .await
        .unwrap();
    check_replication_role(&db.client().await).await.unwrap();
}

// ------------------------------------------------------------------ publication

#[tokio::test]
async fn publication_missing() {
    let db = TestDb::new("admin_pub_missing");
    db.psql("CREATE TABLE outbox (id uuid, payload jsonb)");
    let c = db.client().await;
    let e = check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::PublicationMissing { .. }), "{e:?}");
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(
        msg.contains("publication \"outbox_relay\" does not exist"),
        "{msg}"
    );
    assert!(msg.contains("outbox-relay slot create"), "{msg}");
    assert!(
        msg.contains("CREATE PUBLICATION outbox_relay FOR TABLE"),
        "{msg}"
    );
}

#[tokio::test]
async fn publication_valid() {
    let db = outbox_db("admin_pub_ok");
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
}

#[tokio::test]
async fn table_not_in_publication() {
    let db = outbox_db("admin_pub_table");
    db.psql("CREATE SCHEMA billing; CREATE TABLE billing.outbox (LIKE public.outbox)");
    let c = db.client().await;
    let tables = [
        TableName::parse("public.outbox").unwrap(),
        TableName::parse("billing.outbox").unwrap(),
    ];
    let e = check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::TableNotInPublication { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ALTER PUBLICATION outbox_relay ADD TABLE billing.outbox"),
        "{msg}"
    );
    // Following the advice fixes it.
    db.psql("ALTER PUBLICATION outbox_relay ADD TABLE billing.outbox");
    check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap();
}

#[tokio::test]
async fn configured_table_missing() {
    let db = outbox_db("admin_table_missing");
    let c = db.client().await;
    let tables = [TableName::parse("public.outbox_typo").unwrap()];
    let e = check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    assert!(e
        .to_string()
        .contains("table public.outbox_typo does not exist"));
    let e = check_columns(&c, &tables[0], &ColumnMapping::default())
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    let e = ensure_publication(&c, "other_pub", &tables)
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    assert_eq!(
        db.psql("SELECT count(*) FROM pg_publication WHERE pubname = 'other_pub'"),
        "0"
    );
}

#[tokio::test]
async fn publication_without_inserts() {
    let db = TestDb::new("admin_pub_noins");
    db.psql(
        "CREATE TABLE outbox (id uuid); \
         CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'update, delete')",
    );
    let c = db.client().await;
    let e = check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PublicationNoInserts { .. }),
        "{e:?}"
    );
    assert!(e
        .to_string()
        .contains("ALTER PUBLICATION outbox_relay SET (publish = 'insert')"));
}

#[tokio::test]
async fn ensure_publication_creates_an_insert_only_publication() {
    let db = TestDb::new("admin_pub_ensure");
    db.psql("CREATE TABLE outbox (id uuid)");
    let c = db.client().await;
    let publication = unique_name("pub");

    assert!(ensure_publication(&c, &publication, &outbox_table())
        .await
        .unwrap());
    assert!(!ensure_publication(&c, &publication, &outbox_table())
        .await
        .unwrap());
    check_publication(&c, &publication, &outbox_table())
        .await
        .unwrap();
    assert_eq!(
        db.psql(&format!(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate \
               FROM pg_publication WHERE pubname = '{publication}'"
        )),
        "t|f|f|f"
    );
}

#[tokio::test]
async fn ensure_publication_quotes_table_names() {
    let db = TestDb::new("admin_pub_quote");
    db.psql(r#"CREATE SCHEMA "My Schema"; CREATE TABLE "My Schema"."Out""box; x" (id uuid)"#);
    let c = db.client().await;
    let tables = [TableName {
        schema: "My Schema".into(),
        name: "Out\"box; x".into(),
    }];
    assert!(ensure_publication(&c, "quoted_pub", &tables).await.unwrap());
    check_publication(&c, "quoted_pub", &tables).await.unwrap();
    assert_eq!(
        db.psql("SELECT schemaname || '|' || tablename FROM pg_publication_tables WHERE pubname = 'quoted_pub'"),
        "My Schema|Out\"box; x"
    );
}

/// A partitioned outbox is published through its root, so events carry the
/// configured name; a publication that lists the partitions instead is named.
#[tokio::test]
async fn partitioned_outbox_is_published_via_its_root() {
    let db = TestDb::new("admin_pub_part");
    db.psql(
        "CREATE TABLE outbox (id uuid NOT NULL, aggregate_type text, aggregate_id text, \
                              event_type text, payload jsonb, created_at timestamptz NOT NULL) \
           PARTITION BY RANGE (created_at); \
         CREATE TABLE outbox_2026 PARTITION OF outbox \
           FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')",
    );
    let c = db.client().await;
    assert!(ensure_publication(&c, "part_pub", &outbox_table())
        .await
        .unwrap());
    assert_eq!(
        db.psql("SELECT pubviaroot FROM pg_publication WHERE pubname = 'part_pub'"),
        "t"
    );
    check_publication(&c, "part_pub", &outbox_table())
        .await
        .unwrap();
    check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();

    db.psql("CREATE PUBLICATION leaf_pub FOR TABLE outbox WITH (publish = 'insert')");
    let e = check_publication(&c, "leaf_pub", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PartitionsNotViaRoot { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ALTER PUBLICATION leaf_pub SET (publish_via_partition_root = true)"),
        "{msg}"
    );
    db.psql("ALTER PUBLICATION leaf_pub SET (publish_via_partition_root = true)");
    check_publication(&c, "leaf_pub", &outbox_table())
        .await
        .unwrap();
}

// ------------------------------------------------------------------ columns

#[tokio::test]
async fn columns_of_the_default_table() {
    let db = outbox_db("admin_cols");
    let c = db.client().await;
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    assert_eq!(cols.id.type_oid, oid::UUID);
    assert_eq!(cols.aggregate_type.type_oid, oid::TEXT);
    assert_eq!(cols.payload.type_oid, oid::JSONB);
    assert!(cols.payload.not_null);
    assert_eq!(cols.headers.as_ref().map(|h| h.type_oid), Some(oid::JSONB));
    assert!(cols.correlation_id.is_none());
    check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap();
}

#[tokio::test]
async fn headers_column_may_be_absent() {
    let db = outbox_db("admin_cols_noheaders");
    db.psql("ALTER TABLE outbox DROP COLUMN headers");
    let c = db.client().await;
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    assert!(cols.headers.is_none());
}

#[tokio::test]
async fn mapped_column_missing() {
    let db = outbox_db("admin_cols_missing");
    let c = db.client().await;
    let mapping = ColumnMapping {
        event_type: "kind".into(),
        ..ColumnMapping::default()
    };
    let e = check_columns(&c, &outbox_table()[0], &mapping)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AdminError::ColumnMissing { column, key: "event_type", .. } if column == "kind"),
        "{e:?}"
    );
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        "table public.outbox has no column \"kind\": add the column, or set [mapping] \
         event_type to the name of the column that holds the event_type"
    );

    // A custom mapping that matches the table passes and reports the types.
    db.psql("ALTER TABLE outbox RENAME COLUMN event_type TO kind; ALTER TABLE outbox ADD COLUMN trace text");
    let mapping = ColumnMapping {
        correlation_id: Some("trace".into()),
        ..mapping
    };
    let cols = check_columns(&c, &outbox_table()[0], &mapping)
        .await
        .unwrap();
    assert_eq!(cols.event_type.name, "kind");
    assert_eq!(cols.correlation_id.map(|c| c.type_oid), Some(oid::TEXT));
}

#[tokio::test]
async fn column_left_out_of_the_publication() {
    let db = TestDb::new("admin_cols_list");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let c = db.client().await;
    if admin::server_version_num(&c).await.unwrap() < 150000 {
        return; // no column lists before Postgres 15
    }
    db.psql(
        "ALTER PUBLICATION outbox_relay SET TABLE outbox \
         (id, aggregate_type, aggregate_id, event_type, headers)",
    );
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    let e = check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AdminError::ColumnNotPublished { column, key: "payload", .. } if column == "payload"),
        "{e:?}"
    );
}

// ------------------------------------------------------------------ preflight

#[tokio::test]
async fn preflight_reports_one_line_per_check() {
    let db = outbox_db("admin_preflight");
    let c = db.client().await;
    let slot = unique_name("slot");
    let tables = outbox_table();
    let mapping = ColumnMapping::default();
    let preflight = Preflight {
        slot: &slot,
        publication: "outbox_relay",
        tables: &tables,
        mapping: &mapping,
    };

    // No slot yet: exactly that line fails.
    let results = preflight.run(&c).await;
    let failed: Vec<_> = results.iter().filter(|r| r.failed()).collect();
    assert_eq!(failed.len(), 1, "{results:#?}");
    assert_eq!(failed[0].name, format!("slot {slot}"));
    assert!(failed[0].to_string().contains("outbox-relay slot create"));
    let names: Vec<_> = results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        &names[..5],
        [
            "server",
            "wal_level",
            "replication role",
            "publication outbox_relay",
            "table public.outbox"
        ]
    );

    // With the slot everything passes; a held slot is a warning, not a failure.
    create_slot(&c, &slot, false, false).await.unwrap();
    let results = preflight.run(&c).await;
    assert!(
        results
            .iter()
            .all(|r| matches!(r.status, CheckStatus::Ok(_))),
        "{results:#?}"
    );
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let results = preflight.run(&c).await;
    assert!(!results.iter().any(|r| r.failed()), "{results:#?}");
    let warning = results.last().unwrap();
    assert!(matches!(
        warning.status,
        CheckStatus::Warning(AdminError::SlotActive { .. })
    ));
    assert!(warning.to_string().starts_with("warn"));
}

// ------------------------------------------------------------------ sql/

#[tokio::test]
async fn outbox_sql_applies_and_passes_the_checks() {
    let db = TestDb::new("admin_sql_outbox");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', '1', 'created', '{}')",
    );
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "1");
}

/// The insert of an insert-then-delete transaction reaches the slot; the delete does
/// not; the table stays empty.
#[tokio::test]
async fn insert_then_delete_sql_publishes_the_insert_only() {
    let db = TestDb::new("admin_sql_itd");
    apply_sql_file(&db, "outbox_insert_then_delete.sql", &[]).unwrap();
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();

    db.psql(
        "BEGIN; \
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10', 'order', '42', 'order_paid', \
                 '{\"order_id\": 42}'); \
         DELETE FROM outbox WHERE id = '6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10'; \
         COMMIT;",
    );
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "0");
    // A rolled-back insert is never decoded.
    db.psql(
        "BEGIN; \
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', '43', 'order_paid', '{}'); \
         ROLLBACK;",
    );

    // pgoutput message tags of what the slot would send: B(egin), R(elation),
    // I(nsert), C(ommit) — no D(elete), nothing of the rolled-back transaction.
    let tags = db.psql(&format!(
        "SELECT string_agg(chr(get_byte(data, 0)), '' ORDER BY lsn) \
           FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
                'proto_version', '1', 'publication_names', 'outbox_relay')"
    ));
    assert_eq!(tags, "BRIC");
}

/// sql/role.sql creates a role that can do everything the relay needs, and nothing
/// that needs ownership.
#[tokio::test]
async fn role_sql_is_enough_for_the_relay() {
    let db = TestDb::new("admin_sql_role");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let name = unique_name("relay");
    let applied = apply_sql_file(&db, "role.sql", &[("relay_role", &name)]);
    let role = TestRole::adopt(&db, name);
    applied.unwrap();

    let c = connect_as(&db, &role.name).await;
    check_wal_level(&c).await.unwrap();
    check_replication_role(&c).await.unwrap();
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap();
    assert_eq!(
        c.query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    // The existing publication is used as it is …
    assert!(!ensure_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap());
    // … and creating another one needs the table owner, which the message says.
    let e = ensure_publication(&c, "relay_own_pub", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PublicationCreateDenied { .. }),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(
        msg.contains("CREATE PUBLICATION \"relay_own_pub\" FOR TABLE public.outbox WITH (publish = 'insert')"),
        "{msg}"
    );

    let slot = unique_name("slot");
    assert!(create_slot(&c, &slot, false, false).await.unwrap().created);
    require_slot(&c, &slot).await.unwrap();
    assert!(drop_slot(&c, &slot, false, false).await.unwrap());
}

#[test]
fn role_sql_defaults_to_outbox_relay() {
    let text = std::fs::read_to_string(sql_file("role.sql")).unwrap();
    assert!(text.contains("\\set relay_role outbox_relay"));
    assert!(text.contains("LOGIN REPLICATION"));
}
