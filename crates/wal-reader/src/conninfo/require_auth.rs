//! libpq's `require_auth` (Postgres 16's libpq): the authentication methods the
//! client accepts from the server, e.g. `require_auth=scram-sha-256` forbids
//! cleartext and md5 whatever the link, `!password` forbids only cleartext, `none`
//! allows a login without authentication (trust). The checks themselves run in
//! `conn::policy`, on both connection kinds.

use super::ConnInfoError;

/// One method `require_auth` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    /// AuthenticationCleartextPassword.
    Password,
    Md5,
    Gss,
    Sspi,
    /// SASL (SCRAM-SHA-256, with or without channel binding).
    ScramSha256,
    /// No authentication request at all (trust, peer).
    None,
}

impl AuthMethod {
    const ALL: [AuthMethod; 6] = [
        AuthMethod::Password,
        AuthMethod::Md5,
        AuthMethod::Gss,
        AuthMethod::Sspi,
        AuthMethod::ScramSha256,
        AuthMethod::None,
    ];

    /// libpq's name of the method.
    pub fn name(self) -> &'static str {
        match self {
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::Gss => "gss",
            AuthMethod::Sspi => "sspi",
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::None => "none",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// The methods `require_auth` allows (all of them when it is not given).
#[derive(Clone, PartialEq, Eq)]
pub struct RequireAuth {
    allowed: u8,
    /// The value as written (for messages), or empty when not given.
    written: String,
    given: bool,
}

impl Default for RequireAuth {
    fn default() -> RequireAuth {
        RequireAuth {
            allowed: AuthMethod::ALL.iter().fold(0, |a, m| a | m.bit()),
            written: String::new(),
            given: false,
        }
    }
}

impl std::fmt::Debug for RequireAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = AuthMethod::ALL
            .iter()
            .filter(|m| self.allows(**m))
            .map(|m| m.name())
            .collect();
        f.debug_list().entries(names).finish()
    }
}

impl RequireAuth {
    /// Parses libpq's syntax: a comma-separated list of methods, either all plain
    /// (the allowed ones) or all negated with `!` (the forbidden ones). Empty means
    /// no restriction.
    pub fn parse(value: &str) -> Result<RequireAuth, ConnInfoError> {
        let value = value.trim();
        if value.is_empty() {
            return Ok(RequireAuth::default());
        }
        let err = |why: &str| ConnInfoError(format!("require_auth {why}"));
        let mut listed = 0u8;
        let mut negated = None;
        for item in value.split(',') {
            let item = item.trim();
            let (neg, name) = match item.strip_prefix('!') {
                Some(n) => (true, n),
                None => (false, item),
            };
            if *negated.get_or_insert(neg) != neg {
                return Err(err(
                    "mixes negated (!) and plain methods: list the allowed methods, or only negated ones",
                ));
            }
            let method = AuthMethod::ALL
                .into_iter()
                .find(|m| m.name() == name)
                .ok_or_else(|| {
                    err("names an unknown method: use password, md5, gss, sspi, scram-sha-256 or none, each optionally prefixed with !")
                })?;
            if listed & method.bit() != 0 {
                return Err(err("names a method twice"));
            }
            listed |= method.bit();
        }
        let all = RequireAuth::default().allowed;
        let allowed = if negated == Some(true) {
            all & !listed
        } else {
            listed
        };
        Ok(RequireAuth {
            allowed,
            written: value.to_string(),
            given: true,
        })
    }

    /// True when the server may use `method`.
    pub fn allows(&self, method: AuthMethod) -> bool {
        self.allowed & method.bit() != 0
    }

    /// True when `require_auth` was given (any restriction).
    pub fn is_given(&self) -> bool {
        self.given
    }

    /// The value as written, e.g. `scram-sha-256` or `!password,!md5`.
    pub fn as_written(&self) -> &str {
        &self.written
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_libpq_lists() {
        let r = RequireAuth::parse("scram-sha-256").unwrap();
        assert!(r.allows(AuthMethod::ScramSha256));
        assert!(!r.allows(AuthMethod::Md5) && !r.allows(AuthMethod::None));
        let r = RequireAuth::parse("!password,!md5").unwrap();
        assert!(!r.allows(AuthMethod::Password) && !r.allows(AuthMethod::Md5));
        assert!(r.allows(AuthMethod::ScramSha256) && r.allows(AuthMethod::None));
        let r = RequireAuth::parse("!none").unwrap();
        assert!(!r.allows(AuthMethod::None) && r.allows(AuthMethod::Password));
        assert!(RequireAuth::parse("").unwrap().allows(AuthMethod::Password));
        for bad in ["scram", "md5,!none", "md5,md5", "!md5,!md5", ","] {
            assert!(RequireAuth::parse(bad).is_err(), "{bad}");
        }
    }
}
