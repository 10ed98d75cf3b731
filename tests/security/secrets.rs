//! Secrets never leak on hostile input (docs/security.md): a table of hostile
//! passwords (each reserved URL character unencoded, unicode, very long, one that
//! looks like a port, one that looks like a host name) in the Postgres and the AMQP
//! URL (and in a key=value conninfo) × commands × text and JSON logs at
//! `RUST_LOG=trace` × failures (nothing listening, a refused login, a failed TLS
//! handshake): no fragment of 3 or more characters of either
//! password appears anywhere in stdout or stderr.
//!
//! Needs the test services (scripts/test-services.sh): the bad-login cases log in to
//! the test cluster as `outbox_auth_scram` (a NOLOGIN group with no password: every
//! password is wrong) and to RabbitMQ as `guest` with the hostile password.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::bin;
use testkit::hostile::{auth_request, FakePostgres};

/// Passwords made of letters that rarely occur together in the relay's output, so
/// that a 3-character window found in the output can only come from the password.
fn hostile_passwords() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for c in [
        ':', '/', '?', '#', '[', ']', '@', '!', '$', '&', '\'', '(', ')', '*', '+', ',', ';', '=',
        '%', ' ', '"', '\\', '`',
    ] {
        out.push((format!("reserved {c:?}"), format!("Qxj{c}zXq{c}Jqz")));
    }
    out.push(("unicode".into(), "Qxjü€zXq😀Jqz".into()));
    out.push(("percent-encoded look".into(), "Qxj%2FzXq%zzJqz".into()));
    out.push(("port-like".into(), "49817".into()));
    out.push(("host-like".into(), "qzxj.jxqz.qx".into()));
    out.push(("user-like".into(), "Qxjz@zqxj:Jqz".into()));
    let long: String = "QxjzXqJqzjxQZqXJ".chars().cycle().take(600).collect();
    out.push(("600 characters".into(), long));
    out
}

/// Every window of 3 characters of `secret` (4 for all-digit secrets, whose 3-digit
/// windows also occur in timestamps and process ids).
fn fragments(secret: &str) -> Vec<String> {
    let n = if secret.chars().all(|c| c.is_ascii_digit()) {
        4
    } else {
        3
    };
    let chars: Vec<char> = secret.chars().collect();
    let mut out: Vec<String> = chars
        .windows(n)
        .map(|w| w.iter().collect::<String>())
        // Windows that are only reserved characters and spaces tell nothing.
        .filter(|w: &String| w.chars().filter(|c| c.is_alphanumeric()).count() >= 2)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `text` without hexadecimal runs of 16 or more digits (TLS randoms and session ids
/// in rustls' trace lines): noise for the check of an all-digit password.
fn without_hex_runs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_hexdigit() {
            run.push(c);
            continue;
        }
        if run.len() >= 16 {
            out.push_str("<hex>");
        } else {
            out.push_str(&run);
        }
        run.clear();
        out.push(c);
    }
    out.pop();
    out
}

/// `text` without RFC 3339 timestamps (their digits are noise for the 4-digit check).
fn without_timestamps(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let is_ts = b.len() - i >= 20
            && b[i..i + 4].iter().all(u8::is_ascii_digit)
            && b[i + 4] == b'-'
            && b[i + 7] == b'-'
            && b[i + 10] == b'T';
        if is_ts {
            let mut j = i + 11;
            while j < b.len() && (b[j].is_ascii_digit() || b":.+-Z".contains(&b[j])) {
                j += 1;
            }
            out.push_str("<ts>");
            i = j;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("outbox-relay-secrets-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pg_port() -> u16 {
    std::env::var("OUTBOX_TEST_PG_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55432)
}

#[derive(Debug, Clone, Copy)]
enum Failure {
    /// Nothing listens on either port.
    Unreachable,
    /// Both servers answer and refuse the password.
    BadLogin,
    /// Both TLS handshakes fail: Postgres's certificate is not signed by the system
    /// roots (verify-full), and the AMQP port speaks no TLS.
    BadTls,
    /// As `BadLogin`, with the Postgres password in a key=value conninfo (quoted).
    BadLoginConninfo,
}

/// `s` as a quoted conninfo value.
fn conninfo_quoted(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out
}

fn config(dir: &Path, name: &str, pw: &str, failure: Failure) -> PathBuf {
    let (pg, amqp) = match failure {
        Failure::Unreachable => (
            format!("postgresql://relay:{pw}@127.0.0.1:1/app"),
            format!("amqp://guest:{pw}@127.0.0.1:2/%2f"),
        ),
        Failure::BadLogin => (
            format!(
                "postgresql://outbox_auth_scram:{pw}@127.0.0.1:{}/postgres",
                pg_port()
            ),
            testkit::amqp_url_for("guest", pw, "%2f"),
        ),
        Failure::BadTls => (
            format!(
                "postgresql://outbox_auth_scram:{pw}@localhost:{}/postgres?sslmode=verify-full&sslrootcert=system",
                pg_port()
            ),
            format!("amqps://guest:{pw}@127.0.0.1:{}/%2f", testkit::amqp_port()),
        ),
        Failure::BadLoginConninfo => (
            format!(
                "host=127.0.0.1 port={} user=outbox_auth_scram dbname=postgres password={}",
                pg_port(),
                conninfo_quoted(pw)
            ),
            testkit::amqp_url_for("guest", pw, "%2f"),
        ),
    };
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "[postgres]\nurl = {}\n[rabbitmq]\nurl = {}\n[relay]\nmetrics_listen = \"\"\n",
            toml_string(&pg),
            toml_string(&amqp)
        ),
    )
    .unwrap();
    path
}

/// Runs the binary; a command still running after `limit` is killed.
fn relay(config: &Path, format: &str, args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("OUTBOX_RELAY_") || k.starts_with("PG") {
            cmd.env_remove(k);
        }
    }
    cmd.arg("--config")
        .arg(config)
        .args(["--log-format", format])
        .args(args)
        .env("RUST_LOG", "trace")
        .env("HOME", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn no_fragment_of_a_hostile_password_is_ever_printed() {
    let dir = TempDir::new();
    let commands: &[&[&str]] = &[
        &["check"],
        &["status"],
        &["status", "--json"],
        &["slot", "create"],
        &["slot", "drop"],
        &["peek"],
        &["replay", "--from-table"],
        &["run"],
    ];
    let mut cases = Vec::new();
    for (i, (label, pw)) in hostile_passwords().into_iter().enumerate() {
        for failure in [
            Failure::Unreachable,
            Failure::BadLogin,
            Failure::BadTls,
            Failure::BadLoginConninfo,
        ] {
            let cfg = config(&dir.0, &format!("c{i}-{failure:?}"), &pw, failure);
            for args in commands {
                for format in ["text", "json"] {
                    cases.push((
                        label.clone(),
                        pw.clone(),
                        failure,
                        cfg.clone(),
                        *args,
                        format,
                    ));
                }
            }
        }
    }
    // In parallel, a few at a time.
    let leaks = std::sync::Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((label, pw, failure, cfg, args, format)) = cases.get(i) else {
                    break;
                };
                // `run` retries an unreachable Postgres forever: 3 s of its log.
                let limit = if args.contains(&"run") { 3 } else { 30 };
                let (code, out) = relay(cfg, format, args, Duration::from_secs(limit));
                let clean = without_hex_runs(&without_timestamps(&out));
                let found: Vec<String> = fragments(pw)
                    .into_iter()
                    .filter(|f| clean.contains(f.as_str()))
                    .collect();
                if !found.is_empty() {
                    let lines: Vec<&str> = clean
                        .lines()
                        .filter(|l| found.iter().any(|f| l.contains(f.as_str())))
                        .take(5)
                        .collect();
                    leaks.lock().unwrap().push(format!(
                        "password {label} ({failure:?}), `{}` --log-format {format} (exit {code:?}): {found:?} in\n{}",
                        args.join(" "),
                        lines.join("\n")
                    ));
                }
                // A command other than `run` that is still running at the limit is
                // reported, not failed: lapin, at trace level under this load, now and
                // then stalls after a refused login (its I/O loop waits for a socket
                // event that never comes). The leak check above still applies to
                // everything it printed.
                if !args.contains(&"run") && code.is_none() {
                    eprintln!(
                        "note: `{}` with {} was still running after {limit} s",
                        args.join(" "),
                        cfg.display()
                    );
                }
                if !args.contains(&"run") && code.is_some() {
                    assert_ne!(code, Some(0), "`{}` succeeded:\n{out}", args.join(" "));
                }
            });
        }
    });
    let leaks = leaks.into_inner().unwrap();
    assert!(
        leaks.is_empty(),
        "{} leaks ({}), first ones:\n{}",
        leaks.len(),
        {
            let mut kinds: Vec<&str> = leaks
                .iter()
                .map(|l| l.split(" (").next().unwrap())
                .collect();
            kinds.dedup();
            kinds.join("; ")
        },
        leaks
            .iter()
            .take(6)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

#[test]
fn world_readable_config_with_a_password_warns_once() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let cfg = config(&dir.0, "perm", "Qxjz-zXq", Failure::Unreachable);
    // The .deb's layout, root:outbox-relay 0640, is accepted (root owns it: the
    // key files' rule); the same mode for another owner is not.
    for (mode, owner, warns) in [
        (0o644, 0, true),
        (0o640, 65534, true),
        (0o640, 0, false),
        (0o600, 0, false),
    ] {
        std::os::unix::fs::chown(&cfg, Some(owner), Some(owner)).unwrap();
        std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(mode)).unwrap();
        let (_, out) = relay(&cfg, "text", &["check"], Duration::from_secs(10));
        let n = out.matches("readable by").count();
        assert_eq!(
            n,
            usize::from(warns),
            "mode {mode:o}, owner {owner}:\n{out}"
        );
    }
    // No password in the file: no warning.
    let plain = dir.0.join("nopw.toml");
    std::fs::write(
        &plain,
        "[postgres]\nurl = \"postgresql://relay@127.0.0.1:1/app\"\n[rabbitmq]\nurl = \"amqp://127.0.0.1:2/%2f\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (_, out) = relay(&plain, "text", &["check"], Duration::from_secs(10));
    assert!(!out.contains("readable by"), "{out}");
}

/// Every command that opens an ordinary SQL connection refuses to send a password
/// in cleartext or as md5 over a plain link (sslmode=prefer against a server that
/// answers the TLS request with `N`, or with a byte no Postgres server sends), with
/// exit 2 and a sentence that does not advise a weaker sslmode.
#[test]
fn no_command_sends_a_cleartext_password_over_a_plain_link() {
    let dir = std::env::temp_dir().join(format!("cleartext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (answer, code) in [(b'N', 3), (b'N', 5), (b'E', 3), (b'X', 5), (0, 3)] {
        // A cleartext request, or an md5 one with its salt.
        let request = if code == 5 {
            auth_request(5, b"salt")
        } else {
            auth_request(3, b"")
        };
        let server = FakePostgres::start(answer, request);
        let port = server.port;
        let method = if code == 5 { "md5" } else { "cleartext" };
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            format!(
                "[postgres]\nurl = \"postgresql://relay:Qxjz7Pw@127.0.0.1:{port}/app\"\n\
                 slot = \"s\"\npublication = \"p\"\n\n[relay]\nmetrics_listen = \"\"\n"
            ),
        )
        .unwrap();
        for args in [
            &["check"][..],
            &["status"][..],
            &["peek"][..],
            &["slot", "create"][..],
            &["slot", "drop"][..],
            &["replay", "--from-table"][..],
            &["run"][..],
        ] {
            let case = format!("answer {answer:#04x}, {method}, {args:?}");
            let (code, out) = relay(&path, "text", args, Duration::from_secs(60));
            assert!(
                !server.password_sent(),
                "{case}: the password was sent:\n{out}"
            );
            assert_eq!(code, Some(2), "{case}: {out}");
            if answer == b'N' {
                assert!(
                    out.contains(method) && out.contains("unencrypted"),
                    "{case}: {out}"
                );
            } else {
                assert!(out.contains("instead of S or N"), "{case}: {out}");
            }
            assert!(
                !out.contains("prefer"),
                "{case} advised sslmode=prefer: {out}"
            );
            assert!(
                !out.contains("Qxjz7Pw"),
                "{case} printed the password: {out}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
