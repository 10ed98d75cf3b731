//! Control through the endpoint against web pages, other local users and port
//! squatters (issue 50), and `ctl` after a bad edit of the file (issue 55):
//!
//! - a browser-shaped cross-site POST (an `Origin` of another site, a form's
//!   `Content-Type`) is refused and changes nothing;
//! - a DNS-rebinding `Host` gets 421 on every route, while the probes' IP
//!   addresses and `localhost` work;
//! - control needs this start's control token (mode 0600) when no credentials are
//!   configured: a request without it, or a `ctl` that cannot read it, changes nothing;
//! - a process that takes the port after `ctl drain --wait`, or before `ctl`, gets
//!   no credential;
//! - `ctl` prints what the endpoint sends escaped, in text and in JSON;
//! - `ctl pause`, `resume`, `reload` and `drain` work with a file broken elsewhere
//!   (and not TOML at all), and `ctl --endpoint URL` with no file; `ctl status`
//!   says `connected: false|true`.
//!
//! The relays run against an unreachable Postgres (as in `metrics_endpoint`):
//! control and the endpoint work while `run` waits for it.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::bin;
use testkit::unique_name;

use crate::metrics_endpoint::{ctl, get, send, spawn_env, spawn_on, start, CONTROL};

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `/readyz`'s body: `not ready: paused` while paused.
/// `/readyz` says the relay is not ready (it has no broker here) for a reason other than
/// a pause: the refused request changed nothing.
fn assert_not_paused(port: u16) {
    let body = readyz(port);
    assert!(
        body.starts_with("not ready") && !body.contains("paused"),
        "{body}"
    );
}

fn readyz(port: u16) -> String {
    get(port, "/readyz", &[]).map(|r| r.1).unwrap_or_default()
}

/// A page on another site can send a POST with a form's `Content-Type` and no
/// preflight: it is refused (403), with or without the token, and the relay is
/// neither paused nor drained. Before, it answered 200 and the relay paused.
#[test]
fn a_browser_shaped_cross_site_post_changes_nothing() {
    let relay = start("", &[]);
    let token = std::fs::read_to_string(relay.dir.join("control.token")).unwrap();
    let bearer = format!("Bearer {}", token.trim());
    let browser = [
        ("Origin", "http://evil.example"),
        ("Content-Type", "text/plain"),
    ];
    for path in ["/control/pause", "/control/drain", "/control/reload"] {
        let (status, body) = send(relay.port, "POST", path, &browser).unwrap();
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("another origin"), "{body}");
    }
    // Even with the token, a cross-site origin, a form body or a missing control
    // header is refused.
    let shapes: [&[(&str, &str)]; 4] = [
        &[
            ("Authorization", &bearer),
            CONTROL,
            ("Origin", "http://evil.example"),
        ],
        &[("Authorization", &bearer), CONTROL, ("Origin", "null")],
        &[
            ("Authorization", &bearer),
            CONTROL,
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        &[("Authorization", &bearer)],
    ];
    for headers in shapes {
        let (status, body) = send(relay.port, "POST", "/control/pause", headers).unwrap();
        assert_eq!(status, 403, "{headers:?}: {body}");
    }
    assert_not_paused(relay.port);
    let out = ctl(&relay.dir.join("relay.toml"), &["status"]);
    assert!(text(&out).contains("state: running"), "{}", text(&out));
    // The shape `ctl` sends works.
    let (status, body) = send(
        relay.port,
        "POST",
        "/control/pause",
        &[("Authorization", &bearer), CONTROL],
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(readyz(relay.port), "not ready: paused\n");
}

/// A page whose name a DNS rebinding points at 127.0.0.1 sends its own name in
/// `Host`: 421 on every route, `/metrics` and `/poison` included. The listener's
/// address and `localhost` work; on 0.0.0.0 any IP address (what Kubernetes probes
/// send: the pod's) and the names of `metrics_allowed_hosts`. Before, 200.
#[test]
fn a_rebinding_host_is_misdirected_on_every_route() {
    let relay = start("", &[]);
    let port = relay.port;
    let evil = format!("evil.example:{port}");
    for path in [
        "/control/status",
        "/metrics",
        "/poison",
        "/readyz",
        "/healthz",
    ] {
        let (status, body) = send(port, "GET", path, &[("Host", &evil)]).unwrap();
        assert_eq!(status, 421, "{path}: {body}");
    }
    let (status, _) = send(port, "POST", "/control/pause", &[("Host", &evil), CONTROL]).unwrap();
    assert_eq!(status, 421);
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let (status, body) = send(port, "GET", "/metrics", &[("Host", &host)]).unwrap();
        assert_eq!(status, 200, "{host}: {body}");
    }
    drop(relay);

    let wide = spawn_on(
        "0.0.0.0",
        "metrics_allowed_hosts = [\"relay\"]\n",
        &[],
        &|port| get(port, "/healthz", &[]).map(|r| r.0) == Some(200),
    );
    let port = wide.port;
    for (host, want) in [
        (format!("10.1.2.3:{port}"), 200),
        (format!("[fd00::7]:{port}"), 200),
        (format!("relay:{port}"), 200),
        (format!("RELAY.:{port}"), 200),
        (format!("evil.example:{port}"), 421),
        (format!("relay.evil.example:{port}"), 421),
    ] {
        let got = send(port, "GET", "/healthz", &[("Host", &host)]).map(|r| r.0);
        assert_eq!(got, Some(want), "{host}");
    }
}

/// Without configured credentials, control needs this start's control token,
/// which only the relay's user can read (0600): a request without it or with
/// another one is refused (401) and changes nothing, and a `ctl` that cannot read
/// the file (another user) is refused naming it. Before, any local process could
/// pause or drain the relay.
#[test]
fn control_needs_the_token_only_the_relays_user_reads() {
    let relay = start("", &[]);
    let file = relay.dir.join("control.token");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the token file's mode");
    for headers in [
        &[CONTROL][..],
        &[CONTROL, ("Authorization", "Bearer 0000")][..],
    ] {
        for (method, path) in [
            ("POST", "/control/pause"),
            ("POST", "/control/drain"),
            ("GET", "/control/status"),
        ] {
            let (status, body) = send(relay.port, method, path, headers).unwrap();
            assert_eq!(status, 401, "{path}: {body}");
        }
    }
    assert_not_paused(relay.port);
    let cfg = relay.dir.join("relay.toml");
    let other = relay.dir.join("other.toml");
    let config = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&other, config.replace("control.token", "unreadable.token")).unwrap();
    let out = ctl(&other, &["pause"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("unreadable.token") && text(&out).contains("relay's user"),
        "{}",
        text(&out)
    );
    assert_not_paused(relay.port);
    let out = ctl(&cfg, &["pause"]);
    assert!(text(&out).contains("state: paused since"), "{}", text(&out));
    assert!(!relay
        .log()
        .contains(std::fs::read_to_string(&file).unwrap().trim()));
}

/// A process that took the port: it answers every request with one answer and
/// records every byte of every connection, until dropped.
struct Squatter {
    seen: Arc<Mutex<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Squatter {
    /// Listens on 127.0.0.1:`port`, retrying every millisecond until the port is
    /// free (up to `wait`).
    fn bind(port: u16, wait: Duration, answer: &'static str) -> Squatter {
        let deadline = Instant::now() + wait;
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(l) => break l,
                Err(e) => assert!(Instant::now() < deadline, "cannot take port {port}: {e}"),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        listener.set_nonblocking(true).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (record, stopped) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((mut conn, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_millis(300)));
                let mut buf = [0u8; 4096];
                let mut answered = false;
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    if !answered {
                        let _ = conn.write_all(answer.as_bytes());
                        answered = true;
                    }
                }
            }
        });
        Squatter {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    fn seen(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A fake proof: HTTP 200 with a proof that is not the token's.
const FAKE_PROOF: &str = "HTTP/1.1 200 OK\r\ncontent-length: 76\r\n\r\n{\"proof\":\"0000000000000000000000000000000000000000000000000000000000000000\"}\n";

/// After `ctl drain --wait` the relay frees its port; a local process that takes
/// it at once gets nothing from `ctl` (it watches the relay's pid, and asks the
/// port nothing more; the relay's drain takes a while, as with confirms to wait
/// for). Then, with the old token file still there, `ctl pause`
/// against the squatter (which cannot prove the token) sends no credential.
/// Before, `ctl` sent the bearer token to the port every 200 ms while waiting, and
/// `pause` sent it to whatever answered.
#[test]
fn a_port_squatter_gets_no_credential() {
    // A Postgres that never answers: the relay's drain waits up to connect_timeout
    // (2 s) for the connection attempt under way, as a drain waits for confirms,
    // so `ctl drain --wait` has to wait.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "postgresql://u@127.0.0.1:{}/app?connect_timeout=2",
        silent.local_addr().unwrap().port()
    );
    let relay = spawn_env(
        "127.0.0.1",
        &[("OUTBOX_RELAY_POSTGRES_URL", &url)],
        "metrics_bearer_token_file = \"{dir}/bearer\"\n",
        &[("bearer", "Tk-squatted-0123456789\n")],
        &|port| get(port, "/healthz", &[]).map(|r| r.0) == Some(200),
    );
    let cfg = relay.dir.join("relay.toml");
    let token = std::fs::read_to_string(relay.dir.join("control.token")).unwrap();
    let mut relay = relay;
    let wait = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .args(["ctl", "drain", "--wait", "--timeout", "10s"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Takes the port the moment the relay frees it (within a millisecond or so).
    let squatter = Squatter::bind(
        relay.port,
        Duration::from_secs(30),
        "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n",
    );
    let out = wait.wait_with_output().unwrap();
    let seen = squatter.seen();
    assert!(
        !seen.contains("Tk-squatted") && !seen.contains(token.trim()),
        "the process that took the port received a credential: {seen}"
    );
    assert!(
        out.status.success() && text(&out).contains("stopped"),
        "{}",
        text(&out)
    );
    assert_eq!(
        relay.child.wait().unwrap().code(),
        Some(0),
        "{}",
        relay.log()
    );
    drop(squatter);

    // A token file of an earlier start, and a squatter that fakes the proof.
    let file = relay.dir.join("control.token");
    std::fs::write(&file, &token).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let squatter = Squatter::bind(relay.port, Duration::from_secs(5), FAKE_PROOF);
    let out = ctl(&cfg, &["pause"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    let seen = squatter.seen();
    assert!(
        !seen.contains("Tk-squatted") && !seen.contains(token.trim()),
        "{seen}"
    );
    assert!(
        !seen.to_ascii_lowercase().contains("authorization"),
        "{seen}"
    );
}

/// A fake endpoint (a process on the port that is not the relay) answers every
/// request with `body` as JSON.
fn fake_endpoint(body: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_millis(300)));
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
        }
    });
    port
}

/// What the endpoint sends reaches the terminal escaped, in `ctl status` and in
/// `ctl status --json` (terminal escapes, C1 controls, bidirectional overrides,
/// line separators). Before, the text was printed raw (the JSON kept C1 and
/// bidirectional controls raw).
#[test]
fn ctl_prints_the_endpoints_text_escaped() {
    let port = fake_endpoint(
        "{\"state\":\"running\\u001b]0;owned\\u0007\",\"connected\":true,\"acked_lsn\":\"0/1\\u202e\\u009b2J\",\"confirmed_lsn\":\"0/2\\u2028state: paused\",\"in_flight\":0}\n",
    );
    let dir = std::env::temp_dir().join(unique_name("ctlesc"));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = crate::metrics_endpoint::write_config(&dir, &format!("127.0.0.1:{port}"), "");
    let raw = |s: &str| {
        s.chars().any(|c| {
            c != '\n'
                && (c.is_control()
                    || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2028}' | '\u{2029}'))
        })
    };
    let out = ctl(&cfg, &["status"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    assert!(!raw(&said), "raw control characters in: {said:?}");
    assert!(
        said.contains("\\u{1b}") && said.contains("\\u{202e}"),
        "{said}"
    );
    assert_eq!(said.lines().count(), 5, "{said}");
    let out = ctl(&cfg, &["status", "--json"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    assert!(!raw(&said), "raw control characters in: {said:?}");
    let json: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(json["acked_lsn"], "0/1\u{202e}\u{9b}2J");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Replaces the text of the file at `path`.
fn edit(path: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(from), "{from} not in {text}");
    std::fs::write(path, text.replacen(from, to, 1)).unwrap();
}

/// A running relay, then its file edited to be invalid (an unknown key, a wrong
/// value), then not TOML at all: `ctl pause`, `status`, `resume` and `drain` still
/// work, each warning about the file; `ctl reload` reaches the relay, which logs
/// every error; `ctl --endpoint URL` works with no file at all; `ctl status` says
/// `connected: false` (Postgres is unreachable). Before, every `ctl` exited 2 with
/// the file's errors, `ctl reload` never reached the relay, and `--endpoint` did
/// not exist; the status had no `connected` line.
#[test]
fn ctl_works_with_a_broken_file_and_without_one() {
    // The default control token file, as ctl without a file finds it by the port.
    let relay = start("control_token_file = \"\"\n", &[]);
    let cfg = relay.dir.join("relay.toml");
    edit(&cfg, "[postgres]\n", "[postgres]\nno_such_key = 1\n");
    edit(
        &cfg,
        "[rabbitmq]\n",
        "[rabbitmq]\nmax_in_flight = \"lots\"\n",
    );
    let out = ctl(&cfg, &["pause"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("state: paused since"), "{}", text(&out));
    assert!(
        text(&out).contains("no_such_key"),
        "the file's errors are warned about: {}",
        text(&out)
    );
    let out = ctl(&cfg, &["status"]);
    assert!(
        text(&out).contains("\nconnected: false\n"),
        "{}",
        text(&out)
    );
    let out = ctl(&cfg, &["reload"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(relay.log().contains("reload refused") && relay.log().contains("max_in_flight")) {
        assert!(
            Instant::now() < deadline,
            "the relay logged no reload: {}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(relay.log().contains("no_such_key"), "{}", relay.log());
    // Not TOML at all outside [relay].
    edit(&cfg, "[rabbitmq]\n", "[rabbitmq]\nbroken = = [\n");
    let out = ctl(&cfg, &["resume"]);
    assert!(text(&out).contains("state: running"), "{}", text(&out));
    // No file: the address from --endpoint, the token file by its port.
    let empty = std::env::temp_dir().join(unique_name("nofile"));
    std::fs::create_dir_all(&empty).unwrap();
    let url = format!("http://127.0.0.1:{}", relay.port);
    let out = Command::new(bin())
        .current_dir(&empty)
        .args(["ctl", "--endpoint", &url, "status"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(text(&out).contains("state: running"), "{}", text(&out));
    let out = ctl(&cfg, &["drain", "--wait", "--timeout", "30s"]);
    assert!(text(&out).contains("stopped"), "{}", text(&out));
    let mut relay = relay;
    assert_eq!(
        relay.child.wait().unwrap().code(),
        Some(0),
        "{}",
        relay.log()
    );
    let _ = std::fs::remove_dir_all(&empty);
}
