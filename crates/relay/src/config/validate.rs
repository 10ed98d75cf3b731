//! Checks of the values that serde cannot express: [`Config::validate`] and the
//! checks of single values (names, URL schemes, the routing key template) it uses.
//! Each error names its key and never quotes a URL.

use std::path::Path;

use secrecy::ExposeSecret;
use wal_reader::{PgConnectOptions, TableName};

use super::error::closest;
use publisher::message::cloudevents::validate_source;
use publisher::message::{RoutingKeyError, RoutingKeyTemplate, PLACEHOLDERS};

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

        let r = &self.rabbitmq;
        if r.url.is_empty() {
            check(Err(ConfigError::invalid(
                "rabbitmq.url",
                "the list is empty: give at least one amqp:// or amqps:// URL",
            )));
        }
        for (i, u) in r.url.iter().enumerate() {
            check(validate_amqp_url(u.expose_secret(), i, r.heartbeat_secs));
        }
        if r.declare_exchange && r.exchange.is_empty() {
            check(Err(ConfigError::invalid(
                "rabbitmq.exchange",
                "the default exchange \"\" cannot be declared: name an exchange, or set declare_exchange = false to publish to the default exchange",
            )));
        }
        check(validate_routing_key(&r.routing_key));
        check(
            publisher::check_max_in_flight(r.max_in_flight)
                .map_err(|reason| ConfigError::invalid("rabbitmq.max_in_flight", reason)),
        );
        if !r.ca_file.is_empty() && !Path::new(&r.ca_file).is_file() {
            check(Err(ConfigError::invalid(
                "rabbitmq.ca_file",
                format!(
                    "{:?} is not a file: name a PEM file of CA certificates, or \"\" for the system roots",
                    r.ca_file
                ),
            )));
        }
        check(validate_client_files(r));
        if r.heartbeat_secs > u64::from(u16::MAX) {
            check(Err(ConfigError::invalid(
                "rabbitmq.heartbeat_secs",
                format!(
                    "{} is too large: use at most 65535 (seconds), or 0 for the broker's value",
                    r.heartbeat_secs
                ),
            )));
        }

        if !r.stream.is_empty() {
            check(validate_stream_name(&r.stream));
            if r.stream_url.is_empty() {
                check(Err(ConfigError::invalid(
                    "rabbitmq.stream_url",
                    "the list is empty: give at least one rabbitmq-stream:// or rabbitmq-stream+tls:// URL",
                )));
            }
            for (i, u) in r.stream_url.iter().enumerate() {
                check(validate_stream_url(u.expose_secret(), i));
            }
        }
        // The broker's producer references are short strings; the relay adds
        // `/tl<timeline>/e<epoch>` to this one.
        if r.producer_name.len() > 200 || r.producer_name.chars().any(char::is_control) {
            check(Err(ConfigError::invalid(
                "rabbitmq.producer_name",
                "use at most 200 bytes and no control characters, or \"\" to derive it from the source",
            )));
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

/// The client certificate comes with its key, and the files named exist (their
/// contents are checked at connect, where they are read).
fn validate_client_files(r: &super::RabbitMqConfig) -> Result<(), ConfigError> {
    if r.cert_file.is_empty() != r.key_file.is_empty() {
        let (set, missing) = if r.cert_file.is_empty() {
            ("rabbitmq.key_file", "rabbitmq.cert_file")
        } else {
            ("rabbitmq.cert_file", "rabbitmq.key_file")
        };
        return Err(ConfigError::invalid(
            missing,
            format!("{set} is set but {missing} is not: set both, or neither"),
        ));
    }
    for (key, value) in [
        ("rabbitmq.cert_file", &r.cert_file),
        ("rabbitmq.key_file", &r.key_file),
        ("rabbitmq.password_file", &r.password_file),
        ("rabbitmq.stream_password_file", &r.stream_password_file),
    ] {
        if !value.is_empty() && !Path::new(value).is_file() {
            return Err(ConfigError::invalid(
                key,
                format!("{value:?} is not a file: name a readable file, or \"\" for none"),
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

pub(super) fn validate_amqp_url(
    url: &str,
    index: usize,
    heartbeat_secs: u64,
) -> Result<(), ConfigError> {
    const KEY: &str = "rabbitmq.url";
    let which = format!("URL #{}", index + 1);
    match url.split_once("://") {
        Some(("amqp" | "amqps", rest)) if !rest.is_empty() => {}
        Some((scheme, _)) if scheme != "amqp" && scheme != "amqps" => {
            return Err(ConfigError::invalid(
                KEY,
                format!(
                    "{which} has scheme {}which is not amqp:// or amqps://",
                    quoted_scheme(scheme)
                ),
            ))
        }
        _ => {
            return Err(ConfigError::invalid(
                KEY,
                format!("{which} is not an AMQP URL: use amqp://user:password@host:5672/vhost"),
            ))
        }
    }
    check_userinfo_and_spaces(KEY, &which, url)?;
    let after_userinfo = url
        .split_once("://")
        .map_or(url, |(_, r)| r.rfind('@').map_or(r, |at| &r[at + 1..]));
    if after_userinfo.starts_with('[') {
        return Err(ConfigError::invalid(
            KEY,
            format!("{which} has an IPv6 address as its host, which the AMQP client cannot connect to (it would silently use localhost): use a host name that resolves to that address"),
        ));
    }
    if url.contains(",amqp://") || url.contains(",amqps://") {
        return Err(ConfigError::invalid(
            KEY,
            format!("{which} looks like a comma-separated list: give a TOML array of URLs instead"),
        ));
    }
    check_amqp_query(&which, url)?;
    if heartbeat_secs > 0 {
        let has_heartbeat = url
            .split_once('?')
            .is_some_and(|(_, q)| q.split('&').any(|p| p.starts_with("heartbeat=")));
        if has_heartbeat {
            return Err(ConfigError::invalid(
                "rabbitmq.heartbeat_secs",
                format!("{which} already sets ?heartbeat=: set the heartbeat in one place only"),
            ));
        }
    }
    Ok(())
}

/// The query parameters of an AMQP URL, as the AMQP client reads them at connect
/// (`heartbeat`, `channel_max`, `frame_max`, `connection_timeout`,
/// `auth_mechanism`): a value it cannot read would fail only then, and a name it does
/// not know would be ignored without a word. No value is quoted.
fn check_amqp_query(which: &str, url: &str) -> Result<(), ConfigError> {
    const KEY: &str = "rabbitmq.url";
    let Some((_, query)) = url.split_once('?') else {
        return Ok(());
    };
    let query = query.split('#').next().unwrap_or_default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let whole = |max: u64| value.parse::<u64>().is_ok_and(|n| n <= max);
        let bad = match name {
            "heartbeat" if !whole(u64::from(u16::MAX)) => {
                "heartbeat must be a whole number of seconds from 0 to 65535"
            }
            "channel_max" if !whole(u64::from(u16::MAX)) => {
                "channel_max must be a whole number from 0 to 65535"
            }
            "frame_max" if !whole(u64::from(u32::MAX)) => {
                "frame_max must be a whole number of bytes, e.g. 131072"
            }
            "connection_timeout" if !whole(u64::MAX) => {
                "connection_timeout must be a whole number of milliseconds, e.g. 30000"
            }
            "auth_mechanism"
                if ![
                    "plain",
                    "amqplain",
                    "external",
                    "anonymous",
                    "rabbit-cr-demo",
                ]
                .contains(&value.to_ascii_lowercase().as_str()) =>
            {
                "auth_mechanism must be plain, amqplain, external or anonymous"
            }
            "heartbeat" | "channel_max" | "frame_max" | "connection_timeout" | "auth_mechanism" => {
                continue
            }
            other => {
                let shown = if other.len() <= 40
                    && other
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    format!(" {other}")
                } else {
                    String::new()
                };
                return Err(ConfigError::invalid(
                    KEY,
                    format!("{which} has the query parameter{shown}, which the AMQP client does not know (it knows heartbeat, channel_max, frame_max, connection_timeout and auth_mechanism): remove it"),
                ));
            }
        };
        return Err(ConfigError::invalid(
            KEY,
            format!("{which}: the query parameter {bad}"),
        ));
    }
    Ok(())
}

/// A stream name: what RabbitMQ accepts as a queue name (1 to 255 bytes, not
/// starting with `amq.`), without whitespace.
pub(super) fn validate_stream_name(name: &str) -> Result<(), ConfigError> {
    const KEY: &str = "rabbitmq.stream";
    if name.len() > 255 || name.contains(char::is_whitespace) || name.starts_with("amq.") {
        return Err(ConfigError::invalid(
            KEY,
            format!("{name:?} is not a usable stream name: use at most 255 bytes, no whitespace and no `amq.` prefix"),
        ));
    }
    Ok(())
}

pub(super) fn validate_stream_url(url: &str, index: usize) -> Result<(), ConfigError> {
    const KEY: &str = "rabbitmq.stream_url";
    let which = format!("URL #{}", index + 1);
    match url.split_once("://") {
        Some(("rabbitmq-stream" | "rabbitmq-stream+tls", rest)) if !rest.is_empty() => {}
        Some((scheme, _)) if scheme != "rabbitmq-stream" && scheme != "rabbitmq-stream+tls" => {
            return Err(ConfigError::invalid(
                KEY,
                format!(
                    "{which} has scheme {}which is not rabbitmq-stream:// or rabbitmq-stream+tls://: use rabbitmq-stream://user:password@host:5552/vhost",
                    quoted_scheme(scheme)
                ),
            ))
        }
        _ => {
            return Err(ConfigError::invalid(
                KEY,
                format!("{which} is not a stream URL: use rabbitmq-stream://user:password@host:5552/vhost"),
            ))
        }
    }
    check_userinfo_and_spaces(KEY, &which, url)?;
    if url.contains('?') {
        return Err(ConfigError::invalid(
            KEY,
            format!("{which} has a query (?...), which the stream client does not read: remove it"),
        ));
    }
    if url.contains(",rabbitmq-stream") {
        return Err(ConfigError::invalid(
            KEY,
            format!("{which} looks like a comma-separated list: give a TOML array of URLs instead"),
        ));
    }
    Ok(())
}

/// The checks every broker URL gets after its scheme: an ambiguous user-info part
/// and whitespace. Nothing of the URL is quoted: the user name or password may be in it.
fn check_userinfo_and_spaces(key: &str, which: &str, url: &str) -> Result<(), ConfigError> {
    if publisher::error::userinfo_is_ambiguous(url) {
        return Err(ConfigError::invalid(
            key,
            format!("{which}: {}", publisher::error::PERCENT_ENCODE_PASSWORD),
        ));
    }
    if url.contains(char::is_whitespace) {
        return Err(ConfigError::invalid(
            key,
            format!("{which} holds a space or other whitespace: percent-encode it (%20)"),
        ));
    }
    Ok(())
}

/// `` `scheme` `` followed by a space when it looks like a URL scheme (letters, digits,
/// `+.-`, at most 16), else nothing: what precedes `://` in a malformed value may be
/// a password.
fn quoted_scheme(scheme: &str) -> String {
    let plain = !scheme.is_empty()
        && scheme.len() <= 16
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c));
    if plain {
        format!("`{scheme}` ")
    } else {
        String::new()
    }
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

/// Checks that every `{...}` in the template is a known placeholder and braces balance.
pub fn validate_routing_key(template: &str) -> Result<(), ConfigError> {
    const KEY: &str = "rabbitmq.routing_key";
    match RoutingKeyTemplate::parse(template) {
        Ok(_) => Ok(()),
        Err(RoutingKeyError::Unknown(name)) => {
            let hint = match closest(&name, &PLACEHOLDERS) {
                Some(s) => format!("did you mean `{{{s}}}`?"),
                None => format!(
                    "use only {}",
                    PLACEHOLDERS
                        .iter()
                        .map(|p| format!("{{{p}}}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            Err(ConfigError::invalid(
                KEY,
                format!("unknown placeholder `{{{name}}}`: {hint}"),
            ))
        }
        Err(e) => Err(ConfigError::invalid(KEY, e.to_string())),
    }
}
