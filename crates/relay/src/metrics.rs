//! Prometheus `/metrics`, `/healthz` and `/readyz` on `[relay] metrics_listen`,
//! served by crate::endpoint (timeouts, connection cap, credentials, TLS).

use axum::http::StatusCode;
use axum::routing::get;
use axum::{Extension, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::Instrument;

use crate::control::{Control, RunState};
use crate::endpoint::auth::Authorized;
use crate::endpoint::control::Live;
use crate::endpoint::EndpointConfig;
use crate::error::CliError;
use crate::health::Health;

/// Buckets of the commit → ack latency histogram, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Installs the Prometheus recorder and serves the endpoints in the background.
pub async fn serve(endpoint: EndpointConfig, health: Health, live: Live) -> Result<(), CliError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("outbox_relay_publish_latency_seconds".into()),
            LATENCY_BUCKETS,
        )
        .map_err(|e| CliError::Runtime(format!("cannot configure metric buckets: {e}")))?
        .install_recorder()
        .map_err(|e| CliError::Runtime(format!("cannot install the metrics recorder: {e}")))?;
    describe();
    spawn_gauges(health.clone(), live.control.clone());
    let addr = endpoint.addr;
    let control = crate::endpoint::control::routes(live.clone(), health.clone());
    crate::endpoint::serve(
        endpoint,
        router(handle, health, live.control).merge(control),
    )
    .await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz and /control/");
    Ok(())
}

fn router(handle: PrometheusHandle, health: Health, control: Control) -> Router {
    let gauges = health.clone();
    let gauges_control = control.clone();
    let poison = health.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                update_gauges(&gauges, &gauges_control);
                std::future::ready(handle.render())
            }),
        )
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route(
            "/readyz",
            get(
                move |Extension(Authorized(authorized)): Extension<Authorized>| {
                    let paused = matches!(control.state(), RunState::Paused { .. });
                    let ready = health.ready() && !paused;
                    // Without credentials (when some are configured): ready or not only.
                    let reason = (!ready && !paused && authorized)
                        .then(|| not_ready_reason(&health))
                        .flatten();
                    std::future::ready(match (ready, reason) {
                        (true, _) => (StatusCode::OK, "ready\n".to_string()),
                        // A deliberate state, no secret: said to everyone.
                        (false, _) if paused => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "not ready: paused\n".to_string(),
                        ),
                        (false, Some(reason)) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {reason}\n"),
                        ),
                        (false, None) => {
                            (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_string())
                        }
                    })
                },
            ),
        )
        .route(
            "/poison",
            get(move || std::future::ready(poison_json(&poison))),
        )
}

/// Why the relay is not ready (docs/operations.md, "Health"): a message the broker
/// refuses, a stall (events wait and nothing is confirmed for `stall_after`), the
/// broker blocking publishers, the publisher connecting, the reader not streaming.
/// Text from rows and the broker is escaped.
fn not_ready_reason(health: &Health) -> Option<String> {
    use outbox_event::redact::printable;
    let publisher = health.publisher();
    if let Some(p) = publisher.as_ref().and_then(|p| p.poison()) {
        return Some(format!(
            "rabbitmq refuses message {} ({})",
            printable(&p.message_id),
            printable(&p.reason)
        ));
    }
    if let Some(stall) = publisher.as_ref().and_then(|p| p.stalled()) {
        return Some(format!("stalled: {stall}"));
    }
    match publisher {
        Some(p) if p.blocked() => {
            Some("blocked: rabbitmq blocks publishing (a resource alarm)".into())
        }
        Some(p) if !p.connected() => Some("connecting to rabbitmq".into()),
        None => Some("connecting".into()),
        Some(_) => Some("not streaming from postgres".into()),
    }
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
    describe_counters();
    describe_state();
    describe_features();
    build_info();
}

/// The event counters, by outcome, and the reconnect and fallback counters.
fn describe_counters() {
    use metrics::{describe_counter, Unit};
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
            p::EVENTS_UNFIT,
            "events AMQP cannot carry (content header over the frame size): poison, never sent",
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
        wal_reader::messages::MESSAGES_IGNORED,
        Unit::Count,
        "logical messages not relayed, by reason (non_transactional: a relayed prefix emitted outside its transaction; other_prefix: another tool's messages)"
    );
    for reason in ["non_transactional", "other_prefix"] {
        metrics::counter!(wal_reader::messages::MESSAGES_IGNORED, "reason" => reason).increment(0);
    }
    describe_counter!(
        p::RECONNECTS,
        Unit::Count,
        "reconnects, by side (postgres, rabbitmq)"
    );
    for side in ["postgres", "rabbitmq"] {
        metrics::counter!(p::RECONNECTS, "side" => side).increment(0);
    }
    describe_counter!(
        crate::pipeline::POSITION_FALLBACKS,
        Unit::Count,
        "stored or carried positions a session start refused because they belong to another WAL history or are past the server's WAL, by position (stored, carried)"
    );
    for position in ["stored", "carried"] {
        metrics::counter!(crate::pipeline::POSITION_FALLBACKS, "position" => position).increment(0);
    }
}

/// The publisher's and the relay's state: in flight, positions, poison, stalls, pause, readiness.
fn describe_state() {
    use metrics::{describe_gauge, describe_histogram, Unit};
    use publisher::status as p;

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
        p::STALLED_SECONDS,
        Unit::Seconds,
        "how long events have waited with nothing confirmed, once that is [rabbitmq] stall_after or longer; 0 otherwise"
    );
    metrics::gauge!(p::STALLED_SECONDS).set(0.0);
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
    describe_gauge!(
        PAUSED,
        "1 while `ctl pause` holds publishing (the slot stays held)"
    );
    describe_gauge!(
        PAUSED_SECONDS,
        "how long the current pause has lasted, in seconds (0 when not paused)"
    );
    describe_gauge!(
        crate::reload::PAUSE_ALERT_AFTER,
        "[relay] pause_alert_after in seconds (+Inf: none): OutboxRelayPausedTooLong fires past it"
    );
    describe_gauge!(
        BROKER_BLOCKED,
        "1 while RabbitMQ blocks the relay's connection (a memory or disk alarm), else 0"
    );
    describe_gauge!(
        TARGET_INFO,
        "always 1; labels: target (exchange or stream) and name, where the relay publishes"
    );
    describe_histogram!(
        p::PUBLISH_LATENCY,
        Unit::Seconds,
        "commit to broker ack, per event"
    );
}

/// The slot's WAL, the replay window, skips, retention and tracing.
fn describe_features() {
    use metrics::{describe_counter, describe_gauge, Unit};

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
    describe_gauge!(
        crate::anchor::REPLAY_WINDOW_RETAINED_WAL,
        Unit::Bytes,
        "WAL the replay window's anchor slot retains (with [relay] replay_window)"
    );
    describe_counter!(
        crate::commands::skip::SKIPPED_EVENTS,
        Unit::Count,
        "events skipped by `run --skip-through` (never published)"
    );
    metrics::counter!(crate::commands::skip::SKIPPED_EVENTS).increment(0);
    describe_counter!(
        crate::retention::DELETED_ROWS,
        Unit::Count,
        "confirmed outbox rows deleted by retention, by table (with [retention] keep)"
    );
    describe_counter!(
        crate::telemetry::SPANS_DROPPED,
        Unit::Count,
        "trace spans not exported: the export queue was full or the OTLP receiver did not take them (with [tracing] on)"
    );
    metrics::counter!(crate::telemetry::SPANS_DROPPED).increment(0);
    describe_counter!(
        crate::telemetry::SPANS_EXPORTED,
        Unit::Count,
        "trace spans the OTLP receiver accepted (with [tracing] on)"
    );
    metrics::counter!(crate::telemetry::SPANS_EXPORTED).increment(0);
}

/// The metric naming the running binary.
const BUILD_INFO: &str = "outbox_relay_build_info";

/// `outbox_relay_build_info{version, git_sha, target} 1`: which build runs where
/// (join it on `instance` to label other series with the version).
fn build_info() {
    use crate::build_info::{GIT_SHA, TARGET, VERSION};
    metrics::describe_gauge!(
        BUILD_INFO,
        "always 1; its labels name the running binary's version, git commit and target"
    );
    metrics::gauge!(BUILD_INFO, "version" => VERSION, "git_sha" => GIT_SHA, "target" => TARGET)
        .set(1.0);
}

/// Gauges derived from live state, set at every scrape (so a scrape never sees a
/// stale value) and every second (for recorders that are read otherwise).
fn update_gauges(health: &Health, control: &Control) {
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
    let (paused, paused_for) = match control.state() {
        RunState::Paused { since } => (
            true,
            std::time::SystemTime::now()
                .duration_since(since)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        ),
        _ => (false, 0.0),
    };
    let ready = health.ready() && !paused;
    metrics::gauge!("outbox_relay_ready").set(if ready { 1.0 } else { 0.0 });
    metrics::gauge!(PAUSED).set(if paused { 1.0 } else { 0.0 });
    metrics::gauge!(PAUSED_SECONDS).set(paused_for);
    let blocked = health.publisher().is_some_and(|p| p.blocked());
    metrics::gauge!(BROKER_BLOCKED).set(if blocked { 1.0 } else { 0.0 });
}

/// Gauge: 1 while `ctl pause` holds publishing.
const PAUSED: &str = "outbox_relay_paused";
/// Gauge: how long the current pause has lasted (0 when not paused).
const PAUSED_SECONDS: &str = "outbox_relay_paused_seconds";
/// Gauge: the broker blocks publishing (derived from the publisher's status).
const BROKER_BLOCKED: &str = "outbox_relay_broker_blocked";
/// Gauge: where the relay publishes, as labels.
const TARGET_INFO: &str = "outbox_relay_target_info";

/// `outbox_relay_target_info{target, name} 1`: `target="stream"` with the stream's
/// name, or `target="exchange"` with the exchange's, for dashboards to tell the two
/// kinds of relay apart (`run` sets it once, from the configuration).
pub fn set_target(stream: Option<&str>, exchange: &str) {
    let (target, name) = match stream {
        Some(s) => ("stream", s.to_string()),
        None => ("exchange", exchange.to_string()),
    };
    metrics::gauge!(TARGET_INFO, "target" => target, "name" => name).set(1.0);
}

fn spawn_gauges(health: Health, control: Control) {
    let task = async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            update_gauges(&health, &control);
        }
    }
    .instrument(tracing::info_span!("gauges"));
    tokio::spawn(task);
}

#[cfg(test)]
mod tests {
    //! The metrics the binary registers, against docs/operations.md's table and the
    //! metric names in the sources: neither may drift from `describe()`.

    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    /// Records what `describe()` declares: metric name → type.
    #[derive(Default)]
    struct Declared(Mutex<BTreeMap<String, &'static str>>);

    impl Declared {
        fn add(&self, name: KeyName, kind: &'static str) {
            let prev = self
                .0
                .lock()
                .expect("not poisoned")
                .insert(name.as_str().to_string(), kind);
            assert!(
                prev.is_none() || prev == Some(kind),
                "{} declared twice with different types",
                name.as_str()
            );
        }
    }

    impl Recorder for Declared {
        fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "counter");
        }
        fn describe_gauge(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "gauge");
        }
        fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "histogram");
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    fn declared() -> BTreeMap<String, &'static str> {
        let rec = Declared::default();
        metrics::with_local_recorder(&rec, super::describe);
        rec.0.into_inner().expect("not poisoned")
    }

    fn repo_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// The rows of docs/operations.md's metrics table: `| \`name{labels}\` | type | …`.
    fn documented(text: &str) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if cells.len() < 4 || !cells[1].starts_with("`outbox_relay_") {
                continue;
            }
            let name = cells[1].trim_matches('`');
            let name = name.split('{').next().unwrap_or(name);
            out.insert(name.to_string(), cells[2].to_string());
        }
        out
    }

    #[test]
    fn the_docs_table_lists_exactly_the_registered_metrics() {
        let declared = declared();
        let path = repo_root().join("docs/operations.md");
        let text = std::fs::read_to_string(&path).expect("docs/operations.md");
        let docs = documented(&text);
        assert!(
            declared.len() >= 15,
            "describe() declares only {declared:?}"
        );
        let mut problems = Vec::new();
        for (name, kind) in &declared {
            match docs.get(name) {
                None => problems.push(format!("{name} ({kind}) is not in the table")),
                Some(d) if d != kind => {
                    problems.push(format!("{name} is a {kind}, the table says {d}"))
                }
                Some(_) => {}
            }
        }
        for name in docs.keys() {
            if !declared.contains_key(name) {
                problems.push(format!(
                    "{name} is in the table but the relay does not register it"
                ));
            }
        }
        assert!(
            problems.is_empty(),
            "docs/operations.md's metrics table and describe() differ:\n  {}",
            problems.join("\n  ")
        );
    }

    /// Every metric name written in the sources (a `"outbox_relay_…"` literal that
    /// is not the state table's name) is declared, so a metric added to the code
    /// without a HELP text and a docs row fails here.
    #[test]
    fn every_metric_name_in_the_sources_is_declared() {
        let declared = declared();
        let mut files = Vec::new();
        for krate in ["relay", "publisher", "wal-reader"] {
            collect_rs(
                &repo_root().join("crates").join(krate).join("src"),
                &mut files,
            );
        }
        assert!(files.len() > 20, "found only {} source files", files.len());
        let mut missing = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).expect("source file");
            for name in literals(&text) {
                if name != "outbox_relay_state" && !declared.contains_key(&name) {
                    missing.push(format!("{name} ({})", file.display()));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "metric names used in the code but not declared in metrics::describe(): {missing:?}"
        );
    }

    /// `"outbox_relay_[a-z_]+"` string literals of a source file.
    fn literals(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (i, _) in text.match_indices("\"outbox_relay_") {
            let rest = &text[i + 1..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(rest.len());
            if end > "outbox_relay_".len() && rest[end..].starts_with('"') {
                out.push(rest[..end].to_string());
            }
        }
        out
    }

    fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("source dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                collect_rs(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn build_info_is_one_with_version_commit_and_target() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, super::build_info);
        let text = handle.render();
        let want = format!(
            "outbox_relay_build_info{{version=\"{}\",git_sha=\"{}\",target=\"{}\"}} 1",
            crate::build_info::VERSION,
            crate::build_info::GIT_SHA,
            crate::build_info::TARGET
        );
        assert!(text.contains(&want), "{want} not in:\n{text}");
        assert_eq!(crate::build_info::VERSION, env!("CARGO_PKG_VERSION"));
        assert!(!crate::build_info::TARGET.is_empty());
    }
}
