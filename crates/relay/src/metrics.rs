//! Prometheus `/metrics`, `/healthz` and `/readyz` on `[relay] metrics_listen`.

use std::net::SocketAddr;

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::Instrument;

use crate::error::CliError;
use crate::health::Health;

/// Buckets of the commit → ack latency histogram, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Installs the Prometheus recorder and serves the endpoints in the background.
pub async fn serve(addr: SocketAddr, health: Health) -> Result<(), CliError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("outbox_relay_publish_latency_seconds".into()),
            LATENCY_BUCKETS,
        )
        .map_err(|e| CliError::Runtime(format!("cannot configure metric buckets: {e}")))?
        .install_recorder()
        .map_err(|e| CliError::Runtime(format!("cannot install the metrics recorder: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        CliError::Precondition(format!(
            "cannot listen on {addr} for metrics ({e}): choose a free address in [relay] metrics_listen, or \"\" to disable"
        ))
    })?;
    describe();
    spawn_gauges(health.clone());
    let app = router(handle, health);
    tokio::spawn(
        async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        }
        .instrument(tracing::info_span!("metrics_server", %addr)),
    );
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(())
}

fn router(handle: PrometheusHandle, health: Health) -> Router {
    let gauges = health.clone();
    let poison = health.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                update_gauges(&gauges);
                std::future::ready(handle.render())
            }),
        )
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route(
            "/readyz",
            get(move || {
                let ready = health.ready();
                let poison = health.publisher().and_then(|p| p.poison());
                std::future::ready(match (ready, poison) {
                    (true, _) => (StatusCode::OK, "ready\n".to_string()),
                    (false, Some(p)) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "not ready: rabbitmq refuses message {} ({})\n",
                            p.message_id, p.reason
                        ),
                    ),
                    (false, None) => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_string()),
                })
            }),
        )
        .route(
            "/poison",
            get(move || std::future::ready(poison_json(&poison))),
        )
}

/// The message the broker refuses, as JSON (`null` when none): what `status` shows.
fn poison_json(health: &Health) -> String {
    let value = match health.publisher().and_then(|p| p.poison()) {
        Some(p) => serde_json::json!({
            "message_id": p.message_id,
            "commit_lsn": p.commit_lsn.to_string(),
            "tx_index": p.tx_index,
            "routing_key": p.routing_key,
            "reason": p.reason,
        }),
        None => serde_json::Value::Null,
    };
    format!("{value}\n")
}

/// HELP text for every metric, and the counters registered at 0 so that a scrape
/// shows them (and `rate()`/`increase()` work) before the first event.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    use publisher::status as p;

    let counters = [
        (
            p::EVENTS_PUBLISHED,
            "basic.publish calls for outbox events, retries included",
        ),
        (p::EVENTS_ACKED, "publishes acked by the broker"),
        (p::EVENTS_NACKED, "publishes nacked by the broker (retried)"),
        (p::EVENTS_RETURNED, "publishes returned as unroutable"),
        (
            p::EVENTS_DEAD_LETTERED,
            "returned messages republished to dead_letter_exchange and acked",
        ),
        (
            p::PUBLISH_RETRIES,
            "publish failure recoveries (each republishes from the oldest unacked message)",
        ),
    ];
    for (name, help) in counters {
        describe_counter!(name, Unit::Count, help);
        metrics::counter!(name).increment(0);
    }
    describe_counter!(
        p::RECONNECTS,
        Unit::Count,
        "reconnects, by side (postgres, rabbitmq)"
    );
    for side in ["postgres", "rabbitmq"] {
        metrics::counter!(p::RECONNECTS, "side" => side).increment(0);
    }
    describe_gauge!(
        p::IN_FLIGHT,
        Unit::Count,
        "messages read and not yet behind a position confirmed to Postgres"
    );
    metrics::gauge!(p::IN_FLIGHT).set(0.0);
    describe_gauge!(p::ACKED_LSN, "the acked watermark (LSN as a number)");
    describe_gauge!(
        p::POISON_MESSAGES,
        Unit::Count,
        "1 while a message RabbitMQ refuses holds the relay (no dead_letter_exchange)"
    );
    metrics::gauge!(p::POISON_MESSAGES).set(0.0);
    describe_gauge!(
        "outbox_relay_confirmed_lsn",
        "the last flush position sent to Postgres (LSN as a number)"
    );
    describe_gauge!(
        "outbox_relay_outbox_lag_seconds",
        Unit::Seconds,
        "now minus the commit time of the oldest unacked event; 0 when idle"
    );
    describe_gauge!("outbox_relay_ready", "1 while /readyz answers 200");
    describe_histogram!(
        p::PUBLISH_LATENCY,
        Unit::Seconds,
        "commit to broker ack, per event"
    );
    describe_gauge!(
        crate::slot_metrics::SLOT_RETAINED_WAL,
        Unit::Bytes,
        "WAL the server retains for the slot (current WAL minus restart_lsn)"
    );
    describe_gauge!(
        crate::slot_metrics::SLOT_PENDING_WAL,
        Unit::Bytes,
        "WAL not yet confirmed by the relay (current WAL minus confirmed_flush_lsn)"
    );
    describe_gauge!(
        crate::slot_metrics::SLOT_SAFE_WAL,
        Unit::Bytes,
        "WAL that can still be written before the slot is invalidated (safe_wal_size)"
    );
}

/// Gauges derived from live state, set at every scrape (so a scrape never sees a
/// stale value) and every second (for recorders that are read otherwise).
fn update_gauges(health: &Health) {
    let lag = health
        .oldest_unacked_commit_micros()
        .map(|commit| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as i64)
                .unwrap_or(commit);
            (now - commit).max(0) as f64 / 1e6
        })
        .unwrap_or(0.0);
    metrics::gauge!("outbox_relay_outbox_lag_seconds").set(lag);
    metrics::gauge!("outbox_relay_ready").set(if health.ready() { 1.0 } else { 0.0 });
}

fn spawn_gauges(health: Health) {
    let task = async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            update_gauges(&health);
        }
    }
    .instrument(tracing::info_span!("gauges"));
    tokio::spawn(task);
}
