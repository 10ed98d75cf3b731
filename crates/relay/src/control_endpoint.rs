//! The control routes of the endpoint (`ctl`, docs/operations.md "Incident
//! levers"), beside `/metrics` on the same listener, credentials and TLS:
//!
//! ```text
//!   POST /control/pause    POST /control/resume    POST /control/drain
//!   POST /control/reload   GET  /control/status
//! ```
//!
//! crate::endpoint requires the credentials for every `/control/` path whenever
//! some are configured, and refuses control on a listener beyond loopback that has
//! none. Answers are JSON; a refused command is 409 with `{"error": …}`.

use std::sync::Arc;
use std::time::SystemTime;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;

use crate::control::{Command, Control, RunState};
use crate::health::Health;
use crate::reload::Reloader;

/// What the control routes act on.
#[derive(Clone)]
pub struct Live {
    pub control: Control,
    pub reloader: Arc<Reloader>,
}

/// The `/control/` routes.
pub fn routes(live: Live, health: Health) -> Router {
    let command = |cmd: Command| {
        let live = live.clone();
        let health = health.clone();
        post(move || {
            let answer = match live.control.apply(cmd) {
                Ok(_) => (StatusCode::OK, status_json(&live.control, &health)),
                Err(refused) => (
                    StatusCode::CONFLICT,
                    format!("{}\n", serde_json::json!({ "error": refused.0 })),
                ),
            };
            std::future::ready(answer)
        })
    };
    let status = {
        let live = live.clone();
        let health = health.clone();
        get(move || std::future::ready(status_json(&live.control, &health)))
    };
    let reload = {
        let live = live.clone();
        post(move || {
            let report = live.reloader.reload();
            std::future::ready(format!(
                "{}\n",
                serde_json::to_value(&report).unwrap_or_default()
            ))
        })
    };
    Router::new()
        .route("/control/pause", command(Command::Pause))
        .route("/control/resume", command(Command::Resume))
        .route("/control/drain", command(Command::Drain))
        .route("/control/reload", reload)
        .route("/control/status", status)
}

/// The state, the positions and the in-flight count, as `ctl status --json` prints
/// them.
pub fn status_json(control: &Control, health: &Health) -> String {
    let state = control.state();
    let (since, seconds) = match state {
        RunState::Paused { since } => (
            Some(humantime::format_rfc3339_seconds(since).to_string()),
            Some(
                SystemTime::now()
                    .duration_since(since)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
            ),
        ),
        _ => (None, None),
    };
    let publisher = health.publisher();
    let value = serde_json::json!({
        "state": state.name(),
        "paused_since": since,
        "paused_seconds": seconds,
        "connected": health.ready(),
        "acked_lsn": publisher.as_ref().map(|p| p.acked_lsn().to_string()),
        "confirmed_lsn": health.confirmed().map(|l| l.to_string()),
        "in_flight": publisher.as_ref().map(|p| p.in_flight()),
    });
    format!("{value}\n")
}
