//! The publisher against the real RabbitMQ (testkit's broker, guest/guest).
//!
//! Every test uses its own exchange and queue names and deletes them at the end.
//! All RabbitMQ tests live in this one binary because one of them
//! (`blocked_broker_freezes_the_watermark`) raises a broker-wide memory alarm: it
//! takes `support::BROKER` for writing while every other test holds it for reading,
//! so within this crate it never overlaps another test. Its blocked window is a few
//! seconds, and the alarm is lifted by a guard even if the test panics.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use outbox_event::{Lsn, WalBatch, WalItem};
use publisher::{Publisher, PublisherConfig};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_every_message_in_order_with_spec_properties() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_all").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    let mut config = config(&exchange);
    config.max_in_flight = 1000;
    let mut running = start(config).await;

    let json = table("outbox", JSON);
    let bytea = table("outbox_bin", "application/octet-stream");
    let text = table("outbox_text", "text/plain");
    let mut stream = Stream::new(json.clone());
    // (body, content type) expected for each message, in order.
    let mut expected: Vec<(Vec<u8>, &str, String)> = Vec::new();
    let total = 10_000;
    let mut tx_size = 1;
    while (stream.events as usize) < total {
        let n = tx_size.min(total - stream.events as usize);
        let mut items = Vec::with_capacity(n + 1);
        for _ in 0..n {
            let k = stream.events;
            let mut event = match k % 100 {
                // bytea payload: the reader decoded Postgres' hex text to raw bytes.
                3 => {
                    let mut e =
                        stream.event(Some(Bytes::from(vec![0, 0xff, (k % 256) as u8, 0x0a])));
                    e.table = bytea.clone();
                    expected.push((
                        vec![0, 0xff, (k % 256) as u8, 0x0a],
                        "application/octet-stream",
                        "public.outbox_bin".into(),
                    ));
                    e
                }
                // NULL payload: empty body.
                5 => {
                    let e = stream.event(None);
                    expected.push((Vec::new(), "application/json", "public.outbox".into()));
                    e
                }
                7 => {
                    let mut e = stream.event(Some(Bytes::from(format!("plain \\x text {k}"))));
                    e.table = text.clone();
                    expected.push((
                        format!("plain \\x text {k}").into_bytes(),
                        "text/plain",
                        "public.outbox_text".into(),
                    ));
                    e
                }
                _ => {
                    let body = format!(r#"{{"n": {k}, "s": "ünïcode"}}"#);
                    let e = stream.event(Some(Bytes::from(body.clone())));
                    expected.push((
                        body.into_bytes(),
                        "application/json",
                        "public.outbox".into(),
                    ));
                    e
                }
            };
            if k % 50 == 0 {
                event.headers = None;
            }
            items.push(WalItem::Event(event));
        }
        running.send(stream.commit(items)).await;
        tx_size = tx_size % 97 + 13;
    }

    let deliveries = receive_fast(&mut consumer, total).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    running.assert_watermarks_valid(&stream.ends);
    // With nothing in flight, a keepalive position is acked at once.
    let keepalive = Lsn(last.0 + 0x5000);
    running.send(vec![WalItem::Keepalive(keepalive)]).await;
    running.wait_watermark(keepalive).await;
    assert_eq!(running.status.in_flight(), 0);
    assert_eq!(running.status.oldest_unacked_commit_micros(), None);
    let report = running.finish().await;
    assert_eq!(report.watermark, keepalive);
    assert_eq!(report.abandoned, 0);
    assert_eq!(report.acked, total as u64);
    assert_eq!(report.retries, 0);

    let mut previous: Option<(Lsn, i64)> = None;
    for (i, d) in deliveries.iter().enumerate() {
        let (body, content_type, table_name) = &expected[i];
        let p = &d.properties;
        assert_eq!(message_id(d), format!("id-{i:08}"), "order at {i}");
        assert_eq!(&d.data, body, "body of {i}");
        assert_eq!(d.routing_key.as_str(), "order.created");
        assert_eq!(d.exchange.as_str(), exchange);
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            *content_type,
            "content type of {i}"
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            *p.timestamp(),
            Some((COMMIT_TIME_MICROS / 1_000_000) as u64)
        );
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
        assert_eq!(
            p.correlation_id().as_ref().unwrap().to_string(),
            format!("corr-{i}")
        );
        assert_eq!(header_text(d, "aggregate_type"), "order");
        assert_eq!(header_text(d, "aggregate_id"), format!("{}", i % 7));
        assert_eq!(header_text(d, "event_type"), "created");
        assert_eq!(header_text(d, "outbox_table"), *table_name);
        let end = stream.end_of[&format!("id-{i:08}")];
        // The stream's commit LSN is 0x100 before the end LSN.
        assert_eq!(header_text(d, "commit_lsn"), Lsn(end.0 - 0x100).to_string());
        assert!(matches!(header(d, "xid"), Some(AMQPValue::LongLongInt(x)) if *x >= 1000));
        // tx_index: 0 for a transaction's first event, then +1 in insert order.
        let index = match header(d, "tx_index") {
            Some(AMQPValue::LongLongInt(x)) => *x,
            other => panic!("tx_index: {other:?}"),
        };
        let expected_index = match previous {
            Some((lsn, idx)) if lsn == end => idx + 1,
            _ => 0,
        };
        assert_eq!(index, expected_index, "tx_index of message {i}");
        previous = Some((end, index));
        let headers = p.headers().as_ref().unwrap().inner();
        if i % 50 == 0 {
            assert_eq!(headers.len(), 7, "no headers column: only the relay's own");
        } else {
            assert_eq!(header_text(d, "seq"), i.to_string());
            assert_eq!(header_text(d, "traceparent"), format!("00-t-{i}-01"));
            assert_eq!(headers.len(), 9);
        }
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_messages_are_retried_and_hold_the_watermark() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_nack").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(100));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let queue = broker.bound_queue("pub_nack", &exchange, args).await;

    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    let batches: Vec<_> = (0..30).map(|_| stream.transaction(10)).collect();
    // Fed from a task: while the publisher retries a nacked message it takes no
    // more input, so sending all 30 here would wait for the consumer below.
    let input = running.input.clone().unwrap();
    let feeder = tokio::spawn(async move {
        for batch in batches {
            input.send(batch).await.unwrap();
        }
    });
    // The queue takes at most 100 messages (ten transactions; the broker may nack
    // some earlier, and retries may fill it with copies of acked ones): the
    // watermark moves, and stays below the transactions that cannot fit.
    running.wait_watermark(stream.ends[0]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        *running.watermark.borrow() <= stream.ends[9],
        "watermark passed a nacked message"
    );
    // Everything not acked is in flight (what the publisher has not taken from its
    // input yet, while it retries, is not counted here).
    let in_flight = running.status.in_flight();
    assert!(in_flight > 0 && in_flight <= 200, "in flight: {in_flight}");

    // A consumer drains slowly; everything arrives.
    let mut consumer = broker.consumer(&queue, 1).await;
    let mut ids = std::collections::BTreeSet::new();
    while ids.len() < 300 {
        let batch = receive(&mut consumer, 1).await;
        ids.insert(message_id(&batch[0]));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    tokio::time::timeout(PATIENCE, feeder)
        .await
        .unwrap()
        .unwrap();
    running.assert_watermarks_valid(&stream.ends);
    let report = running.finish().await;
    assert_eq!(ids.len(), 300);
    assert!(report.nacked > 0, "{report:?}");
    assert!(report.retries > 0, "{report:?}");
    assert_eq!(report.watermark, last);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_goes_to_the_dead_letter_exchange() {
    let _shared = BROKER.read().await;
    let dlx = testkit::unique_name("pub_dlx_d");
    let queue = testkit::unique_name("pub_dlx_q");
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_dlx").await;
    broker.exchange(&dlx, ExchangeKind::Fanout).await;
    broker.queue(&queue, FieldTable::default()).await;
    broker.bind(&queue, &dlx, "").await;
    let mut consumer = broker.consumer(&queue, 100).await;

    let mut config = config(&exchange);
    config.dead_letter_exchange = Some(dlx.clone());
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    running.send(stream.transaction(2)).await;

    let deliveries = receive(&mut consumer, 5).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    for (i, d) in deliveries.iter().enumerate() {
        assert_eq!(message_id(d), format!("id-{i:08}"));
        assert_eq!(d.exchange.as_str(), dlx);
        assert_eq!(header_text(d, "x-outbox-error"), "unroutable");
        assert_eq!(header_text(d, "x-original-exchange"), exchange);
        assert_eq!(header_text(d, "x-original-routing-key"), "order.created");
        assert_eq!(header_text(d, "aggregate_type"), "order");
    }
    assert_eq!(report.returned, 5);
    assert_eq!(report.dead_lettered, 5);
    assert_eq!(report.retries, 0);
    assert_eq!(report.watermark, last);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_without_dead_letter_is_retried_until_routable() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let exchange = broker.topic_exchange("pub_unr").await;

    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *running.watermark.borrow(),
        Lsn::ZERO,
        "watermark moved past unroutable messages"
    );
    assert_eq!(running.status.in_flight(), 3);

    let queue = broker
        .bound_queue("pub_unr", &exchange, FieldTable::default())
        .await;
    let mut consumer = broker.consumer(&queue, 100).await;
    let deliveries = receive(&mut consumer, 3).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    assert_eq!(ids, ["id-00000000", "id-00000001", "id-00000002"]);
    assert!(report.returned >= 3, "{report:?}");
    assert!(report.retries >= 1, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_closed_mid_stream_loses_nothing() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_cut").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    let mut config = config(&exchange);
    config.max_in_flight = 500;
    let name = config.connection_name.clone();
    let mut running = start(config.clone()).await;
    let mut stream = Stream::new(table("outbox", JSON));
    let mut transactions = Vec::new();
    // More than the publisher can take at this feeding pace: a backlog builds up,
    // so the connection is closed with messages in flight.
    for _ in 0..120 {
        transactions.push(stream.transaction(400));
    }
    let pid = connection_pid(&name);
    // Feed at a steady pace so the connection is closed mid-stream.
    let sender = running.input.clone().unwrap();
    let all = transactions.clone();
    let feeder = tokio::spawn(async move {
        for batch in all {
            // The publisher is killed below: later sends may fail.
            if sender.send(batch).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    running.wait_watermark(stream.ends[3]).await;
    tokio::task::spawn_blocking(move || close_connection(&pid))
        .await
        .unwrap();
    let closed_at = *running.watermark.borrow();
    assert!(
        running.status.in_flight() > 0,
        "the connection was not closed mid-stream"
    );

    // Once it reconnected and made progress, kill the publisher (as a crash would)
    // and check that everything below its watermark really is in the queue.
    let reconnected = tokio::time::timeout(PATIENCE, async {
        while running.status.reconnects() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(reconnected.is_ok(), "the publisher did not reconnect");
    let after = stream
        .ends
        .iter()
        .position(|e| *e > closed_at)
        .unwrap_or(stream.ends.len() - 1);
    running.wait_watermark(stream.ends[after]).await;
    running.task.abort();
    let _ = (&mut running.task).await;
    feeder.await.unwrap();
    let watermark = *running.watermark.borrow();
    running.assert_watermarks_valid(&stream.ends);
    let below: usize = stream.ends.iter().take_while(|e| **e <= watermark).count() * 400;
    assert!(below >= 4 * 400);

    let mut first_seen: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut seen_below = 0;
    let mut record = |deliveries: Vec<lapin::message::Delivery>,
                      first_seen: &mut Vec<String>,
                      seen_below: &mut usize| {
        for d in deliveries {
            let id = message_id(&d);
            if seen.insert(id.clone()) {
                let index: usize = id.trim_start_matches("id-").parse().unwrap();
                if index < below {
                    *seen_below += 1;
                }
                first_seen.push(id);
            }
        }
    };
    // Every message below the watermark arrives (a missing one fails after PATIENCE).
    while seen_below < below {
        let d = receive_fast(&mut consumer, 1).await;
        record(d, &mut first_seen, &mut seen_below);
    }

    // A restarted publisher resumes after the watermark, like the relay would.
    let resume = stream
        .ends
        .iter()
        .position(|e| *e > watermark)
        .unwrap_or(stream.ends.len());
    let mut running = start(config).await;
    for batch in &transactions[resume..] {
        running.send(batch.clone()).await;
    }
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    assert_eq!(report.abandoned, 0);

    // Everything arrived (duplicates allowed); first occurrences are in order.
    let total = stream.events as usize;
    while first_seen.len() < total {
        let d = receive_fast(&mut consumer, 1).await;
        record(d, &mut first_seen, &mut seen_below);
    }
    let expected: Vec<String> = (0..total).map(|i| format!("id-{i:08}")).collect();
    assert_eq!(first_seen, expected);
    broker.cleanup().await;
}

/// The broker's pid of the connection whose client-provided name is `name`.
fn connection_pid(name: &str) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    let pid = listing
        .lines()
        .find(|l| l.contains(name))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no connection named {name} in:\n{listing}"))
        .to_string();
    pid
}

/// Closes a connection from the broker side.
fn close_connection(pid: &str) {
    let status = std::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "close_connection",
            pid,
            "publisher test closes the connection",
        ])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Restores the broker's memory high watermark when dropped (even on panic).
struct MemoryWatermarkGuard {
    original: Vec<String>,
}

impl MemoryWatermarkGuard {
    /// Reads the current setting, then sets the watermark to 0 (blocks publishers).
    fn block() -> MemoryWatermarkGuard {
        let out = std::process::Command::new("rabbitmqctl")
            .args(["-q", "environment"])
            .output()
            .unwrap();
        let env = String::from_utf8_lossy(&out.stdout);
        let setting = env
            .split("{vm_memory_high_watermark,")
            .nth(1)
            .expect("rabbitmqctl environment shows vm_memory_high_watermark");
        // Either `0.4}` or `{absolute,1073741824}}`.
        let original = if let Some(rest) = setting.strip_prefix("{absolute,") {
            let value = rest.split('}').next().unwrap().trim().trim_matches('"');
            vec!["absolute".to_string(), value.to_string()]
        } else {
            vec![setting.split('}').next().unwrap().trim().to_string()]
        };
        let guard = MemoryWatermarkGuard { original };
        set_memory_watermark(&["0"]);
        guard
    }
}

impl Drop for MemoryWatermarkGuard {
    fn drop(&mut self) {
        let args: Vec<&str> = self.original.iter().map(String::as_str).collect();
        set_memory_watermark(&args);
    }
}

fn set_memory_watermark(args: &[&str]) {
    let status = std::process::Command::new("rabbitmqctl")
        .arg("-q")
        .arg("set_vm_memory_high_watermark")
        .args(args)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "rabbitmqctl set_vm_memory_high_watermark {args:?} failed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_broker_freezes_the_watermark() {
    let _exclusive = BROKER.write().await;
    let mut broker = Broker::new().await;
    let (exchange, _queue) = broker.topic_queue("pub_blk").await;

    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(5)).await;
    running.wait_watermark(stream.ends[0]).await;
    assert!(running.status.ready());

    let guard = MemoryWatermarkGuard::block();
    // The broker blocks a connection when it next publishes after the alarm.
    let waited = tokio::time::timeout(PATIENCE, async {
        while !running.status.blocked() {
            running.send(stream.transaction(1)).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the publisher never saw connection.blocked");
    assert!(!running.status.ready());
    // Let acks of messages the broker took before blocking arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let frozen = *running.watermark.borrow();
    running.send(stream.transaction(3)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *running.watermark.borrow(),
        frozen,
        "watermark moved while blocked"
    );
    assert!(frozen < *stream.ends.last().unwrap());
    drop(guard);

    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    assert!(!running.status.blocked());
    running.assert_watermarks_valid(&stream.ends);
    let report = running.finish().await;
    assert_eq!(report.watermark, last);
    broker.cleanup().await;
}

#[tokio::test]
async fn wrong_password_is_a_definite_error_without_the_password() {
    let _shared = BROKER.read().await;
    let mut config = config(&testkit::unique_name("pub_auth_x"));
    config.urls = vec!["amqp://guest:sUpErSeCrEt@127.0.0.1:5672/%2f".into()];
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
    config.urls = vec!["amqp://guest:guest@127.0.0.1:5672/no_such_vhost_here".into()];
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
    config.urls = vec!["amqps://guest:tlssecret@127.0.0.1:5672/%2f".into()];
    config.ca_file = Some(testkit::pg_ca_file().into());
    let err = Publisher::connect(config.clone())
        .await
        .err()
        .expect("no TLS on 5672");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_the_window_goes_through() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_big").await;
    let mut consumer = broker.fast_consumer(&queue).await;

    let mut config = config(&exchange);
    config.max_in_flight = 10;
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(stream.transaction(3)).await;
    running.send(stream.transaction(250)).await;
    running.send(stream.transaction(3)).await;
    let deliveries = receive_fast(&mut consumer, 256).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    running.assert_watermarks_valid(&stream.ends);
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    let expected: Vec<String> = (0..256).map(|i| format!("id-{i:08}")).collect();
    assert_eq!(ids, expected);
    assert_eq!(report.retries, 0);
    broker.cleanup().await;
}

/// A transaction of three events whose middle one has a body of `big` bytes.
fn with_big_middle(stream: &mut Stream, big: usize) -> WalBatch {
    let items = vec![
        WalItem::Event(stream.event(Some(Bytes::from_static(b"{\"n\":1}")))),
        WalItem::Event(stream.event(Some(Bytes::from(format!(
            "{{\"pad\":\"{}\"}}",
            "x".repeat(big)
        ))))),
        WalItem::Event(stream.event(Some(Bytes::from_static(b"{\"n\":3}")))),
    ];
    stream.commit(items)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_header_keys_never_poison_the_relay() {
    let _shared = BROKER.read().await;
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_cc").await;
    let mut consumer = broker.consumer(&queue, 100).await;
    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    let mut items = Vec::new();
    for i in 0..5 {
        let mut e = stream.event(Some(Bytes::from_static(b"{}")));
        if i == 2 {
            // RabbitMQ routes by CC/BCC and closes the channel when they are not
            // arrays: from the headers column they must never reach the broker.
            e.headers = Some(Bytes::from_static(
                br#"{"CC":"not-an-array","BCC":7,"x-death":"x","tenant":"t1"}"#,
            ));
        }
        items.push(WalItem::Event(e));
    }
    running.send(stream.commit(items)).await;
    let deliveries = receive(&mut consumer, 5).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    let expected: Vec<String> = (0..5).map(|i| format!("id-{i:08}")).collect();
    assert_eq!(ids, expected);
    let third = &deliveries[2];
    assert_eq!(header_text(third, "tenant"), "t1");
    for key in ["CC", "BCC", "x-death"] {
        assert!(header(third, key).is_none(), "{key} reached the broker");
    }
    assert_eq!(report.retries, 0, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_goes_to_the_dead_letter_exchange_as_a_notice() {
    let _exclusive = BROKER.write().await;
    let _limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let dlx = testkit::unique_name("pub_psn_d");
    let dlq = testkit::unique_name("pub_psn_q");
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_psn").await;
    broker.exchange(&dlx, ExchangeKind::Fanout).await;
    broker.queue(&dlq, FieldTable::default()).await;
    broker.bind(&dlq, &dlx, "").await;
    let mut main = broker.consumer(&queue, 100).await;
    let mut dead = broker.consumer(&dlq, 100).await;

    let mut config = config(&exchange);
    config.dead_letter_exchange = Some(dlx.clone());
    let mut running = start(config).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(with_big_middle(&mut stream, 200 * 1024)).await;
    running.send(stream.transaction(2)).await;

    // First occurrences (a message acked before the refusal may come again).
    let mut ids: Vec<String> = Vec::new();
    while ids.len() < 4 {
        let id = message_id(&receive(&mut main, 1).await[0]);
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    let notice = receive(&mut dead, 1).await;
    let last = *stream.ends.last().unwrap();
    running.wait_watermark(last).await;
    let report = running.finish().await;
    assert_eq!(
        ids,
        ["id-00000000", "id-00000002", "id-00000003", "id-00000004"]
    );
    let n = &notice[0];
    assert_eq!(message_id(n), "id-00000001");
    assert!(n.data.is_empty(), "the refused body was sent again");
    assert!(
        header_text(n, "x-outbox-error").contains("refused"),
        "{}",
        header_text(n, "x-outbox-error")
    );
    assert_eq!(header_text(n, "x-original-exchange"), exchange);
    assert!(
        matches!(header(n, "x-outbox-body-bytes"), Some(AMQPValue::LongLongInt(b)) if *b > 200 * 1024)
    );
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert!(report.retries >= 1, "{report:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_without_dead_letter_exchange_holds_and_is_reported() {
    let _exclusive = BROKER.write().await;
    let limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let mut broker = Broker::new().await;
    let (exchange, queue) = broker.topic_queue("pub_psn2").await;
    let mut main = broker.consumer(&queue, 100).await;
    let mut running = start(config(&exchange)).await;
    let mut stream = Stream::new(table("outbox", JSON));
    running.send(with_big_middle(&mut stream, 200 * 1024)).await;
    let end = *stream.ends.last().unwrap();

    // The message before it arrives; the poison is reported and holds the watermark.
    let first = receive(&mut main, 1).await;
    assert_eq!(message_id(&first[0]), "id-00000000");
    let reported = tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(p) = running.status.poison() {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the poison message is reported");
    assert_eq!(reported.message_id, "id-00000001");
    assert_eq!(reported.tx_index, 1);
    assert!(reported.reason.contains("406"), "{}", reported.reason);
    assert!(
        !running.status.ready(),
        "ready while a poison message holds it"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        *running.watermark.borrow() < end,
        "watermark passed a refused message"
    );

    // The operator raises the limit: it goes through, in order, and the report clears.
    drop(limit);
    // The first may come again (it was acked before its transaction was): the
    // first occurrences are in order.
    let mut ids: Vec<String> = Vec::new();
    while !ids.iter().any(|i| i == "id-00000002") {
        let id = message_id(&receive(&mut main, 1).await[0]);
        if !ids.contains(&id) && id != "id-00000000" {
            ids.push(id);
        }
    }
    running.wait_watermark(end).await;
    assert_eq!(ids, ["id-00000001", "id-00000002"]);
    assert!(running.status.poison().is_none());
    let report = running.finish().await;
    assert!(report.retries >= 2, "{report:?}");
    broker.cleanup().await;
}
