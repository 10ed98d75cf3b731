//! `OUTBOX_RELAY_<SECTION>_<KEY>` environment overrides, typed by a table of every key.

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::error::{closest, expectation};
use super::keys::{Kind, ENV_METADATA_NAME, KEYS};
use super::{ConfigError, ENV_PREFIX};

/// The environment variable that overrides `section.key`.
pub fn env_var_name(dotted_key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        dotted_key.replace('.', "_").to_uppercase()
    )
}

/// The `OUTBOX_RELAY_*` variables, typed, as a figment provider.
pub(super) struct EnvOverrides(Dict);

impl EnvOverrides {
    /// The variables that name a key and hold a value of its kind, and an error for
    /// each of the others (every one is reported, not only the first).
    pub(super) fn parse<I, K, V>(env: I) -> (EnvOverrides, Vec<ConfigError>)
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut sections: Map<String, Dict> = Map::new();
        let mut errors = Vec::new();
        for (var, text) in env {
            match Self::parse_one(var.as_ref(), text.as_ref()) {
                Ok(None) => {}
                Ok(Some((section, key, value))) => {
                    sections
                        .entry(section.to_string())
                        .or_default()
                        .insert(key.to_string(), value);
                }
                Err(e) => errors.push(e),
            }
        }
        let dict = sections
            .into_iter()
            .map(|(s, d)| (s, Value::from(d)))
            .collect();
        (EnvOverrides(dict), errors)
    }

    /// True when a variable set `section.key`.
    pub(super) fn sets(&self, section: &str, key: &str) -> bool {
        match self.0.get(section) {
            Some(Value::Dict(_, d)) => d.contains_key(key),
            _ => false,
        }
    }

    /// Drops the value at `path` (a key that failed), so that the others can still be
    /// checked. Returns whether there was one.
    pub(super) fn remove(&mut self, path: &[&str]) -> bool {
        remove_path(&mut self.0, path)
    }

    /// One variable: `Ok(None)` when it is not ours.
    fn parse_one(
        var: &str,
        text: &str,
    ) -> Result<Option<(&'static str, &'static str, Value)>, ConfigError> {
        {
            let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
                return Ok(None);
            };
            let lower = rest.to_ascii_lowercase();
            let found = KEYS.iter().find(|(section, key, _)| {
                lower.len() == section.len() + 1 + key.len()
                    && lower.starts_with(section)
                    && lower[section.len()..].starts_with('_')
                    && lower.ends_with(key)
            });
            if found.is_none() && (lower == "topology" || lower.starts_with("topology_")) {
                return Err(ConfigError::Invalid {
                    key: "topology".to_string(),
                    origin: Some(format!("in {ENV_METADATA_NAME} {var}")),
                    reason: "[topology] is read from the configuration file only (environment variables cannot express its arrays of tables): move it to the file and unset the variable".to_string(),
                });
            }
            let Some(&(section, key, kind)) = found else {
                let names: Vec<String> = KEYS
                    .iter()
                    .map(|(s, k, _)| env_var_name(&format!("{s}.{k}")))
                    .collect();
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                return Err(ConfigError::UnknownEnvVar {
                    var: var.to_string(),
                    suggestion: closest(var, &names).map(str::to_string),
                });
            };
            let dotted = format!("{section}.{key}");
            let origin = Some(format!("in {ENV_METADATA_NAME} {var}"));
            let invalid = |reason: String| ConfigError::Invalid {
                key: dotted.clone(),
                origin: origin.clone(),
                reason,
            };
            // The value is quoted: it is not a URL (those are `Str` or `UrlList`).
            let wrong = || ConfigError::WrongType {
                expected: expectation(&dotted),
                found: format!("{text:?}"),
                key: dotted.clone(),
                origin: origin.clone(),
            };
            let value = match kind {
                Kind::Str => Value::from(text.to_string()),
                Kind::Bool => match text.trim().to_ascii_lowercase().as_str() {
                    "true" => Value::from(true),
                    "false" => Value::from(false),
                    _ => return Err(wrong()),
                },
                Kind::UInt => match text.trim().parse::<u64>() {
                    Ok(n) => Value::from(n),
                    Err(_) => return Err(wrong()),
                },
                Kind::Float => match text.trim().parse::<f64>() {
                    Ok(n) if n.is_finite() => Value::from(n),
                    _ => return Err(wrong()),
                },
                Kind::List => {
                    if text.trim_start().starts_with('[') {
                        Value::from(toml_string_array(text).ok_or_else(|| {
                            invalid(format!(
                                "{text:?} is not a TOML array of strings: use [\"a\", \"b\"] or a comma-separated list"
                            ))
                        })?)
                    } else {
                        Value::from(
                            text.split(',')
                                .map(str::trim)
                                .filter(|s| !s.is_empty())
                                .map(str::to_string)
                                .collect::<Vec<_>>(),
                        )
                    }
                }
                Kind::UrlList => {
                    if text.trim_start().starts_with('[') {
                        // No value in the message: it holds passwords.
                        Value::from(toml_string_array(text).ok_or_else(|| {
                            invalid(
                                "starts with `[` but is not a TOML array of strings: use [\"amqp://...\", \"amqp://...\"] or a single URL"
                                    .to_string(),
                            )
                        })?)
                    } else {
                        Value::from(text.to_string())
                    }
                }
            };
            Ok(Some((section, key, value)))
        }
    }
}

/// Parses `["a", "b"]` as TOML.
fn toml_string_array(text: &str) -> Option<Vec<String>> {
    Figment::from(Toml::string(&format!("v = {text}")))
        .extract_inner::<Vec<String>>("v")
        .ok()
}

impl Provider for EnvOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named(ENV_METADATA_NAME)
            .interpolater(|_profile: &Profile, keys: &[&str]| env_var_name(&keys.join(".")))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.0.clone()))
    }
}

/// Removes the value at `path` (`["rabbitmq", "url"]`) from `dict`; true if there
/// was one.
pub(super) fn remove_path(dict: &mut Dict, path: &[&str]) -> bool {
    match path {
        [] => false,
        [key] => dict.remove(*key).is_some(),
        [section, rest @ ..] => match dict.get_mut(*section) {
            Some(Value::Dict(_, inner)) => remove_path(inner, rest),
            _ => false,
        },
    }
}
