//! The control routes of the endpoint (`ctl`, docs/operations.md "Incident
//! levers"), beside `/metrics` on the same listener, credentials and TLS:
//!
//! ```text
//!   POST /control/pause    POST /control/resume    POST /control/drain
//!   POST /control/reload   GET  /control/status
//! ```
//!
//! crate::endpoint::guard checks every `/control/` request first: its Host, its
//! origin and shape (a POST carries `X-Outbox-Relay-Control`, no form body), and the
//! configured credentials or this start's control token; it refuses control on a
//! listener beyond loopback without credentials, and answers `GET /control/proof`
//! itself. Answers are JSON; a refused command is 409 with `{"error": …}`. The
//! status names the process (`pid`, `process_start`), so that `ctl drain --wait`
//! watches the process instead of asking the port again.

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
        "pid": std::process::id(),
        "process_start": process_start(std::process::id()),
    });
    format!("{value}\n")
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`, field
/// 22): with the pid, it names one process even after the pid is reused. `None` when
/// the process is not visible (another pid namespace, no `/proc`) or has exited (a
/// zombie its parent has not reaped yet has exited).
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) is in parentheses and may hold spaces: count after it.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_process_is_named_by_its_start_until_it_exits() {
        let me = super::process_start(std::process::id());
        assert!(me.is_some_and(|t| t > 0));
        assert_eq!(super::process_start(std::process::id()), me);
        let mut child = std::process::Command::new("true")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // Exited but not reaped (a zombie): gone already.
        while super::process_start(pid).is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "a zombie counts as running"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = child.wait();
        assert_eq!(super::process_start(u32::MAX), None);
    }
}
