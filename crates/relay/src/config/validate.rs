//! Checks of the values that serde cannot express: [`Config::validate`] and the
//! checks of single values (names, the Postgres URL) it uses; `[mapping]` and
//! `[rabbitmq]` are checked by their owners ([`wal_reader::MappingConfig::validate`],
//! [`publisher::settings::RabbitMqConfig::validate`]). Each error names its key and
//! never quotes a URL.

use outbox_event::redact::quoted_scheme;
use secrecy::ExposeSecret;
use wal_reader::{PgConnectOptions, TableName};

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
        let pg = &self.postgres;
        check(validate_pg_url(pg.url.expose_secret()));
        check(validate_identifier("postgres.slot", &pg.slot, true));
        check(validate_identifier(
            "postgres.publication",
            &pg.publication,
            false,
        ));
        check(validate_tables(&pg.tables));

        for (key, reason) in self.mapping.validate() {
            check(Err(ConfigError::invalid(&format!("mapping.{key}"), reason)));
        }

        for e in self.rabbitmq.validate() {
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
        errors
    }

    /// Settings that are valid but do nothing, or less than they seem to: each a
    /// sentence for the log and for `check`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let r = &self.rabbitmq;
        if let Some(stream) = self.stream() {
            if !r.dead_letter_exchange.is_empty() {
                out.push(format!(
                    "[rabbitmq] dead_letter_exchange = {:?} is ignored: events go to the stream {stream}, where nothing is unroutable; remove it, or set stream = \"\" to publish to the exchange",
                    r.dead_letter_exchange
                ));
            }
        }
        out
    }
}

/// `postgres.tables`: at least one, each a table name.
fn validate_tables(tables: &[String]) -> Result<(), ConfigError> {
    if tables.is_empty() {
        return Err(ConfigError::invalid(
            "postgres.tables",
            "the list is empty: name at least one outbox table, e.g. [\"public.outbox\"]",
        ));
    }
    for t in tables {
        if TableName::parse(t).is_none() {
            return Err(ConfigError::invalid(
                "postgres.tables",
                format!("{t:?} is not a table name: use \"schema.table\" or \"table\""),
            ));
        }
    }
    Ok(())
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

pub(super) fn validate_pg_url(url: &str) -> Result<(), ConfigError> {
    const KEY: &str = "postgres.url";
    if url.trim().is_empty() {
        return Err(ConfigError::invalid(
            KEY,
            "it is empty: set a URL like postgresql://user@host:5432/db or a conninfo like \"host=... dbname=...\"",
        ));
    }
    if let Some((scheme, _)) = url.split_once("://") {
        if scheme != "postgresql" && scheme != "postgres" {
            return Err(ConfigError::invalid(
                KEY,
                format!(
                    "the URL scheme {}is not postgresql:// or postgres://: fix the URL",
                    quoted_scheme(scheme)
                ),
            ));
        }
    } else if !url.contains('=') {
        return Err(ConfigError::invalid(
            KEY,
            "it is neither a postgresql:// URL nor key=value conninfo: fix it",
        ));
    }
    // Every parameter is read now, as at connect (the message names parameters,
    // never values).
    PgConnectOptions::parse(url)
        .map(|_| ())
        .map_err(|e| ConfigError::invalid(KEY, e.0))
}

/// Slot names: lower-case letters, digits, underscores, at most 63 bytes. Publications:
/// any non-empty name of at most 63 bytes (it is quoted when used).
pub(super) fn validate_identifier(
    key: &str,
    value: &str,
    slot_rules: bool,
) -> Result<(), ConfigError> {
    if value.is_empty() || value.len() > 63 {
        return Err(ConfigError::invalid(
            key,
            format!("{value:?} must be 1 to 63 bytes long: choose another name"),
        ));
    }
    if slot_rules
        && !value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(ConfigError::invalid(
            key,
            format!("{value:?} is not a valid slot name: use only lower-case letters, digits and underscores"),
        ));
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
