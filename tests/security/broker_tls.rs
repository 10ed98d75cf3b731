//! The broker over TLS: `amqps://` and `rabbitmq-stream+tls://` against the test
//! broker's TLS listeners (scripts/test-services.sh writes them, signed by a test CA),
//! with `[rabbitmq] ca_file`. A certificate the relay cannot verify is refused with an
//! error that names `ca_file`, and no password appears in any output.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::stream::{assert_exactly_once, delete_stream, read_stream, stream_exists};
use support::*;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);

fn service_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run scripts/test-services.sh and load target/test-services.env")
    })
}

/// `amqps://` with `ca_file`: every row arrives once, in order; without the CA the
/// connection is refused naming `ca_file`; a wrong password is not echoed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_brokers_ca() {
    let mut env = Env::new().await;
    let url = service_var("OUTBOX_TEST_AMQPS");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    env.create_slot();

    let untrusted = vec![("OUTBOX_RELAY_RABBITMQ_URL", url.clone())];
    let out = env.cli_env(&["check"], &as_refs(&untrusted));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FAIL  rabbitmq"), "{text}");
    assert!(text.contains("ca_file"), "{text}");

    let wrong = vec![
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            url.replace("guest:guest@", "guest:not-the-password@"),
        ),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&wrong));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(!text.contains("not-the-password"), "{text}");

    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_URL", url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));

    let got = env.consumer().await;
    let relay = env.start_env(&[], &as_refs(&vars));
    let mut next = 1;
    for size in [1usize, 40, 300] {
        env.insert_seq(next, size, size);
        next += size;
    }
    let total = next - 1;
    let msgs = got.wait_for(total, WAIT).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(check_sequence(&got.snapshot(), total), 0, "{}", msgs.len());
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("guest:guest@"), "{log}");
    env.cleanup().await;
}
/// A TLS server on a local port whose certificate (self-signed, for `localhost`) no
/// configured CA trusts: what a man in the middle on the broker's link presents. It
/// completes no handshake the relay would accept and holds nothing.
async fn impostor() -> std::net::SocketAddr {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    addr
}

/// The broker's certificate is refused *after* the relay has been publishing (its
/// address now answered by a server no configured CA trusts, as a man in the middle
/// appearing later would be): `run` stops with exit code 2 and names `ca_file`,
/// instead of retrying as it does for a broker that restarts (docs/security.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_refused_after_the_first_connection_stops_the_relay() {
    let mut env = Env::new().await;
    let url = service_var("OUTBOX_TEST_AMQPS");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    env.create_slot();
    let port: u16 = url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|hp| hp.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or(5671);
    let proxy = testkit::proxy::Proxy::start(([127, 0, 0, 1], port).into()).await;
    let vars = vec![
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            url.replace(
                &format!("localhost:{port}"),
                &format!("localhost:{}", proxy.port()),
            ),
        ),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca),
    ];
    let got = env.consumer().await;
    let mut relay = env.start_env(&[], &as_refs(&vars));
    env.insert_seq(1, 50, 10);
    got.wait_for(50, WAIT).await;
    proxy.redirect(impostor().await);
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.restore();
    let code = relay.wait(WAIT);
    let log = relay.log_text();
    assert_eq!(code, Some(2), "the relay must stop, not retry: {log}");
    assert!(log.contains("ca_file"), "{log}");
    assert!(!log.contains("guest:guest@"), "{log}");
    env.cleanup().await;
}

/// `rabbitmq-stream+tls://` with `ca_file`: the relay verifies the broker's
/// certificate against the test CA and publishes every row over TLS exactly once;
/// without the CA (system roots) `check` fails and says how to fix it, and the
/// password appears nowhere in the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_target_over_tls() {
    let env = Env::new().await;
    let tls_url = service_var("OUTBOX_TEST_STREAM_TLS_URL");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    let stream = testkit::unique_name("stream_tls");
    env.create_slot();
    let secret_url = tls_url.replace("guest:guest@", "guest:not-the-password@");
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", tls_url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];

    // Right credentials, but the broker's certificate is not signed by a trusted
    // root (no ca_file: the system's): the handshake is refused.
    let untrusted = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", tls_url.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&untrusted));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FAIL  rabbitmq stream"), "{text}");
    assert!(text.contains("ca_file"), "{text}");
    assert!(!stream_exists(&stream).await, "nothing was declared");

    // The trusted CA and a wrong password: refused, the password not shown.
    let mut wrong = vars.clone();
    wrong[1].1 = secret_url;
    let out = env.cli_env(&["check"], &as_refs(&wrong));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(!text.contains("not-the-password"), "{text}");

    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains("ok    rabbitmq stream: logged in"),
        "{}",
        stdout(&out)
    );

    let relay = env.start_env(&[], &as_refs(&vars));
    let mut next = 1;
    for size in [1usize, 40, 300] {
        env.insert_seq(next, size, size);
        next += size;
    }
    let total = (next - 1) as u64;
    let msgs = read_stream(&stream, total as usize, QUIET, WAIT).await;
    assert_eq!(assert_exactly_once(&msgs, total), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("guest:guest@"), "{log}");

    delete_stream(&stream).await;
    env.cleanup().await;
}

/// A stream TLS setup the client library cannot use is a configuration error that
/// names the key (exit 2), never a panic (exit 101): a `ca_file` whose PEM holds bad
/// base64 or a certificate that is not DER, and a host that is not a valid TLS name
/// (it resolves, but `rabbitmq-stream-client` unwraps the name's conversion).
#[test]
fn stream_tls_setup_errors_name_the_key_and_never_panic() {
    let dir = std::env::temp_dir().join(testkit::unique_name("stream_tls_bad"));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    std::fs::write(
        dir.join("bad-base64.pem"),
        "-----BEGIN CERTIFICATE-----\n!!!!notbase64!!!!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("bad-der.pem"),
        "-----BEGIN CERTIFICATE-----\nMIIBAAAAAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let bad_base64 = dir.join("bad-base64.pem").display().to_string();
    let bad_der = dir.join("bad-der.pem").display().to_string();
    let cases = [
        (bad_base64.as_str(), "localhost", "ca_file"),
        (bad_der.as_str(), "localhost", "ca_file"),
        (ca.as_str(), "2130706433", "stream_url"),
        (ca.as_str(), "127.1", "stream_url"),
    ];
    // A reachable Postgres, so that the broker's line decides nothing but itself.
    let pg = testkit::pg_url("postgres");
    let tls_port = testkit::port_of(&service_var("OUTBOX_TEST_STREAM_TLS_URL"), 5551);
    for (i, (ca_file, host, key)) in cases.into_iter().enumerate() {
        let cfg = dir.join(format!("c{i}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "[postgres]\nurl = \"{pg}\"\n\
                 [rabbitmq]\nstream = \"s1\"\n\
                 stream_url = \"rabbitmq-stream+tls://guest:guest@{host}:{tls_port}/%2f\"\n\
                 ca_file = \"{ca_file}\"\n[relay]\nmetrics_listen = \"\"\n"
            ),
        )
        .unwrap();
        let out = std::process::Command::new(bin())
            .arg("--config")
            .arg(&cfg)
            .arg("check")
            .output()
            .unwrap();
        let text = format!("{}{}", stdout(&out), stderr(&out));
        // Exit 2 (not 101): the slot of this configuration is missing too.
        assert_eq!(out.status.code(), Some(2), "{ca_file} / {host}:\n{text}");
        assert!(!text.contains("panicked"), "{ca_file} / {host}:\n{text}");
        assert!(
            text.contains("FAIL  rabbitmq stream") && text.contains(key),
            "{ca_file} / {host}: the line names {key}:\n{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of the key at `src` in `dir` with `mode` (the broker's test key is root's).
fn key_copy(dir: &std::path::Path, src: &str, name: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::copy(src, &p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p.display().to_string()
}

/// AMQPS with a client certificate and EXTERNAL (plugin rabbitmq_auth_mechanism_ssl,
/// scripts/test-services.sh): the URL holds no password, the broker logs the relay
/// in as the user the certificate names, and every row arrives. Without the
/// certificate, or with a key others may read, it is refused (exit 2) naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_client_certificate_and_external() {
    let mut env = Env::new().await;
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    let cert = service_var("OUTBOX_TEST_RABBITMQ_CLIENT_CERT");
    let key = key_copy(
        &env.dir,
        &service_var("OUTBOX_TEST_RABBITMQ_CLIENT_KEY"),
        "client.key",
        0o600,
    );
    let open_key = key_copy(
        &env.dir,
        &service_var("OUTBOX_TEST_RABBITMQ_CLIENT_KEY"),
        "open.key",
        0o644,
    );
    env.create_slot();
    let url = testkit::amqps_external_url();
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_URL", url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CERT_FILE", cert.clone()),
        ("OUTBOX_RELAY_RABBITMQ_KEY_FILE", key.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));

    let no_cert = vec![
        ("OUTBOX_RELAY_RABBITMQ_URL", url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&no_cert));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("FAIL  rabbitmq"), "{text}");

    let mut open = vars.clone();
    open[3].1 = open_key;
    let out = env.cli_env(&["check"], &as_refs(&open));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("key_file") && text.contains("chmod 600"),
        "{text}"
    );

    let got = env.consumer().await;
    let relay = env.start_env(&[], &as_refs(&vars));
    env.insert_seq(1, 20, 5);
    got.wait_for(20, WAIT).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(check_sequence(&got.snapshot(), 20), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

/// The stream target over TLS presents the client certificate (its client logs in
/// with PLAIN besides; it has no EXTERNAL), and a key in a format the stream client
/// cannot read is an error naming key_file, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_over_tls_with_a_client_certificate() {
    let env = Env::new().await;
    let tls_url = service_var("OUTBOX_TEST_STREAM_TLS_URL");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    let cert = service_var("OUTBOX_TEST_RABBITMQ_CLIENT_CERT");
    let key = key_copy(
        &env.dir,
        &service_var("OUTBOX_TEST_RABBITMQ_CLIENT_KEY"),
        "client.key",
        0o600,
    );
    let stream = testkit::unique_name("stream_cert");
    env.create_slot();
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", tls_url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CERT_FILE", cert.clone()),
        ("OUTBOX_RELAY_RABBITMQ_KEY_FILE", key.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // The same key as PKCS#1 (`openssl rsa -traditional`): the stream client reads
    // only PKCS#8.
    let rsa = env.dir.join("client-rsa.key");
    let conv = std::process::Command::new("openssl")
        .args(["rsa", "-traditional", "-in", &key, "-out"])
        .arg(&rsa)
        .output()
        .unwrap();
    assert!(
        conv.status.success(),
        "{}",
        String::from_utf8_lossy(&conv.stderr)
    );
    let mut pkcs1 = vars.clone();
    pkcs1[4].1 = key_copy(&env.dir, &rsa.display().to_string(), "rsa.key", 0o600);
    let out = env.cli_env(&["check"], &as_refs(&pkcs1));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("key_file") && text.contains("PKCS#8"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    delete_stream(&stream).await;
    env.cleanup().await;
}
