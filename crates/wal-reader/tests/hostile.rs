//! Hostile Postgres servers (or a man in the middle) against both connection kinds,
//! the replication connection (`ReplicationConnection`) and the ordinary SQL
//! connection (`wal_reader::tls::connect_sql`): each test scripts one fake server that
//! answers in a way a real server never would, and checks that the relay refuses
//! definitely (`is_precondition`: exit 2, never retried) and sends nothing it should
//! not. docs/security.md names these tests.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use testkit::hostile::{auth_request, error_response, SSL_REQUEST};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wal_reader::conn::ReplicationConnection;
use wal_reader::tls::connect_sql;
use wal_reader::PgConnectOptions;

/// How the fake server answers the SSLRequest.
#[derive(Clone)]
enum TlsAnswer {
    /// One byte (`N`, or a byte a real server never sends).
    Byte(u8),
    /// `S`, then a TLS handshake with a self-signed certificate for `localhost`.
    Tls(Arc<rustls::ServerConfig>),
}

fn self_signed_tls() -> Arc<rustls::ServerConfig> {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    Arc::new(config)
}

/// What the fake server saw of one client.
#[derive(Debug, Default)]
struct Seen {
    /// Bytes the client sent after the startup message.
    after_startup: Vec<u8>,
}

/// A fake server on a local port: it answers the SSLRequest with `answer`, reads the
/// startup message, writes `script`, then records what the client sends until it
/// closes or `hold` passes. Serves `clients` connections, one after another.
async fn fake_pg(
    answer: TlsAnswer,
    script: Vec<u8>,
    hold: Duration,
    clients: usize,
) -> (u16, tokio::task::JoinHandle<Vec<Seen>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut all = Vec::new();
        for _ in 0..clients {
            let Ok(Ok((mut tcp, _))) =
                tokio::time::timeout(Duration::from_secs(20), listener.accept()).await
            else {
                break;
            };
            let first = read_startup(&mut tcp).await;
            let seen = match (&answer, first) {
                (TlsAnswer::Tls(config), Some(true)) => {
                    tcp.write_all(b"S").await.unwrap();
                    let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
                    match acceptor.accept(tcp).await {
                        Ok(mut tls) => serve(&mut tls, &script, hold).await,
                        Err(_) => Seen::default(),
                    }
                }
                (TlsAnswer::Byte(b), Some(true)) => {
                    tcp.write_all(&[*b]).await.unwrap();
                    serve(&mut tcp, &script, hold).await
                }
                (_, Some(false)) => {
                    // A startup message without SSLRequest (sslmode=disable).
                    after_startup(&mut tcp, &script, hold).await
                }
                (_, None) => Seen::default(),
            };
            all.push(seen);
        }
        all
    });
    (port, task)
}

/// [`fake_pg`] over TLS for the two connection kinds, holding each for 1 s.
async fn tls_pg(
    tls: &Arc<rustls::ServerConfig>,
    script: Vec<u8>,
) -> (u16, tokio::task::JoinHandle<Vec<Seen>>) {
    fake_pg(
        TlsAnswer::Tls(tls.clone()),
        script,
        Duration::from_secs(1),
        2,
    )
    .await
}

/// Reads the first message: `Some(true)` for an SSLRequest, `Some(false)` for a
/// startup message, `None` when the client closed.
async fn read_startup<S: AsyncRead + Unpin>(s: &mut S) -> Option<bool> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.ok()?;
    let mut rest = vec![
        0u8;
        (u32::from_be_bytes(len) as usize)
            .saturating_sub(4)
            .min(1 << 16)
    ];
    s.read_exact(&mut rest).await.ok()?;
    Some(rest == SSL_REQUEST)
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    script: &[u8],
    hold: Duration,
) -> Seen {
    // After the TLS answer (and handshake), the startup message.
    if read_startup(s).await.is_none() {
        return Seen::default();
    }
    after_startup(s, script, hold).await
}

async fn after_startup<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    script: &[u8],
    hold: Duration,
) -> Seen {
    let _ = s.write_all(script).await;
    let _ = s.flush().await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(hold, s.read_to_end(&mut got)).await;
    Seen { after_startup: got }
}

fn parse(conninfo: &str) -> PgConnectOptions {
    PgConnectOptions::parse_with_env(conninfo, &|k| {
        (k == "HOME").then(|| "/nonexistent".to_string())
    })
    .unwrap()
}

/// Both connection kinds against one server: `Err(text, definite)` or `Ok(())`.
async fn try_both(o: &PgConnectOptions) -> [Result<(), (String, bool)>; 2] {
    let sql = match tokio::time::timeout(Duration::from_secs(20), connect_sql(o)).await {
        Err(_) => Err(("connect_sql did not return within 20 s".to_string(), false)),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err((e.to_string(), e.is_precondition())),
    };
    let repl = match tokio::time::timeout(
        Duration::from_secs(20),
        ReplicationConnection::connect(o),
    )
    .await
    {
        Err(_) => Err((
            "the replication connection did not return within 20 s".to_string(),
            false,
        )),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err((e.to_string(), e.is_precondition())),
    };
    [sql, repl]
}

/// Both connections were refused definitely, with every one of `words` in the
/// message; returns the messages.
async fn refused_definitely(o: &PgConnectOptions, case: &str, words: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for (kind, r) in ["sql", "replication"].iter().zip(try_both(o).await) {
        let (msg, definite) = r
            .err()
            .unwrap_or_else(|| panic!("{kind}, {case}: connected"));
        assert!(definite, "{kind}, {case}: not definite: {msg}");
        for w in words {
            assert!(msg.contains(w), "{kind}, {case}: {w:?} missing from {msg}");
        }
        out.push(msg);
    }
    out
}

/// No client sent a PasswordMessage (or anything starting like one).
async fn nothing_sent(server: tokio::task::JoinHandle<Vec<Seen>>, case: &str) {
    for seen in server.await.unwrap() {
        assert!(
            !seen.after_startup.contains(&b'p'),
            "{case}: the client sent a password message: {:?}",
            seen.after_startup
        );
    }
}

/// A server that answers the SSLRequest with a byte other than `S` or `N` (which
/// tokio-postgres alone takes for "no TLS" under `sslmode=prefer`) and then asks for
/// the password in cleartext or as md5: neither connection sends it, and both refuse
/// definitely.
#[tokio::test]
async fn a_tls_answer_other_than_s_or_n_is_refused_and_no_password_is_sent() {
    for answer in [b'E', b'X', 0u8, b's'] {
        for (code, extra) in [(3, &b""[..]), (5, &b"salt"[..])] {
            let (port, server) = fake_pg(
                TlsAnswer::Byte(answer),
                auth_request(code, extra),
                Duration::from_secs(1),
                2,
            )
            .await;
            let o = parse(&format!(
                "host=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d"
            ));
            let case = format!("answer {answer:?}, code {code}");
            for msg in refused_definitely(&o, &case, &["instead of S or N"]).await {
                assert!(!msg.contains("Sekr1tPw"), "{msg}");
            }
            nothing_sent(server, &case).await;
        }
    }
}

/// A 1 GB message announced before login over TLS that is not verified
/// (`sslmode=require` or `prefer` without a root certificate: a man in the middle
/// can terminate it): both connections end it at once, as on a plain link.
#[tokio::test]
async fn an_oversized_message_over_unverified_tls_ends_the_login() {
    let tls = self_signed_tls();
    for mode in ["require", "prefer"] {
        for tag in [b'E', b'R', b'S'] {
            let mut huge = vec![tag];
            huge.extend_from_slice(&1_000_000_000i32.to_be_bytes());
            huge.extend_from_slice(&[b'x'; 4096]);
            let (port, _server) = fake_pg(
                TlsAnswer::Tls(tls.clone()),
                huge,
                Duration::from_secs(30),
                2,
            )
            .await;
            let o = parse(&format!(
                "host=localhost hostaddr=127.0.0.1 port={port} user=u password=pw dbname=d sslmode={mode}"
            ));
            let started = Instant::now();
            for (kind, r) in ["sql", "replication"].iter().zip(try_both(&o).await) {
                let (msg, definite) = r.err().unwrap();
                assert!(
                    msg.contains("30000") || msg.contains("invalid length"),
                    "{kind}, sslmode={mode}, tag {}: {msg}",
                    tag as char
                );
                let _ = definite;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "sslmode={mode}: the clients waited for the rest of the message"
            );
        }
    }
}

/// Security refusals are definite (exit 2, never retried by `run`): a server
/// without TLS under `sslmode=require`, and `channel_binding=require` against a
/// server that logs the client in without channel binding (trust, cleartext over
/// TLS, SCRAM without PLUS).
#[tokio::test]
async fn security_refusals_are_definite_on_both_connections() {
    // No TLS, sslmode=require.
    let (port, _s) = fake_pg(TlsAnswer::Byte(b'N'), Vec::new(), Duration::from_secs(1), 2).await;
    let o = parse(&format!(
        "host=127.0.0.1 port={port} user=u password=pw dbname=d sslmode=require"
    ));
    refused_definitely(&o, "no TLS", &["does not accept TLS"]).await;
    // channel_binding=require over TLS, the server does not bind.
    let tls = self_signed_tls();
    let mut ok_then_ready = auth_request(0, b"");
    ok_then_ready.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
    for (what, script) in [
        ("trust", ok_then_ready),
        ("cleartext", auth_request(3, b"")),
        ("SCRAM without PLUS", auth_request(10, b"SCRAM-SHA-256\0\0")),
    ] {
        let (port, server) = tls_pg(&tls, script).await;
        let o = parse(&format!(
            "host=localhost hostaddr=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d sslmode=require channel_binding=require"
        ));
        refused_definitely(&o, what, &["channel_binding=require"]).await;
        nothing_sent(server, what).await;
    }
}

/// libpq's `require_auth`: a server asking for a method the list forbids is refused
/// before anything is sent, on both connections; `none` forbids a login without
/// authentication, `!none` requires one.
#[tokio::test]
async fn require_auth_refuses_methods_it_does_not_list() {
    let tls = self_signed_tls();
    let mut trust = auth_request(0, b"");
    trust.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("scram-sha-256", auth_request(3, b""), "cleartext"),
        ("scram-sha-256", auth_request(5, b"salt"), "md5"),
        ("scram-sha-256", trust.clone(), "without"),
        ("!password,!md5", auth_request(3, b""), "cleartext"),
        ("!password,!md5", auth_request(5, b"salt"), "md5"),
        ("md5", auth_request(10, b"SCRAM-SHA-256\0\0"), "SCRAM"),
        ("!none", trust.clone(), "without"),
        ("none", auth_request(3, b""), "cleartext"),
        ("password", auth_request(5, b"salt"), "md5"),
    ];
    for (list, script, word) in cases {
        let (port, server) = tls_pg(&tls, script).await;
        let o = parse(&format!(
            "host=localhost hostaddr=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d sslmode=require require_auth={list}"
        ));
        let case = format!("require_auth={list}");
        refused_definitely(&o, &case, &["require_auth", word]).await;
        nothing_sent(server, &case).await;
    }
    // Allowed methods go through: trust with `none`, cleartext with `password`.
    let (port, _s) = fake_pg(
        TlsAnswer::Tls(tls.clone()),
        trust,
        Duration::from_secs(1),
        1,
    )
    .await;
    let o = parse(&format!(
        "host=localhost hostaddr=127.0.0.1 port={port} user=u dbname=d sslmode=require require_auth=none,scram-sha-256"
    ));
    let r = tokio::time::timeout(Duration::from_secs(10), connect_sql(&o))
        .await
        .unwrap();
    assert!(r.is_ok(), "{:?}", r.err().map(|e| e.to_string()));
    let (port, server) = fake_pg(
        TlsAnswer::Tls(tls.clone()),
        auth_request(3, b""),
        Duration::from_secs(1),
        1,
    )
    .await;
    let o = parse(&format!(
        "host=localhost hostaddr=127.0.0.1 port={port} user=u password=Sekr1tPw dbname=d sslmode=require require_auth=password"
    ));
    let _ = tokio::time::timeout(Duration::from_secs(3), connect_sql(&o)).await;
    let seen = server.await.unwrap();
    assert_eq!(
        seen[0].after_startup.first(),
        Some(&b'p'),
        "the password was sent"
    );
    // Malformed lists are configuration errors that name the key.
    for bad in ["scram", "md5,!password", "md5,md5", ""] {
        let e =
            PgConnectOptions::parse_with_env(&format!("host=h require_auth='{bad}'"), &|_| None);
        if bad.is_empty() {
            assert!(e.is_ok(), "an empty require_auth is libpq's default");
            continue;
        }
        let e = e.err().unwrap().to_string();
        assert!(e.contains("require_auth"), "{bad}: {e}");
    }
}

/// The relay's own words never carry what a hostile server puts in its error text:
/// no line breaks (which would forge log lines) and no terminal escapes.
#[tokio::test]
async fn server_error_text_cannot_forge_lines_or_escape_the_terminal() {
    let forged = "login refused\n2026-01-01T00:00:00.000000Z  INFO outbox_relay: forged line\r\x1b[2J\x1b]0;owned\x07";
    let error = error_response(&[
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', "XX000"),
        (b'M', forged),
        (b'D', forged),
        (b'H', forged),
    ]);
    let (port, _s) = fake_pg(TlsAnswer::Byte(b'N'), error, Duration::from_secs(1), 2).await;
    let o = parse(&format!("host=127.0.0.1 port={port} user=u dbname=d"));
    for (kind, r) in ["sql", "replication"].iter().zip(try_both(&o).await) {
        let (msg, _) = r.err().unwrap();
        assert!(
            msg.contains("forged line"),
            "{kind}: the text is kept: {msg}"
        );
        assert!(
            !msg.chars().any(|c| c.is_control()),
            "{kind}: control characters in {msg:?}"
        );
    }
}
