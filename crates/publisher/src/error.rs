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
    /// The TLS handshake failed on the broker's certificate (unknown issuer, wrong
    /// host name, expired): the configuration must change, so it is not retried.
    #[error("the TLS handshake with RabbitMQ at {url} failed: {reason}; set [rabbitmq] ca_file to the PEM file of the CA that signed the broker's certificate, and connect by a host name the certificate names")]
    TlsRefused { url: String, reason: String },
    /// The broker refused the user name or password.
    #[error("RabbitMQ at {url} refused the login: {reason}; fix the user name and password in the [rabbitmq] url")]
    AuthenticationRefused { url: String, reason: String },
    /// The virtual host is missing or the user may not use it.
    #[error("RabbitMQ at {url} refused the virtual host: {reason}; create the vhost or grant the user access to it (the vhost is the url path, %2f for /)")]
    VirtualHost { url: String, reason: String },
    /// The user's or the virtual host's connection limit is reached (530): other
    /// connections must close first, so it is retried.
    #[error("RabbitMQ at {url} refused a connection: {reason}; the user's or the virtual host's connection limit is reached: raise it (rabbitmqctl set_user_limits / set_vhost_limits) or close other connections (the relay holds one connection per channel)")]
    ConnectionLimit { url: String, reason: String },
    /// The exchange is missing, or exists with another type or durability.
    #[error("exchange {exchange:?} cannot be used: {reason}; declare it (or set [rabbitmq] declare_exchange = true) with the configured exchange_type, or fix [rabbitmq] exchange")]
    Exchange { exchange: String, reason: String },
    /// An exchange, queue or binding of `[topology]` the broker refused to declare
    /// (406: it exists with other arguments; 403: no configure permission; ...).
    #[error("{object} cannot be declared: {reason}")]
    Topology { object: String, reason: String },
    /// A configuration value the publisher cannot work with.
    #[error("invalid [rabbitmq] {key}: {reason}")]
    InvalidConfig { key: &'static str, reason: String },
    /// The stream (stream target) is missing and may not be declared, or cannot be
    /// declared with the configured arguments.
    #[error("stream {stream:?} cannot be used: {reason}")]
    Stream { stream: String, reason: String },
    /// Publishing into the stream must stop, or an event would be lost or published
    /// under another source's ids (`publisher::stream`): never retried, whatever the
    /// moment (exit code 2).
    #[error("stopped publishing into stream {stream:?}: {reason}")]
    Halted { stream: String, reason: String },
    /// The CA file given for amqps could not be read.
    #[error("cannot read the RabbitMQ CA file {path}: {reason}; point [rabbitmq] ca_file at a readable PEM file")]
    CaFile { path: String, reason: String },
    /// A client certificate, key or password file cannot be used.
    #[error("cannot use [rabbitmq] {key} {path}: {reason}")]
    File {
        key: &'static str,
        path: String,
        reason: String,
    },
}

impl PublishError {
    /// True when retrying later may succeed without changing the configuration.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            PublishError::Unreachable { .. } | PublishError::ConnectionLimit { .. }
        )
    }

    /// True when the publisher stopped so as not to lose an event: no retry may
    /// continue, even after the first connection ([`PublishError::Halted`]).
    pub fn is_halt(&self) -> bool {
        matches!(self, PublishError::Halted { .. })
    }

    /// The broker's certificate was refused, or the relay's own TLS or secret files
    /// are unusable: unlike a refused login or virtual host, which a restarting
    /// broker answers too, never an outage, so a session loop should stop on it even
    /// after it was once connected (docs/security.md, "Known gaps").
    pub fn is_security_refusal(&self) -> bool {
        matches!(
            self,
            PublishError::TlsRefused { .. }
                | PublishError::CaFile { .. }
                | PublishError::File { .. }
        )
    }

    /// How much the error tells the operator, for choosing one among the errors of
    /// several broker nodes: a refusal (exchange, login, vhost) names what to fix, an
    /// unreachable node only that it did not answer. Higher is more specific.
    pub fn specificity(&self) -> u8 {
        match self {
            PublishError::Unreachable { .. } => 0,
            PublishError::VirtualHost { .. } | PublishError::ConnectionLimit { .. } => 1,
            PublishError::AuthenticationRefused { .. } | PublishError::TlsRefused { .. } => 2,
            PublishError::Exchange { .. }
            | PublishError::Stream { .. }
            | PublishError::Topology { .. } => 3,
            PublishError::InvalidConfig { .. }
            | PublishError::CaFile { .. }
            | PublishError::Halted { .. }
            | PublishError::File { .. } => 4,
        }
    }
}

/// True when a connection error's text is a refused server certificate (the
/// TLS libraries of the AMQP client and the stream client both say it in rustls' words).
pub(crate) fn is_certificate_error(reason: &str) -> bool {
    reason.contains("invalid peer certificate") || reason.contains("certificate verify failed")
}

/// The program's one redaction (docs/security.md): the password of every URL,
/// `password=` parameter and conninfo in a text becomes `***`.
pub use outbox_event::redact::redact_url;

/// The message for a URL whose user name or password holds an unencoded `/`, `?` or
/// `#`: it quotes nothing of the URL.
pub const PERCENT_ENCODE_PASSWORD: &str = "the user name or password holds an unencoded '/', '?' or '#' (or an '@' follows the host): percent-encode the password (/ is %2F, ? is %3F, # is %23, @ is %40, % is %25)";

/// True when the userinfo of `url` (up to its last `@`) holds a character that ends
/// the authority in the URL grammar, so that no URL parser would read it as written.
pub fn userinfo_is_ambiguous(url: &str) -> bool {
    let Some(scheme_end) = url.find("://") else {
        return false;
    };
    let rest = &url[scheme_end + 3..];
    rest.rfind('@')
        .is_some_and(|at| rest[..at].contains(['/', '?', '#']))
}

/// Removes the URL and its password from an error text from a library (a URL
/// parser, for one, quotes the whole URL). If a fragment of 3 or more characters of
/// the password (as written or percent-decoded) is still there, the whole text is
/// withheld: a library may quote a piece of a mis-split URL (a "port", a "host").
pub(crate) fn scrub(reason: &str, url: &str) -> String {
    let mut out = reason.replace(url, &redact_url(url));
    let Some(password) = password_of(url) else {
        return out;
    };
    let decoded = percent_decode(password);
    for p in [password, decoded.as_str()] {
        if p.chars().count() >= 3 {
            out = out.replace(p, "***");
        }
    }
    if has_fragment(&out, password) || has_fragment(&out, &decoded) {
        return "(the library's message is withheld: it quotes part of the password)".into();
    }
    out
}

/// True when `text` contains 3 consecutive characters of `secret`.
pub fn has_fragment(text: &str, secret: &str) -> bool {
    let chars: Vec<char> = secret.chars().collect();
    chars.windows(3).any(|w| {
        let f: String = w.iter().collect();
        text.contains(&f)
    })
}

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%')
            .then(|| b.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let userinfo = &rest[..rest.rfind('@')?];
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
        assert_eq!(redact_url("amqp://user@host"), "amqp://user@host");
        assert_eq!(redact_url("amqp://host:5672"), "amqp://host:5672");
        assert_eq!(redact_url("not a url"), "not a url");
        // Unencoded '#', '/', '?' in the password: the last '@' ends the userinfo.
        assert_eq!(
            redact_url("amqp://guest:Qx#j/z?q@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(redact_url("amqp://gu/est@host/v"), "amqp://***@host/v");
        assert!(userinfo_is_ambiguous("amqp://guest:a#b@host/"));
        assert!(!userinfo_is_ambiguous("amqp://guest:a@b@host/"));
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
        // A fragment of the password (a mis-split "port") withholds the message.
        let url = "amqp://guest:Qxj:zXq@host/";
        assert!(!scrub("invalid port 'zXq@host'", url).contains("zXq"));
        let url = "amqp://guest:Qxj%2FzXq@host/";
        assert!(!scrub("bad Qxj/zXq", url).contains("Qxj"));
    }

    #[test]
    fn validate_refuses_what_no_parser_reads_as_written() {
        for (url, words) in [
            ("amqp://guest:Qx#jz@h/%2f", "percent-encode the password"),
            ("amqp://guest:Qx/jz@h/%2f", "percent-encode the password"),
            ("amqp://guest:Qx jz@h/%2f", "percent-encode it"),
            ("amqps://guest:Qxjz@[fd00::zz]/", "IPv6 address"),
        ] {
            let e = crate::PublisherConfig::new(url, "x")
                .validate()
                .unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(words), "{url}: {msg}");
            assert!(!msg.contains("Qx") && !msg.contains("jz"), "{url}: {msg}");
        }
        // An IPv6 literal is read by the relay itself (issue 49: the URL parser
        // would connect to localhost instead).
        for url in [
            "amqp://guest:a%23b@127.0.0.1/%2f",
            "amqps://guest:Qxjz@[fd00::5]/",
            "amqp://[::1]:5673/%2f",
        ] {
            assert!(
                crate::PublisherConfig::new(url, "x").validate().is_ok(),
                "{url}"
            );
        }
        assert_eq!(
            crate::amqp::connection::ipv6_literal("amqp://u:p@[fd00::5]:5673/%2f").as_deref(),
            Some("fd00::5")
        );
        assert_eq!(
            crate::amqp::connection::ipv6_literal("amqp://[::1]/"),
            Some("::1".into())
        );
        assert_eq!(
            crate::amqp::connection::ipv6_literal("amqp://host:5672/"),
            None
        );
    }

    #[test]
    fn a_refused_certificate_is_definite_and_names_ca_file() {
        assert!(is_certificate_error(
            "IO error: invalid peer certificate: UnknownIssuer"
        ));
        assert!(is_certificate_error(
            "invalid peer certificate: NotValidForName"
        ));
        assert!(!is_certificate_error("Connection refused (os error 111)"));
        let e = PublishError::TlsRefused {
            url: "amqps://u:***@h/".into(),
            reason: "invalid peer certificate: UnknownIssuer".into(),
        };
        assert!(!e.is_transient());
        assert!(e.to_string().contains("set [rabbitmq] ca_file"), "{e}");
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_an_error_naming_the_key() {
        let dir = std::env::temp_dir().join(format!("publisher-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, contents) in [
            ("empty.pem", ""),
            (
                "key.pem",
                "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            ),
            (
                "garbage.pem",
                "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
            ),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, contents).unwrap();
            let mut c = crate::PublisherConfig::new("amqps://h/", "x");
            c.ca_file = Some(path);
            let e = c.tls().unwrap_err().to_string();
            assert!(
                e.contains("[rabbitmq] ca_file") && e.contains("no parsable"),
                "{name}: {e}"
            );
        }
        let mut c = crate::PublisherConfig::new("amqps://h/", "x");
        c.ca_file = Some(dir.join("missing.pem"));
        assert!(c
            .tls()
            .unwrap_err()
            .to_string()
            .contains("[rabbitmq] ca_file"));
        std::fs::remove_dir_all(&dir).unwrap();
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
