//! The endpoint's credentials (`[relay] metrics_bearer_token_file`,
//! `metrics_basic_auth_*`): read from their files at every request, compared in
//! constant time. The server (`server.rs`), its guard (`guard.rs`) and
//! the client (`client.rs`) take them from here.

use std::path::PathBuf;

use axum::http::header;

use crate::error::CliError;

/// What `/metrics` and `/poison` require; nothing when neither is set.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// A file holding the token of `Authorization: Bearer <token>`.
    pub bearer_token_file: Option<PathBuf>,
    /// The user and a file holding the password of `Authorization: Basic`.
    pub basic: Option<(String, PathBuf)>,
}

impl Credentials {
    pub fn is_set(&self) -> bool {
        self.bearer_token_file.is_some() || self.basic.is_some()
    }

    /// Reads every file once, so that a missing or empty one is an error at start
    /// that names its key.
    pub(crate) fn check(&self) -> Result<(), CliError> {
        if let Some(path) = &self.bearer_token_file {
            read_secret(path).map_err(|why| key_error("metrics_bearer_token_file", path, &why))?;
        }
        if let Some((user, path)) = &self.basic {
            if user.contains(':') {
                return Err(CliError::Precondition(
                    "[relay] metrics_basic_auth_user may not contain ':' (HTTP basic authentication separates user and password with it): choose another user name".into(),
                ));
            }
            read_secret(path)
                .map_err(|why| key_error("metrics_basic_auth_password_file", path, &why))?;
        }
        Ok(())
    }

    /// True when `headers` carry one of the configured credentials (always when
    /// none is configured).
    pub(crate) fn allow(&self, headers: &axum::http::HeaderMap) -> bool {
        if !self.is_set() {
            return true;
        }
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let (scheme, value) = given.trim().split_once(' ').unwrap_or((given, ""));
        let value = value.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            if let Some(path) = &self.bearer_token_file {
                return read_secret(path).is_ok_and(|t| same(t.as_bytes(), value.as_bytes()));
            }
        }
        if scheme.eq_ignore_ascii_case("basic") {
            if let Some((user, path)) = &self.basic {
                use base64::Engine;
                let Ok(password) = read_secret(path) else {
                    return false;
                };
                let expected =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                return same(expected.as_bytes(), value.as_bytes());
            }
        }
        false
    }
}

/// A secret file's content without surrounding whitespace (a trailing newline is
/// common); an empty one is an error.
pub(crate) fn read_secret(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let text = text.trim();
    if text.is_empty() {
        return Err("it is empty".into());
    }
    Ok(text.to_string())
}

pub(crate) fn key_error(key: &str, path: &std::path::Path, why: &str) -> CliError {
    CliError::Precondition(format!(
        "cannot read [relay] {key} {} ({why}): point it at a readable file holding the secret",
        path.display()
    ))
}

/// Compares without an early exit on the first difference.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carried the configured credentials (or none are needed);
/// `/readyz` gives its detail only then.
#[derive(Debug, Clone, Copy)]
pub struct Authorized(pub bool);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn credentials_are_compared_whole() {
        let dir = std::env::temp_dir().join(testkit::unique_name("cred"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("t"), "tok\n").unwrap();
        std::fs::write(dir.join("p"), "pw").unwrap();
        let c = Credentials {
            bearer_token_file: Some(dir.join("t")),
            basic: Some(("u".into(), dir.join("p"))),
        };
        let h = |v: &str| {
            let mut m = axum::http::HeaderMap::new();
            m.insert(header::AUTHORIZATION, v.parse().unwrap());
            m
        };
        assert!(c.allow(&h("Bearer tok")));
        assert!(c.allow(&h("bearer  tok")));
        assert!(!c.allow(&h("Bearer to")));
        assert!(!c.allow(&h("Bearer tokk")));
        assert!(c.allow(&h("Basic dTpwdw==")));
        assert!(!c.allow(&h("Basic dTpwdx==")));
        assert!(!c.allow(&axum::http::HeaderMap::new()));
        assert!(Credentials::default().allow(&axum::http::HeaderMap::new()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
