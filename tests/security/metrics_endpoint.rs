//! The metrics endpoint (`[relay] metrics_listen`) against slow and hostile HTTP
//! clients and without credentials (docs/security.md): a client that never finishes
//! its request is cut off after the read timeout, connections beyond the cap are
//! closed at once (so the process's descriptors stay bounded), `/healthz` answers
//! again as soon as the slow clients are gone, and with credentials configured
//! `/metrics` and `/poison` answer 401 without them while `/healthz` and `/readyz`
//! (probes) stay open but say nothing more than ready or not.
//!
//! The relay runs against an unreachable Postgres: `run` serves the endpoint while it
//! waits for Postgres, which is all these tests need.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::bin;
use testkit::hostile::base64;
use testkit::{free_port, unique_name};

pub(crate) struct Relay {
    pub(crate) child: Child,
    pub(crate) dir: PathBuf,
    pub(crate) port: u16,
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts `run` with the metrics endpoint on a free port and `extra` lines in
/// `[relay]`; waits until `/healthz` answers.
pub(crate) fn start(extra: &str, files: &[(&str, &str)]) -> Relay {
    spawn(extra, files, &|port| {
        get(port, "/healthz", &[]).map(|r| r.0) == Some(200)
    })
}

/// Writes the configuration and `files` into a new directory (`{dir}` in `extra`
/// names it), starts `run`, and waits until `up(port)`.
pub(crate) fn spawn(extra: &str, files: &[(&str, &str)], up: &dyn Fn(u16) -> bool) -> Relay {
    spawn_on("127.0.0.1", extra, files, up)
}

/// [`spawn`] on the address `ip`.
pub(crate) fn spawn_on(
    ip: &str,
    extra: &str,
    files: &[(&str, &str)],
    up: &dyn Fn(u16) -> bool,
) -> Relay {
    spawn_env(ip, &[], extra, files, up)
}

/// [`spawn_on`] with `env` in the relay's environment.
pub(crate) fn spawn_env(
    ip: &str,
    env: &[(&str, &str)],
    extra: &str,
    files: &[(&str, &str)],
    up: &dyn Fn(u16) -> bool,
) -> Relay {
    bin();
    let dir = std::env::temp_dir().join(unique_name("metrics"));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, content) in files {
        // Secret files: readable by their owner only (the rule the relay checks).
        std::fs::write(dir.join(name), content).unwrap();
        std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let port = free_port();
    let extra = extra.replace("{dir}", &dir.display().to_string());
    let cfg = write_config(&dir, &format!("{ip}:{port}"), &extra);
    let child = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("relay.log")).unwrap())
        .spawn()
        .unwrap();
    let relay = Relay { child, dir, port };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !up(port) {
        assert!(
            Instant::now() < deadline,
            "/healthz never answered: {}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    relay
}

impl Relay {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("relay.log")).unwrap_or_default()
    }

    fn descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

/// One request on its own connection, naming the listener's address in `Host`:
/// (status, body), or `None` when the server closed the connection without an
/// answer or did not answer within 5 s.
pub(crate) fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.split(' ').nth(1)?.parse().ok()?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// True when the server has closed `s` (EOF or reset), waiting at most `wait`.
fn closed_by_server(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// 300 clients that send half a request and then nothing: the relay does not keep
/// them (nor a descriptor each) beyond the read timeout, never holds more than its
/// connection cap, and answers `/healthz` again once they are cut off.
#[test]
fn slow_clients_are_cut_off_and_connections_are_capped() {
    let relay = start("", &[]);
    let before = relay.descriptors();
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(("127.0.0.1", relay.port)).unwrap();
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n");
        slow.push(s);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let during = relay.descriptors();
    assert!(
        during < before + 150,
        "the relay holds {during} descriptors with 300 slow clients (it had {before})"
    );
    // The default read timeout is 10 s: every slow client is gone well within 20 s.
    let started = Instant::now();
    let mut kept = 0;
    for s in &mut slow {
        let left = Duration::from_secs(20).saturating_sub(started.elapsed());
        if !closed_by_server(s, left.max(Duration::from_millis(10))) {
            kept += 1;
        }
    }
    assert_eq!(
        kept, 0,
        "{kept} of 300 slow clients still connected after 20 s"
    );
    assert_eq!(get(relay.port, "/healthz", &[]).map(|r| r.0), Some(200));
    let after = relay.descriptors();
    assert!(
        after <= before + 5,
        "{after} descriptors after, {before} before"
    );
}

/// With a bearer token or basic credentials configured (both read from files),
/// `/metrics` and `/poison` need them; `/healthz` and `/readyz` (probes) do not, and
/// `/readyz` says only "not ready" without them.
#[test]
fn credentials_guard_metrics_and_poison_but_not_the_probes() {
    let relay = start(
        "metrics_bearer_token_file = \"{dir}/token\"\n\
         metrics_basic_auth_user = \"prometheus\"\n\
         metrics_basic_auth_password_file = \"{dir}/password\"\n",
        &[
            ("token", "Tk-0123456789abcdef\n"),
            ("password", "Bp-secret\n"),
        ],
    );
    let basic = format!("Basic {}", base64(b"prometheus:Bp-secret"));
    let wrong = format!("Basic {}", base64(b"prometheus:nope"));
    for path in ["/metrics", "/poison"] {
        assert_eq!(get(relay.port, path, &[]).map(|r| r.0), Some(401), "{path}");
        assert_eq!(
            get(relay.port, path, &[("Authorization", "Bearer wrong")]).map(|r| r.0),
            Some(401),
            "{path}"
        );
        assert_eq!(
            get(relay.port, path, &[("Authorization", &wrong)]).map(|r| r.0),
            Some(401),
            "{path}"
        );
        assert_eq!(
            get(
                relay.port,
                path,
                &[("Authorization", "Bearer Tk-0123456789abcdef")]
            )
            .map(|r| r.0),
            Some(200),
            "{path}"
        );
        assert_eq!(
            get(relay.port, path, &[("Authorization", &basic)]).map(|r| r.0),
            Some(200),
            "{path}"
        );
    }
    let (status, body) = get(relay.port, "/metrics", &[("Authorization", &basic)]).unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("outbox_relay_"), "{body}");
    assert_eq!(get(relay.port, "/healthz", &[]).map(|r| r.0), Some(200));
    let (status, body) = get(relay.port, "/readyz", &[]).unwrap();
    assert_eq!((status, body.trim()), (503, "not ready"));
    // The token file is read at every request: a rotated token works at once.
    std::fs::write(relay.dir.join("token"), "Tk-rotated-token\n").unwrap();
    assert_eq!(
        get(
            relay.port,
            "/metrics",
            &[("Authorization", "Bearer Tk-rotated-token")]
        )
        .map(|r| r.0),
        Some(200)
    );
    assert_eq!(
        get(
            relay.port,
            "/metrics",
            &[("Authorization", "Bearer Tk-0123456789abcdef")]
        )
        .map(|r| r.0),
        Some(401)
    );
    let log = relay.log();
    assert!(!log.contains("Tk-") && !log.contains("Bp-secret"), "{log}");
}

/// Listening beyond loopback without credentials is allowed but warned about.
#[test]
fn an_open_endpoint_beyond_loopback_is_warned_about() {
    let dir = std::env::temp_dir().join(unique_name("metrics"));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = write_config(&dir, &format!("0.0.0.0:{}", free_port()), "");
    let out = run_for(&cfg, Duration::from_secs(3));
    assert!(
        out.contains("metrics endpoint") && out.contains("without credentials"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A configuration in `dir` with an unreachable Postgres and broker, the endpoint on
/// `listen` and `extra` lines in `[relay]`; the control token goes to
/// `dir/control.token` unless `extra` sets `control_token_file` (`""`: the default).
pub(crate) fn write_config(dir: &Path, listen: &str, extra: &str) -> PathBuf {
    let cfg = dir.join("relay.toml");
    let token = if extra.contains("control_token_file") {
        String::new()
    } else {
        format!("control_token_file = \"{}/control.token\"\n", dir.display())
    };
    std::fs::write(
        &cfg,
        format!(
            "[postgres]\nurl = \"postgresql://u@127.0.0.1:1/app\"\n\
             [rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:2/%2f\"\n\
             [relay]\nmetrics_listen = \"{listen}\"\n{token}{extra}\n"
        ),
    )
    .unwrap();
    cfg
}

fn run_for(cfg: &Path, limit: Duration) -> String {
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(cfg)
        .arg("run")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(limit);
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// With `metrics_tls_cert_file` and `metrics_tls_key_file` the endpoint speaks HTTPS
/// only (as Prometheus's `scheme: https` with `tls_config.ca_file` scrapes it), and
/// the bearer token works over it. Uses `openssl` and `curl`
/// (scripts/test-services.sh installs both).
#[test]
fn the_endpoint_serves_https_with_a_certificate() {
    let dir = std::env::temp_dir().join(unique_name("mtls"));
    std::fs::create_dir_all(&dir).unwrap();
    let ok = Command::new("openssl")
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
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    std::fs::set_permissions(dir.join("key.pem"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = dir.display().to_string();
    let relay = start_tls(&format!(
        "metrics_tls_cert_file = \"{d}/cert.pem\"\nmetrics_tls_key_file = \"{d}/key.pem\"\n\
         metrics_bearer_token_file = \"{{dir}}/token\"\n"
    ));
    let curl = |args: &[&str]| {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "5",
            ])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let url = format!("https://localhost:{}/metrics", relay.port);
    let ca = format!("{d}/cert.pem");
    assert_eq!(
        curl(&["--cacert", &ca, "-H", "Authorization: Bearer Tk-tls", &url]),
        "200"
    );
    assert_eq!(curl(&["--cacert", &ca, &url]), "401");
    // Plain HTTP on the same port gets no answer.
    assert_eq!(get(relay.port, "/healthz", &[]).map(|r| r.0), None);
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`start`] for an HTTPS endpoint: waits with `curl -k` instead of plain HTTP.
fn start_tls(extra: &str) -> Relay {
    spawn(extra, &[("token", "Tk-tls\n")], &|port| {
        Command::new("curl")
            .args([
                "-sk",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
            ])
            .arg(format!("https://localhost:{port}/healthz"))
            .output()
            .is_ok_and(|out| out.stdout == b"200")
    })
}

/// The header a control change needs (`ctl` sends it; no web page can cross-site).
pub(crate) const CONTROL: (&str, &str) = ("X-Outbox-Relay-Control", "1");

/// One request with `method` on its own connection: (status, body). `Host` names
/// the listener's address unless `headers` give one.
pub(crate) fn send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let host = if headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        String::new()
    } else {
        format!("Host: 127.0.0.1:{port}\r\n")
    };
    let mut req =
        format!("{method} {path} HTTP/1.1\r\n{host}Connection: close\r\nContent-Length: 0\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.split(' ').nth(1)?.parse().ok()?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// `outbox-relay --config cfg ctl args`.
pub(crate) fn ctl(cfg: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("--config")
        .arg(cfg)
        .arg("ctl")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// Control (issue 44) needs the credentials (or this start's control token)
/// whenever some are configured: without them or with wrong ones every `/control/`
/// route answers 401 and changes nothing; `ctl` with the relay's configuration
/// reads the control token, and `ctl pause` pauses (`/readyz`: not ready: paused)
/// and `ctl resume` resumes. A `ctl` that cannot read the token file sends the
/// configured token nowhere over plain HTTP (issue 50: nothing proves the port's
/// owner), and one without either is refused with the fix named.
#[test]
fn control_needs_the_credentials() {
    let relay = start(
        "metrics_bearer_token_file = \"{dir}/token\"\n",
        &[("token", "Tk-control-0123456789\n")],
    );
    for (method, path) in [
        ("POST", "/control/pause"),
        ("POST", "/control/resume"),
        ("POST", "/control/drain"),
        ("POST", "/control/reload"),
        ("GET", "/control/status"),
    ] {
        assert_eq!(
            send(relay.port, method, path, &[CONTROL]).map(|r| r.0),
            Some(401),
            "{path}"
        );
        assert_eq!(
            send(
                relay.port,
                method,
                path,
                &[CONTROL, ("Authorization", "Bearer wrong")]
            )
            .map(|r| r.0),
            Some(401),
            "{path}"
        );
    }
    let (status, body) = send(
        relay.port,
        "GET",
        "/control/status",
        &[("Authorization", "Bearer Tk-control-0123456789")],
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"state\":\"running\""),
        "the refused drain changed the state: {body}"
    );
    let cfg = relay.dir.join("relay.toml");
    let out = ctl(&cfg, &["pause"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("state: paused since"), "{said}");
    let (status, body) = get(relay.port, "/readyz", &[]).unwrap();
    assert_eq!((status, body.trim()), (503, "not ready: paused"));
    let out = ctl(&cfg, &["status", "--json"]);
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["state"], "paused", "{json}");
    let out = ctl(&cfg, &["resume"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("state: running"));
    // Without the control token file, the configured token does not go over plain
    // HTTP; without either, `ctl` is refused with the fix named.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let elsewhere = text.replace("control.token", "not-the.token");
    let unproven = relay.dir.join("unproven.toml");
    std::fs::write(&unproven, &elsewhere).unwrap();
    let out = ctl(&unproven, &["pause"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("nothing was sent") && err.contains("TLS"),
        "{err}"
    );
    let bare = relay.dir.join("bare.toml");
    std::fs::write(
        &bare,
        elsewhere.replace("metrics_bearer_token_file", "# metrics_bearer_token_file"),
    )
    .unwrap();
    let out = ctl(&bare, &["pause"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("401") && err.contains("control token"),
        "{err}"
    );
    assert_eq!(
        get(relay.port, "/readyz", &[]).map(|r| r.1),
        Some("not ready\n".into())
    );
    let log = relay.log();
    assert!(!log.contains("Tk-control"), "{log}");
}

/// Without credentials, control is refused on a listener beyond loopback (403,
/// and `ctl` exits 2 naming the fix), while the probes still answer; on loopback it
/// is allowed.
#[test]
fn control_beyond_loopback_needs_credentials() {
    let dir = std::env::temp_dir().join(unique_name("metrics"));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let cfg = write_config(&dir, &format!("0.0.0.0:{port}"), "");
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(port, "/healthz", &[]).map(|r| r.0) != Some(200) {
        assert!(Instant::now() < deadline, "/healthz never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    for (method, path) in [("POST", "/control/pause"), ("GET", "/control/status")] {
        let (status, body) = send(port, method, path, &[]).unwrap();
        assert_eq!(status, 403, "{path}: {body}");
        assert!(
            body.contains("beyond loopback without credentials"),
            "{body}"
        );
    }
    let out = ctl(&cfg, &["pause"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("loopback") && err.contains("metrics_bearer_token_file"),
        "{err}"
    );
    // Not paused: not ready only because it has no broker here.
    let body = get(port, "/readyz", &[]).map(|r| r.1).unwrap_or_default();
    assert!(
        body.starts_with("not ready") && !body.contains("paused"),
        "{body}"
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
