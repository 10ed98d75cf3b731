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

mod binding;
mod matrix;
mod plain_link;

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
