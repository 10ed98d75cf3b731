//! The binary against hostile peers (docs/security.md): security refusals stop `run`
//! with exit 2 instead of being retried like an outage; text a server sends cannot
//! forge log lines or reach the terminal as escape sequences; the AMQP password is
//! in no log line at `RUST_LOG=trace`, in any encoding (plain, a decimal byte list,
//! hex, base64).
//!
//! Needs the test services (scripts/test-services.sh).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;
use testkit::hostile::{base64, error_response, BrokerUser, FakePostgres};
use testkit::unique_name;

/// Runs the binary with `config`; a command still running after `limit` is killed
/// (exit `None`). Returns the exit code and stdout + stderr.
fn relay(config: &Path, args: &[&str], rust_log: &str, limit: Duration) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("OUTBOX_RELAY_") || k.starts_with("PG") {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd
        .arg("--config")
        .arg(config)
        .args(args)
        .env("RUST_LOG", rust_log)
        .env("HOME", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let d = std::env::temp_dir().join(unique_name("hostile"));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn config(&self, name: &str, pg_url: &str, amqp_url: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(
            &path,
            format!(
                "[postgres]\nurl = {pg_url:?}\nslot = \"s\"\npublication = \"p\"\n\n\
                 [rabbitmq]\nurl = {amqp_url:?}\n\n[relay]\nmetrics_listen = \"\"\n"
            ),
        )
        .unwrap();
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A login role of the test cluster in `group` (see scripts/test-services.sh's
/// pg_hba.conf), with its password stored as `encryption`.
fn role(group: &str, encryption: &str) -> (DropRole, String) {
    let name = unique_name("hp");
    let password = format!("Pw-{name}");
    testkit::psql(
        "postgres",
        &format!(
            "SET password_encryption = '{encryption}'; \
             CREATE ROLE {name} LOGIN REPLICATION PASSWORD '{password}'; GRANT {group} TO {name};"
        ),
    );
    (
        DropRole {
            role: name,
            db: "postgres".into(),
        },
        password,
    )
}

/// A fake Postgres that answers every SSLRequest with `N` and every startup
/// message with `reply`.
fn fake_pg(reply: Vec<u8>) -> u16 {
    FakePostgres::start(b'N', reply).port
}

/// `run` stops with exit 2 and the fix on every security refusal, where it used to
/// retry them forever as if Postgres were down: a server without TLS under
/// `sslmode=require`, a certificate from another CA under `verify-full`,
/// `channel_binding=require` and `require_auth=scram-sha-256` against a role that
/// logs in with md5, and a password the server asks for but none is configured.
#[test]
fn run_stops_with_exit_2_on_security_refusals() {
    bin();
    let dir = Dir::new();
    let port = testkit::pg_port();
    let other_ca = std::env::var("OUTBOX_TEST_RABBITMQ_CA")
        .unwrap_or_else(|_| "/etc/rabbitmq/outbox-test-certs/ca.crt".into());
    let (md5, md5_pw) = role("outbox_auth_md5", "md5");
    let (scram, _) = role("outbox_auth_scram", "scram-sha-256");
    let no_tls = fake_pg(Vec::new());
    let cases = [
        (
            "server without TLS, sslmode=require",
            format!("postgresql://u:pw@127.0.0.1:{no_tls}/app?sslmode=require"),
            "does not accept TLS",
        ),
        (
            "certificate of another CA",
            format!(
                "postgresql://{}:{md5_pw}@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={other_ca}",
                md5.role
            ),
            "TLS handshake",
        ),
        (
            "channel_binding=require, md5 login",
            format!(
                "postgresql://{}:{md5_pw}@localhost:{port}/postgres?sslmode=require&channel_binding=require",
                md5.role
            ),
            "channel_binding=require",
        ),
        (
            "require_auth=scram-sha-256, md5 login",
            format!(
                "postgresql://{}:{md5_pw}@localhost:{port}/postgres?sslmode=require&require_auth=scram-sha-256",
                md5.role
            ),
            "require_auth",
        ),
        (
            "no password configured",
            format!(
                "postgresql://{}@localhost:{port}/postgres?sslmode=require",
                scram.role
            ),
            "password",
        ),
    ];
    for (i, (what, url, words)) in cases.iter().enumerate() {
        let cfg = dir.config(&format!("c{i}.toml"), url, &testkit::amqp_url());
        let started = Instant::now();
        let (code, out) = relay(&cfg, &["run"], "info", Duration::from_secs(30));
        assert_eq!(
            code,
            Some(2),
            "{what}: `run` did not stop with exit 2 within 30 s:\n{out}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{what}: took {:?}",
            started.elapsed()
        );
        assert!(out.contains(words), "{what}:\n{out}");
        assert!(!out.contains("retry_in"), "{what}: retried:\n{out}");
        assert!(!out.contains(&md5_pw), "{what}: printed the password");
    }
}

/// A server's error text with a line break and a forged log line, a carriage return,
/// and terminal escapes (clear screen, set title): `check` (stdout and its `error:`
/// line) and `run`'s log lines, text and JSON, keep the text on the relay's own line
/// and print no control character.
#[test]
fn server_text_cannot_forge_log_lines_or_reach_the_terminal() {
    let dir = Dir::new();
    let forged = "login refused\n2026-01-01T00:00:00.000000Z  INFO outbox_relay: forged line\r\x1b[2J\x1b]0;owned\x07";
    let port = fake_pg(error_response(&[
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', "08006"),
        (b'M', forged),
        (b'D', forged),
    ]));
    let cfg = dir.config(
        "forged.toml",
        &format!("postgresql://u@127.0.0.1:{port}/app"),
        "amqp://guest:guest@127.0.0.1:2/%2f",
    );
    let runs: [(&[&str], Duration); 4] = [
        (&["check"], Duration::from_secs(30)),
        (&["--log-format", "json", "check"], Duration::from_secs(30)),
        (&["run"], Duration::from_secs(4)),
        (&["--log-format", "json", "run"], Duration::from_secs(4)),
    ];
    for (args, limit) in runs {
        let (_, out) = relay(&cfg, args, "debug", limit);
        assert!(
            out.contains("forged line"),
            "{args:?}: the server's text is kept:\n{out}"
        );
        for line in out.lines() {
            assert!(
                !line.starts_with("2026-01-01T00:00:00"),
                "{args:?}: a forged line:\n{out}"
            );
        }
        let bad: Vec<char> = out
            .chars()
            .filter(|c| c.is_control() && *c != '\n')
            .collect();
        assert!(
            bad.is_empty(),
            "{args:?}: control characters {bad:?} in the output:\n{out:?}"
        );
    }
}

/// The forms the password's bytes can take in a log line: as written, as a decimal
/// byte list (`LongString([0, 114, …])`), as hex (upper or lower case, with or without
/// separators), and as base64 (standard or URL-safe) at each of the three alignments
/// it can have inside a longer encoded value (the SASL PLAIN response is
/// `\0user\0password`).
fn encodings(secret: &str) -> Vec<(String, String)> {
    let b = secret.as_bytes();
    let mut out = vec![("plain".to_string(), secret.to_string())];
    let dec: Vec<String> = b.iter().map(|x| x.to_string()).collect();
    out.push(("decimal list".into(), dec.join(", ")));
    out.push(("decimal list (no spaces)".into(), dec.join(",")));
    for (name, sep) in [("hex", ""), ("hex spaced", " "), ("hex colons", ":")] {
        let lower: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
        out.push((name.into(), lower.join(sep)));
        out.push((format!("{name} upper"), lower.join(sep).to_uppercase()));
    }
    let escaped: String = b.iter().map(|x| format!("\\x{x:02x}")).collect();
    out.push(("escaped hex".into(), escaped));
    for k in 0..3 {
        let mut padded = vec![0u8; k];
        padded.extend_from_slice(b);
        let enc = base64(&padded);
        // Drop the group holding the prefix and a last, partial group: what is left
        // depends on the secret's bytes only.
        let start = if k > 0 { 4 } else { 0 };
        let end = if padded.len() % 3 != 0 {
            enc.len() - 4
        } else {
            enc.len()
        };
        if end < start + 8 {
            continue;
        }
        let middle = &enc[start..end];
        out.push((format!("base64 at offset {k}"), middle.to_string()));
        out.push((
            format!("base64url at offset {k}"),
            middle.replace('+', "-").replace('/', "_"),
        ));
    }
    out
}

/// `check` and `run` at `RUST_LOG=trace` (every library's lines, text and JSON)
/// against the real broker: the AMQP password appears in none of its encodings. The
/// relay's own AMQP client logs no frame; an AMQP library that logs them (lapin did,
/// Connection.StartOk's SASL PLAIN response as a byte list among them) would be
/// caught here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amqp_password_is_in_no_trace_line_in_any_encoding() {
    let env = Env::new().await;
    let password = format!("Tq{}Zw", &unique_name("p")[2..]);
    let user = BrokerUser::new("trace_user", &password);
    let url = testkit::amqp_url_for(&user.0, &password, "%2f");
    let cfg = env.config_file("trace.toml", &env.db.url(), &url, "");
    env.create_slot();
    let mut outputs = Vec::new();
    for format in ["text", "json"] {
        let out = Command::new(bin())
            .args([
                "--config",
                cfg.to_str().unwrap(),
                "--log-format",
                format,
                "check",
            ])
            .env("RUST_LOG", "trace")
            .output()
            .unwrap();
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert!(out.status.success(), "check failed:\n{text}");
        outputs.push((format!("check --log-format {format}"), text));
        let relay = env.start_with(&cfg, "trace", &["--log-format", format]);
        tokio::time::sleep(Duration::from_secs(4)).await;
        env.insert_seq(1, 3, 3);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (_, log) = relay.terminate();
        outputs.push((format!("run --log-format {format}"), log));
    }
    let mut leaks = Vec::new();
    for (what, text) in &outputs {
        assert!(
            text.contains("TRACE") && text.contains("rabbitmq"),
            "{what}: no trace lines, or none about RabbitMQ: the scan proves nothing"
        );
        for (name, needle) in encodings(&password) {
            if let Some(line) = text.lines().find(|l| l.contains(&needle)) {
                leaks.push(format!(
                    "{what}: {name} ({needle}) in: {}",
                    &line[..line.len().min(400)]
                ));
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "the password leaked:\n{}",
        leaks.join("\n")
    );
    env.cleanup().await;
}

#[test]
fn the_encodings_are_right() {
    assert_eq!(base64(b"\0u\0pw"), "AHUAcHc=");
    let e = encodings("pw-secret");
    assert!(e.contains(&(
        "decimal list".into(),
        "112, 119, 45, 115, 101, 99, 114, 101, 116".into()
    )));
    assert!(e.contains(&("hex".into(), "70772d736563726574".into())));
    // "\0u\0pw-secret" encodes to AHUAcHctc2VjcmV0: offset 0 of the secret is
    // "cHctc2VjcmV0" without its last group.
    assert_eq!(base64(b"\0u\0pw-secret"), "AHUAcHctc2VjcmV0");
    assert!(e
        .iter()
        .any(|(_, n)| "AHUAcHctc2VjcmV0".contains(n.as_str()) && n.len() >= 4));
}

/// A plain `amqp://` or `rabbitmq-stream://` URL whose host is not this machine sends
/// the broker credentials (SASL PLAIN) in clear: the relay says so in a warning
/// (`0.0.0.0` refuses at once here but is not a loopback address).
#[test]
fn plaintext_broker_credentials_beyond_loopback_are_warned_about() {
    let dir = Dir::new();
    let pg = testkit::pg_url("postgres");
    let amqp = dir.config("amqp.toml", &pg, "amqp://guest:guest@0.0.0.0:2/%2f");
    let stream = dir.0.join("stream.toml");
    std::fs::write(
        &stream,
        format!(
            "[postgres]\nurl = {pg:?}\n[rabbitmq]\nstream = \"s1\"\n\
             stream_url = \"rabbitmq-stream://guest:guest@0.0.0.0:2/%2f\"\n\
             [relay]\nmetrics_listen = \"\"\n"
        ),
    )
    .unwrap();
    let local = dir.config("local.toml", &pg, "amqp://guest:guest@127.0.0.1:2/%2f");
    for (cfg, warns) in [(&amqp, true), (&stream, true), (&local, false)] {
        let (_, out) = relay(cfg, &["check"], "warn", Duration::from_secs(30));
        assert_eq!(
            out.contains("not encrypted"),
            warns,
            "{}:\n{out}",
            cfg.display()
        );
        assert!(!out.contains("guest:guest"), "{out}");
    }
}
