//! The publisher's recovery at the broker's edges (issue 49, "Black-box tests"; SPEC
//! §1 item 8), through TCP proxies to the test broker so that each fault lands at an
//! exact point and touches this test's connections only:
//!
//! - the connection lost while a per-event `exchange.declare` awaits its answer
//!   (the proxy cuts when it sees the frame), round after round: every event
//!   delivered, in order;
//! - failover to the second URL of `[rabbitmq] url` mid-run: the first node's proxy
//!   cut for good, or the first node silent (it stops reading while its heartbeats
//!   still arrive, `request_timeout` then fails the connection); delivery resumes
//!   through the second, every row present;
//! - the user's connection limit (530) met at a reconnect: an ERROR line says
//!   "connection limit", and delivery resumes when the other client frees the slot.
//!
//! Each test uses its own proxies, exchanges, queues and broker user (the world's
//! lock for reading).

use std::net::SocketAddr;

use lapin::{Connection, ConnectionProperties};
use testkit::connections as broker_connections;
use testkit::hostile::BrokerUser;
use testkit::proxy::Proxy;
use testkit::unique_name;

use super::event_exchanges::{insert_event, EventExchanges};
use super::*;

/// AMQP 0-9-1 `exchange.declare` (class 40, method 10).
const EXCHANGE_DECLARE: (u16, u16) = (40, 10);

/// The test broker's AMQP port, where the proxies forward.
fn broker_addr() -> SocketAddr {
    testkit::amqp_addr()
}

/// Five rounds: the proxy is armed to cut at the relay's next `exchange.declare`,
/// then one transaction writes three events to an aggregate type not seen before
/// (its exchange declared at its first publish) and one to the first; the cut
/// happens while that declaration is outstanding, and once more while the
/// declaration the reconnect makes again is (as a broker restart would: every first
/// event to an exchange after a reconnect declares it); the proxy lets the relay
/// back in, and the round's events arrive before the next round. At the end every event is
/// there, in commit order. Caught: before issue 49 the loop noted the failure and
/// went on waiting for a connection that had already ended: nothing was delivered
/// after the first cut, and nothing reconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_during_a_per_event_declare() {
    const ROUNDS: u64 = 5;
    let _broker = BROKER.read().await;
    let proxies = Proxies {
        postgres: false,
        amqp: true,
    };
    let mut w = World::new(Cluster::Test, proxies, 100).await;
    let ex = EventExchanges::new(&mut w);
    for round in 0..=ROUNDS {
        ex.bound(&mut w, &format!("t{round}")).await;
    }
    let relay = w.start();
    insert_event(&w, "'t0'", 0).await;
    w.wait_distinct(1, SOON).await;
    let proxy = w.amqp_proxy.as_ref().unwrap();
    for round in 1..=ROUNDS {
        proxy.cut_at_client_method(EXCHANGE_DECLARE.0, EXCHANGE_DECLARE.1);
        let seq = round * 10;
        w.sql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT CASE WHEN s.n % 10 = 3 THEN 't0' ELSE 't{round}' END, s.n::text, 'tick',
                    jsonb_build_object('seq', s.n)
               FROM generate_series({seq}, {seq} + 3) AS s(n) ORDER BY s.n"
        ))
        .await;
        // At the first declaration, then at the one the reconnect makes again.
        for cut in ["", "again after the reconnect "] {
            let start = Instant::now();
            while !proxy.is_cut() {
                assert!(
                    start.elapsed() < SOON,
                    "round {round}: the relay sent no exchange.declare {cut}within {SOON:?}; \
                     last log lines:\n{}",
                    tail(&relay.log_text(), 15)
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            proxy.restore();
            if cut.is_empty() {
                proxy.cut_at_client_method(EXCHANGE_DECLARE.0, EXCHANGE_DECLARE.1);
            }
        }
        let want = 1 + 4 * round as usize;
        let start = Instant::now();
        while w.consumer.distinct() < want {
            assert!(
                start.elapsed() < SOON,
                "round {round}: {} of {want} events arrived within {SOON:?} of the cut during \
                 an exchange.declare; last log lines:\n{}",
                w.consumer.distinct(),
                tail(&relay.log_text(), 15)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "round {round}: delivered {:?} after the cut",
            start.elapsed()
        );
    }
    let report = verify_within(&w, &relay, None, SOON, w.max_in_flight).await;
    assert_eq!(report.distinct, 1 + 4 * ROUNDS as usize);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// How the first node fails in a failover test.
#[derive(Clone, Copy, Debug)]
enum FirstNode {
    /// Its connections cut, and new ones refused, from then on.
    Cut,
    /// It stops reading (the relay's requests and publishes go unanswered) while
    /// its heartbeats still arrive: alive, and answering nothing.
    StopsReading,
}

/// `[rabbitmq] url = [A, B]`, two proxies to the test broker, and `extra` in
/// `[rabbitmq]`. 3,000 rows stream; after 500 arrived, A fails as `how` says and
/// stays so. Delivery resumes through B within `recovery`, and every row arrives,
/// in order, with duplicates within the window.
async fn failover_mid_run(how: FirstNode, extra: &str, recovery: Duration) {
    const MAX_IN_FLIGHT: usize = 200;
    let proxies = Proxies {
        postgres: false,
        amqp: true,
    };
    let mut w = World::new(Cluster::Test, proxies, MAX_IN_FLIGHT).await;
    let second = Proxy::start(broker_addr()).await;
    let first = w.amqp_proxy.as_ref().unwrap().port();
    w.relay_amqp_urls = vec![
        format!("amqp://guest:guest@127.0.0.1:{first}/%2f"),
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", second.port()),
    ];
    w.rabbitmq_extra = extra.to_string();
    let relay = w.start();
    let load = w.load(1, 3000, 20, Duration::from_millis(10));
    w.wait_distinct(500, Duration::from_secs(60)).await;
    assert_eq!(
        second.forwarded_from_target(),
        0,
        "the relay started on the first URL"
    );

    let proxy = w.amqp_proxy.as_ref().unwrap();
    match how {
        FirstNode::Cut => proxy.cut(),
        FirstNode::StopsReading => proxy.stop_reading(),
    }
    let at_fault = w.consumer.distinct();
    let fault_at = Instant::now();
    let mut resumed = None;
    while fault_at.elapsed() < recovery {
        if w.consumer.distinct() > at_fault + MAX_IN_FLIGHT {
            resumed = Some(fault_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The load ends before any panic (its database goes with the world).
    load.await.unwrap();
    let Some(resumed) = resumed else {
        panic!(
            "no delivery through the second URL within {recovery:?} of the first node's fault \
             ({how:?}; {} distinct, {at_fault} at the fault; {} bytes from the second node); \
             last log lines:\n{}",
            w.consumer.distinct(),
            second.forwarded_from_target(),
            tail(&relay.log_text(), 15)
        );
    };
    eprintln!("{how:?}: publishing through the second URL {resumed:?} after the fault");
    let report = verify_within(&w, &relay, None, Duration::from_secs(60), MAX_IN_FLIGHT).await;
    assert_eq!(report.distinct, 3000);
    assert!(
        second.forwarded_from_target() > 0,
        "the second URL carried the rest"
    );
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The first node's connection cut (and new ones refused): the relay moves to the
/// second URL within 10 s. The path was untested before issue 49; it passes on the
/// relay of before that issue too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_to_the_second_url_when_the_first_is_cut() {
    let _broker = BROKER.read().await;
    failover_mid_run(FirstNode::Cut, "", Duration::from_secs(10)).await;
}

/// The first node stops answering mid-run while its heartbeats still arrive (the
/// proxy stops reading the relay's bytes): with `request_timeout = "2s"`, publishes
/// unconfirmed that long fail the connection and the relay moves to the second URL
/// within 10 s. Caught: before issue 49 nothing had a deadline and the broker's
/// heartbeats kept the connection alive, so the relay waited on the silent node
/// and published nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_to_the_second_url_when_the_first_stops_answering() {
    let _broker = BROKER.read().await;
    failover_mid_run(
        FirstNode::StopsReading,
        "request_timeout = \"2s\"",
        Duration::from_secs(10),
    )
    .await;
}

/// A broker user limited to one connection, which the relay holds (through a proxy).
/// The proxy cuts it; another client takes the slot; the proxy lets the relay back
/// in and its reconnects meet 530. Within [`SOON`] an ERROR line says "connection
/// limit"; rows written meanwhile wait; the other client closes, and they are
/// delivered within [`SOON`]. Caught: before issue 49 a 530 at a reconnect was
/// logged at DEBUG only (the relay waited without a word at the default level).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_limit_at_a_reconnect_is_an_error_until_a_slot_frees() {
    let _broker = BROKER.read().await;
    let password = unique_name("pw");
    let user = BrokerUser::new("limit", &password);
    user.set_max_connections(1);
    let proxies = Proxies {
        postgres: false,
        amqp: true,
    };
    let mut w = World::new(Cluster::Test, proxies, 100).await;
    let proxy_port = w.amqp_proxy.as_ref().unwrap().port();
    w.relay_amqp_url = Some(format!(
        "amqp://{}:{password}@127.0.0.1:{proxy_port}/%2f",
        user.0
    ));
    let relay = w.start();
    w.insert(1, 10, 5).await;
    w.wait_distinct(10, SOON).await;

    // The relay's one connection cut; the other client in its slot.
    let proxy = w.amqp_proxy.as_ref().unwrap();
    proxy.cut();
    let direct = testkit::amqp_url_for(&user.0, &password, "%2f");
    let start = Instant::now();
    let holder = loop {
        let props = ConnectionProperties::default()
            .with_connection_name(unique_name("holder").as_str().into());
        match Connection::connect(&direct, props).await {
            Ok(c) => break c,
            Err(e) => assert!(
                start.elapsed() < SOON,
                "the other client found no free slot within {SOON:?}: {e}; connections: {:?}",
                broker_connections::of_user(&user.0)
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    proxy.restore();
    w.insert(11, 10, 5).await;
    let error_line = |log: &str| {
        log.lines()
            .find(|l| l.contains("ERROR") && l.contains("connection limit"))
            .map(str::to_string)
    };
    let start = Instant::now();
    let line = loop {
        if let Some(line) = error_line(&relay.log_text()) {
            break line;
        }
        assert!(
            start.elapsed() < SOON,
            "no ERROR line saying \"connection limit\" within {SOON:?} of the relay's \
             reconnects meeting 530; last log lines:\n{}",
            tail(&relay.log_text(), 15)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("connection limit named after {:?}: {line}", start.elapsed());
    assert_eq!(
        w.consumer.distinct(),
        10,
        "nothing is published while the slot is taken"
    );

    let _ = holder.close(200, "slot freed by the test".into()).await;
    let freed = Instant::now();
    let report = verify_within(&w, &relay, None, SOON, w.max_in_flight).await;
    assert_eq!(report.distinct, 20);
    eprintln!("delivered {:?} after the slot freed", freed.elapsed());
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
