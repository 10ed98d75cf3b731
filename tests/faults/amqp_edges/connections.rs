//! The relay's AMQP connections: one per lane (issue 40, "Done when": `ordering =
//! "aggregate"`, `channels = 4` holds 4, not 8; the default holds 1), over amqps with
//! EXTERNAL too; and a user connection limit while the broker closes the relay's
//! connections mid-stream. Each relay logs in as a broker user of its test's own (or
//! EXTERNAL's), so its connections are counted by user, whatever they are named.

use lapin::{Connection, ConnectionProperties};
use testkit::connections::{self as broker_connections, BrokerConnection};
use testkit::hostile::BrokerUser;
use testkit::unique_name;

use super::*;

/// A broker user of the test's own and the relay's URL logging in as it.
fn relay_user() -> (BrokerUser, String) {
    let password = unique_name("pw");
    let user = BrokerUser::new("edges", &password);
    let url = testkit::amqp_url_for(&user.0, &password, "%2f");
    (user, url)
}

/// `name (user, tls)` of each connection, for assertion messages.
fn describe(conns: &[BrokerConnection]) -> Vec<String> {
    conns
        .iter()
        .map(|c| format!("{:?} ({}, ssl {})", c.name, c.user, c.ssl))
        .collect()
}

/// Starts the relay with `rabbitmq_extra`, publishes 200 rows (each its own
/// aggregate), and returns the connections of `user` once they all arrived.
async fn connections_after_events(
    mut w: World,
    relay_url: String,
    extra: &str,
    user: &str,
) -> Vec<BrokerConnection> {
    w.relay_amqp_url = Some(relay_url);
    w.rabbitmq_extra = extra.to_string();
    let relay = w.start();
    w.insert(1, 200, 20).await;
    verify_grouped_within(&w, &relay).await;
    let conns = broker_connections::of_user(user);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
    conns
}

/// Everything arrives, in order per aggregate.
async fn verify_grouped_within(w: &World, relay: &Relay) {
    let deadline = Instant::now() + SOON;
    while w.consumer.distinct() < 200 {
        assert!(
            Instant::now() < deadline,
            "{} of 200 rows arrived within {SOON:?}:\n{}",
            w.consumer.distinct(),
            tail(&relay.log_text(), 15)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    w.verify_grouped(0, false, &|r| r.seq as u64).await;
}

/// `ordering = "commit"` (the default): one lane, one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn default_ordering_holds_one_connection() {
    let _broker = BROKER.read().await;
    let (user, url) = relay_user();
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let conns = connections_after_events(w, url, "", &user.0).await;
    assert_eq!(
        conns.len(),
        1,
        "a relay with the default ordering holds one AMQP connection, not {}: {:?}",
        conns.len(),
        describe(&conns)
    );
}

/// `ordering = "aggregate"`, `channels = 4`: four lanes, four connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aggregate_ordering_with_four_channels_holds_four_connections() {
    let _broker = BROKER.read().await;
    let (user, url) = relay_user();
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let extra = "ordering = \"aggregate\"\nchannels = 4";
    let conns = connections_after_events(w, url, extra, &user.0).await;
    assert_eq!(
        conns.len(),
        4,
        "a relay with 4 channels holds 4 AMQP connections, not {}: {:?}",
        conns.len(),
        describe(&conns)
    );
}

/// A copy of the broker's test client key (root's) in `dir`, mode 0600.
fn key_copy(dir: &std::path::Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let src = std::env::var("OUTBOX_TEST_RABBITMQ_CLIENT_KEY")
        .unwrap_or_else(|_| "/etc/rabbitmq/outbox-test-certs/client-external.key".into());
    let p = dir.join("client.key");
    std::fs::copy(&src, &p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// amqps with a client certificate and EXTERNAL (the full delivery check is
/// tests/security/broker_tls.rs, `amqps_with_a_client_certificate_and_external`):
/// the relay holds one connection, over TLS, as the user its certificate names.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqps_with_external_holds_one_tls_connection() {
    let _broker = BROKER.read().await;
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let ca = var(
        "OUTBOX_TEST_RABBITMQ_CA",
        "/etc/rabbitmq/outbox-test-certs/ca.crt",
    );
    let cert = var(
        "OUTBOX_TEST_RABBITMQ_CLIENT_CERT",
        "/etc/rabbitmq/outbox-test-certs/client-external.crt",
    );
    let w = World::new(Cluster::Test, Proxies::default(), 1000).await;
    let key = key_copy(&w.env.dir);
    let prefix = format!("outbox-relay {}", w.env.slot);
    let extra = format!("ca_file = {ca:?}\ncert_file = {cert:?}\nkey_file = {key:?}");
    let url = testkit::amqps_external_url();
    let conns = connections_after_events(w, url, &extra, "outbox-relay-external").await;
    // outbox-relay-external is shared with tests/security: count this relay's only.
    let mine: Vec<BrokerConnection> = conns
        .into_iter()
        .filter(|c| c.name.starts_with(&prefix))
        .collect();
    assert!(
        mine.iter().all(|c| c.ssl),
        "every connection over TLS: {:?}",
        describe(&mine)
    );
    assert_eq!(
        mine.len(),
        1,
        "a relay over amqps with EXTERNAL holds one AMQP connection, not {}: {:?}",
        mine.len(),
        describe(&mine)
    );
}

/// Closes every connection of `user` but `keep` from the broker's side; returns them.
fn close_all_but(user: &str, keep: &str) -> Vec<BrokerConnection> {
    let conns: Vec<BrokerConnection> = broker_connections::of_user(user)
        .into_iter()
        .filter(|c| c.name != keep)
        .collect();
    for c in &conns {
        broker_connections::close(c, "closed by a test (issue 40)");
    }
    conns
}

/// A user limited to 3 connections, one of them held by another client; 5,000 rows
/// stream while the broker closes the relay's connections. Every row arrives in
/// order with duplicates within the bound; the relay publishes again within
/// [`RECOVERY`] (a given-up connection must not keep holding a slot); no log line
/// calls a connection-limit refusal "refused the virtual host".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn user_connection_limit_while_connections_are_closed_mid_stream() {
    const MAX_IN_FLIGHT: usize = 500;
    const RECOVERY: Duration = Duration::from_secs(10);
    let _broker = BROKER.read().await;
    let (user, url) = relay_user();
    user.set_max_connections(3);
    let holder_name = unique_name("holder");
    let holder = Connection::connect(
        &url,
        ConnectionProperties::default().with_connection_name(holder_name.as_str().into()),
    )
    .await
    .expect("the other client's connection");
    let mut w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    w.relay_amqp_url = Some(url);
    let relay = w.start();
    let load = w.load(1, 5000, 50, Duration::from_millis(40));
    w.wait_distinct(1000, Duration::from_secs(60)).await;

    let closed = close_all_but(&user.0, &holder_name);
    let at_close = w.consumer.distinct();
    let closed_at = Instant::now();
    assert!(!closed.is_empty(), "the relay held no connection to close");
    // Recovered: a message published after the close arrived (more than the window
    // that may have been on the wire at the close).
    let mut recovered = None;
    while closed_at.elapsed() < Duration::from_secs(60) {
        if w.consumer.distinct() > at_close + MAX_IN_FLIGHT {
            recovered = Some(closed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = relay.log_text();
    let Some(recovered) = recovered else {
        panic!(
            "no new message within 60 s of closing {:?}; connections now: {:?}; last log lines:\n{}",
            describe(&closed),
            describe(&broker_connections::of_user(&user.0)),
            tail(&log, 20)
        );
    };
    eprintln!(
        "closed {:?}; publishing again after {recovered:?}",
        describe(&closed)
    );
    load.await.unwrap();
    let report = verify_within(
        &w,
        &relay,
        None,
        Duration::from_secs(120),
        2 * MAX_IN_FLIGHT,
    )
    .await;
    assert_eq!(report.distinct, 5000);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    let mut problems = Vec::new();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused the virtual host"))
        .collect();
    if !refusals.is_empty() {
        problems.push(format!(
            "a connection-limit refusal (530) is logged as a refused virtual host ({} lines), e.g.: {}",
            refusals.len(),
            refusals[0]
        ));
    }
    if recovered > RECOVERY {
        problems.push(format!(
            "publishing resumed {recovered:?} after the broker closed the relay's connections (bound {RECOVERY:?})"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let _ = holder.close(200, "test done".into()).await;
    w.cleanup().await;
}
