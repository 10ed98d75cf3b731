//! AMQPS through a real TLS listener: a TLS terminator in front of the test broker
//! (the machine's RabbitMQ has no TLS port), with certificates made here.
//!
//! `[rabbitmq] ca_file` must *replace* the system's roots, not add to them
//! (docs/security.md): with the server's CA among the "system" roots
//! (`SSL_CERT_FILE`, which the native root loader reads) and an unrelated CA in
//! `ca_file`, the connection must be refused. One test in its own binary, because
//! it sets `SSL_CERT_FILE` for the whole process.
#![allow(clippy::unwrap_used)]

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use publisher::Publisher;
use support::*;
use tokio::net::{TcpListener, TcpStream};

/// A CA: its certificate (PEM) and what it needs to sign a server certificate.
struct Ca {
    pem: String,
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

fn ca(name: &str) -> Ca {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        cert,
        key,
    }
}

/// Terminates TLS for `localhost` with a certificate `ca` signed and forwards the
/// plain bytes to the test broker. Returns the listening address.
async fn tls_terminator(ca: &Ca) -> SocketAddr {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
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
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let broker: SocketAddr = broker_addr();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A refused handshake ends here, as a real TLS listener's would.
                let Ok(mut tls) = acceptor.accept(client).await else {
                    return;
                };
                let Ok(mut upstream) = TcpStream::connect(broker).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
            });
        }
    });
    addr
}

/// The test broker's address, from its AMQP URL.
fn broker_addr() -> SocketAddr {
    let url: lapin::uri::AMQPUri = testkit::amqp_url().parse().unwrap();
    let host = match url.authority.host.as_str() {
        "localhost" => "127.0.0.1",
        h => h,
    };
    format!("{host}:{}", url.authority.port).parse().unwrap()
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap();
    path
}

/// `amqps://` to the terminator, with the test broker's user and vhost.
fn amqps_url(port: u16) -> String {
    let url: lapin::uri::AMQPUri = testkit::amqp_url().parse().unwrap();
    format!(
        "amqps://{}:{}@localhost:{port}/{}",
        url.authority.userinfo.username,
        url.authority.userinfo.password,
        if url.vhost == "/" {
            "%2f".to_string()
        } else {
            url.vhost.clone()
        }
    )
}

async fn try_connect(url: &str, exchange: &str, ca_file: Option<&Path>) -> Result<(), String> {
    let mut c = config(exchange);
    c.urls = vec![url.to_string()];
    c.ca_file = ca_file.map(Path::to_path_buf);
    match Publisher::connect(c).await {
        Ok(p) => {
            drop(p);
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_file_replaces_the_system_roots() {
    init_logs();
    let dir = std::env::temp_dir().join(testkit::unique_name("amqps"));
    std::fs::create_dir_all(&dir).unwrap();
    let server_ca = ca("outbox-relay amqps test CA");
    let other_ca = ca("an unrelated CA");
    let server_ca_file = write(&dir, "server-ca.pem", &server_ca.pem);
    let other_ca_file = write(&dir, "other-ca.pem", &other_ca.pem);
    let port = tls_terminator(&server_ca).await.port();
    let url = amqps_url(port);
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("amqps").await;

    // The server's CA is a "system" root from here on.
    std::env::set_var("SSL_CERT_FILE", &server_ca_file);

    // 1. No ca_file: the system roots verify the server.
    try_connect(&url, &exchange, None)
        .await
        .expect("system roots that hold the server's CA");

    // 2. ca_file names an unrelated CA: refused, although the system roots would
    //    have accepted the server (ca_file replaces them).
    let refused = try_connect(&url, &exchange, Some(&other_ca_file)).await;
    let e = refused.expect_err("ca_file must replace the system roots, not add to them");
    assert!(!e.contains("guest:guest"), "the password was printed: {e}");

    // 3. ca_file names the server's CA: connects, and messages go through TLS.
    let mut consumer = broker.fast_consumer(&queue).await;
    let mut c = config(&exchange);
    c.urls = vec![url.clone()];
    c.ca_file = Some(server_ca_file.clone());
    let mut running = start(c).await;
    let mut stream = Stream::new(table("outbox", JSON));
    for _ in 0..10 {
        running.send(stream.transaction(10)).await;
    }
    running.wait_watermark(*stream.ends.last().unwrap()).await;
    let got = receive_fast(&mut consumer, 100).await;
    let ids: Vec<String> = got.iter().map(message_id).collect();
    let expected: Vec<String> = (0..100).map(|n| format!("id-{n:08}")).collect();
    assert_eq!(ids, expected, "every message over amqps, in order");
    running.finish().await;

    // 4. Without the server's CA anywhere: refused.
    std::env::set_var("SSL_CERT_FILE", &other_ca_file);
    try_connect(&url, &exchange, None)
        .await
        .expect_err("no root for the server's certificate");

    std::env::remove_var("SSL_CERT_FILE");
    broker.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
