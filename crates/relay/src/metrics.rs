//! Prometheus `/metrics`, `/healthz` and `/readyz` on `[relay] metrics_listen`.

use std::net::SocketAddr;

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::CliError;
use crate::pipeline::Health;

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
    spawn_gauges(health.clone());
    let app = router(handle, health);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(())
}

fn router(handle: PrometheusHandle, health: Health) -> Router {
    Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route(
            "/readyz",
            get(move || {
                let ready = health.ready();
                std::future::ready(if ready {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                })
            }),
        )
}

/// Gauges derived from live state, refreshed every second.
fn spawn_gauges(health: Health) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            let lag = health
                .publisher()
                .and_then(|p| p.oldest_unacked_commit_micros())
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
    });
}
