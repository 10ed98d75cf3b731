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

/// Both connection kinds against the test cluster: `Ok(tls)` when each logged in
/// (and their TLS agreed), else the first error and whether it is definite.
async fn login_both(o: &PgConnectOptions) -> Result<bool, (String, bool)> {
    let repl = identify(o)
        .await
        .map_err(|e| (e.to_string(), e.is_precondition()))?;
    let (client, conn) = wal_reader::tls::connect_sql(o)
        .await
        .map_err(|e| (e.to_string(), e.is_precondition()))?;
    let h = tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    drop(client);
    let _ = h.await;
    assert_eq!(row.get::<_, bool>(0), repl.is_tls());
    Ok(repl.is_tls())
}

/// A directory of the test's own, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let d = std::env::temp_dir().join(unique_name("auth"));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    /// Writes `content` to `name` with `mode`; returns the path.
    fn file(&self, name: &str, content: &[u8], mode: u32) -> String {
        use std::os::unix::fs::PermissionsExt;
        let p = self.0.join(name);
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The client certificates scripts/test-services.sh makes, signed by the test CA,
/// for the roles of its pg_hba.conf lines `hostssl … outbox_cert_client … cert` and
/// `hostssl … outbox_certpw_client … scram-sha-256 clientcert=verify-full`.
fn client_cert(name: &str) -> (String, Vec<u8>) {
    let dir = std::env::var("OUTBOX_TEST_PG_CLIENT_CERTS").unwrap_or_else(|_| {
        std::path::Path::new(&pg_ca_file())
            .parent()
            .unwrap()
            .display()
            .to_string()
    });
    (
        format!("{dir}/{name}.crt"),
        std::fs::read(format!("{dir}/{name}.key")).unwrap(),
    )
}

fn cert_opts(user: &str, extra: &str) -> PgConnectOptions {
    PgConnectOptions::parse_with_env(
        &format!(
            "host=localhost port={} user={user} dbname=postgres sslmode=verify-full sslrootcert={} {extra}",
            pg_port(),
            pg_ca_file()
        ),
        &|k| (k == "HOME").then(|| "/nonexistent".to_string()),
    )
    .unwrap()
}

/// `sslcert` / `sslkey` / `sslpassword` on both connection kinds against pg_hba.conf
/// `cert` (the certificate alone logs the role in) and `clientcert=verify-full` (the
/// certificate and the password), with libpq's permission check on the key file and
/// a PKCS#8 key encrypted by `openssl pkcs8 -topk8 -v2 aes-256-cbc`.
#[tokio::test]
async fn client_certificates_against_cert_and_clientcert_verify_full() {
    let dir = TempDir::new();
    let (cert, key) = client_cert("client-cert");
    let key_path = dir.file("client.key", &key, 0o600);
    let (pw_cert, pw_key) = client_cert("client-certpw");
    let pw_key_path = dir.file("certpw.key", &pw_key, 0o600);

    // cert: the certificate is the login.
    let o = cert_opts(
        "outbox_cert_client",
        &format!("sslcert={cert} sslkey={key_path}"),
    );
    assert_eq!(login_both(&o).await, Ok(true));
    // Without it, or with another role's certificate: refused, definitely.
    for extra in [
        String::new(),
        format!("sslcert={pw_cert} sslkey={pw_key_path}"),
    ] {
        let o = cert_opts("outbox_cert_client", &extra);
        let (msg, definite) = login_both(&o).await.unwrap_err();
        assert!(definite, "{extra}: {msg}");
    }
    // clientcert=verify-full: the certificate and the password.
    let both = format!("sslcert={pw_cert} sslkey={pw_key_path} password=outbox-certpw-test");
    assert_eq!(
        login_both(&cert_opts("outbox_certpw_client", &both)).await,
        Ok(true)
    );
    for extra in [
        "password=outbox-certpw-test".to_string(),
        format!("sslcert={pw_cert} sslkey={pw_key_path} password=wrong"),
    ] {
        let (msg, definite) = login_both(&cert_opts("outbox_certpw_client", &extra))
            .await
            .unwrap_err();
        assert!(definite, "{extra}: {msg}");
    }
    // A key file others may read is refused before anything is sent (libpq's rule).
    let open_key = dir.file("open.key", &key, 0o644);
    let o = cert_opts(
        "outbox_cert_client",
        &format!("sslcert={cert} sslkey={open_key}"),
    );
    let (msg, definite) = login_both(&o).await.unwrap_err();
    assert!(
        definite && msg.contains("sslkey") && msg.contains("group or world access"),
        "{msg}"
    );

    // An encrypted key: sslpassword decrypts it; a wrong or missing one names the fix.
    let out = std::process::Command::new("openssl")
        .args([
            "pkcs8",
            "-topk8",
            "-v2",
            "aes-256-cbc",
            "-passout",
            "pass:Kp-secret",
        ])
        .arg("-in")
        .arg(&key_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ENCRYPTED PRIVATE KEY"));
    let enc = dir.file("enc.key", &out.stdout, 0o600);
    let o = cert_opts(
        "outbox_cert_client",
        &format!("sslcert={cert} sslkey={enc} sslpassword=Kp-secret"),
    );
    assert_eq!(login_both(&o).await, Ok(true));
    for (extra, word) in [("sslpassword=wrong", "passphrase"), ("", "sslpassword")] {
        let o = cert_opts(
            "outbox_cert_client",
            &format!("sslcert={cert} sslkey={enc} {extra}"),
        );
        let (msg, definite) = login_both(&o).await.unwrap_err();
        assert!(definite && msg.contains(word), "{extra}: {msg}");
        assert!(!msg.contains("Kp-secret"), "{msg}");
    }
}

/// libpq's `require_auth` against the real server's methods (pg_hba.conf of
/// scripts/test-services.sh): the listed method logs in, another is refused
/// definitely before any password is sent, on both connection kinds.
#[tokio::test]
async fn require_auth_against_the_servers_methods() {
    let scram = Role::new("outbox_auth_scram", "scram-sha-256");
    let md5 = Role::new("outbox_auth_md5", "md5");
    let clear = Role::new("outbox_auth_password", "scram-sha-256");
    let o = |role: &Role, list: &str| {
        opts(
            &role.name,
            Some(&role.password()),
            &format!("sslmode=require require_auth={list}"),
        )
    };
    assert_eq!(login_both(&o(&scram, "scram-sha-256")).await, Ok(true));
    assert_eq!(login_both(&o(&md5, "md5,scram-sha-256")).await, Ok(true));
    assert_eq!(login_both(&o(&clear, "password")).await, Ok(true));
    for (role, list, word) in [
        (&md5, "scram-sha-256", "md5"),
        (&clear, "scram-sha-256", "cleartext"),
        (&clear, "!password", "cleartext"),
        (&scram, "md5,password", "SCRAM"),
        (&scram, "none", "SCRAM"),
    ] {
        let (msg, definite) = login_both(&o(role, list)).await.unwrap_err();
        assert!(definite, "require_auth={list}: {msg}");
        assert!(
            msg.contains("require_auth") && msg.contains(word),
            "{list}: {msg}"
        );
    }
    // trust (the superuser's line): only with `none`.
    let trust = |list: &str| {
        opts(
            "postgres",
            None,
            &format!("sslmode=require require_auth={list}"),
        )
    };
    assert_eq!(login_both(&trust("none")).await, Ok(true));
    let (msg, definite) = login_both(&trust("!none")).await.unwrap_err();
    assert!(definite && msg.contains("without authentication"), "{msg}");
}

/// libpq's password file: `passfile`, `PGPASSFILE`, `~/.pgpass`; a matching line
/// logs in, a file group or others may read is ignored (the server's request for a
/// password then names the fix), and the file is read at every login, so a rotated
/// password is used at the next connection with the same options.
#[tokio::test]
async fn passfile_is_read_at_every_login_with_libpqs_permission_check() {
    let dir = TempDir::new();
    let role = Role::new("outbox_auth_scram", "scram-sha-256");
    let line = |pw: &str| {
        format!(
            "# test\nother:1:*:*:nope\nlocalhost:{}:*:{}:{pw}\n",
            pg_port(),
            role.name
        )
    };
    let passfile = dir.file("pgpass", line(&role.password()).as_bytes(), 0o600);
    let env_for = |vars: Vec<(&'static str, String)>| {
        move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    };
    let conninfo = format!(
        "host=localhost port={} user={} dbname=postgres sslmode=require",
        pg_port(),
        role.name
    );
    let by_param = PgConnectOptions::parse_with_env(
        &format!("{conninfo} passfile={passfile}"),
        &env_for(vec![("HOME", "/nonexistent".into())]),
    )
    .unwrap();
    assert_eq!(login_both(&by_param).await, Ok(true));
    let by_env = PgConnectOptions::parse_with_env(
        &conninfo,
        &env_for(vec![
            ("HOME", "/nonexistent".into()),
            ("PGPASSFILE", passfile.clone()),
        ]),
    )
    .unwrap();
    assert_eq!(login_both(&by_env).await, Ok(true));
    std::fs::create_dir_all(dir.0.join("home")).unwrap();
    let home_file = dir.file("home/.pgpass", line(&role.password()).as_bytes(), 0o600);
    let by_home = PgConnectOptions::parse_with_env(
        &conninfo,
        &env_for(vec![("HOME", dir.0.join("home").display().to_string())]),
    )
    .unwrap();
    assert_eq!(login_both(&by_home).await, Ok(true));

    // Rotation: a new password in the server and the file, the same options.
    testkit::psql(
        "postgres",
        &format!("ALTER ROLE {} PASSWORD 'rotated-{}'", role.name, role.name),
    );
    let (msg, _) = login_both(&by_param).await.unwrap_err();
    assert!(msg.contains("password"), "{msg}");
    std::fs::write(&passfile, line(&format!("rotated-{}", role.name))).unwrap();
    assert_eq!(login_both(&by_param).await, Ok(true));

    // A file others may read is ignored: the server's request has no password.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&home_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&home_file, line(&format!("rotated-{}", role.name))).unwrap();
    let (msg, definite) = login_both(&by_home).await.unwrap_err();
    assert!(definite && msg.contains("has none"), "{msg}");
}

/// `sslmode` means nothing on a Unix socket (libpq's rule): both connection kinds
/// log in over it without asking for TLS, even with `sslmode=require`.
#[tokio::test]
async fn sslmode_is_ignored_on_a_unix_socket() {
    let dir = "/var/run/postgresql";
    if !std::path::Path::new(&format!("{dir}/.s.PGSQL.{}", pg_port())).exists() {
        eprintln!("skipping: no Unix socket of the test cluster in {dir}");
        return;
    }
    for mode in ["require", "prefer", "disable"] {
        let o = PgConnectOptions::parse(&format!(
            "host={dir} port={} user=postgres dbname=postgres sslmode={mode}",
            pg_port()
        ))
        .unwrap();
        assert_eq!(login_both(&o).await, Ok(false), "sslmode={mode}");
    }
}
