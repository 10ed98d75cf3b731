//! The secret files the relay's own sections name, held to the one rule of secret
//! files (`outbox_event::secret_file`: 0600, or 0640 when root owns it), checked at
//! load so that every command refuses a file others may read, with the key and the
//! `chmod` (docs/security.md, "Secrets from files"). A file that does not exist is
//! left to the reader of the file, which names it.

use std::path::Path;

use super::{Config, ConfigError};

impl Config {
    /// The files that hold credentials, by key (empty when not set): each new
    /// connection reads them again, and a reload checks them (docs/security.md).
    pub(crate) fn credential_files(&self) -> [(&'static str, &str); 6] {
        let r = &self.rabbitmq;
        let m = &self.relay;
        [
            ("rabbitmq.password_file", r.password_file.as_str()),
            (
                "rabbitmq.stream_password_file",
                r.stream_password_file.as_str(),
            ),
            (
                "rabbitmq.management_password_file",
                r.management_password_file.as_str(),
            ),
            ("tracing.headers_file", self.tracing.headers_file.as_str()),
            (
                "relay.metrics_bearer_token_file",
                m.metrics_bearer_token_file.as_str(),
            ),
            (
                "relay.metrics_basic_auth_password_file",
                m.metrics_basic_auth_password_file.as_str(),
            ),
        ]
    }

    /// One error per secret file that group or others may read.
    pub(super) fn check_secret_files(&self) -> Vec<ConfigError> {
        let tls_key = (
            "relay.metrics_tls_key_file",
            self.relay.metrics_tls_key_file.as_str(),
        );
        self.credential_files()
            .into_iter()
            .chain([tls_key])
            .filter(|(_, path)| !path.is_empty())
            .filter_map(|(key, path)| too_open(key, Path::new(path)))
            .collect()
    }
}

/// The error for `path` when it breaks the rule.
fn too_open(key: &str, path: &Path) -> Option<ConfigError> {
    let meta = std::fs::metadata(path).ok()?;
    let mode = outbox_event::secret_file::too_open(&meta)?;
    Some(ConfigError::invalid(
        key,
        format!(
            "{} has group or world access (mode {mode:o}); a secret file's permissions must be {}: chmod 600 it",
            path.display(),
            outbox_event::secret_file::ALLOWED
        ),
    ))
}
