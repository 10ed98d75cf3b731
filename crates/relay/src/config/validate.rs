//! Checks of the values that serde cannot express: [`Config::validate`] and the
//! checks of the relay's own sections it uses; `[postgres]`, `[mapping]` and
//! `[rabbitmq]` are checked by their owners ([`wal_reader::PostgresConfig::validate`],
//! [`wal_reader::MappingConfig::validate`],
//! [`publisher::settings::RabbitMqConfig::validate`]). Each error names its key and
//! never quotes a URL.

use publisher::message::cloudevents::validate_source;

use super::{Config, ConfigError, MIN_STATUS_INTERVAL_MS};

impl Config {
    /// Checks the values serde cannot: ranges, names, the routing key template, the
    /// URLs' schemes and query parameters. Every offending key is reported.
    pub fn validate_all(&self) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        let mut check = |r: Result<(), ConfigError>| {
            if let Err(e) = r {
                errors.push(e);
            }
        };
        // The components' own sections, in the order of the file.
        let owned = (self.postgres.validate().into_iter())
            .chain(self.mapping.validate())
            .chain(self.rabbitmq.validate())
            .chain(self.topology.validate(&self.rabbitmq));
        for e in owned {
            check(Err(ConfigError::invalid(e.key, e.reason)));
        }
        if let Err(e) = validate_source(&self.message.cloudevents_source) {
            check(Err(ConfigError::invalid(
                "message.cloudevents_source",
                e.to_string(),
            )));
        }
        if self.relay.status_interval_ms < MIN_STATUS_INTERVAL_MS {
            check(Err(ConfigError::invalid(
                "relay.status_interval_ms",
                format!(
                    "{} is too small: use at least {MIN_STATUS_INTERVAL_MS} (milliseconds)",
                    self.relay.status_interval_ms
                ),
            )));
        }
        check(validate_metrics_endpoint(&self.relay));
        check(validate_tracing(&self.tracing));
        if !self.relay.log_filter.trim().is_empty() {
            if let Err(e) = crate::logging::parse_filter(&self.relay.log_filter) {
                check(Err(ConfigError::invalid(
                    "relay.log_filter",
                    format!("is not a valid log filter ({e}): use a level such as info or debug, or directives such as \"info,outbox_relay=debug\""),
                )));
            }
        }
        if self.relay.pause_alert_after.is_some_and(|d| d.is_zero()) {
            check(Err(ConfigError::invalid(
                "relay.pause_alert_after",
                "must be more than 0: use e.g. \"1h\", or \"\" for no pause alert",
            )));
        }
        errors
    }

    /// Settings that are valid but do nothing, or less than they seem to: each a
    /// sentence for the log and for `check`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let r = &self.rabbitmq;
        if let Some(stream) = self.stream() {
            if r.declare_topology && !self.topology.is_empty() {
                out.push(format!(
                    "[rabbitmq] declare_topology = true is ignored: events go to the stream {stream} over the stream protocol, which declares no [topology]; declare it with `check --declare`, or set stream = \"\""
                ));
            }
            if !r.dead_letter_exchange.is_empty() {
                out.push(format!(
                    "[rabbitmq] dead_letter_exchange = {:?} is ignored: events go to the stream {stream}, where nothing is unroutable; remove it, or set stream = \"\" to publish to the exchange",
                    r.dead_letter_exchange
                ));
            }
        }
        if r.declare_topology && self.topology.is_empty() {
            out.push(
                "[rabbitmq] declare_topology = true declares nothing: [topology] is empty (it is read from the file only); add [[topology.exchange]] / [[topology.queue]] tables, or remove declare_topology".to_string(),
            );
        }
        out
    }
}

/// The metrics endpoint's limits and credentials (`relay.metrics_*`).
fn validate_metrics_endpoint(r: &super::RelayConfig) -> Result<(), ConfigError> {
    if r.metrics_read_timeout_ms < 100 {
        return Err(ConfigError::invalid(
            "relay.metrics_read_timeout_ms",
            "must be at least 100 (milliseconds): Prometheus sends a request at once, so a few seconds is plenty",
        ));
    }
    if r.metrics_max_connections < 1 {
        return Err(ConfigError::invalid(
            "relay.metrics_max_connections",
            "must be at least 1: allow a few connections per scraper, e.g. 64",
        ));
    }
    let pairs = [
        (
            "relay.metrics_basic_auth_user",
            &r.metrics_basic_auth_user,
            "relay.metrics_basic_auth_password_file",
            &r.metrics_basic_auth_password_file,
        ),
        (
            "relay.metrics_tls_cert_file",
            &r.metrics_tls_cert_file,
            "relay.metrics_tls_key_file",
            &r.metrics_tls_key_file,
        ),
    ];
    for name in &r.metrics_allowed_hosts {
        let n = name.trim();
        let bad = n.is_empty()
            || (n != "*"
                && !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'));
        if bad {
            return Err(ConfigError::invalid(
                "relay.metrics_allowed_hosts",
                format!(
                    "{} is not a host name: list names without port or scheme, e.g. [\"relay\", \"relay.example\"], or \"*\" for any",
                    outbox_event::redact::printable(&format!("{n:?}"))
                ),
            ));
        }
    }
    for (a, va, b, vb) in pairs {
        if va.is_empty() != vb.is_empty() {
            let (set, missing) = if va.is_empty() { (b, a) } else { (a, b) };
            return Err(ConfigError::invalid(
                missing,
                format!("{set} is set but {missing} is not: set both, or neither"),
            ));
        }
    }
    Ok(())
}

/// Checks that every `{...}` in the template is a known placeholder and braces balance
/// (the publisher's check, [`publisher::settings::check_routing_key`], as
/// [`Config::validate_all`] reports it; its tests call it alone).
#[cfg(test)]
pub fn validate_routing_key(template: &str) -> Result<(), ConfigError> {
    publisher::settings::check_routing_key(template)
        .map_err(|reason| ConfigError::invalid("rabbitmq.routing_key", reason))
}

/// `[tracing]`: the ratio is a share, the queue holds at least one span, the
/// endpoint is an HTTP URL (never quoted: it may hold credentials), and not plain
/// http:// beyond loopback when headers go with it (docs/security.md).
fn validate_tracing(t: &super::TracingConfig) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&t.sampling_ratio) {
        return Err(ConfigError::invalid(
            "tracing.sampling_ratio",
            format!(
                "{} is not a share of traces: use a number from 0.0 (none) to 1.0 (all)",
                t.sampling_ratio
            ),
        ));
    }
    if t.max_queue_size == 0 {
        return Err(ConfigError::invalid(
            "tracing.max_queue_size",
            "must be at least 1: set the number of spans that may wait for export, e.g. 8192",
        ));
    }
    let endpoint = t.endpoint.trim();
    let http = endpoint.starts_with("http://") || endpoint.starts_with("https://");
    if !endpoint.is_empty() && !http {
        return Err(ConfigError::invalid(
            "tracing.endpoint",
            "is not an http:// or https:// URL: set the OTLP/HTTP receiver, e.g. \"http://collector:4318\"",
        ));
    }
    // The endpoint of the OTEL_* variables is checked when the export starts.
    if !t.headers_file.is_empty() {
        let why = super::plain_http::tracing_headers_in_clear(
            endpoint,
            t.allow_insecure_http,
            "tracing.headers_file",
        );
        if let Some(why) = why {
            return Err(ConfigError::invalid("tracing.endpoint", why));
        }
    }
    Ok(())
}
