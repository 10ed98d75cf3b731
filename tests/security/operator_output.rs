//! What an operator reads during an incident (docs/security.md, "Text a server
//! sends"), with an event RabbitMQ refuses holding the relay: outbox text holding terminal escapes, carriage returns and Unicode
//! bidirectional controls reaches `peek`, the list `slot skip` asks to confirm,
//! `status`'s stuck message and the relay's log only escaped; and `status` asks the
//! running relay for its stuck message with the endpoint's credentials and TLS, or
//! says that it could not ask.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use support::scenarios::WAIT;
use support::*;

const ID: &str = "00000000-0000-0000-0000-0000000e5c00";

/// An aggregate_type (hence the routing key) a hostile writer of the outbox chose:
/// a carriage return and erase-line, an OSC window title, BEL, a right-to-left
/// override, a left-to-right isolate, a line separator and the C1 CSI.
const HOSTILE_SQL: &str =
    r"E'evil\r\x1b[2K\x1b]0;pwned\x07' || U&'\202Egpj.exe\2066x\2028y\009B31m'";

/// The characters no operator output may carry raw.
const BIDI_AND_SEPARATORS: &[char] = &[
    '\u{202a}', '\u{202b}', '\u{202c}', '\u{202d}', '\u{202e}', '\u{2066}', '\u{2067}', '\u{2068}',
    '\u{2069}', '\u{2028}', '\u{2029}', '\u{9b}', '\u{7f}',
];

/// Fails when `bytes` hold a byte below 0x20 other than `\n`, or a bidirectional
/// control, a Unicode line separator, DEL or a C1 control.
fn assert_clean(what: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    let raw: Vec<String> = bytes
        .iter()
        .filter(|b| **b < 0x20 && **b != b'\n')
        .map(|b| format!("{b:#04x}"))
        .collect();
    assert!(
        raw.is_empty(),
        "{what}: raw control bytes {raw:?} in\n{text}"
    );
    let bidi: Vec<String> = text
        .chars()
        .filter(|c| BIDI_AND_SEPARATORS.contains(c))
        .map(|c| format!("U+{:04X}", c as u32))
        .collect();
    assert!(bidi.is_empty(), "{what}: raw {bidi:?} in\n{text}");
}

/// The broker's message size limit the stuck event exceeds.
const LIMIT: usize = 4 << 20;

/// A database whose one pending event RabbitMQ refuses (406, over the message size
/// limit [`refusing`] sets), with `aggregate_type` from `aggregate_type_sql`.
async fn stuck_event(aggregate_type_sql: &str) -> Env {
    let env = Env::new().await;
    env.create_slot();
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{ID}', {aggregate_type_sql}, {aggregate_type_sql}, 'e', \
                 jsonb_build_object('pad', repeat('x', {})))",
        LIMIT + (LIMIT >> 3)
    ));
    env
}

/// Lowers the broker's `max_message_size` to [`LIMIT`] (restored on drop), holding
/// the broker lock: it is broker-wide, though only messages over 4 MiB notice it.
async fn refusing() -> (
    tokio::sync::RwLockWriteGuard<'static, ()>,
    testkit::amqp::MaxMessageSize,
) {
    let lock = testkit::BROKER.write().await;
    (lock, testkit::amqp::MaxMessageSize::set(LIMIT))
}

/// Runs `status` (with `vars`) until its output holds `needle`; the last output.
async fn status_until(env: &Env, vars: &[(&str, &str)], needle: &str) -> std::process::Output {
    let deadline = Instant::now() + WAIT;
    loop {
        let out = env.cli_env(&["status"], vars);
        if stdout(&out).contains(needle) || Instant::now() > deadline {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `peek` (text and JSON), `slot skip` without a terminal, `status` (text and JSON)
/// while the relay is stuck on the event, and the relay's JSON log: no raw control byte
/// but the line breaks, no bidirectional control; the text is there, escaped, and
/// the JSON forms give back the exact value.
#[tokio::test]
async fn outbox_text_reaches_terminals_and_logs_escaped() {
    let env = stuck_event(HOSTILE_SQL).await;
    let hostile = env.db.psql(&format!("SELECT {HOSTILE_SQL}"));
    let escaped = "\\u{1b}]0;pwned\\u{7}\\u{202e}gpj.exe";

    let out = env.cli(&["peek"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean("peek", &out.stdout);
    assert!(stdout(&out).contains(escaped), "{}", stdout(&out));

    let out = env.cli(&["peek", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean("peek --json", &out.stdout);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["aggregate_id"].as_str(), Some(hostile.as_str()));

    // No terminal to confirm on: the list is printed, nothing is skipped.
    let out = env.cli(&["slot", "skip", ID]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_clean("slot skip (stdout)", &out.stdout);
    assert_clean("slot skip (stderr)", &out.stderr);
    assert!(stdout(&out).contains(escaped), "{}", stdout(&out));

    let listen = testkit::free_addr();
    let vars = [("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str())];
    let limit = refusing().await;
    let relay = env.start_env(&["--log-format", "json"], &vars);
    let out = status_until(&env, &vars, "stuck_message:").await;
    assert!(
        stdout(&out).contains("stuck_message:"),
        "{}\n{}",
        stdout(&out),
        relay.log_text()
    );
    assert_clean("status", &out.stdout);
    assert!(stdout(&out).contains(escaped), "{}", stdout(&out));
    let out = env.cli_env(&["status", "--json"], &vars);
    assert_clean("status --json", &out.stdout);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["stuck_message"]["routing_key"].as_str(),
        Some(format!("{hostile}.e").as_str()),
        "{v}"
    );

    let (code, log) = relay.terminate();
    drop(limit);
    assert_eq!(code, Some(0), "{log}");
    // JSON lines: escaped (`\u202e`), and the field gives back the exact value.
    assert_clean("the relay's log", log.as_bytes());
    let line = log
        .lines()
        .find(|l| l.contains("rabbitmq refuses this message"))
        .unwrap_or_else(|| panic!("no ERROR line for the refused message:\n{log}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(
        v["routing_key"].as_str(),
        Some(format!("{hostile}.e").as_str()),
        "{line}"
    );
    env.cleanup().await;
}

/// A self-signed certificate for `localhost` in `dir` (cert.pem, key.pem 0600).
fn certificate(dir: &std::path::Path) {
    let ok = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ])
        .arg("-keyout")
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(dir.join("cert.pem"))
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", stderr(&ok));
    secret(&dir.join("key.pem"), None);
}

/// Makes `path` (writing `content` when given) readable by its owner only.
fn secret(path: &std::path::Path, content: Option<&str>) {
    use std::os::unix::fs::PermissionsExt;
    if let Some(content) = content {
        std::fs::write(path, content).unwrap();
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// With a bearer token and TLS on the endpoint, `status` shows the stuck message
/// (it asks over HTTPS, trusting the endpoint's own certificate, with the relay's
/// control token); with only a token the endpoint refuses it says it could not ask
/// instead of showing nothing.
#[tokio::test]
async fn status_asks_for_the_stuck_message_with_the_endpoints_credentials_and_tls() {
    let env = stuck_event("'nobody'").await;
    certificate(&env.dir);
    secret(&env.dir.join("token"), Some("Tk-status-0123456789\n"));
    secret(&env.dir.join("wrong"), Some("Tk-not-the-token\n"));
    let d = env.dir.display().to_string();
    let (listen, token, wrong, cert, key) = (
        testkit::free_addr(),
        format!("{d}/token"),
        format!("{d}/wrong"),
        format!("{d}/cert.pem"),
        format!("{d}/key.pem"),
    );
    let mut vars = vec![
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str()),
        (
            "OUTBOX_RELAY_RELAY_METRICS_BEARER_TOKEN_FILE",
            token.as_str(),
        ),
        ("OUTBOX_RELAY_RELAY_METRICS_TLS_CERT_FILE", cert.as_str()),
        ("OUTBOX_RELAY_RELAY_METRICS_TLS_KEY_FILE", key.as_str()),
    ];
    let limit = refusing().await;
    let relay = env.start_env(&[], &vars);
    let out = status_until(&env, &vars, "stuck_message:").await;
    let text = stdout(&out);
    assert!(
        text.contains(&format!("stuck_message:       {ID} ")) && text.contains("nobody.e"),
        "{text}\n{}\n{}",
        stderr(&out),
        relay.log_text()
    );

    // The configured token alone (`status` on this host would read the relay's
    // control token first): a wrong one is refused.
    vars[1].1 = wrong.as_str();
    let elsewhere = format!("{d}/not-the-relays.token");
    vars.push(("OUTBOX_RELAY_RELAY_CONTROL_TOKEN_FILE", elsewhere.as_str()));
    let out = env.cli_env(&["status"], &vars);
    let text = stdout(&out);
    assert!(!text.contains("stuck_message:"), "{text}");
    assert!(
        text.contains("warning: could not ask the running relay for a stuck message"),
        "{text}"
    );
    let (code, log) = relay.terminate();
    drop(limit);
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
