//! `/metrics` against what a consumer received, and `/readyz`/`/healthz` across a broker cut.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_what_the_consumer_received() {
    let _shared = testkit::BROKER.read().await;
    const N: usize = 500;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let addr = free_addr();
    let config = env.config_file("metrics.toml", &env.db.url(), &testkit::amqp_url(), &addr);
    let relay = env.start_with(&config, "info", &[]);
    wait_ready(&addr, 200, &relay).await;

    // Before any event: every counter is exported, at 0.
    let body = http_get(&addr, "/metrics").await.unwrap().1;
    for name in [
        "outbox_relay_events_published_total",
        "outbox_relay_events_acked_total",
        "outbox_relay_events_nacked_total",
        "outbox_relay_events_returned_total",
        "outbox_relay_events_dead_lettered_total",
        "outbox_relay_publish_retries_total",
    ] {
        assert_eq!(sample(&body, name, ""), Some(0.0), "{name} in\n{body}");
    }
    assert_eq!(
        sample(&body, "outbox_relay_reconnects_total", "side=\"rabbitmq\""),
        Some(0.0),
        "{body}"
    );

    env.insert_seq(1, N, 50);
    let msgs = got.wait_for(N, WAIT).await;
    assert_eq!(
        check_sequence(&msgs, N),
        0,
        "no duplicates without failures"
    );

    let body = scrape_until(&addr, "all acked, nothing in flight", |b| {
        sample(b, "outbox_relay_events_acked_total", "") == Some(N as f64)
            && sample(b, "outbox_relay_in_flight", "") == Some(0.0)
            && sample(b, "outbox_relay_outbox_lag_seconds", "") == Some(0.0)
            && sample(b, "outbox_relay_slot_retained_wal_bytes", "").is_some()
    })
    .await;
    eprintln!("/metrics after {N} events:\n{body}");
    let received = got.len() as f64;
    assert_eq!(received, N as f64, "nothing more arrived");
    let v = |name: &str| sample(&body, name, "").unwrap_or_else(|| panic!("{name} in\n{body}"));
    assert_eq!(v("outbox_relay_events_published_total"), received);
    assert_eq!(v("outbox_relay_events_acked_total"), received);
    assert_eq!(v("outbox_relay_publish_latency_seconds_count"), received);
    assert!(v("outbox_relay_publish_latency_seconds_sum") > 0.0);
    assert_eq!(
        sample(
            &body,
            "outbox_relay_publish_latency_seconds_bucket",
            "le=\"+Inf\""
        ),
        Some(received),
        "{body}"
    );
    for zero in [
        "outbox_relay_events_nacked_total",
        "outbox_relay_events_returned_total",
        "outbox_relay_events_dead_lettered_total",
        "outbox_relay_publish_retries_total",
    ] {
        assert_eq!(v(zero), 0.0, "{zero}");
    }
    assert_eq!(v("outbox_relay_ready"), 1.0);
    assert!(v("outbox_relay_acked_lsn") > 0.0);
    assert!(v("outbox_relay_slot_retained_wal_bytes") > 0.0);
    assert!(v("outbox_relay_slot_pending_wal_bytes") >= 0.0);
    // The acked watermark reaches Postgres: the confirmed LSN follows it.
    scrape_until(&addr, "confirmed LSN at the acked LSN", |b| {
        let acked = sample(b, "outbox_relay_acked_lsn", "");
        acked.is_some() && sample(b, "outbox_relay_confirmed_lsn", "") >= acked
    })
    .await;
    assert_eq!(http_get(&addr, "/healthz").await.map(|r| r.0), Some(200));

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------
// /readyz and /healthz across a broker cut

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_fails_while_the_broker_is_cut_and_recovers() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    env.create_slot();
    let got = env.consumer().await;
    let proxy = Proxy::start(amqp_target()).await;
    let amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let addr = free_addr();
    let config = env.config_file("readyz.toml", &env.db.url(), &amqp, &addr);
    let relay = env.start_with(&config, "info", &[]);

    wait_ready(&addr, 200, &relay).await;
    env.insert_seq(1, 10, 5);
    got.wait_for(10, WAIT).await;

    proxy.cut();
    wait_ready(&addr, 503, &relay).await;
    // No credentials are configured, so the answer names the reason (docs/operations.md,
    // "Health").
    let body = http_get(&addr, "/readyz").await.unwrap().1;
    assert_eq!(body.trim(), "not ready: connecting to rabbitmq");
    scrape_until(&addr, "ready gauge at 0", |b| {
        sample(b, "outbox_relay_ready", "") == Some(0.0)
    })
    .await;
    // Events committed during the outage wait, and the outbox lag (docs/design.md §7: age of
    // the oldest unacked event) grows meanwhile, although the publisher takes no
    // input while it reconnects: the reader tracks what it read until it is acked.
    env.insert_seq(11, 10, 5);
    scrape_until(&addr, "a positive outbox lag during the outage", |b| {
        sample(b, "outbox_relay_outbox_lag_seconds", "").unwrap_or(0.0) > 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        http_get(&addr, "/readyz").await.map(|r| r.0),
        Some(503),
        "still cut"
    );

    proxy.restore();
    wait_ready(&addr, 200, &relay).await;
    let msgs = got.wait_for(20, WAIT).await;
    check_sequence(&msgs, 20);
    let body = scrape_until(
        &addr,
        "a rabbitmq reconnect counted, nothing in flight",
        |b| {
            sample(b, "outbox_relay_reconnects_total", "side=\"rabbitmq\"").unwrap_or(0.0) >= 1.0
                && sample(b, "outbox_relay_ready", "") == Some(1.0)
                && sample(b, "outbox_relay_in_flight", "") == Some(0.0)
                && sample(b, "outbox_relay_outbox_lag_seconds", "") == Some(0.0)
        },
    )
    .await;
    assert_eq!(
        sample(&body, "outbox_relay_reconnects_total", "side=\"postgres\""),
        Some(0.0),
        "the Postgres side was not disturbed"
    );

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    drop(proxy);
    env.cleanup().await;
}
