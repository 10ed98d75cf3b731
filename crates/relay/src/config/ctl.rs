//! What `ctl` reads of the configuration (docs/operations.md, "Incident levers"):
//! only the endpoint's address, credentials and TLS certificate and the control
//! token file, so that a bad edit elsewhere in the file does not take the incident
//! levers away from the operator of a relay that still runs.
//!
//! ```text
//!   Config::load ─ ok ─► those keys
//!                └ errors ─► warn with every error, then [relay]'s keys alone:
//!                            the file's [relay] table (or, when the file is not
//!                            TOML, its [relay] lines alone), then OUTBOX_RELAY_RELAY_*
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Format, Toml};
use figment::value::{Dict, Value};
use figment::Profile;

use super::env::env_var_name;
use super::{Config, ConfigError, DEFAULT_CONFIG_FILE, DEFAULT_METRICS_LISTEN};
use crate::endpoint::auth::Credentials;

/// The `[relay]` keys `ctl` uses.
const KEYS: &[&str] = &[
    "metrics_listen",
    "metrics_bearer_token_file",
    "metrics_basic_auth_user",
    "metrics_basic_auth_password_file",
    "metrics_tls_cert_file",
    "control_token_file",
];

/// What `ctl` needs to reach the relay.
#[derive(Debug, Clone)]
pub struct CtlSettings {
    /// `[relay] metrics_listen`; `None` when `""` (disabled) or not needed.
    pub listen: Option<SocketAddr>,
    pub auth: Credentials,
    /// `metrics_tls_cert_file`: the certificate the endpoint serves.
    pub tls_cert: Option<PathBuf>,
    /// `control_token_file` as written (`""`: the default for the port).
    pub control_token_file: String,
}

impl CtlSettings {
    fn of(cfg: &Config) -> CtlSettings {
        let r = &cfg.relay;
        let path = |s: &str| Some(PathBuf::from(s)).filter(|_| !s.is_empty());
        CtlSettings {
            listen: r.metrics_listen,
            auth: Credentials {
                bearer_token_file: path(&r.metrics_bearer_token_file),
                basic: path(&r.metrics_basic_auth_password_file)
                    .map(|p| (r.metrics_basic_auth_user.clone(), p)),
            },
            tls_cert: path(&r.metrics_tls_cert_file),
            control_token_file: r.control_token_file.clone(),
        }
    }
}

impl Config {
    /// The settings of `ctl`: from the whole configuration when it is valid; else,
    /// after a warning naming every error, from `[relay]`'s endpoint keys alone.
    /// `endpoint_given` (`ctl --endpoint`): the address is not read from the file.
    pub fn load_for_ctl(
        path: Option<&Path>,
        endpoint_given: bool,
    ) -> Result<CtlSettings, ConfigError> {
        let error = match Config::load(path) {
            Ok(cfg) => {
                for warning in cfg.warnings() {
                    tracing::warn!("{warning}");
                }
                return Ok(CtlSettings::of(&cfg));
            }
            Err(e @ ConfigError::FileNotFound { .. }) => return Err(e),
            Err(e) => e,
        };
        tracing::warn!(
            "the configuration has errors, which a reload or a restart of the relay would refuse; ctl uses only [relay] metrics_listen, the endpoint's credentials and certificate, and control_token_file: {error}"
        );
        let file = match path {
            Some(p) => Some(p.to_path_buf()),
            None => Some(PathBuf::from(DEFAULT_CONFIG_FILE)).filter(|p| p.is_file()),
        };
        let mut relay = match &file {
            Some(f) => relay_table(f).or_else(|e| {
                if endpoint_given {
                    Ok(Dict::new())
                } else {
                    Err(e)
                }
            })?,
            None => Dict::new(),
        };
        for key in KEYS {
            if let Ok(value) = std::env::var(env_var_name(&format!("relay.{key}"))) {
                relay.insert(key.to_string(), Value::from(value));
            }
        }
        settings(&relay, endpoint_given)
    }
}

/// The file's `[relay]` table; when the file is not TOML, its `[relay]` lines alone.
fn relay_table(file: &Path) -> Result<Dict, ConfigError> {
    let read = |data: Result<figment::value::Map<Profile, Dict>, figment::Error>| {
        data.ok()
            .and_then(|mut d| d.remove(&Profile::Default))
            .map(|mut d| match d.remove("relay") {
                Some(Value::Dict(_, relay)) => relay,
                _ => Dict::new(),
            })
    };
    if let Some(relay) = read(figment::Provider::data(&Toml::file_exact(file))) {
        return Ok(relay);
    }
    let text = std::fs::read_to_string(file).unwrap_or_default();
    read(figment::Provider::data(&Toml::string(&relay_lines(&text)))).ok_or_else(|| {
        ConfigError::Syntax {
            path: file.to_path_buf(),
            detail: "not even its [relay] table can be read, so ctl does not know the endpoint"
                .into(),
        }
    })
}

/// The `[relay]` header and the lines up to the next table header.
fn relay_lines(text: &str) -> String {
    let header = |line: &str| -> Option<String> {
        let l = line.trim();
        let inner = l.strip_prefix("[[").or_else(|| l.strip_prefix('['))?;
        let name = inner.split(']').next()?.trim();
        name.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.\"".contains(c))
            .then(|| name.to_string())
    };
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if let Some(name) = header(line) {
            inside = name == "relay";
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The settings from `[relay]`'s values: a key of the wrong kind is an error that
/// names it.
fn settings(relay: &Dict, endpoint_given: bool) -> Result<CtlSettings, ConfigError> {
    let text = |key: &str| -> Result<String, ConfigError> {
        match relay.get(key) {
            None => Ok(String::new()),
            Some(Value::String(_, s)) => Ok(s.trim().to_string()),
            Some(_) => Err(ConfigError::invalid(
                &format!("relay.{key}"),
                "must be text in quotes",
            )),
        }
    };
    let listen = if endpoint_given {
        None
    } else {
        let given = relay.contains_key("metrics_listen");
        let value = if given {
            text("metrics_listen")?
        } else {
            DEFAULT_METRICS_LISTEN.into()
        };
        if value.is_empty() {
            None
        } else {
            Some(value.parse::<SocketAddr>().map_err(|_| {
                ConfigError::invalid(
                    "relay.metrics_listen",
                    "is not an address like \"127.0.0.1:9187\": fix it, or pass ctl --endpoint URL",
                )
            })?)
        }
    };
    let path = |key: &str| -> Result<Option<PathBuf>, ConfigError> {
        Ok(Some(text(key)?)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from))
    };
    Ok(CtlSettings {
        listen,
        auth: Credentials {
            bearer_token_file: path("metrics_bearer_token_file")?,
            basic: path("metrics_basic_auth_password_file")?
                .map(|p| Ok::<_, ConfigError>((text("metrics_basic_auth_user")?, p)))
                .transpose()?,
        },
        tls_cert: path("metrics_tls_cert_file")?,
        control_token_file: text("control_token_file")?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_relay_lines_of_a_broken_file_are_read_alone() {
        let text = "[postgres]\nurl = \"x\"\nslot = = broken\n[relay]\n\
                    metrics_listen = \"127.0.0.1:9999\" # here\ncontrol_token_file = \"/t\"\n\
                    [[topology.queue]]\nname = \"q\"\n";
        let relay = Toml::string(&relay_lines(text));
        let mut data = figment::Provider::data(&relay).unwrap();
        let Some(Value::Dict(_, relay)) = data.remove(&Profile::Default).unwrap().remove("relay")
        else {
            panic!("no [relay]")
        };
        let s = settings(&relay, false).unwrap();
        assert_eq!(s.listen, Some("127.0.0.1:9999".parse().unwrap()));
        assert_eq!(s.control_token_file, "/t");
        assert!(settings(&relay, true).unwrap().listen.is_none());
        assert!(settings(&Dict::new(), false).unwrap().listen.is_some());
    }
}
