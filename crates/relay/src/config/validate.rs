//! Checks of the values that serde cannot express: [`Config::validate`] and the
//! checks of single values (names, URL schemes, the routing key template) it uses.
//! Each error names its key and never quotes a URL.

use std::path::Path;

use secrecy::ExposeSecret;
use wal_reader::TableName;

use super::error::closest;
use publisher::message::cloudevents::validate_source;
use publisher::message::{RoutingKeyError, RoutingKeyTemplate, PLACEHOLDERS};

use super::{Config, ConfigError, MIN_STATUS_INTERVAL_MS};

impl Config {
    /// Checks the values serde cannot: ranges, names, the routing key template, the
    /// URLs' schemes. The error names the first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let pg = &self.postgres;
        validate_pg_url(pg.url.expose_secret())?;
        validate_identifier("postgres.slot", &pg.slot, true)?;
        validate_identifier("postgres.publication", &pg.publication, false)?;
        if pg.tables.is_empty() {
            return Err(ConfigError::invalid(
                "postgres.tables",
                "the list is empty: name at least one outbox table, e.g. [\"public.outbox\"]",
            ));
        }
        for t in &pg.tables {
            if TableName::parse(t).is_none() {
                return Err(ConfigError::invalid(
                    "postgres.tables",
                    format!("{t:?} is not a table name: use \"schema.table\" or \"table\""),
                ));
            }
        }

        let m = &self.mapping;
        for (key, column) in [
            ("mapping.id", &m.id),
            ("mapping.aggregate_type", &m.aggregate_type),
            ("mapping.aggregate_id", &m.aggregate_id),
            ("mapping.event_type", &m.event_type),
            ("mapping.payload", &m.payload),
        ] {
            if column.trim().is_empty() {
                return Err(ConfigError::invalid(
                    key,
                    "the column name is empty: name the outbox column that holds this field",
                ));
            }
        }

        let r = &self.rabbitmq;
        if r.url.is_empty() {
            return Err(ConfigError::invalid(
                "rabbitmq.url",
                "the list is empty: give at least one amqp:// or amqps:// URL",
            ));
        }
        for (i, u) in r.url.iter().enumerate() {
            validate_amqp_url(u.expose_secret(), i, r.heartbeat_secs)?;
        }
        if r.declare_exchange && r.exchange.is_empty() {
            return Err(ConfigError::invalid(
                "rabbitmq.exchange",
                "the default exchange \"\" cannot be declared: name an exchange, or set declare_exchange = false to publish to the default exchange",
            ));
        }
        validate_routing_key(&r.routing_key)?;
        if r.max_in_flight < 1 {
            return Err(ConfigError::invalid(
                "rabbitmq.max_in_flight",
                "must be at least 1: set it to the number of unconfirmed messages to allow, e.g. 10000",
            ));
        }
        if !r.ca_file.is_empty() && !Path::new(&r.ca_file).is_file() {
            return Err(ConfigError::invalid(
                "rabbitmq.ca_file",
                format!(
                    "{:?} is not a file: name a PEM file of CA certificates, or \"\" for the system roots",
                    r.ca_file
                ),
            ));
        }
        if r.heartbeat_secs > u64::from(u16::MAX) {
            return Err(ConfigError::invalid(
                "rabbitmq.heartbeat_secs",
                format!(
                    "{} is too large: use at most 65535 (seconds), or 0 for the broker's value",
                    r.heartbeat_secs
                ),
            ));
        }

        if !r.stream.is_empty() {
            validate_stream_name(&r.stream)?;
            if r.stream_url.is_empty() {
                return Err(ConfigError::invalid(
                    "rabbitmq.stream_url",
                    "the list is empty: give at least one rabbitmq-stream:// or rabbitmq-stream+tls:// URL",
                ));
            }
            for (i, u) in r.stream_url.iter().enumerate() {
                validate_stream_url(u.expose_secret(), i)?;
            }
        }
        if let Err(e) = validate_source(&self.message.cloudevents_source) {
            return Err(ConfigError::invalid(
                "message.cloudevents_source",
                e.to_string(),
            ));
        }
        if self.relay.status_interval_ms < MIN_STATUS_INTERVAL_MS {
            return Err(ConfigError::invalid(
                "relay.status_interval_ms",
                format!(
                    "{} is too small: use at least {MIN_STATUS_INTERVAL_MS} (milliseconds)",
                    self.relay.status_interval_ms
                ),
            ));
        }
        Ok(())
    }
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
    Ok(())
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
