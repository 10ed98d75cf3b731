//! RabbitMQ faults: connection cut, broker app stopped, publishers blocked by the
//! memory alarm, a stalled connection, and unroutable and nacked messages.

use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::types::{AMQPValue, FieldTable};

use crate::harness::*;

const OUTAGE: Duration = Duration::from_secs(20);

/// docs/design.md §1.1: the proxy between relay and broker closes every connection and
/// refuses new ones for 20 s; the relay reconnects and republishes from the oldest
/// unacked message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_connection_cut_for_20s() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let proxies = Proxies {
        postgres: false,
        amqp: true,
    };
    let w = World::new(Cluster::Test, proxies, MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    w.amqp_proxy.as_ref().unwrap().cut();
    tokio::time::sleep(OUTAGE).await;
    let during = w.consumer.distinct();
    w.amqp_proxy.as_ref().unwrap().restore();
    load.await.unwrap();
    w.rolled_back(10).await;
    let report = w.verify(2 * MAX_IN_FLIGHT).await;
    assert!(report.distinct > during, "publishing resumed after the cut");
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// docs/design.md §1.1: `rabbitmqctl stop_app` for 20 s, then `start_app`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_app_stopped_for_20s() {
    let _broker = BROKER.write().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    {
        let _stopped = BrokerStopped::stop();
        tokio::time::sleep(OUTAGE).await;
    }
    load.await.unwrap();
    w.verify(2 * MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup_after_broker_restart().await;
}

/// docs/design.md §1.1: the memory alarm blocks every publisher for 20 s
/// (`set_vm_memory_high_watermark 0`, the old value restored on drop).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_blocks_publishers_for_20s() {
    let _broker = BROKER.write().await;
    const MAX_IN_FLIGHT: usize = 500;
    let w = World::new(Cluster::Test, Proxies::default(), MAX_IN_FLIGHT).await;
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    {
        let _alarm = MemoryAlarm::raise();
        assert!(
            World::wait_log(
                &relay,
                "rabbitmq blocked publishing",
                Duration::from_secs(15)
            )
            .await,
            "the relay noticed the block: {}",
            relay.log_text()
        );
        tokio::time::sleep(OUTAGE).await;
    }
    load.await.unwrap();
    w.verify(2 * MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// The AMQP connection stalls (the proxy stops forwarding, nothing closes): AMQP
/// heartbeats (`heartbeat_secs = 2`) make the relay notice and reconnect; once the
/// network is back everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_side_network_stall() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 500;
    let proxies = Proxies {
        postgres: false,
        amqp: true,
    };
    let mut w = World::new(Cluster::Test, proxies, MAX_IN_FLIGHT).await;
    w.rabbitmq_extra = "heartbeat_secs = 2".into();
    let relay = w.start();
    let load = w.load(1, 10_000, 50, Duration::from_millis(100));
    w.wait_distinct(1000, WAIT).await;
    let mark = relay.log_text().len();
    w.amqp_proxy.as_ref().unwrap().stall();
    // Heartbeats (2 s) detect the dead peer well before the stall ends.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut noticed = false;
    while std::time::Instant::now() < deadline && !noticed {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let log = relay.log_text();
        let new = &log[mark.min(log.len())..];
        noticed = new.contains("WARN");
    }
    w.amqp_proxy.as_ref().unwrap().restore();
    assert!(
        noticed,
        "the relay noticed the stalled broker connection: {}",
        relay.log_text()
    );
    load.await.unwrap();
    w.verify(2 * MAX_IN_FLIGHT).await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}

/// docs/design.md §5: unroutable (returned) messages and nacked messages while others flow:
/// the relay does not move past them, retries in order, drops nothing. Rows of type
/// `odd` have no binding until one is added; rows of type `nack` go to a queue that
/// rejects every publish (`x-max-length 0`, `reject-publish`) until it is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_and_nacked_messages_keep_order() {
    let _broker = BROKER.read().await;
    const MAX_IN_FLIGHT: usize = 50;
    let mut w = World::with_binding(
        Cluster::Test,
        Proxies::default(),
        MAX_IN_FLIGHT,
        &["seq.#", "nack.#"],
    )
    .await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let exchange = w.env.exchange.clone();
    let rejecting = w
        .env
        .broker
        .queue_bound_with(&exchange, "nack.#", args)
        .await;
    let relay = w.start();
    w.insert(1, 500, 50).await;
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('seq', '501', 'tick', '{}'), ('odd', '502', 'tick', '{}'), ('seq', '503', 'tick', '{}')",
    )
    .await;
    w.insert(504, 200, 50).await;
    w.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('nack', '704', 'tick', '{}'), ('seq', '705', 'tick', '{}')",
    )
    .await;
    w.insert(706, 300, 50).await;
    // Everything up to the unroutable message arrives; nothing after it is final yet.
    w.wait_distinct(501, WAIT).await;
    assert!(
        World::wait_log(&relay, "unroutable", Duration::from_secs(30)).await
            || World::wait_log(&relay, "returned", Duration::from_secs(1)).await,
        "the relay reports the unroutable message: {}",
        relay.log_text()
    );
    w.bind("odd.#").await;
    // Then the nacks: the rejecting queue goes away.
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.env
        .broker
        .channel
        .queue_delete(rejecting.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let report = w.verify_with(usize::MAX, true).await;
    eprintln!("retries published {} duplicates", report.duplicates);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    w.cleanup().await;
}
