//! Operating the relay (docs/design.md §6, §8): `/metrics` against what a consumer received,
//! `/readyz` and `/healthz` across a broker cut, `status` and `peek` on a known slot,
//! and no password in any log line at trace level.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use testkit::proxy::Proxy;
use testkit::{free_addr, unique_name};

mod credentials;
mod metrics;
mod refused;
mod status_peek;

const WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------
// helpers

/// The value of a sample `name` (exact name, `labels` e.g. `side="rabbitmq"` or
/// "") in Prometheus text. Histogram bodies with chunked encoding are never split
/// inside a line by axum for bodies this small, but be lenient anyway.
pub(crate) fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let rest = if labels.is_empty() {
            rest.strip_prefix(' ')?
        } else {
            rest.strip_prefix('{')?
                .strip_prefix(labels)?
                .strip_prefix("} ")?
        };
        rest.trim().parse().ok()
    })
}

/// Polls `/metrics` until `pred` holds; panics with the last scrape after `WAIT`.
pub(crate) async fn scrape_until(addr: &str, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        if let Some((200, body)) = http_get(addr, "/metrics").await {
            if pred(&body) {
                return body;
            }
            last = body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; last scrape:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `/readyz` until it answers `want`, asserting `/healthz` answers 200 at every
/// step; panics with the relay's log after `WAIT`.
async fn wait_ready(addr: &str, want: u16, relay: &Relay) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        // /readyz first: once the server answered, /healthz must answer 200.
        let ready = http_get(addr, "/readyz").await.map(|(s, _)| s);
        let health = http_get(addr, "/healthz").await.map(|(s, _)| s);
        if ready.is_some() {
            assert_eq!(health, Some(200), "/healthz while /readyz is {ready:?}");
        }
        if ready == Some(want) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz is {ready:?}, not {want}, after {WAIT:?}; log:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn amqp_target() -> SocketAddr {
    let url = testkit::amqp_url();
    let host = url.split('@').nth(1).unwrap().split('/').next().unwrap();
    host.parse().unwrap()
}
