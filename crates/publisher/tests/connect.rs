//! Connecting through a URL list whose first nodes refuse the connection (a missing
//! virtual host answers 530, a vhost the user may not use 403, as a RabbitMQ node does
//! while it boots or after a vhost was deleted): every URL is tried before giving up,
//! and when all fail the most meaningful error is returned (docs/reliability.md).
//!
//! These tests create and delete a vhost of their own with `rabbitmqctl`; they change
//! nothing else on the broker.
#![allow(clippy::unwrap_used)]

mod support;

use publisher::{PublishError, Publisher};
use support::*;
use testkit::BROKER;

fn rabbitmqctl(args: &[&str]) {
    let out = testkit::rabbitmqctl_command().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A vhost of the test's own, without permissions for guest; deleted on drop.
struct Vhost(String);

impl Vhost {
    fn create() -> Vhost {
        let name = testkit::unique_name("pub_vh");
        rabbitmqctl(&["add_vhost", &name]);
        Vhost(name)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command()
            .args(["delete_vhost", &self.0])
            .output();
    }
}

fn url_for_vhost(vhost: &str) -> String {
    testkit::amqp_url_for("guest", "guest", vhost)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_vhosts_are_skipped_for_the_next_url() {
    let _shared = BROKER.read().await;
    init_logs();
    let forbidden = Vhost::create();
    let missing = testkit::unique_name("pub_no_vh");
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_next").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    // Each refusal alone is a definite error naming the vhost.
    for url in [url_for_vhost(&missing), url_for_vhost(&forbidden.0)] {
        let mut config = config(&exchange);
        config.urls = vec![url.clone()];
        match Publisher::connect(config).await {
            Ok(_) => panic!("connected to {url}"),
            Err(e) => assert!(matches!(e, PublishError::VirtualHost { .. }), "{e:?}"),
        }
    }

    // Missing vhost (530), forbidden vhost (403), then the good one: connects to the
    // third URL and publishes there.
    let mut config = config(&exchange);
    config.urls = vec![
        url_for_vhost(&missing),
        url_for_vhost(&forbidden.0),
        testkit::amqp_url(),
    ];
    let mut running = start(config).await;
    assert!(running.status.connected());
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let got = receive_fast(&mut consumer, 3).await;
    assert_eq!(message_id(&got[0]), "id-00000000");
    running.finish().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn when_every_url_fails_the_refusal_is_reported_not_the_unreachable_node() {
    let _shared = BROKER.read().await;
    let missing = testkit::unique_name("pub_no_vh");
    let exchange = testkit::unique_name("pub_allfail_x");
    // The refusing node first, an unreachable one last: the error names the vhost
    // (what the operator must fix), not the last node's "connection refused".
    for urls in [
        vec![
            url_for_vhost(&missing),
            "amqp://guest:guest@127.0.0.1:1/%2f".to_string(),
        ],
        vec![
            "amqp://guest:guest@127.0.0.1:1/%2f".to_string(),
            url_for_vhost(&missing),
        ],
    ] {
        let mut config = config(&exchange);
        config.urls = urls;
        match Publisher::connect(config).await {
            Ok(_) => panic!("connected to a missing vhost"),
            Err(e) => {
                assert!(matches!(e, PublishError::VirtualHost { .. }), "{e:?}");
                assert!(!e.is_transient());
            }
        }
    }
    // Only unreachable nodes: transient.
    let mut config = config(&exchange);
    config.urls = vec![
        "amqp://guest:guest@127.0.0.1:1/%2f".to_string(),
        "amqp://guest:guest@127.0.0.1:2/%2f".to_string(),
    ];
    match Publisher::connect(config).await {
        Ok(_) => panic!("connected to a closed port"),
        Err(e) => assert!(e.is_transient(), "{e:?}"),
    }
}
