//! Connecting: definite and transient errors, the shutdown timeout, URLs that never leak a password.

use super::*;

#[tokio::test]
async fn wrong_password_is_a_definite_error_without_the_password() {
    let _shared = BROKER.read().await;
    let mut config = config(&testkit::unique_name("pub_auth_x"));
    config.urls = vec![testkit::amqp_url_for("guest", "sUpErSeCrEt", "%2f")];
    let err = match Publisher::connect(config).await {
        Ok(_) => panic!("connected with a wrong password"),
        Err(e) => e,
    };
    assert!(!err.is_transient(), "{err:?}");
    assert!(
        matches!(err, publisher::PublishError::AuthenticationRefused { .. }),
        "{err:?}"
    );
    assert!(!err.to_string().contains("sUpErSeCrEt"), "{err}");
    assert!(!format!("{err:?}").contains("sUpErSeCrEt"));
}

#[tokio::test]
async fn missing_vhost_and_exchange_are_definite_errors() {
    let _shared = BROKER.read().await;
    let mut config = config(&testkit::unique_name("pub_vh_x"));
    config.urls = vec![testkit::amqp_url_for(
        "guest",
        "guest",
        "no_such_vhost_here",
    )];
    let err = Publisher::connect(config)
        .await
        .err()
        .expect("missing vhost fails");
    assert!(
        matches!(err, publisher::PublishError::VirtualHost { .. }),
        "{err:?}"
    );

    let mut config = support::config(&testkit::unique_name("pub_missing_x"));
    config.declare_exchange = false;
    let err = Publisher::connect(config)
        .await
        .err()
        .expect("missing exchange fails");
    assert!(
        matches!(err, publisher::PublishError::Exchange { .. }),
        "{err:?}"
    );
    assert!(!err.is_transient());
}

#[tokio::test]
async fn unreachable_is_transient_and_the_next_url_is_tried() {
    let _shared = BROKER.read().await;
    let exchange = testkit::unique_name("pub_urls_x");
    let mut config: PublisherConfig = support::config(&exchange);
    config.urls = vec!["amqp://guest:hunter2@127.0.0.1:1/%2f".into()];
    let err = Publisher::connect(config.clone())
        .await
        .err()
        .expect("port 1 is closed");
    assert!(err.is_transient(), "{err:?}");
    assert!(!err.to_string().contains("hunter2"), "{err}");

    config.urls.push(testkit::amqp_url());
    let publisher = Publisher::connect(config).await.unwrap();
    assert!(publisher.status().connected());
    drop(publisher);
    let mut broker = Broker::new().await;
    broker.forget_exchange_later(&exchange);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_bounds_the_wait_for_confirms() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_stop").await;
    // No queue is bound: the messages are returned and retried until the deadline.
    let mut config = config(&exchange);
    config.shutdown_timeout = Duration::from_millis(500);
    let running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(2)).await;
    running
        .send(vec![WalItem::Keepalive(Lsn(0x9_0000_0000))])
        .await;
    // The oldest unacked event's commit time is visible for the outbox-lag metric.
    let lagging = tokio::time::timeout(PATIENCE, async {
        while running.status.oldest_unacked_commit_micros().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(lagging.is_ok());
    assert_eq!(
        running.status.oldest_unacked_commit_micros(),
        Some(COMMIT_TIME_MICROS)
    );
    let report = running.finish().await;
    assert_eq!(report.abandoned, 2, "{report:?}");
    assert_eq!(report.watermark, Lsn::ZERO, "{report:?}");
    assert!(report.returned >= 1, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test]
async fn amqps_against_a_plain_port_fails_cleanly() {
    let _shared = BROKER.read().await;
    let mut config = config(&testkit::unique_name("pub_tls_x"));
    config.urls = vec![format!(
        "amqps://guest:tlssecret@127.0.0.1:{}/%2f",
        testkit::amqp_port()
    )];
    config.ca_file = Some(testkit::pg_ca_file().into());
    let err = Publisher::connect(config.clone())
        .await
        .err()
        .expect("no TLS on the plain AMQP port");
    assert!(err.is_transient(), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("tlssecret"), "{err}");

    config.ca_file = Some("/nonexistent/ca.pem".into());
    let err = Publisher::connect(config)
        .await
        .err()
        .expect("missing CA file");
    assert!(
        matches!(err, publisher::PublishError::CaFile { .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn invalid_urls_never_leak_the_password() {
    let mut config = config("unused");
    config.urls = vec!["amqp://guest:leakme@127.0.0.1:notaport/%2f".into()];
    let err = Publisher::connect(config.clone())
        .await
        .err()
        .expect("bad port");
    assert!(!format!("{err} {err:?}").contains("leakme"), "{err}");
    config.urls = vec!["http://guest:leakme@127.0.0.1/".into()];
    let err = Publisher::connect(config.clone())
        .await
        .err()
        .expect("bad scheme");
    assert!(!format!("{err} {err:?}").contains("leakme"), "{err}");
    assert!(!format!("{config:?}").contains("leakme"));
}
