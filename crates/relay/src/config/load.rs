//! Loading the configuration: the file (as a provider whose values can be left out
//! one by one, so that every error is found), the environment, the checks; and the
//! rule that a command never connects on built-in server addresses.

use std::path::{Path, PathBuf};

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::env::{self, remove_path, EnvOverrides};
use super::error::{describe_origin, from_figment};
use super::{redact_url, Config, ConfigError, ConfigSource, DEFAULT_CONFIG_FILE, ENV_PREFIX};

/// Warns (once: [`Config::load`] runs once per process) when `file` holds a password
/// and group or others may read it beyond the secret files' rule
/// ([`outbox_event::secret_file`]: 0600, or 0640 when root owns it, the layout the
/// Debian package installs, root:outbox-relay). The warning names the file and its
/// mode, never anything from its contents (docs/security.md).
fn warn_if_readable_with_password(file: &Path) {
    let Ok(meta) = std::fs::metadata(file) else {
        return;
    };
    let Some(mode) = outbox_event::secret_file::too_open(&meta) else {
        return;
    };
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    // The redaction changes the text exactly where it holds a password. RabbitMQ's
    // well-known default login (guest:guest, accepted from localhost only) is no
    // secret.
    let text = text.replace("://guest:guest@", "://guest@");
    if redact_url(&text) != text {
        tracing::warn!(
            "the configuration file {} holds a password and is readable by group or others (mode {mode:03o}): run chmod 600 on it (or chown root:<the relay's group> and chmod 640)",
            file.display()
        );
    }
}

impl Config {
    /// Loads the configuration: `path` if given (it must exist), else
    /// `./outbox-relay.toml` if present, else the defaults; then the process
    /// environment's `OUTBOX_RELAY_*` overrides; then [`Config::validate`].
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os() {
            // Variables outside our prefix are none of our business, even if not UTF-8.
            let Some(k) = k.to_str() else { continue };
            if !k.starts_with(ENV_PREFIX) {
                continue;
            }
            let Some(v) = v.to_str() else {
                return Err(ConfigError::Invalid {
                    key: k.to_string(),
                    origin: None,
                    reason: "the value is not valid UTF-8: set it to UTF-8 text".to_string(),
                });
            };
            env.push((k.to_string(), v.to_string()));
        }
        let config = Config::load_with_env(path, env)?;
        if let ConfigSource::File(file) = &config.source {
            warn_if_readable_with_password(file);
        }
        Ok(config)
    }

    /// [`Config::load`] with an explicit environment (for tests; variables without the
    /// `OUTBOX_RELAY_` prefix are ignored).
    ///
    /// Every problem is reported, not only the first ([`ConfigError::Several`]): a
    /// value that cannot be read is recorded and left out, and the rest read again,
    /// until what remains reads; then [`Config::validate`] checks every key. Only a
    /// file that is not TOML at all stops at once.
    pub fn load_with_env<I, K, V>(path: Option<&Path>, env: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let file = match path {
            Some(p) if p.is_file() => Some(p.to_path_buf()),
            Some(p) => {
                return Err(ConfigError::FileNotFound {
                    path: p.to_path_buf(),
                })
            }
            None => Some(PathBuf::from(DEFAULT_CONFIG_FILE)).filter(|p| p.is_file()),
        };
        let (mut overrides, mut errors) = EnvOverrides::parse(env);
        let mut layer = match &file {
            Some(f) => Some(FileLayer::read(f)?),
            None => None,
        };
        let given = Given {
            postgres_url: overrides.sets("postgres", "url")
                || layer.as_ref().is_some_and(|l| l.sets("postgres", "url")),
            rabbitmq_url: overrides.sets("rabbitmq", "url")
                || layer.as_ref().is_some_and(|l| l.sets("rabbitmq", "url")),
            stream_url: overrides.sets("rabbitmq", "stream_url")
                || layer
                    .as_ref()
                    .is_some_and(|l| l.sets("rabbitmq", "stream_url")),
        };
        let (mut config, figment) = loop {
            let mut figment = Figment::new();
            if let Some(layer) = &layer {
                figment = figment.merge(layer);
            }
            figment = figment.merge(&overrides);
            match figment.extract::<Config>() {
                Ok(config) => break (config, figment),
                Err(e) => {
                    let e = from_figment(e, file.as_deref());
                    let key = e.key().map(str::to_string);
                    errors.push(e);
                    // Leave the value out and read the rest again; stop when it cannot
                    // be left out (nothing is left to learn then).
                    let path: Vec<&str> = key.as_deref().map_or(vec![], |k| k.split('.').collect());
                    let removed_file = layer.as_mut().is_some_and(|l| l.remove(&path));
                    let removed_env = overrides.remove(&path);
                    if path.is_empty() || !(removed_file || removed_env) {
                        return Err(ConfigError::from_list(errors).unwrap_or(
                            ConfigError::Syntax {
                                path: file.unwrap_or_default(),
                                detail: "unreadable".into(),
                            },
                        ));
                    }
                }
            }
        };
        config.source = match file {
            Some(f) => ConfigSource::File(f),
            None => ConfigSource::Defaults,
        };
        config.given = given;
        config.fingerprint = fingerprint(&figment);
        let checks = config.validate_all().into_iter();
        errors.extend(checks.chain(config.check_secret_files()).map(|e| {
            e.with_origin(|key| figment.find_metadata(key).map(|m| describe_origin(m, key)))
        }));
        match ConfigError::from_list(errors) {
            Some(e) => Err(e),
            None => Ok(config),
        }
    }

    /// Refuses to connect on built-in defaults (docs/operations.md, "Configuration and check"):
    /// with no file read, a command that connects to Postgres (`postgres`) or to the
    /// broker (`broker`) needs the URL variable of each, or it would silently log in
    /// to a local server it was never pointed at.
    pub fn require_connection_settings(
        &self,
        command: &str,
        postgres: bool,
        broker: bool,
    ) -> Result<(), ConfigError> {
        if self.source != ConfigSource::Defaults {
            return Ok(());
        }
        let mut variables = Vec::new();
        if postgres && !self.given.postgres_url {
            variables.push(env::env_var_name("postgres.url"));
        }
        if broker {
            match self.stream() {
                Some(_) if !self.given.stream_url => {
                    variables.push(env::env_var_name("rabbitmq.stream_url"))
                }
                None if !self.given.rabbitmq_url => {
                    variables.push(env::env_var_name("rabbitmq.url"))
                }
                _ => {}
            }
        }
        if variables.is_empty() {
            return Ok(());
        }
        let looked_for = std::env::current_dir()
            .map(|d| d.join(DEFAULT_CONFIG_FILE))
            .unwrap_or_else(|_| PathBuf::from(DEFAULT_CONFIG_FILE));
        Err(ConfigError::NoConnectionSettings {
            command: command.to_string(),
            looked_for,
            variables,
        })
    }
}

/// A hash of every key's value as the file and the environment give it, by dotted
/// key (a `[[topology.*]]` array is one key): what a reload compares.
fn fingerprint(figment: &Figment) -> super::Fingerprint {
    use std::hash::{Hash, Hasher};
    fn walk(
        prefix: &str,
        v: &serde_json::Value,
        out: &mut std::collections::BTreeMap<String, u64>,
    ) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            other => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                other.to_string().hash(&mut h);
                out.insert(prefix.to_string(), h.finish());
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    if let Ok(value) = figment.extract::<serde_json::Value>() {
        walk("", &value, &mut out);
    }
    super::Fingerprint(out)
}

/// Which connection settings the file or the environment gave (not the defaults).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Given {
    pub postgres_url: bool,
    pub rabbitmq_url: bool,
    pub stream_url: bool,
}

/// The TOML file as a figment provider whose values can be left out one by one
/// ([`Config::load_with_env`]).
struct FileLayer {
    metadata: Metadata,
    dict: Dict,
}

impl FileLayer {
    fn read(file: &Path) -> Result<FileLayer, ConfigError> {
        let toml = Toml::file_exact(file);
        let metadata = toml.metadata();
        let mut data = toml.data().map_err(|e| from_figment(e, Some(file)))?;
        Ok(FileLayer {
            metadata,
            dict: data.remove(&Profile::Default).unwrap_or_default(),
        })
    }

    fn sets(&self, section: &str, key: &str) -> bool {
        matches!(self.dict.get(section), Some(Value::Dict(_, d)) if d.contains_key(key))
    }

    fn remove(&mut self, path: &[&str]) -> bool {
        remove_path(&mut self.dict, path)
    }
}

impl Provider for FileLayer {
    fn metadata(&self) -> Metadata {
        self.metadata.clone()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}
