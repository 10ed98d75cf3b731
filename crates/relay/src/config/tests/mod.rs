//! Unit tests of loading, overriding, validating and redacting the configuration.

#![allow(clippy::unwrap_used)]

mod errors;
mod examples;
mod load;
mod targets;
mod topology;

use super::env::env_var_name;
use super::error::closest;
use super::keys::{Kind, KEYS};
use super::validate::validate_routing_key;
use super::*;
use std::io::Write as _;
use std::path::Path;

use figment::providers::{Format, Toml};
use figment::Figment;
use wal_reader::TableName;

const NO_ENV: [(&str, &str); 0] = [];

/// A TOML file in a fresh temporary directory, removed on drop.
struct TempToml {
    dir: PathBuf,
    path: PathBuf,
}

impl TempToml {
    fn new(contents: &str) -> TempToml {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-config-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outbox-relay.toml");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(contents.as_bytes()).unwrap();
        TempToml { dir, path }
    }
}

impl Drop for TempToml {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn load_toml(contents: &str) -> Result<Config, ConfigError> {
    let file = TempToml::new(contents);
    Config::load_with_env(Some(&file.path), NO_ENV)
}

fn load_env(env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load_with_env(None, env.iter().copied())
}

/// The error must be `Invalid` (or `UnknownKey`) about `key`; returns its message.
fn err_about(result: Result<Config, ConfigError>, key: &str) -> String {
    let e = result.expect_err("the configuration was accepted");
    assert_eq!(e.key(), Some(key), "wrong key in: {e}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{key}`")), "key not named in: {msg}");
    msg
}
