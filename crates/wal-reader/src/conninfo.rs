//! Connection options: libpq-style URLs (`postgresql://user:pw@host:port/db?sslmode=…`)
//! and key=value conninfo strings (`host=… port=… user=… password=… dbname=…`).
//!
//! We parse these ourselves rather than with `tokio_postgres::Config` because the
//! replication connection is our own transport, and because libpq's `verify-ca` and
//! `verify-full` sslmodes must be honoured. The password is kept out of `Debug`.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS if the server offers it, unverified; plain TCP otherwise (libpq's default).
    #[default]
    Prefer,
    /// TLS required, certificate not verified.
    Require,
    /// TLS required, certificate chain verified against `sslrootcert`.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host.
    VerifyFull,
}

impl SslMode {
    fn parse(v: &str) -> Result<SslMode, ConnInfoError> {
        Ok(match v {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(ConnInfoError(format!(
                "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
            )))
            }
        })
    }
}

/// The Postgres connection string could not be parsed. The message never contains
/// the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid [postgres] url: {0}")]
pub struct ConnInfoError(pub String);

/// Parsed connection options.
#[derive(Clone, PartialEq, Eq)]
pub struct PgConnectOptions {
    /// Host name, IP address, or a Unix socket directory (starts with `/`).
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    pub sslmode: SslMode,
    pub sslrootcert: Option<PathBuf>,
    pub application_name: String,
    pub connect_timeout: Option<Duration>,
}

impl fmt::Debug for PgConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnectOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("dbname", &self.dbname)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("application_name", &self.application_name)
            .finish()
    }
}

impl PgConnectOptions {
    /// Parses a `postgresql://` / `postgres://` URL or a key=value conninfo string.
    /// Missing values fall back to `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`,
    /// `PGDATABASE`, `PGSSLMODE`, `PGSSLROOTCERT`, then libpq's defaults.
    pub fn parse(s: &str) -> Result<PgConnectOptions, ConnInfoError> {
        let s = s.trim();
        let pairs = if s.starts_with("postgresql://") || s.starts_with("postgres://") {
            parse_url(s)?
        } else {
            parse_keyvalue(s)?
        };
        let mut o = PgConnectOptions {
            host: String::new(),
            port: 0,
            user: String::new(),
            password: None,
            dbname: String::new(),
            sslmode: SslMode::Prefer,
            sslrootcert: None,
            application_name: "outbox-relay".into(),
            connect_timeout: None,
        };
        let mut sslmode = None;
        for (k, v) in pairs {
            match k.as_str() {
                "host" | "hostaddr" => o.host = v,
                "port" => {
                    o.port = v
                        .parse()
                        .map_err(|_| ConnInfoError(format!("port {v:?} is not a number")))?
                }
                "user" => o.user = v,
                "password" => o.password = Some(v),
                "dbname" => o.dbname = v,
                "sslmode" => sslmode = Some(SslMode::parse(&v)?),
                "sslrootcert" => o.sslrootcert = Some(PathBuf::from(v)),
                "application_name" => o.application_name = v,
                "connect_timeout" => {
                    let secs: u64 = v.parse().map_err(|_| {
                        ConnInfoError(format!("connect_timeout {v:?} is not a number of seconds"))
                    })?;
                    o.connect_timeout = (secs > 0).then(|| Duration::from_secs(secs));
                }
                // Accepted and ignored: they do not apply to this client.
                "client_encoding"
                | "options"
                | "replication"
                | "target_session_attrs"
                | "keepalives"
                | "keepalives_idle"
                | "gssencmode"
                | "channel_binding" => {}
                other => {
                    return Err(ConnInfoError(format!(
                        "unknown connection parameter {other:?}"
                    )))
                }
            }
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if o.host.is_empty() {
            o.host = env("PGHOST").unwrap_or_else(|| "localhost".into());
        }
        if o.port == 0 {
            o.port = env("PGPORT").and_then(|p| p.parse().ok()).unwrap_or(5432);
        }
        if o.user.is_empty() {
            o.user = env("PGUSER")
                .or_else(|| env("USER"))
                .unwrap_or_else(|| "postgres".into());
        }
        if o.password.is_none() {
            o.password = env("PGPASSWORD");
        }
        if o.dbname.is_empty() {
            o.dbname = env("PGDATABASE").unwrap_or_else(|| o.user.clone());
        }
        if o.sslrootcert.is_none() {
            o.sslrootcert = env("PGSSLROOTCERT").map(PathBuf::from);
        }
        o.sslmode = match sslmode {
            Some(m) => m,
            None => match env("PGSSLMODE") {
                Some(m) => SslMode::parse(&m)?,
                None => SslMode::Prefer,
            },
        };
        if o.host.contains(',') {
            return Err(ConnInfoError(
                "several hosts are not supported: give one host (for HA, point it at a virtual IP or DNS name that follows the primary)".into(),
            ));
        }
        Ok(o)
    }

    /// True when `host` is a Unix socket directory.
    pub fn is_unix_socket(&self) -> bool {
        self.host.starts_with('/')
    }

    /// `host:port/dbname` for messages (no user, no password).
    pub fn display_target(&self) -> String {
        format!("{}:{}/{}", self.host, self.port, self.dbname)
    }

    /// Options for an ordinary SQL connection with tokio-postgres. TLS is negotiated
    /// by the connector from [`crate::tls`], which applies `sslmode`'s verification.
    pub fn to_tokio_postgres(&self) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        if self.is_unix_socket() {
            c.host_path(&self.host);
        } else {
            c.host(&self.host);
        }
        c.port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(&self.application_name)
            .ssl_mode(match self.sslmode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            });
        if let Some(p) = &self.password {
            c.password(p);
        }
        if let Some(t) = self.connect_timeout {
            c.connect_timeout(t);
        }
        c
    }
}

fn parse_keyvalue(s: &str) -> Result<Vec<(String, String)>, ConnInfoError> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(ConnInfoError(format!(
                "expected key=value pairs or a postgresql:// URL, but {key:?} has no '='"
            )));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        if let Some(n) = chars.next() {
                            value.push(n);
                        }
                    }
                    '\'' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                return Err(ConnInfoError(format!(
                    "the quoted value of {key:?} has no closing quote"
                )));
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                if c == '\\' {
                    chars.next();
                    if let Some(n) = chars.next() {
                        value.push(n);
                    }
                    continue;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
    Ok(out)
}

fn percent_decode(s: &str, what: &str) -> Result<String, ConnInfoError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| ConnInfoError(format!("bad percent-encoding in the {what}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ConnInfoError(format!("the {what} is not UTF-8")))
}

fn parse_url(s: &str) -> Result<Vec<(String, String)>, ConnInfoError> {
    let rest = s.split_once("://").map(|(_, r)| r).unwrap_or(s);
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (rest, None),
    };
    let mut out = Vec::new();
    let hostport = match authority.rsplit_once('@') {
        Some((userinfo, hostport)) => {
            match userinfo.split_once(':') {
                Some((u, p)) => {
                    out.push(("user".into(), percent_decode(u, "user name")?));
                    out.push(("password".into(), percent_decode(p, "password")?));
                }
                None => out.push(("user".into(), percent_decode(userinfo, "user name")?)),
            }
            hostport
        }
        None => authority,
    };
    if !hostport.is_empty() {
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| ConnInfoError("an IPv6 host has no closing ']'".into()))?;
            (h.to_string(), after.strip_prefix(':').map(str::to_string))
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p.to_string())),
                None => (hostport.to_string(), None),
            }
        };
        if !host.is_empty() {
            out.push(("host".into(), percent_decode(&host, "host")?));
        }
        if let Some(p) = port.filter(|p| !p.is_empty()) {
            out.push(("port".into(), p));
        }
    }
    if let Some(db) = path.filter(|p| !p.is_empty()) {
        out.push(("dbname".into(), percent_decode(db, "database name")?));
    }
    if let Some(q) = query {
        for pair in q.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            out.push((percent_decode(k, "query")?, percent_decode(v, "query")?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_url() {
        let o = PgConnectOptions::parse(
            "postgresql://relay:s%40cret@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(o.host, "db.example");
        assert_eq!(o.port, 6543);
        assert_eq!(o.user, "relay");
        assert_eq!(o.password.as_deref(), Some("s@cret"));
        assert_eq!(o.dbname, "app");
        assert_eq!(o.sslmode, SslMode::VerifyFull);
        assert_eq!(o.sslrootcert, Some(PathBuf::from("/ca.pem")));
        assert_eq!(o.application_name, "x");
    }

    #[test]
    fn parses_keyvalue_with_quotes() {
        let o = PgConnectOptions::parse(
            "host=127.0.0.1 port = 5433 user=u password='a b\\'c' dbname=d sslmode=disable",
        )
        .unwrap();
        assert_eq!(o.port, 5433);
        assert_eq!(o.password.as_deref(), Some("a b'c"));
        assert_eq!(o.sslmode, SslMode::Disable);
    }

    #[test]
    fn ipv6_and_defaults() {
        let o = PgConnectOptions::parse("postgres://u@[::1]:5434").unwrap();
        assert_eq!(o.host, "::1");
        assert_eq!(o.port, 5434);
        assert_eq!(o.dbname, "u");
    }

    #[test]
    fn errors_never_contain_password() {
        for s in [
            "host=x password=hunter2 sslmode=bogus",
            "host=x password=hunter2 bogus=1",
            "postgresql://u:hunter2@h:notaport/db",
            "host=x password='hunter2",
        ] {
            let e = PgConnectOptions::parse(s).unwrap_err().to_string();
            assert!(!e.contains("hunter2"), "{e}");
        }
        let o = PgConnectOptions::parse("postgresql://u:hunter2@h/db").unwrap();
        assert!(!format!("{o:?}").contains("hunter2"));
    }
}
