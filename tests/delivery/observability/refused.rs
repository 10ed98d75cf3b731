//! A message RabbitMQ refuses holds the slot and is reported.

use super::*;

/// A row whose message the broker refuses (larger than `max_message_size`), with no
/// dead-letter exchange: the relay holds the slot before it and says so — an ERROR
/// line naming the message, the poison gauge, /readyz 503, `status` — and goes on
/// once the operator fixes the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_rabbitmq_refuses_holds_the_slot_and_is_reported() {
    // It lowers the broker-wide max_message_size (delivery/main.rs).
    let _exclusive = testkit::BROKER.write().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("poison.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    // Broker-wide, though only messages over the limit notice it: the lock above
    // keeps the other tests of this binary out until it is restored.
    let limit = testkit::amqp::MaxMessageSize::set(64 * 1024);
    let relay = env.start_with(&config, "info", &[]);
    wait_ready(&addr, 200, &relay).await;
    env.insert_seq(1, 3, 3);
    got.wait_for(3, WAIT).await;

    env.db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('seq', '4', 'tick', jsonb_build_object('pad', repeat('x', 200000)))",
    );
    let big_id = env
        .db
        .psql("SELECT id FROM outbox WHERE aggregate_id = '4'")
        .trim()
        .to_string();
    env.insert_seq(5, 2, 2);

    wait_ready(&addr, 503, &relay).await;
    let body = http_get(&addr, "/readyz").await.unwrap().1;
    assert!(
        body.contains("refuses message") && body.contains(&big_id),
        "/readyz body: {body}"
    );
    scrape_until(&addr, "the poison gauge at 1", |b| {
        sample(b, "outbox_relay_poison_messages", "") == Some(1.0)
    })
    .await;
    let out = env.cli_with(&config, "warn", &["status"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("stuck_message:") && stdout.contains(&big_id),
        "status does not show the stuck message:\n{stdout}"
    );
    let out = env.cli_with(&config, "warn", &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stuck_message"]["message_id"], big_id.as_str());
    assert_eq!(v["stuck_message"]["tx_index"], 0);
    // Nothing after it was published (the slot holds before it).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: std::collections::HashSet<String> =
        got.snapshot().iter().map(|m| m.message_id()).collect();
    assert_eq!(ids.len(), 3, "published past a refused message");
    assert!(relay.log_text().contains("rabbitmq refuses this message"));
    assert!(relay.log_text().contains(&big_id));

    // The operator raises the limit: everything arrives in order, ready again.
    drop(limit);
    got.wait_for(6, WAIT).await;
    wait_ready(&addr, 200, &relay).await;
    let msgs = got
        .wait_until(WAIT, |m| {
            m.iter()
                .map(|m| m.message_id())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= 6
        })
        .await;
    check_sequence(&msgs, 6);
    scrape_until(&addr, "the poison gauge back at 0", |b| {
        sample(b, "outbox_relay_poison_messages", "") == Some(0.0)
    })
    .await;
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}
