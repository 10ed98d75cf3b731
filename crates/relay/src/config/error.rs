//! [`ConfigError`] and the translation of figment's errors into it: every message
//! names the key and where its value came from, and none quotes a secret.

use std::path::{Path, PathBuf};

use figment::{Metadata, Profile};

use super::env::ENV_METADATA_NAME;
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
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::Invalid { key, .. } => Some(key),
            _ => None,
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
    let secret = path.iter().any(|k| k == "url");
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
            let reason = match kind {
                K::Message(msg) => msg.clone(),
                K::InvalidType(a, exp) | K::InvalidValue(a, exp) => {
                    format!("expected {exp}, found {}: fix the value", actual(a))
                }
                K::UnknownVariant(v, expected) => format!(
                    "{v:?} is not one of {}: use one of them",
                    expected.join(", ")
                ),
                K::InvalidLength(n, exp) => format!("expected {exp}, found {n} items"),
                other => format!("{other}: fix the value"),
            };
            // An element of a list: name the key and the element's position.
            let item = match path.last().map(|i| i.parse::<usize>()) {
                Some(Ok(i)) => {
                    path.pop();
                    format!("item #{}: ", i + 1)
                }
                _ => String::new(),
            };
            ConfigError::Invalid {
                key: path.join("."),
                origin,
                reason: redact_url(&format!("{item}{reason}")),
            }
        }
    }
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

/// The candidate closest to `name` by edit distance, if it is close enough to be a typo.
pub(super) fn closest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let name = name.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (edit_distance(&name, &c.to_ascii_lowercase()), *c))
        .filter(|(d, c)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
