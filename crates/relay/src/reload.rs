//! Reloading the configuration of a running relay (SIGHUP, `ctl reload`;
//! docs/design.md §9):
//!
//! ```text
//!   Config::load(the same file, the same environment)
//!     invalid ─► every error logged; the running configuration stays
//!     valid   ─► each key whose value changed:
//!                  relay.log_filter, relay.pause_alert_after,
//!                  retention.keep (while retention runs)   ─► applied now
//!                  anything else (slot, url, tables, …)    ─► "needs a restart",
//!                                                             named, not applied
//!             ─► every secret file of the running configuration read again
//!                (the tracing headers file into the running export)
//! ```
//!
//! Secret files (`[rabbitmq] password_file`, `stream_password_file`,
//! `management_password_file`, the endpoint's credential files, a libpq
//! `passfile`) are read at every connection or request anyway, so the next
//! connection uses a rotated one; the reload reads each to report one that became
//! unreadable before a reconnect needs it. `[tracing] headers_file` is the
//! exception: its headers go with every export request, so the reload reads it into
//! the running export (crate::telemetry). A changed *path* is a changed key: it
//! needs a restart.
//!
//! A key that needs a restart keeps its running value, and is reported again by the
//! next reload until the relay restarts; nothing of it is applied, so the running
//! configuration never mixes two files' values of a setting that cannot change.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use tracing::{error, info, warn};

use crate::config::Config;

/// The keys a reload applies to the running relay.
pub const LIVE_KEYS: &[&str] = &[
    "relay.log_filter",
    "relay.pause_alert_after",
    "retention.keep",
];

/// Gauge: `[relay] pause_alert_after` in seconds (+Inf: no alert).
pub const PAUSE_ALERT_AFTER: &str = "outbox_relay_pause_alert_after_seconds";

/// What one reload did; keys only, never values.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Report {
    /// Keys whose new value is in effect.
    pub applied: Vec<String>,
    /// Keys that changed but need a restart; their running values stay.
    pub needs_restart: Vec<String>,
    /// Secret files read again, by key.
    pub secret_files: Vec<String>,
    /// Why the file was refused (then nothing changed), or a secret file that
    /// cannot be read.
    pub errors: Vec<String>,
}

/// What the running relay was configured with.
struct Running {
    fingerprint: BTreeMap<String, u64>,
    retention_on: bool,
    secret_files: Vec<(&'static str, String)>,
}

/// Reloads the file `run` was started with.
pub struct Reloader {
    path: Option<PathBuf>,
    running: Mutex<Running>,
}

impl Reloader {
    /// For the configuration `cfg`, loaded from `path` (`--config`).
    pub fn new(path: Option<PathBuf>, cfg: &Config) -> Reloader {
        set_pause_alert_after(cfg.relay.pause_alert_after);
        Reloader {
            path,
            running: Mutex::new(Running {
                fingerprint: cfg.fingerprint.0.clone(),
                retention_on: cfg.retention_keep().is_some(),
                secret_files: secret_files(cfg),
            }),
        }
    }

    /// Reads the file again and applies what may change live; logs the outcome.
    pub fn reload(&self) -> Report {
        let mut report = Report::default();
        let cfg = match Config::load(self.path.as_deref()) {
            Ok(cfg) => cfg,
            Err(e) => {
                for each in e.each() {
                    error!(error = %each, "reload: the configuration is invalid");
                    report.errors.push(each.to_string());
                }
                warn!(
                    errors = report.errors.len(),
                    "reload refused: the running configuration stays; fix the file and reload again"
                );
                return report;
            }
        };
        let Ok(mut running) = self.running.lock() else {
            report
                .errors
                .push("the reload state is unusable after a panic: restart the relay".into());
            return report;
        };
        let keys: BTreeSet<&String> = running
            .fingerprint
            .keys()
            .chain(cfg.fingerprint.0.keys())
            .collect();
        let changed: Vec<String> = keys
            .into_iter()
            .filter(|k| running.fingerprint.get(*k) != cfg.fingerprint.0.get(*k))
            .cloned()
            .collect();
        for key in changed {
            match apply(&key, &cfg, running.retention_on) {
                Ok(()) => {
                    match cfg.fingerprint.0.get(&key) {
                        Some(v) => running.fingerprint.insert(key.clone(), *v),
                        None => running.fingerprint.remove(&key),
                    };
                    report.applied.push(key);
                }
                Err(Some(why)) => report.errors.push(format!("{key}: {why}")),
                Err(None) => report.needs_restart.push(key),
            }
        }
        for (key, path) in &running.secret_files {
            let read = match *key {
                // The export's headers are replaced now: they are sent with every
                // request, not read at each.
                "tracing.headers_file" => crate::telemetry::reload_headers(path),
                _ => crate::endpoint::auth::read_secret(std::path::Path::new(path)).map(drop),
            };
            match read {
                Ok(()) => report.secret_files.push((*key).to_string()),
                Err(why) => report.errors.push(format!(
                    "cannot read {key} {path} ({why}): the next connection that needs it fails until it holds the secret"
                )),
            }
        }
        drop(running);
        log(&report);
        report
    }
}

/// Applies one changed key: `Err(None)` when it needs a restart, `Err(Some(why))`
/// when applying it failed.
fn apply(key: &str, cfg: &Config, retention_on: bool) -> Result<(), Option<String>> {
    if !LIVE_KEYS.contains(&key) {
        return Err(None);
    }
    match key {
        "relay.log_filter" => crate::logging::set_filter(&cfg.relay.log_filter).map_err(Some),
        "relay.pause_alert_after" => {
            set_pause_alert_after(cfg.relay.pause_alert_after);
            Ok(())
        }
        // Turning retention on needs the preflight of its column and privilege,
        // and off the end of its task: both at a start.
        "retention.keep" => match cfg.retention_keep() {
            Some(keep) if retention_on => {
                crate::retention::set_keep(keep);
                Ok(())
            }
            _ => Err(None),
        },
        _ => Err(None),
    }
}

fn log(report: &Report) {
    for key in &report.needs_restart {
        warn!(%key, "reload: {key} changed and needs a restart: the running value stays until the relay is restarted");
    }
    for e in &report.errors {
        error!(error = %e, "reload");
    }
    info!(
        applied = ?report.applied,
        needs_restart = ?report.needs_restart,
        secret_files = ?report.secret_files,
        "configuration reloaded"
    );
}

/// Exports `[relay] pause_alert_after` for the alert (+Inf when off).
pub fn set_pause_alert_after(after: Option<Duration>) {
    metrics::gauge!(PAUSE_ALERT_AFTER).set(after.map_or(f64::INFINITY, |d| d.as_secs_f64()));
}

/// The secret files the running relay reads, by key (docs/security.md).
fn secret_files(cfg: &Config) -> Vec<(&'static str, String)> {
    let mut files: Vec<(&'static str, String)> = cfg
        .credential_files()
        .into_iter()
        .map(|(key, path)| (key, path.to_string()))
        .collect();
    if let Ok(pg) = cfg.pg_options() {
        if let Some(passfile) = pg.passfile.as_ref().filter(|p| p.is_file()) {
            files.push(("postgres.url passfile", passfile.display().to_string()));
        }
    }
    files.retain(|(_, path)| !path.is_empty());
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_live_keys_apply() {
        let cfg = Config::default();
        assert_eq!(apply("postgres.slot", &cfg, true), Err(None));
        assert_eq!(apply("rabbitmq.url", &cfg, true), Err(None));
        // retention.keep "" (off) while on: a restart.
        assert_eq!(apply("retention.keep", &cfg, true), Err(None));
        assert_eq!(apply("relay.pause_alert_after", &cfg, false), Ok(()));
        assert!(LIVE_KEYS.contains(&"relay.log_filter"));
    }
}
