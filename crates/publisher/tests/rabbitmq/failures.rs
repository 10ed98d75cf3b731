//! A connection closed mid-stream, and a blocked broker.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_closed_mid_stream_loses_nothing() {
    closed_mid_stream_loses_nothing().await;
}

async fn closed_mid_stream_loses_nothing() {
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
    let out = testkit::rabbitmqctl_command()
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    let pid = listing
        .lines()
        .find(|l| l.contains(&format!("\"{name}\"")))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no connection named {name} in:\n{listing}"))
        .to_string();
    pid
}

/// Closes a connection from the broker side.
fn close_connection(pid: &str) {
    let status = testkit::rabbitmqctl_command()
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
        let out = testkit::rabbitmqctl_command()
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
    let status = testkit::rabbitmqctl_command()
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
