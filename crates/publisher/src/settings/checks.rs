//! The checks of `[rabbitmq]` that serde cannot express: [`RabbitMqConfig::validate`]
//! and the checks of single values (URL schemes and query parameters, the stream
//! name, the routing key template) it uses. Each error names its key and never
//! quotes a URL.

use std::path::Path;

use outbox_event::redact::quoted_scheme;
pub use outbox_event::setting::SettingError;
use outbox_event::suggest::closest;
use secrecy::ExposeSecret;

use super::RabbitMqConfig;
use crate::amqp::config::check_channels;
use crate::config::check_max_in_flight;
use crate::message::{RoutingKeyError, RoutingKeyTemplate, PLACEHOLDERS};
use crate::settings::Ordering;

impl RabbitMqConfig {
    /// Checks the values serde cannot: names, the routing key template, the flow
    /// limit, the URLs' schemes and query parameters, the files named. Every
    /// offending key is reported, in the order of the section.
    pub fn validate(&self) -> Vec<SettingError> {
        let mut errors = Vec::new();
        let mut check = |r: Result<(), SettingError>| {
            if let Err(e) = r {
                errors.push(e);
            }
        };
        let r = self;
        if r.url.is_empty() {
            check(Err(SettingError::new(
                "rabbitmq.url",
                "the list is empty: give at least one amqp:// or amqps:// URL",
            )));
        }
        for (i, u) in r.url.iter().enumerate() {
            check(validate_amqp_url(u.expose_secret(), i, r.heartbeat_secs));
        }
        if r.declare_exchange && r.exchange.is_empty() {
            check(Err(SettingError::new(
                "rabbitmq.exchange",
                "the default exchange \"\" cannot be declared: name an exchange, or set declare_exchange = false to publish to the default exchange",
            )));
        }
        let management = r.management_url.expose_secret();
        if !management.is_empty()
            && !management.starts_with("http://")
            && !management.starts_with("https://")
        {
            // The value may hold a password: never quoted.
            check(Err(SettingError::new(
                "rabbitmq.management_url",
                "is not an http:// or https:// URL: give the management plugin's address, e.g. http://127.0.0.1:15672, or leave it empty",
            )));
        }
        if r.management_user.is_empty() != r.management_password_file.is_empty() {
            let (set, missing) = match r.management_user.is_empty() {
                true => (
                    "rabbitmq.management_password_file",
                    "rabbitmq.management_user",
                ),
                false => (
                    "rabbitmq.management_user",
                    "rabbitmq.management_password_file",
                ),
            };
            check(Err(SettingError::new(
                missing,
                format!("{set} is set but {missing} is not: set both (the management API's own user and its password file), or neither"),
            )));
        }
        check(
            check_routing_key(&r.routing_key)
                .map_err(|reason| SettingError::new("rabbitmq.routing_key", reason)),
        );
        check(
            check_routing_key(&r.stream_filter_value)
                .map_err(|reason| SettingError::new("rabbitmq.stream_filter_value", reason)),
        );
        check(
            check_max_in_flight(r.max_in_flight)
                .map_err(|reason| SettingError::new("rabbitmq.max_in_flight", reason)),
        );
        check(check_recovery_limits(r));
        for glob in &r.allowed_exchanges {
            check(check_exchange_glob(glob));
        }
        check(check_ordering(r));
        if !r.ca_file.is_empty() && !Path::new(&r.ca_file).is_file() {
            check(Err(SettingError::new(
                "rabbitmq.ca_file",
                format!(
                    "{:?} is not a file: name a PEM file of CA certificates, or \"\" for the system roots",
                    r.ca_file
                ),
            )));
        }
        check(validate_client_files(r));
        if r.heartbeat_secs > u64::from(u16::MAX) {
            check(Err(SettingError::new(
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
                check(Err(SettingError::new(
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
            check(Err(SettingError::new(
                "rabbitmq.producer_name",
                "use at most 200 bytes and no control characters, or \"\" to derive it from the source",
            )));
        }
        errors
    }
}

/// The client certificate comes with its key, and the files named exist (their
/// contents are checked at connect, where they are read).
/// `ordering` and `channels` together: more than one channel only with per-aggregate
/// order, and per-aggregate order only on the exchange target.
fn check_ordering(r: &RabbitMqConfig) -> Result<(), SettingError> {
    match r.ordering {
        Ordering::Commit if r.channels != 1 => Err(SettingError::new(
            "rabbitmq.channels",
            format!("{} channels need ordering = \"aggregate\" (commit order publishes on one channel): set ordering = \"aggregate\", or remove channels", r.channels),
        )),
        Ordering::Aggregate if !r.stream.is_empty() => Err(SettingError::new(
            "rabbitmq.ordering",
            "\"aggregate\" spreads events over channels to an exchange, but stream is set (a stream keeps one order, exactly once): remove ordering, or remove stream to publish to the exchange",
        )),
        _ => check_channels(r.channels, r.max_in_flight)
            .map_err(|reason| SettingError::new("rabbitmq.channels", reason)),
    }
}

/// The bounds of the recovery layer (docs/reliability.md): each at least 1, and
/// durations of at least a second.
fn check_recovery_limits(r: &RabbitMqConfig) -> Result<(), SettingError> {
    if r.max_in_flight_bytes == 0 {
        return Err(SettingError::new(
            "rabbitmq.max_in_flight_bytes",
            "must be at least 1 (0 would never publish): set the bytes of message bodies to allow unconfirmed, e.g. 268435456 (256 MiB)",
        ));
    }
    if r.max_declared_exchanges == 0 {
        return Err(SettingError::new(
            "rabbitmq.max_declared_exchanges",
            "must be at least 1: set how many exchanges named by events the relay may declare, e.g. 1000",
        ));
    }
    for (key, value) in [
        ("rabbitmq.request_timeout", r.request_timeout),
        ("rabbitmq.stall_after", r.stall_after),
    ] {
        match value {
            None => {
                return Err(SettingError::new(
                    key,
                    "cannot be turned off: set a duration in quotes like \"60s\"",
                ))
            }
            Some(d) if d < std::time::Duration::from_secs(1) => {
                return Err(SettingError::new(
                    key,
                    "must be at least a second: set a duration in quotes like \"60s\"",
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// One glob of `allowed_exchanges`: an exchange name whose `*` stands for one or
/// more of `[A-Za-z0-9_.:-]`.
fn check_exchange_glob(glob: &str) -> Result<(), SettingError> {
    let bad = glob.is_empty()
        || glob.len() > 255
        || glob.chars().any(|c| c.is_control() || c.is_whitespace());
    if bad {
        return Err(SettingError::new(
            "rabbitmq.allowed_exchanges",
            format!(
                "{:?} is not an exchange name or glob: use names of at most 255 bytes without spaces or control characters, `*` for one or more of [A-Za-z0-9_.:-] (e.g. \"events.*\")",
                outbox_event::redact::printable(glob)
            ),
        ));
    }
    Ok(())
}

fn validate_client_files(r: &RabbitMqConfig) -> Result<(), SettingError> {
    if r.cert_file.is_empty() != r.key_file.is_empty() {
        let (set, missing) = if r.cert_file.is_empty() {
            ("rabbitmq.key_file", "rabbitmq.cert_file")
        } else {
            ("rabbitmq.cert_file", "rabbitmq.key_file")
        };
        return Err(SettingError::new(
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
            return Err(SettingError::new(
                key,
                format!("{value:?} is not a file: name a readable file, or \"\" for none"),
            ));
        }
    }
    Ok(())
}

fn validate_amqp_url(url: &str, index: usize, heartbeat_secs: u64) -> Result<(), SettingError> {
    const KEY: &str = "rabbitmq.url";
    let which = format!("URL #{}", index + 1);
    match url.split_once("://") {
        Some(("amqp" | "amqps", rest)) if !rest.is_empty() => {}
        Some((scheme, _)) if scheme != "amqp" && scheme != "amqps" => {
            return Err(SettingError::new(
                KEY,
                format!(
                    "{which} has scheme {}which is not amqp:// or amqps://",
                    quoted_scheme(scheme)
                ),
            ))
        }
        _ => {
            return Err(SettingError::new(
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
        return Err(SettingError::new(
            KEY,
            format!("{which} has an IPv6 address as its host, which the AMQP client cannot connect to (it would silently use localhost): use a host name that resolves to that address"),
        ));
    }
    if url.contains(",amqp://") || url.contains(",amqps://") {
        return Err(SettingError::new(
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
            return Err(SettingError::new(
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
fn check_amqp_query(which: &str, url: &str) -> Result<(), SettingError> {
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
                return Err(SettingError::new(
                    KEY,
                    format!("{which} has the query parameter{shown}, which the AMQP client does not know (it knows heartbeat, channel_max, frame_max, connection_timeout and auth_mechanism): remove it"),
                ));
            }
        };
        return Err(SettingError::new(
            KEY,
            format!("{which}: the query parameter {bad}"),
        ));
    }
    Ok(())
}

/// A stream name: what RabbitMQ accepts as a queue name (1 to 255 bytes, not
/// starting with `amq.`), without whitespace.
fn validate_stream_name(name: &str) -> Result<(), SettingError> {
    const KEY: &str = "rabbitmq.stream";
    if name.len() > 255 || name.contains(char::is_whitespace) || name.starts_with("amq.") {
        return Err(SettingError::new(
            KEY,
            format!("{name:?} is not a usable stream name: use at most 255 bytes, no whitespace and no `amq.` prefix"),
        ));
    }
    Ok(())
}

fn validate_stream_url(url: &str, index: usize) -> Result<(), SettingError> {
    const KEY: &str = "rabbitmq.stream_url";
    let which = format!("URL #{}", index + 1);
    match url.split_once("://") {
        Some(("rabbitmq-stream" | "rabbitmq-stream+tls", rest)) if !rest.is_empty() => {}
        Some((scheme, _)) if scheme != "rabbitmq-stream" && scheme != "rabbitmq-stream+tls" => {
            return Err(SettingError::new(
                KEY,
                format!(
                    "{which} has scheme {}which is not rabbitmq-stream:// or rabbitmq-stream+tls://: use rabbitmq-stream://user:password@host:5552/vhost",
                    quoted_scheme(scheme)
                ),
            ))
        }
        _ => {
            return Err(SettingError::new(
                KEY,
                format!("{which} is not a stream URL: use rabbitmq-stream://user:password@host:5552/vhost"),
            ))
        }
    }
    check_userinfo_and_spaces(KEY, &which, url)?;
    if url.contains('?') {
        return Err(SettingError::new(
            KEY,
            format!("{which} has a query (?...), which the stream client does not read: remove it"),
        ));
    }
    if url.contains(",rabbitmq-stream") {
        return Err(SettingError::new(
            KEY,
            format!("{which} looks like a comma-separated list: give a TOML array of URLs instead"),
        ));
    }
    Ok(())
}

/// The checks every broker URL gets after its scheme: an ambiguous user-info part
/// and whitespace. Nothing of the URL is quoted: the user name or password may be in it.
fn check_userinfo_and_spaces(
    key: &'static str,
    which: &str,
    url: &str,
) -> Result<(), SettingError> {
    if crate::error::userinfo_is_ambiguous(url) {
        return Err(SettingError::new(
            key,
            format!("{which}: {}", crate::error::PERCENT_ENCODE_PASSWORD),
        ));
    }
    if url.contains(char::is_whitespace) {
        return Err(SettingError::new(
            key,
            format!("{which} holds a space or other whitespace: percent-encode it (%20)"),
        ));
    }
    Ok(())
}

/// Checks that every `{...}` in the routing key template is a known placeholder and
/// braces balance: the reason it is refused, with a suggestion for a typo.
pub fn check_routing_key(template: &str) -> Result<(), String> {
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
            Err(format!("unknown placeholder `{{{name}}}`: {hint}"))
        }
        Err(e) => Err(e.to_string()),
    }
}
