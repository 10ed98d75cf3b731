//! Errors, grouped by what the caller does next: [`PublishError::is_transient`] errors
//! are retried (the broker is unreachable or went away); the others are definite and
//! need the operator to fix the configuration. No message contains a password: URLs
//! are redacted with [`redact_url`] before they are put in an error or a log line.

use thiserror::Error;

/// A publisher failure.
#[derive(Debug, Error)]
pub enum PublishError {
    /// No broker URL answered (TCP, TLS or an AMQP handshake that died midway).
    #[error("cannot reach RabbitMQ at {url}: {reason}; check that the broker is running and the [rabbitmq] url host and port are right")]
    Unreachable { url: String, reason: String },
    /// The broker refused the user name or password.
    #[error("RabbitMQ at {url} refused the login: {reason}; fix the user name and password in the [rabbitmq] url")]
    AuthenticationRefused { url: String, reason: String },
    /// The virtual host is missing or the user may not use it.
    #[error("RabbitMQ at {url} refused the virtual host: {reason}; create the vhost or grant the user access to it (the vhost is the url path, %2f for /)")]
    VirtualHost { url: String, reason: String },
    /// The exchange is missing, or exists with another type or durability.
    #[error("exchange {exchange:?} cannot be used: {reason}; declare it (or set [rabbitmq] declare_exchange = true) with the configured exchange_type, or fix [rabbitmq] exchange")]
    Exchange { exchange: String, reason: String },
    /// A configuration value the publisher cannot work with.
    #[error("invalid [rabbitmq] {key}: {reason}")]
    InvalidConfig { key: &'static str, reason: String },
    /// The CA file given for amqps could not be read.
    #[error("cannot read the RabbitMQ CA file {path}: {reason}; point [rabbitmq] ca_file at a readable PEM file")]
    CaFile { path: String, reason: String },
}

impl PublishError {
    /// True when retrying later may succeed without changing the configuration.
    pub fn is_transient(&self) -> bool {
        matches!(self, PublishError::Unreachable { .. })
    }

    /// How much the error tells the operator, for choosing one among the errors of
    /// several broker nodes: a refusal (exchange, login, vhost) names what to fix, an
    /// unreachable node only that it did not answer. Higher is more specific.
    pub fn specificity(&self) -> u8 {
        match self {
            PublishError::Unreachable { .. } => 0,
            PublishError::VirtualHost { .. } => 1,
            PublishError::AuthenticationRefused { .. } => 2,
            PublishError::Exchange { .. } => 3,
            PublishError::InvalidConfig { .. } | PublishError::CaFile { .. } => 4,
        }
    }
}

/// Replaces the password of an AMQP URL with `***`: `amqp://guest:***@host/vhost`.
/// Anything that does not look like a URL with credentials is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_string();
    };
    let userinfo = &authority[..at];
    let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
    format!("{}{}:***{}", &url[..scheme_end + 3], user, &rest[at..])
}

/// Removes the URL and its password from an error text from a library (lapin's URL
/// parser, for one, quotes the whole URL).
pub(crate) fn scrub(reason: &str, url: &str) -> String {
    let mut out = reason.replace(url, &redact_url(url));
    if let Some(password) = password_of(url) {
        // Very short passwords would garble the text and are not worth hiding.
        if password.len() >= 3 {
            out = out.replace(password, "***");
        }
    }
    out
}

fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("amqps://u:p@ss:w@host/v?x=1"),
            "amqps://u:***@host/v?x=1"
        );
        assert_eq!(redact_url("amqp://user@host"), "amqp://user:***@host");
        assert_eq!(redact_url("amqp://host:5672"), "amqp://host:5672");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn scrubs_urls_and_passwords_from_library_errors() {
        let url = "amqp://guest:topsecret@host:5672/%2f";
        assert_eq!(
            scrub(&format!("Invalid URL: '{url}'"), url),
            "Invalid URL: 'amqp://guest:***@host:5672/%2f'"
        );
        assert_eq!(scrub("bad topsecret here", url), "bad *** here");
        assert_eq!(scrub("no secrets", "amqp://host"), "no secrets");
    }

    #[test]
    fn transient_versus_definite() {
        let url = "amqp://h".to_string();
        let reason = String::new();
        assert!(PublishError::Unreachable {
            url: url.clone(),
            reason: reason.clone()
        }
        .is_transient());
        assert!(!PublishError::AuthenticationRefused {
            url: url.clone(),
            reason: reason.clone()
        }
        .is_transient());
        let unreachable = PublishError::Unreachable {
            url: url.clone(),
            reason: reason.clone(),
        };
        let vhost = PublishError::VirtualHost { url, reason };
        assert!(vhost.specificity() > unreachable.specificity());
    }
}
