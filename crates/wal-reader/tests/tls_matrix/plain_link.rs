//! Against a scripted fake server: no password over a plain link, refusals that name the fix, the size cap before authentication; and a superuser login reported.

use super::*;

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
