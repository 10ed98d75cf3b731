//! Authentication methods and TLS on the replication connection, against the test
//! cluster's pg_hba.conf (scripts/test-services.sh): members of `outbox_auth_scram`,
//! `outbox_auth_md5`, `outbox_auth_password` must use that method over TCP; members of
//! `outbox_auth_tls` must use TLS.
#![allow(clippy::unwrap_used)]

mod support;

use support::*;
use testkit::{pg_ca_file, pg_port, unique_name};
use wal_reader::conn::ReplicationConnection;
use wal_reader::{PgConnectOptions, ReaderError};

/// A login role with REPLICATION, member of `group`, with a password stored as
/// SCRAM or md5; dropped on drop.
struct Role {
    name: String,
}

impl Role {
    fn new(group: &str, encryption: &str) -> Role {
        let name = unique_name("u");
        testkit::psql(
            "postgres",
            &format!(
                "SET password_encryption = '{encryption}';
                 CREATE ROLE {name} LOGIN REPLICATION PASSWORD 'pw-{name}';
                 GRANT {group} TO {name};"
            ),
        );
        Role { name }
    }

    fn password(&self) -> String {
        format!("pw-{}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                "-XAtq",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .args(["-p", &pg_port().to_string()])
            .args(["-c", &format!("DROP ROLE IF EXISTS {}", self.name)])
            .output();
    }
}

fn opts(user: &str, password: Option<&str>, extra: &str) -> PgConnectOptions {
    let pw = password
        .map(|p| format!(" password={p}"))
        .unwrap_or_default();
    PgConnectOptions::parse(&format!(
        "host=127.0.0.1 port={} user={user} dbname=postgres{pw} {extra}",
        pg_port()
    ))
    .unwrap()
}

async fn identify(o: &PgConnectOptions) -> Result<ReplicationConnection, ReaderError> {
    let mut c = ReplicationConnection::connect(o).await?;
    let rows = c.simple_query("IDENTIFY_SYSTEM").await?;
    assert_eq!(rows.len(), 1, "IDENTIFY_SYSTEM answers one row");
    Ok(c)
}

#[tokio::test]
async fn scram_md5_and_cleartext_logins() {
    for (group, enc) in [
        ("outbox_auth_scram", "scram-sha-256"),
        ("outbox_auth_md5", "md5"),
        ("outbox_auth_password", "scram-sha-256"),
    ] {
        let role = Role::new(group, enc);
        let c = identify(&opts(&role.name, Some(&role.password()), "sslmode=disable"))
            .await
            .unwrap_or_else(|e| panic!("{group}: {e}"));
        assert!(!c.is_tls());

        // Wrong password: an authentication error that names the fix, without the
        // password.
        let err = identify(&opts(&role.name, Some("wrong-secret"), "sslmode=disable"))
            .await
            .err()
            .unwrap();
        assert!(err.is_precondition(), "{group}: {err}");
        let msg = err.to_string();
        assert!(msg.contains("password in [postgres] url"), "{msg}");
        assert!(!msg.contains("wrong-secret"), "{msg}");

        // No password at all.
        let err = identify(&opts(&role.name, None, "sslmode=disable"))
            .await
            .err()
            .unwrap();
        assert!(matches!(err, ReaderError::PasswordRequired(_)), "{err}");
    }
}

#[tokio::test]
async fn tls_verify_full_against_the_servers_ca() {
    let role = Role::new("outbox_auth_tls", "scram-sha-256");
    let ca = pg_ca_file();
    for host in ["localhost", "127.0.0.1"] {
        let o = PgConnectOptions::parse(&format!(
            "postgresql://{}:{}@{host}:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
            role.name,
            role.password(),
            pg_port()
        ))
        .unwrap();
        let c = identify(&o).await.unwrap_or_else(|e| panic!("{host}: {e}"));
        assert!(c.is_tls());
    }
    // The role may not log in without TLS at all.
    let err = identify(&opts(&role.name, Some(&role.password()), "sslmode=disable"))
        .await
        .err()
        .unwrap();
    assert!(err.is_precondition(), "{err}");
    // prefer and require encrypt without verifying.
    for mode in ["prefer", "require"] {
        let c = identify(&opts(
            &role.name,
            Some(&role.password()),
            &format!("sslmode={mode}"),
        ))
        .await
        .unwrap();
        assert!(c.is_tls(), "{mode}");
    }
}

#[tokio::test]
async fn tls_verification_fails_against_another_ca() {
    // A CA generated here, which did not sign the server's certificate.
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["other-ca".into()]).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other = params.self_signed(&key).unwrap();
    let dir = std::env::temp_dir().join(unique_name("ca"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ca.pem");
    std::fs::write(&path, other.pem()).unwrap();

    for mode in ["verify-ca", "verify-full"] {
        let o = opts(
            "postgres",
            None,
            &format!("sslmode={mode} sslrootcert={}", path.display()),
        );
        let err = identify(&o).await.err().unwrap();
        assert!(matches!(err, ReaderError::Tls(_)), "{mode}: {err}");
        assert!(err.is_precondition(), "{mode}: {err}");
        assert!(err.to_string().contains("sslrootcert"), "{err}");
    }
    // verify-ca accepts a certificate whose name does not match the host.
    let o = PgConnectOptions::parse(&format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=verify-ca sslrootcert={}",
        pg_port(),
        pg_ca_file()
    ))
    .unwrap();
    assert!(identify(&o).await.unwrap().is_tls());
    // A missing CA file is a clear configuration error.
    let o = opts(
        "postgres",
        None,
        "sslmode=verify-full sslrootcert=/nonexistent/ca.pem",
    );
    let err = identify(&o).await.err().unwrap();
    assert!(
        err.is_precondition() && err.to_string().contains("sslrootcert"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn streams_over_tls_with_scram() {
    let f = Fixture::new();
    let role = Role::new("outbox_auth_tls", "scram-sha-256");
    let mut cfg = f.config();
    cfg.conn = PgConnectOptions::parse(&format!(
        "postgresql://{}:{}@localhost:{}/{}?sslmode=verify-full&sslrootcert={}",
        role.name,
        role.password(),
        pg_port(),
        f.db.name,
        pg_ca_file()
    ))
    .unwrap();
    let mut r = spawn_reader(cfg).await;
    f.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', '1', 'tls', '{}');",
    );
    let items = r.collect_until(|i| commits(i) >= 1).await;
    assert!(items
        .iter()
        .any(|i| matches!(i, outbox_event::WalItem::Event(_))));
    r.stop().await;
}

#[tokio::test]
async fn missing_slot_role_without_replication_and_wrong_database() {
    let f = Fixture::new();
    let mut cfg = f.config();
    cfg.slot = "no_such_slot".into();
    let err = wal_reader::WalReader::start(cfg).await.err().unwrap();
    assert!(err.is_precondition(), "{err}");
    assert!(
        err.to_string().contains("outbox-relay slot create"),
        "{err}"
    );

    let role = unique_name("norepl");
    testkit::psql("postgres", &format!("CREATE ROLE {role} LOGIN"));
    let mut cfg = f.config();
    cfg.conn.user = role.clone();
    let err = wal_reader::WalReader::start(cfg).await.err().unwrap();
    testkit::psql("postgres", &format!("DROP ROLE {role}"));
    assert!(err.is_precondition(), "{err}");
    assert!(err.to_string().contains("REPLICATION"), "{err}");

    let mut cfg = f.config();
    cfg.conn.dbname = "no_such_database".into();
    let err = wal_reader::WalReader::start(cfg).await.err().unwrap();
    assert!(err.is_precondition(), "{err}");
    assert!(err.to_string().contains("[postgres] url"), "{err}");
}

#[tokio::test]
async fn wal_level_replica_is_a_precondition_error() {
    // The machine's own Postgres on 5432 runs with the default wal_level=replica.
    let o = PgConnectOptions::parse(
        "host=127.0.0.1 port=5432 user=postgres dbname=postgres sslmode=disable",
    )
    .unwrap();
    let mut c = match ReplicationConnection::connect(&o).await {
        Ok(c) => c,
        Err(e) => panic!("the machine's Postgres on 5432 is expected to run: {e}"),
    };
    let level = c.simple_query("SHOW wal_level").await.unwrap();
    if level[0][0].as_deref() == Some("logical") {
        eprintln!("skipping: the Postgres on 5432 already has wal_level=logical");
        return;
    }
    let err = c
        .simple_query("CREATE_REPLICATION_SLOT outbox_wal_level_probe TEMPORARY LOGICAL pgoutput")
        .await
        .err()
        .unwrap();
    assert!(err.is_precondition(), "{err}");
    assert!(err.to_string().contains("wal_level = logical"), "{err}");
}

#[tokio::test]
async fn slot_in_use_is_reported_with_the_pid() {
    let f = Fixture::new();
    let r = spawn_reader(f.config()).await;
    let err = wal_reader::WalReader::start(f.config())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, ReaderError::SlotInUse { pid, .. } if pid > 0),
        "{err}"
    );
    assert!(err.is_transient());
    r.stop().await;
}
