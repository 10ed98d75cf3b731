//! Credentials the relay sends to HTTP services of its own choosing (issue 50;
//! docs/security.md, "Credentials in clear"): the management API's, which `check
//! --routes` sends, and the OTLP collector's headers (`[tracing] headers_file`).
//! Neither goes over plain `http://` to a host beyond loopback unless the section's
//! `allow_insecure_http = true`; the AMQP password never goes with another user; the
//! headers file is a secret file (0600), and a reload rereads it.
//!
//! The fake management API is a listener of this test on all addresses, reached
//! through a non-loopback address of this machine; it records every request.
#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::cli::TempDir;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::secret_file;

const AMQP_PASSWORD: &str = "Mgmt-amqp-7Qx";

/// An address of this machine that is not loopback (the one it would use to reach
/// the test network or a documentation address); the test fails without one.
fn non_loopback_ip() -> IpAddr {
    for target in ["10.77.0.11:9", "192.0.2.1:9", "198.51.100.1:9"] {
        let Ok(socket) = UdpSocket::bind("0.0.0.0:0") else {
            continue;
        };
        if socket.connect(target).is_ok() {
            if let Ok(addr) = socket.local_addr() {
                if !addr.ip().is_loopback() && !addr.ip().is_unspecified() {
                    return addr.ip();
                }
            }
        }
    }
    panic!("this machine has no non-loopback IPv4 address to test plain http:// beyond loopback");
}

/// A fake management API: every request's head, answered 401.
struct FakeApi {
    port: u16,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeApi {
    async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                let read = tokio::time::timeout(Duration::from_secs(5), async {
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                });
                let _ = read.await;
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head).into_owned());
                let _ = stream
                    .write_all(b"HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                    .await;
            }
        });
        FakeApi {
            port,
            requests,
            task,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    /// The `user:password` of the last request's basic authorization.
    fn last_credentials(&self) -> Option<String> {
        let requests = self.requests();
        let line = requests
            .last()?
            .lines()
            .find_map(|l| l.strip_prefix("Authorization: Basic "))?
            .trim()
            .to_string();
        Some(base64_decode(&line))
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Standard base64, decoded (the tests' own: one header).
fn base64_decode(text: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = ALPHABET.iter().position(|&a| a == c).unwrap() as u32;
        bits = bits << 6 | v;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// `check --routes` with a configuration whose AMQP URL carries [`AMQP_PASSWORD`],
/// and `vars`.
fn check_routes(dir: &TempDir, vars: &[(&str, &str)]) -> (Option<i32>, String) {
    check(dir, &["check", "--routes"], vars)
}

/// `args` (a `check`) with a config whose servers are unreachable.
fn check(dir: &TempDir, args: &[&str], vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let cfg = dir.file(
        "relay.toml",
        &format!(
            "[postgres]\nurl = \"postgresql://relay@127.0.0.1:1/app\"\n\
             [rabbitmq]\nurl = \"amqp://relay:{AMQP_PASSWORD}@127.0.0.1:1/%2f\"\n\
             [relay]\nmetrics_listen = \"\"\n"
        ),
    );
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out: Output = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .args(args)
        .envs(vars.iter().copied())
        .env("RUST_LOG", "warn")
        .current_dir(&dir.0)
        .output()
        .unwrap();
    (
        out.status.code(),
        format!("{}{}", stdout(&out), stderr(&out)),
    )
}

/// A management URL over plain http:// to an address of this machine beyond
/// loopback: refused with exit 2 in one sentence naming
/// `[rabbitmq] allow_insecure_http`, and no request reaches the API (today's code
/// sent the AMQP password there, in clear). With `allow_insecure_http = true` the
/// request goes, and `check` warns that it went in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_management_url_over_http_beyond_loopback_gets_no_credentials() {
    let api = FakeApi::start().await;
    let ip = non_loopback_ip();
    let url = format!("http://{ip}:{}", api.port);
    let dir = TempDir::new();
    let vars = [("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", url.as_str())];
    let (code, text) = check_routes(&dir, &vars);
    assert_eq!(api.requests(), Vec::<String>::new(), "a request was made");
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("beyond loopback") && text.contains("[rabbitmq] allow_insecure_http = true"),
        "{text}"
    );
    assert!(!text.contains(AMQP_PASSWORD), "{text}");

    let allowed = [
        ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", url.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_ALLOW_INSECURE_HTTP", "true"),
    ];
    let (code, text) = check_routes(&dir, &allowed);
    assert_eq!(code, Some(2), "the fake API answers 401:\n{text}");
    assert!(text.contains("in clear"), "{text}");
    assert_eq!(
        api.last_credentials().as_deref(),
        Some(format!("relay:{AMQP_PASSWORD}").as_str())
    );
}

/// A management URL naming only another user (`http://monitor@…`): refused before
/// any request, since the AMQP password is never sent for another user (today's
/// code sent `monitor:<the AMQP password>`). `management_user` with a
/// `management_password_file` of its own is what sends another user, with that
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amqp_password_never_goes_with_another_management_user() {
    let api = FakeApi::start().await;
    let dir = TempDir::new();
    let url = format!("http://monitor@127.0.0.1:{}", api.port);
    let (code, text) = check_routes(&dir, &[("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", &url)]);
    assert_eq!(api.last_credentials(), None, "{:?}", api.requests());
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("management_user") && text.contains("management_password_file"),
        "{text}"
    );

    let file = dir.file("monitor-password", "Monitor-own-7Qx\n");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let plain = format!("http://127.0.0.1:{}", api.port);
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", plain.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_USER", "monitor"),
        (
            "OUTBOX_RELAY_RABBITMQ_MANAGEMENT_PASSWORD_FILE",
            file.to_str().unwrap(),
        ),
    ];
    let (code, text) = check_routes(&dir, &vars);
    assert_eq!(code, Some(2), "the fake API answers 401:\n{text}");
    assert_eq!(
        api.last_credentials().as_deref(),
        Some("monitor:Monitor-own-7Qx")
    );
    assert!(
        !text.contains("Monitor-own") && !text.contains(AMQP_PASSWORD),
        "{text}"
    );
}

/// `[rabbitmq] url` over amqps:// with a management URL over plain http:// (here
/// on loopback, so allowed): `check --routes` and `check` warn that the management
/// credentials are not encrypted where the AMQP ones are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_plain_http_management_url_is_warned_about() {
    let api = FakeApi::start().await;
    let dir = TempDir::new();
    let url = format!("http://127.0.0.1:{}", api.port);
    let amqps = format!("amqps://relay:{AMQP_PASSWORD}@localhost:1/%2f");
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", url.as_str()),
        ("OUTBOX_RELAY_RABBITMQ_URL", amqps.as_str()),
    ];
    // `check --routes`, and plain `check`, which asks the same API about RabbitMQ 4.
    for args in [&["check", "--routes"][..], &["check"][..]] {
        let (_, text) = check(&dir, args, &vars);
        assert!(
            text.lines()
                .any(|l| l.starts_with("warn") && l.contains("amqps://") && l.contains("http://")),
            "{args:?}: {text}"
        );
        assert!(!text.contains(AMQP_PASSWORD), "{text}");
    }
}

/// `run` with `cfg` and `vars`, which must stop by itself (a relay that started
/// waits for its unreachable Postgres: killed after 20 s, exit code `None`).
fn run_refused(
    dir: &TempDir,
    cfg: &std::path::Path,
    vars: &[(&str, &str)],
) -> (Option<i32>, String) {
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(cfg)
        .arg("run")
        .envs(vars.iter().copied())
        .env("RUST_LOG", "warn")
        .current_dir(&dir.0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if child.try_wait().unwrap().is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        format!("{}{}", stdout(&out), stderr(&out)),
    )
}

/// A tracing headers file others may read (0644) stops `run` at start, exit 2, in
/// a sentence naming `tracing.headers_file` and the chmod; its content is never
/// shown. (Today's code started with it.)
#[test]
fn a_world_readable_tracing_headers_file_stops_the_start() {
    let dir = TempDir::new();
    let headers = dir.file("otlp-headers", "x-api-key=Otlp-secret-7Qx\n");
    std::fs::set_permissions(&headers, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = dir.file(
        "relay.toml",
        &format!(
            "[postgres]\nurl = \"postgresql://relay@127.0.0.1:1/app\"\n\
             [rabbitmq]\nurl = \"amqp://relay@127.0.0.1:1/%2f\"\n\
             [relay]\nmetrics_listen = \"\"\n\
             [tracing]\nendpoint = \"http://127.0.0.1:1\"\nheaders_file = {:?}\n",
            headers.display()
        ),
    );
    let (code, text) = run_refused(&dir, &cfg, &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("tracing.headers_file")
            && text.contains("group or world access")
            && text.contains("chmod 600"),
        "{text}"
    );
    assert!(!text.contains("Otlp-secret"), "{text}");
}

/// Headers for a plain http:// collector beyond loopback stop `run` at start (exit
/// 2, naming `[tracing] allow_insecure_http`): they would cross the network in
/// clear. Also when the endpoint comes from `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[test]
fn tracing_headers_for_a_plain_http_collector_beyond_loopback_stop_the_start() {
    let dir = TempDir::new();
    let headers = dir.file("otlp-headers", "x-api-key=Otlp-secret-7Qx\n");
    std::fs::set_permissions(&headers, std::fs::Permissions::from_mode(0o600)).unwrap();
    let endpoint = format!("http://{}:4318", non_loopback_ip());
    let base = format!(
        "[postgres]\nurl = \"postgresql://relay@127.0.0.1:1/app\"\n\
         [rabbitmq]\nurl = \"amqp://relay@127.0.0.1:1/%2f\"\n\
         [relay]\nmetrics_listen = \"\"\n\
         [tracing]\nheaders_file = {:?}\n",
        headers.display()
    );
    for (file, vars) in [
        (format!("{base}endpoint = {endpoint:?}\n"), vec![]),
        (
            base.clone(),
            vec![("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
        ),
    ] {
        let cfg = dir.file("relay.toml", &file);
        let (code, text) = run_refused(&dir, &cfg, &vars);
        assert_eq!(code, Some(2), "{vars:?}: {text}");
        assert!(
            text.contains("[tracing] allow_insecure_http = true") && text.contains("in clear"),
            "{vars:?}: {text}"
        );
        assert!(!text.contains("Otlp-secret"), "{text}");
    }
}

/// SIGHUP after the tracing headers file changed: the next export request carries
/// the new headers (an API key rotated without a restart), and the reload names the
/// file as reread. (Today's code kept the headers it started with.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_rereads_the_tracing_headers_file() {
    let _shared = testkit::BROKER.read().await;
    let receiver = testkit::otlp::Receiver::start().await.unwrap();
    let mut env = Env::new().await;
    let file = secret_file(&env, "otlp-headers", "x-api-key=Key-first-7Qx\n");
    env.extra = format!(
        "[tracing]\nendpoint = {:?}\nheaders_file = {file:?}\n",
        receiver.endpoint()
    );
    env.create_slot();
    let got = env.consumer().await;
    let relay = env.start(&[]);
    env.insert_seq(1, 1, 1);
    got.wait_for(1, Duration::from_secs(60)).await;
    receiver
        .wait_for(Duration::from_secs(60), |s| !s.is_empty())
        .await;
    assert_eq!(
        receiver.last_header("x-api-key").as_deref(),
        Some("Key-first-7Qx")
    );

    std::fs::write(&file, "x-api-key=Key-second-7Qx\n").unwrap();
    relay.signal("HUP");
    let log = relay
        .wait_log("configuration reloaded", Duration::from_secs(60))
        .await;
    env.insert_seq(2, 1, 1);
    got.wait_for(2, Duration::from_secs(60)).await;
    receiver
        .wait_for(Duration::from_secs(60), |s| s.len() >= 2)
        .await;
    assert_eq!(
        receiver.last_header("x-api-key").as_deref(),
        Some("Key-second-7Qx")
    );
    let line = log
        .lines()
        .find(|l| l.contains("configuration reloaded"))
        .unwrap();
    assert!(line.contains("tracing.headers_file"), "{line}");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        !log.contains("Key-first") && !log.contains("Key-second"),
        "{log}"
    );
    env.cleanup().await;
}
