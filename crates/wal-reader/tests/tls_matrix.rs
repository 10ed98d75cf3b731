//! libpq's TLS rules, cell by cell, against the real TLS-enabled test cluster
//! (scripts/test-services.sh: its server certificate names DNS:localhost and
//! IP:127.0.0.1) and compared with libpq itself (`psql`) in the same environment:
//! every `sslmode` × root certificate (none, the right CA given as `sslrootcert`,
//! `PGSSLROOTCERT` or `~/.postgresql/root.crt`, an unrelated CA) × host name
//! (matching the certificate, or not: `host=wrong.invalid hostaddr=127.0.0.1`).
//! Also: channel binding, the password that is never sent over a plain link, and the
//! size cap on messages before authentication (against a scripted fake server).
//! docs/security.md has the table these tests assert.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use testkit::{pg_ca_file, pg_port, unique_name};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wal_reader::conn::ReplicationConnection;
use wal_reader::{PgConnectOptions, ReaderError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Root {
    None,
    RightParam,
    RightEnv,
    RightHome,
    OtherParam,
    OtherHome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Host {
    Localhost,
    Loopback,
    Mismatch,
}

/// What a client did: refused, or connected with or without TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Refused,
    Plain,
    Tls,
}

/// A temporary directory with the unrelated CA and three `HOME`s: one without
/// `.postgresql/root.crt`, one with the right CA there, one with the other CA.
struct Dirs {
    base: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let base = std::env::temp_dir().join(unique_name("tlsm"));
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let other = params.self_signed(&key).unwrap();
        std::fs::create_dir_all(base.join("home-none")).unwrap();
        for (home, pem) in [
            ("home-right", std::fs::read_to_string(pg_ca_file()).unwrap()),
            ("home-other", other.pem()),
        ] {
            std::fs::create_dir_all(base.join(home).join(".postgresql")).unwrap();
            std::fs::write(base.join(home).join(".postgresql/root.crt"), &pem).unwrap();
        }
        std::fs::write(base.join("other-ca.pem"), other.pem()).unwrap();
        Dirs { base }
    }

    fn other_ca(&self) -> PathBuf {
        self.base.join("other-ca.pem")
    }

    /// (conninfo additions, environment) for `root`.
    fn setup(&self, root: Root) -> (String, Vec<(&'static str, String)>) {
        let home = |h: &str| self.base.join(h).display().to_string();
        match root {
            Root::None => (String::new(), vec![("HOME", home("home-none"))]),
            Root::RightParam => (
                format!(" sslrootcert={}", pg_ca_file()),
                vec![("HOME", home("home-none"))],
            ),
            Root::RightEnv => (
                String::new(),
                vec![("HOME", home("home-none")), ("PGSSLROOTCERT", pg_ca_file())],
            ),
            Root::RightHome => (String::new(), vec![("HOME", home("home-right"))]),
            Root::OtherParam => (
                format!(" sslrootcert={}", self.other_ca().display()),
                vec![("HOME", home("home-none"))],
            ),
            Root::OtherHome => (String::new(), vec![("HOME", home("home-other"))]),
        }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

fn host_part(host: Host) -> &'static str {
    match host {
        Host::Localhost => "host=localhost",
        Host::Loopback => "host=127.0.0.1",
        Host::Mismatch => "host=wrong.invalid hostaddr=127.0.0.1",
    }
}

/// What libpq's documentation (and code) says for a cell; `Plain` for prefer with a
/// root certificate that does not verify is libpq's fallback to a plain connection,
/// which the relay refuses instead ([`ours_expected`]).
fn libpq_expected(mode: &str, root: Root, host: Host) -> Verdict {
    let has_root = root != Root::None;
    let right = matches!(root, Root::RightParam | Root::RightEnv | Root::RightHome);
    match mode {
        // The server accepts plain logins of `postgres` (trust), so allow never tries TLS.
        "disable" | "allow" => Verdict::Plain,
        "prefer" if has_root && !right => Verdict::Plain,
        "prefer" => Verdict::Tls,
        // require with a root certificate behaves as verify-ca.
        "require" if has_root && !right => Verdict::Refused,
        "require" => Verdict::Tls,
        "verify-ca" if right => Verdict::Tls,
        "verify-ca" => Verdict::Refused,
        "verify-full" if right && host != Host::Mismatch => Verdict::Tls,
        "verify-full" => Verdict::Refused,
        _ => unreachable!(),
    }
}

/// The relay's verdict: libpq's, except that `prefer` does not fall back to a plain
/// connection when a root certificate is in effect and the server's certificate
/// does not verify (docs/security.md: stricter than libpq).
fn ours_expected(mode: &str, root: Root, host: Host) -> Verdict {
    match (mode, libpq_expected(mode, root, host)) {
        ("prefer", Verdict::Plain) => Verdict::Refused,
        (_, v) => v,
    }
}

fn psql_verdict(conninfo: &str, env: &[(&'static str, String)]) -> Verdict {
    let out = std::process::Command::new("psql")
        .env_remove("PGSSLROOTCERT")
        .env_remove("PGSSLMODE")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args([
            "-XAtq",
            "-d",
            conninfo,
            "-c",
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        return Verdict::Refused;
    }
    match String::from_utf8_lossy(&out.stdout).trim() {
        "t" => Verdict::Tls,
        "f" => Verdict::Plain,
        other => panic!("psql printed {other:?}"),
    }
}

fn parse(conninfo: &str, env: &[(&'static str, String)]) -> Result<PgConnectOptions, String> {
    let env = env.to_vec();
    PgConnectOptions::parse_with_env(conninfo, &move |k| {
        env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    })
    .map_err(|e| e.to_string())
}

async fn ours_verdict(o: &PgConnectOptions) -> (Verdict, String) {
    match ReplicationConnection::connect(o).await {
        Ok(mut c) => {
            let rows = c.simple_query("IDENTIFY_SYSTEM").await.unwrap();
            assert_eq!(rows.len(), 1);
            let v = if c.is_tls() {
                Verdict::Tls
            } else {
                Verdict::Plain
            };
            c.terminate().await;
            (v, String::new())
        }
        Err(e) => {
            assert!(
                e.is_precondition(),
                "a TLS refusal is a precondition (exit 2): {e}"
            );
            (Verdict::Refused, e.to_string())
        }
    }
}

/// The SQL connection (tokio-postgres with the same rustls configuration, through
/// `connect_sql`).
async fn sql_verdict(o: &PgConnectOptions) -> Verdict {
    match wal_reader::tls::connect_sql(o).await {
        Ok((client, conn)) => {
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
            if row.get::<_, bool>(0) {
                Verdict::Tls
            } else {
                Verdict::Plain
            }
        }
        Err(_) => Verdict::Refused,
    }
}

#[tokio::test]
async fn sslmode_matrix_matches_libpq() {
    let dirs = Dirs::new();
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for mode in [
        "disable",
        "allow",
        "prefer",
        "require",
        "verify-ca",
        "verify-full",
    ] {
        for root in [
            Root::None,
            Root::RightParam,
            Root::RightEnv,
            Root::RightHome,
            Root::OtherParam,
            Root::OtherHome,
        ] {
            for host in [Host::Localhost, Host::Loopback, Host::Mismatch] {
                let (extra, env) = dirs.setup(root);
                let conninfo = format!(
                    "{} port={} user=postgres dbname=postgres sslmode={mode}{extra}",
                    host_part(host),
                    pg_port()
                );
                let libpq = psql_verdict(&conninfo, &env);
                let (ours, why) = match parse(&conninfo, &env) {
                    Ok(o) => ours_verdict(&o).await,
                    Err(e) => (Verdict::Refused, e),
                };
                let sql = match parse(&conninfo, &env) {
                    Ok(o) => sql_verdict(&o).await,
                    Err(_) => Verdict::Refused,
                };
                let want_libpq = libpq_expected(mode, root, host);
                let want = ours_expected(mode, root, host);
                // tokio-postgres has no `allow`: the SQL connection treats it as
                // prefer (TLS first), so it refuses an unverifiable certificate.
                let want_sql = match (mode, want) {
                    ("allow", _) => ours_expected("prefer", root, host),
                    (_, w) => w,
                };
                let line = format!(
                    "{mode:<11} {root:<10?} {host:<9?} libpq={libpq:?} ours={ours:?} sql={sql:?} {why}"
                );
                if libpq != want_libpq || ours != want || sql != want_sql {
                    failures.push(format!(
                        "{line}\n    expected libpq={want_libpq:?} ours={want:?} sql={want_sql:?}"
                    ));
                }
                table.push(line);
            }
        }
    }
    eprintln!("{}", table.join("\n"));
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[tokio::test]
async fn sslrootcert_system_only_with_verify_full_and_errors_name_the_fix() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    for mode in ["disable", "allow", "prefer", "require", "verify-ca"] {
        let ci = format!(
            "host=localhost port={} user=postgres dbname=postgres sslmode={mode} sslrootcert=system",
            pg_port()
        );
        let e = parse(&ci, &env).unwrap_err();
        assert!(e.contains("verify-full"), "{e}");
        // (libpq 16 refuses the same; the installed libpq 15 predates
        // sslrootcert=system and reads a file named "system", so no psql comparison.)
    }
    // With verify-full the system roots are used: they did not sign the test CA.
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslrootcert=system",
        pg_port()
    );
    let o = parse(&ci, &env).unwrap();
    assert_eq!(o.sslmode, wal_reader::SslMode::VerifyFull);
    let (v, why) = ours_verdict(&o).await;
    assert_eq!(v, Verdict::Refused, "{why}");
    assert!(why.contains("TLS handshake"), "{why}");

    // No root certificate for verify-ca: the error says how to give one.
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-ca",
        pg_port()
    );
    let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
    assert_eq!(v, Verdict::Refused);
    assert!(why.contains("sslrootcert"), "{why}");
    // An explicitly given root certificate that cannot be read is an error even with
    // require (libpq would silently skip verification: stricter, docs/security.md).
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=require sslrootcert=/nonexistent/ca.pem",
        pg_port()
    );
    let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
    assert_eq!(v, Verdict::Refused);
    assert!(why.contains("sslrootcert"), "{why}");
}

/// A login role with a SCRAM or md5 password, member of a pg_hba group of the test
/// cluster; dropped on drop.
struct Role {
    name: String,
}

impl Role {
    fn new(group: &str, encryption: &str) -> Role {
        let name = unique_name("tm");
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

    fn conninfo(&self, host: &str, extra: &str) -> String {
        format!(
            "host={host} port={} user={} password=pw-{} dbname=postgres {extra}",
            pg_port(),
            self.name,
            self.name
        )
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

#[tokio::test]
async fn channel_binding_require_is_enforced() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    let scram = Role::new("outbox_auth_tls", "scram-sha-256");
    // SCRAM-SHA-256-PLUS over TLS: both we and libpq connect.
    for host in ["localhost", "127.0.0.1"] {
        let ci = scram.conninfo(
            host,
            &format!(
                "sslmode=verify-full sslrootcert={} channel_binding=require",
                pg_ca_file()
            ),
        );
        let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
        assert_eq!(v, Verdict::Tls, "{why}");
        assert_eq!(psql_verdict(&ci, &env), Verdict::Tls);
        // The SQL connection binds too.
        assert_eq!(sql_verdict(&parse(&ci, &env).unwrap()).await, Verdict::Tls);
    }
    // A trust login, or an md5 password, is not channel binding: refused (libpq too).
    let md5 = Role::new("outbox_auth_md5", "md5");
    for ci in [
        format!(
            "host=localhost port={} user=postgres dbname=postgres sslmode=require channel_binding=require",
            pg_port()
        ),
        md5.conninfo("localhost", "sslmode=require channel_binding=require"),
    ] {
        let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
        assert_eq!(v, Verdict::Refused, "{ci}");
        assert!(why.contains("channel_binding=require"), "{why}");
        assert_eq!(psql_verdict(&ci, &env), Verdict::Refused, "{ci}");
        assert_eq!(sql_verdict(&parse(&ci, &env).unwrap()).await, Verdict::Refused);
    }
    // channel_binding=prefer (the default) over TLS uses the binding when offered.
    let ci = scram.conninfo("localhost", "sslmode=require");
    assert_eq!(
        ours_verdict(&parse(&ci, &env).unwrap()).await.0,
        Verdict::Tls
    );
    // channel_binding=require with sslmode=disable is a configuration error.
    assert!(parse(
        &scram.conninfo("localhost", "sslmode=disable channel_binding=require"),
        &env
    )
    .is_err());
    // gssencmode=require is refused, not ignored.
    let e = parse(&scram.conninfo("localhost", "gssencmode=require"), &env).unwrap_err();
    assert!(e.contains("gssencmode"), "{e}");
}

#[tokio::test]
async fn allow_retries_with_tls_instead_of_sending_a_cleartext_password() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    // pg_hba: outbox_auth_password logs in with a cleartext password. sslmode=allow
    // tries plain first; the relay refuses to send the password there and retries
    // over TLS.
    let role = Role::new("outbox_auth_password", "scram-sha-256");
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=allow"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Tls, "{why}");
    // An explicit sslmode=disable sends it (the operator asked for a plain link).
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=disable"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Plain, "{why}");
    // md5 likewise.
    let role = Role::new("outbox_auth_md5", "md5");
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=allow"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Tls, "{why}");
}

/// A scripted server on a local port: answers SSLRequest with `N`, then sends
/// `after_startup`, and returns everything the client sent.
async fn fake_server(after_startup: Vec<u8>) -> (u16, tokio::task::JoinHandle<Vec<u8>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        // SSLRequest (answered with N) or the startup message; then the startup
        // message after an SSLRequest.
        loop {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).await.unwrap();
            let mut rest = vec![0u8; u32::from_be_bytes(len) as usize - 4];
            s.read_exact(&mut rest).await.unwrap();
            if rest == [0x04, 0xd2, 0x16, 0x2f] {
                s.write_all(b"N").await.unwrap();
                continue;
            }
            break;
        }
        let mut got = Vec::new();
        s.write_all(&after_startup).await.unwrap();
        let mut tail = Vec::new();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(2), s.read_to_end(&mut tail)).await;
        got.extend_from_slice(&tail);
        got
    });
    (port, task)
}

fn auth_request(code: i32, extra: &[u8]) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend_from_slice(&(8 + extra.len() as i32).to_be_bytes());
    m.extend_from_slice(&code.to_be_bytes());
    m.extend_from_slice(extra);
    m
}

#[tokio::test]
async fn no_password_over_a_plain_link_unless_sslmode_disable_is_explicit() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    for (code, extra, method) in [(3, &b""[..], "cleartext"), (5, &b"salt"[..], "md5")] {
        // Default sslmode (prefer), the server refuses TLS and asks for the password.
        let (port, server) = fake_server(auth_request(code, extra)).await;
        let o = parse(
            &format!("host=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d"),
            &env,
        )
        .unwrap();
        let err = ReplicationConnection::connect(&o).await.err().unwrap();
        assert!(err.is_precondition(), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(method) && msg.contains("unencrypted"), "{msg}");
        assert!(
            !msg.contains("prefer"),
            "never advise a weaker sslmode: {msg}"
        );
        let sent = server.await.unwrap();
        assert!(
            sent.is_empty(),
            "nothing was sent after the request: {sent:?}"
        );
        // PGSSLMODE=disable is explicit too.
        let (port, server) = fake_server(auth_request(code, extra)).await;
        let mut env2 = env.clone();
        env2.push(("PGSSLMODE", "disable".into()));
        let o = parse(
            &format!("host=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d"),
            &env2,
        )
        .unwrap();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            ReplicationConnection::connect(&o),
        )
        .await;
        let sent = server.await.unwrap();
        assert_eq!(sent.first(), Some(&b'p'), "the password message was sent");
    }
}

#[tokio::test]
async fn tls_refused_names_the_server_fix_not_a_weaker_mode() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    for mode in ["require", "verify-ca", "verify-full"] {
        let (port, _server) = fake_server(Vec::new()).await;
        let o = parse(
            &format!(
                "host=127.0.0.1 port={port} user=u dbname=d sslmode={mode} sslrootcert={}",
                pg_ca_file()
            ),
            &env,
        )
        .unwrap();
        let err = ReplicationConnection::connect(&o).await.err().unwrap();
        let msg = err.to_string();
        assert!(err.is_precondition(), "{msg}");
        assert!(
            msg.contains("does not accept TLS") && msg.contains("ssl = on"),
            "{msg}"
        );
        assert!(!msg.contains("prefer") && !msg.contains("disable"), "{msg}");
    }
}

#[tokio::test]
async fn messages_before_authentication_are_capped() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    // An ErrorResponse announcing 1 GB.
    let mut huge = vec![b'E'];
    huge.extend_from_slice(&(1_000_000_000i32).to_be_bytes());
    huge.extend_from_slice(&[b'S'; 64]);
    let (port, _server) = fake_server(huge).await;
    let o = parse(
        &format!("host=127.0.0.1 port={port} user=u dbname=d sslmode=prefer"),
        &env,
    )
    .unwrap();
    let err = ReplicationConnection::connect(&o).await.err().unwrap();
    assert!(
        matches!(err, ReaderError::Protocol(ref m) if m.contains("invalid length")),
        "{err}"
    );
}

#[tokio::test]
async fn a_superuser_login_is_reported() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    let su = parse(
        &format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            pg_port()
        ),
        &env,
    )
    .unwrap();
    let mut c = ReplicationConnection::connect(&su).await.unwrap();
    assert!(c.is_superuser());
    c.terminate().await;
    let role = Role::new("outbox_auth_scram", "scram-sha-256");
    let o = parse(&role.conninfo("127.0.0.1", "sslmode=require"), &env).unwrap();
    let mut c = ReplicationConnection::connect(&o).await.unwrap();
    assert!(!c.is_superuser());
    c.terminate().await;
}

#[tokio::test]
async fn sql_connections_send_no_password_over_a_plain_link_either() {
    use wal_reader::tls::{connect_sql, SqlConnectError};
    let env = vec![("HOME", "/nonexistent".to_string())];
    for (code, extra, method) in [(3, &b""[..], "cleartext"), (5, &b"salt"[..], "md5")] {
        let (port, server) = fake_server(auth_request(code, extra)).await;
        let o = parse(
            &format!("host=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d"),
            &env,
        )
        .unwrap();
        let err = connect_sql(&o).await.err().unwrap();
        assert!(
            matches!(err, SqlConnectError::Refused(ref m) if m.contains(method) && m.contains("unencrypted")),
            "{err}"
        );
        let sent = server.await.unwrap();
        assert!(
            sent.is_empty(),
            "nothing was sent after the request: {sent:?}"
        );
        // An explicit sslmode=disable sends it.
        let (port, server) = fake_server(auth_request(code, extra)).await;
        let o = parse(
            &format!(
                "host=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d sslmode=disable"
            ),
            &env,
        )
        .unwrap();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), connect_sql(&o)).await;
        let sent = server.await.unwrap();
        assert_eq!(sent.first(), Some(&b'p'), "the password message was sent");
    }
    // A huge message before login ends the connection.
    let mut huge = vec![b'E'];
    huge.extend_from_slice(&(1_000_000_000i32).to_be_bytes());
    let (port, _server) = fake_server(huge).await;
    let o = parse(&format!("host=127.0.0.1 port={port} user=u dbname=d"), &env).unwrap();
    let err = connect_sql(&o).await.err().unwrap();
    assert!(
        matches!(err, SqlConnectError::Refused(ref m) if m.contains("30000")),
        "{err}"
    );
    // Against the real server: cleartext over TLS is fine (the server offers TLS).
    let role = Role::new("outbox_auth_password", "scram-sha-256");
    let o = parse(&role.conninfo("127.0.0.1", ""), &env).unwrap();
    assert_eq!(sql_verdict(&o).await, Verdict::Tls);
    let o = parse(&role.conninfo("127.0.0.1", "sslmode=disable"), &env).unwrap();
    assert_eq!(sql_verdict(&o).await, Verdict::Plain);
}
