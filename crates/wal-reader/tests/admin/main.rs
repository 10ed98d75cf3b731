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

mod columns;
mod preflight;
mod publication;
mod server;
mod slots;

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
