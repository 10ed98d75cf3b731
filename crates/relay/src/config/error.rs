//! [`ConfigError`] and the translation of figment's errors into it: every message
//! names the key and where its value came from, and none quotes a secret.

use std::path::{Path, PathBuf};

use figment::{Metadata, Profile};

use super::keys::ENV_METADATA_NAME;
use super::DEFAULT_CONFIG_FILE;
use wal_reader::redact::redact_url;

/// A configuration that cannot be used. Every message names the key (or file) and
/// what to do about it; none quotes a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--config` named a file that does not exist.
    #[error("config file {} does not exist: pass an existing file to --config, or omit --config to use ./{DEFAULT_CONFIG_FILE} or the defaults", path.display())]
    FileNotFound { path: PathBuf },
    /// The file exists but is not valid TOML.
    #[error("{} is not valid TOML ({detail}): fix the syntax there", path.display())]
    Syntax { path: PathBuf, detail: String },
    /// A key (or section) that does not exist.
    #[error("unknown key `{key}`{}: {}", origin_suffix(origin), unknown_fix(suggestion.as_deref()))]
    UnknownKey {
        key: String,
        origin: Option<String>,
        suggestion: Option<String>,
    },
    /// An `OUTBOX_RELAY_*` variable that names no key.
    #[error("unknown environment variable {var}: {}", unknown_fix(suggestion.as_deref()))]
    UnknownEnvVar {
        var: String,
        suggestion: Option<String>,
    },
    /// A key with a value that is not allowed.
    #[error("invalid `{key}`{}: {reason}", origin_suffix(origin))]
    Invalid {
        key: String,
        origin: Option<String>,
        reason: String,
    },
    /// A value of the wrong kind (text for a number, ...): says what the key takes,
    /// in words rather than in Rust's type names.
    #[error("`{key}`{} must be {expected}, not {found}", origin_suffix(origin))]
    WrongType {
        key: String,
        origin: Option<String>,
        /// What it takes: "a whole number like 10000".
        expected: String,
        /// What it holds: `the string "lots"` (never a secret's value).
        found: String,
    },
    /// A command that connects found no configuration at all: no file, no
    /// `--config`, no URL variable (docs/operations.md, "Configuration and check").
    #[error("nothing says where to connect: {} does not exist, --config was not given, and {} {} not set; pass --config FILE (outbox-relay.example.toml shows every key) or set {}: `{command}` does not connect to built-in defaults", looked_for.display(), and_list(variables), if variables.len() == 1 { "is" } else { "are" }, if variables.len() == 1 { "it" } else { "them" })]
    NoConnectionSettings {
        command: String,
        /// The file looked for (`./outbox-relay.toml`, absolute).
        looked_for: PathBuf,
        /// The variables that would have named the servers.
        variables: Vec<String>,
    },
    /// Several of the above, in the order found: every problem at once.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Several(Vec<ConfigError>),
}

/// `A`, `A and B`, `A, B and C`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

fn origin_suffix(origin: &Option<String>) -> String {
    origin.as_ref().map(|o| format!(" {o}")).unwrap_or_default()
}

fn unknown_fix(suggestion: Option<&str>) -> String {
    match suggestion {
        Some(s) => format!("did you mean `{s}`?"),
        None => "remove it (see outbox-relay.example.toml for every key)".to_string(),
    }
}

impl ConfigError {
    pub(super) fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            key: key.to_string(),
            origin: None,
            reason: reason.into(),
        }
    }

    /// The configuration key the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. }
            | ConfigError::Invalid { key, .. }
            | ConfigError::WrongType { key, .. } => Some(key),
            _ => None,
        }
    }

    /// One error, or [`ConfigError::Several`]; `None` for none.
    pub(super) fn from_list(mut errors: Vec<ConfigError>) -> Option<ConfigError> {
        match errors.len() {
            0 => None,
            1 => errors.pop(),
            _ => Some(ConfigError::Several(errors)),
        }
    }

    /// The errors one by one ([`ConfigError::Several`] unpacked).
    pub fn each(&self) -> Vec<&ConfigError> {
        match self {
            ConfigError::Several(list) => list.iter().collect(),
            one => vec![one],
        }
    }

    /// Sets where the value came from, if the error does not say yet.
    pub(super) fn with_origin(self, origin: impl FnOnce(&str) -> Option<String>) -> ConfigError {
        match self {
            ConfigError::Invalid {
                key,
                origin: None,
                reason,
            } => ConfigError::Invalid {
                origin: origin(&key),
                key,
                reason,
            },
            ConfigError::WrongType {
                key,
                origin: None,
                expected,
                found,
            } => ConfigError::WrongType {
                origin: origin(&key),
                key,
                expected,
                found,
            },
            other => other,
        }
    }
}

/// " in FILE" / " in environment variable OUTBOX_RELAY_X".
pub(super) fn describe_origin(meta: &Metadata, dotted_key: &str) -> String {
    if meta.name == ENV_METADATA_NAME {
        let keys: Vec<&str> = dotted_key.split('.').collect();
        return format!(
            "in {ENV_METADATA_NAME} {}",
            meta.interpolate(&Profile::Default, &keys)
        );
    }
    match &meta.source {
        Some(figment::Source::File(p)) => format!("in {}", p.display()),
        _ => format!("in {}", meta.name),
    }
}

/// Turns figment's error into one that names the key and never quotes a URL.
pub(super) fn from_figment(e: figment::Error, file: Option<&Path>) -> ConfigError {
    use figment::error::{Actual, Kind as K};
    let mut path = e.path.clone();
    let origin = e
        .metadata
        .as_ref()
        .map(|m| describe_origin(m, &path.join(".")));
    // `rabbitmq.url` may fail on one of its elements: `rabbitmq.url.1`.
    let secret = path.iter().any(|k| k == "url" || k == "stream_url");
    let actual = |a: &Actual| -> String {
        match a {
            Actual::Bool(b) => format!("the boolean {b}"),
            Actual::Unsigned(n) => format!("the number {n}"),
            Actual::Signed(n) => format!("the number {n}"),
            Actual::Float(n) => format!("the number {n}"),
            Actual::Str(s) | Actual::Other(s) if !secret => format!("the string {s:?}"),
            Actual::Str(_) | Actual::Char(_) => "a string".to_string(),
            Actual::Seq => "an array".to_string(),
            Actual::Map => "a table".to_string(),
            _ => "a value of another type".to_string(),
        }
    };
    match &e.kind {
        K::UnknownField(field, expected) => {
            // Only the file can hold unknown keys (unknown variables are rejected
            // earlier), and the error's tag may be that of a merged section.
            if path.last() != Some(field) {
                path.push(field.clone());
            }
            let suggestion = closest(field, expected).map(str::to_string);
            ConfigError::UnknownKey {
                key: path.join("."),
                origin: file.map(|f| format!("in {}", f.display())),
                suggestion,
            }
        }
        K::Message(msg) if path.is_empty() => match file {
            Some(f) => ConfigError::Syntax {
                path: f.to_path_buf(),
                detail: condense_toml_error(msg),
            },
            None => ConfigError::invalid("", redact_url(msg)),
        },
        kind => {
            // An element of a list: name the key and the element's position.
            let item = match path.last().map(|i| i.parse::<usize>()) {
                Some(Ok(i)) => {
                    path.pop();
                    Some(i + 1)
                }
                _ => None,
            };
            let key = path.join(".");
            let found = match kind {
                K::InvalidType(a, _) | K::InvalidValue(a, _) => Some(actual(a)),
                K::UnknownVariant(v, _) => Some(format!("{v:?}")),
                _ => None,
            };
            if let Some(found) = found {
                let expected = match (kind, item) {
                    (K::UnknownVariant(_, choices), _) => format!("one of {}", choices.join(", ")),
                    (_, Some(n)) => format!("{} (item #{n} is not)", expectation(&key)),
                    _ => expectation(&key),
                };
                return ConfigError::WrongType {
                    key,
                    origin,
                    expected,
                    found: redact_url(&found),
                };
            }
            let reason = match kind {
                K::Message(msg) => msg.clone(),
                K::InvalidLength(n, exp) => format!("expected {exp}, found {n} items"),
                other => format!("{other}: fix the value"),
            };
            let item = item.map(|n| format!("item #{n}: ")).unwrap_or_default();
            ConfigError::Invalid {
                key,
                origin,
                reason: redact_url(&format!("{item}{reason}")),
            }
        }
    }
}

/// What `dotted_key` takes, in words: "a whole number like 10000", "true or false".
pub(super) fn expectation(dotted_key: &str) -> String {
    use super::keys::{Kind, KEYS};
    let kind = KEYS
        .iter()
        .find(|(s, k, _)| dotted_key.split_once('.') == Some((s, k)))
        .map(|(_, _, kind)| *kind);
    let text = match dotted_key {
        "rabbitmq.max_in_flight" => "a whole number like 10000",
        "rabbitmq.max_in_flight_bytes" => "a whole number of bytes like 268435456 (256 MiB)",
        "rabbitmq.max_declared_exchanges" => "a whole number like 1000",
        "rabbitmq.request_timeout" | "rabbitmq.stall_after" => {
            "a duration in quotes like \"30s\" or \"2min\""
        }
        "rabbitmq.heartbeat_secs" => "a whole number of seconds like 60, or 0 for the broker's",
        "rabbitmq.max_length_bytes" => {
            "a whole number of bytes like 20000000000, or 0 for no limit"
        }
        "relay.status_interval_ms" => "a whole number of milliseconds like 1000",
        "relay.shutdown_timeout_ms" => "a whole number of milliseconds like 30000",
        "relay.metrics_read_timeout_ms" => "a whole number of milliseconds like 10000",
        "relay.metrics_max_connections" => "a whole number like 64",
        "tracing.sampling_ratio" => "a number from 0.0 to 1.0 like 0.1",
        "tracing.max_queue_size" => "a whole number of spans like 8192",
        "relay.replay_window" | "relay.pause_alert_after" | "retention.keep" | "rabbitmq.max_age" => {
            "a duration in quotes like \"1h\", \"30min\" or \"7D\", or \"\" for none"
        }
        "relay.metrics_listen" => {
            "an address in quotes like \"127.0.0.1:9187\" or \"[::]:9187\", or \"\" to disable it"
        }
        "rabbitmq.exchange_type" => "one of direct, fanout, topic, headers",
        "rabbitmq.ordering" => "one of commit, aggregate",
        "rabbitmq.channels" => "a whole number of channels like 4",
        "message.format" => "one of native, cloudevents",
        "message.headers" => "one of full, minimal",
        "postgres.tables" => "a table name or a list of them, like [\"public.outbox\"]",
        "postgres.messages" => "a prefix or a list of them, like [\"outbox\"]",
        "relay.metrics_allowed_hosts" => "a list of host names like [\"relay\", \"relay.example\"]",
        "rabbitmq.url" => {
            "a URL in quotes, or a list of URLs like [\"amqp://...\", \"amqp://...\"]"
        }
        "rabbitmq.stream_url" => {
            "a URL in quotes, or a list of URLs like [\"rabbitmq-stream://...\"]"
        }
        // `[[topology.*]]` tables: `topology.queue.0.durable`, ...
        t if t.starts_with("topology.") => match t.rsplit('.').next().unwrap_or_default() {
            "exchange" | "queue" if t.matches('.').count() == 1 => {
                "an array of tables, each written [[topology.queue]] (or [[topology.exchange]]) with its keys below it"
            }
            "durable" | "auto_delete" | "internal" => "true or false",
            "name" | "type" | "routing_key" => "text in quotes",
            "arguments" => "a table like { x-message-ttl = 60000, x-dead-letter-exchange = \"dlx\" }",
            "bindings" => "a list of tables like [{ exchange = \"orders\", routing_key = \"order.*\" }]",
            _ => "another kind of value",
        },
        _ => match kind {
            Some(Kind::Bool) => "true or false",
            Some(Kind::UInt) => "a whole number like 100",
            Some(Kind::Float) => "a number like 0.5",
            Some(Kind::Str) => "text in quotes",
            Some(Kind::List | Kind::UrlList) => "a string or a list of strings",
            // A section: `[rabbitmq] = 5`.
            None if !dotted_key.contains('.') => "a section of keys, like [rabbitmq]",
            None => "another kind of value",
        },
    };
    text.to_string()
}

/// toml's errors span several lines and quote the offending line (which may hold a
/// password): keep the position and the final message only.
fn condense_toml_error(msg: &str) -> String {
    let lines: Vec<&str> = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let position = lines
        .iter()
        .find_map(|l| l.find("line ").map(|i| l[i..].to_string()));
    let last = lines
        .iter()
        .rev()
        .find(|l| {
            !l.starts_with('|')
                && !l.starts_with(|c: char| c.is_ascii_digit())
                && !l.starts_with('^')
        })
        .map(|l| l.to_string());
    match (position, last) {
        (Some(p), Some(l)) if !l.contains("line ") => format!("{p}: {l}"),
        (Some(p), _) => p,
        (None, Some(l)) => redact_url(&l),
        (None, None) => "parse error".to_string(),
    }
}

/// The program's one typo suggestion.
pub(super) use outbox_event::suggest::closest;
