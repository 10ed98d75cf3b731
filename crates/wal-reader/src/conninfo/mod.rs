//! Connection options: libpq-style URLs (`postgresql://user:pw@host:port/db?sslmode=…`)
//! and key=value conninfo strings (`host=… port=… user=… password=… dbname=…`).
//!
//! We parse these ourselves rather than with `tokio_postgres::Config` because the
//! replication connection is our own transport, and because libpq's TLS rules
//! (`sslmode`, `sslrootcert`, `channel_binding`) must be honoured exactly; where the
//! relay is stricter than libpq, docs/security.md says so.
//!
//! Secrets: the password is kept out of `Debug`, and no parse error ever echoes a
//! value from the string (only parameter names, and not even those once a password
//! was seen), so a malformed URL cannot print a fragment of the password.

mod modes;
mod passfile;
mod require_auth;
mod syntax;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub use modes::{ChannelBindingMode, SslMode};
pub use require_auth::{AuthMethod, RequireAuth};
pub use syntax::PERCENT_ENCODE_PASSWORD;
use syntax::{parse_keyvalue, parse_url};

/// The Postgres connection string could not be parsed. The message never contains
/// the password, nor any other value of the string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid [postgres] url: {0}")]
pub struct ConnInfoError(pub String);

/// Parsed connection options.
#[derive(Clone, PartialEq, Eq)]
pub struct PgConnectOptions {
    /// Host name, IP address, or a Unix socket directory (starts with `/`). With TLS
    /// this is the name the certificate is checked against (verify-full).
    pub host: String,
    /// libpq's `hostaddr`: the IP address to connect to instead of resolving `host`.
    pub hostaddr: Option<String>,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    pub sslmode: SslMode,
    /// True when `sslmode` was given (in the string or `PGSSLMODE`), not defaulted.
    /// Only an explicit `sslmode=disable` lets a password go over a plain TCP link in
    /// cleartext or md5 (docs/security.md).
    pub sslmode_explicit: bool,
    /// The root certificate file in effect: `sslrootcert`, `PGSSLROOTCERT`, or
    /// `~/.postgresql/root.crt` when that file exists; `system` for the system roots.
    pub sslrootcert: Option<PathBuf>,
    /// True when `sslrootcert` was given (string or `PGSSLROOTCERT`): an unreadable
    /// file is then an error in every TLS mode (libpq silently ignores it with
    /// `require`; see docs/security.md).
    pub sslrootcert_explicit: bool,
    pub channel_binding: ChannelBindingMode,
    /// libpq's `require_auth`: the authentication methods the server may use.
    pub require_auth: RequireAuth,
    /// The client certificate (`sslcert`, `PGSSLCERT`, or
    /// `~/.postgresql/postgresql.crt` when that file exists) and its key (`sslkey`,
    /// `PGSSLKEY`, or `~/.postgresql/postgresql.key`), presented when the server asks
    /// for one (pg_hba.conf `cert`, `clientcert=verify-ca|verify-full`).
    pub sslcert: Option<PathBuf>,
    pub sslkey: Option<PathBuf>,
    /// The passphrase of an encrypted `sslkey` (PKCS#8 `ENCRYPTED PRIVATE KEY`).
    pub sslpassword: Option<String>,
    /// The password file (`passfile`, `PGPASSFILE`, or `~/.pgpass`), read at every
    /// login when no password is given ([`PgConnectOptions::login_password`]).
    pub passfile: Option<PathBuf>,
    pub application_name: String,
    /// libpq's `options` (or `PGOPTIONS`): command-line options for the server
    /// session, sent as the startup packet's `options` as libpq sends them. The
    /// relay appends [`SEARCH_PATH_OPTION`] ([`PgConnectOptions::startup_options`]).
    pub options: Option<String>,
    /// libpq's `connect_timeout`; `None` means [`DEFAULT_CONNECT_TIMEOUT`]
    /// ([`PgConnectOptions::connect_limit`]).
    pub connect_timeout: Option<Duration>,
}

/// How long opening a connection (replication or SQL) may take when the connection
/// string sets no `connect_timeout`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// What every session the relay opens (SQL and replication) runs with: catalog names
/// resolve in `pg_catalog` only, so a function planted in `public` under a catalog
/// name is never called (docs/security.md, "SQL sessions").
pub const SEARCH_PATH_OPTION: &str = "-c search_path=pg_catalog";

impl fmt::Debug for PgConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnectOptions")
            .field("host", &self.host)
            .field("hostaddr", &self.hostaddr)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("dbname", &self.dbname)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("channel_binding", &self.channel_binding)
            .field("require_auth", &self.require_auth)
            .field("sslcert", &self.sslcert)
            .field("sslkey", &self.sslkey)
            .field("sslpassword", &self.sslpassword.as_ref().map(|_| "***"))
            .field("passfile", &self.passfile)
            .field("application_name", &self.application_name)
            .field("options", &self.options)
            .finish()
    }
}

/// Parameters accepted and ignored: they do not change how this client connects.
const IGNORED: &[&str] = &[
    "client_encoding",
    "replication",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "fallback_application_name",
];

/// libpq's `target_session_attrs` chooses among several hosts; the relay connects to
/// one host, so only `any` (libpq's default) means what it says. Any other value is
/// refused rather than ignored: `read-write` would promise a check that is not made.
fn check_target_session_attrs(value: &str) -> Result<(), ConnInfoError> {
    const LIBPQ: &[&str] = &[
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ];
    if value == "any" {
        return Ok(());
    }
    let named = if LIBPQ.contains(&value) {
        format!("={value}")
    } else {
        String::new()
    };
    Err(ConnInfoError(format!(
        "target_session_attrs{named} is not supported: the relay connects to the one host of the URL, which must be the primary, so remove the parameter (or set it to any)"
    )))
}

/// What the connection string gave that the environment may still supply, or that
/// is checked after it.
#[derive(Default)]
struct Given {
    port: Option<String>,
    sslmode: Option<SslMode>,
    channel_binding: Option<ChannelBindingMode>,
    require_auth: Option<RequireAuth>,
    gssencmode: Option<String>,
}

/// The error for a parameter libpq does not know. `name` never comes from inside a
/// value (parse_keyvalue and parse_url refuse what would make it so), but a name that
/// is not a plain identifier is not echoed anyway.
fn unknown_parameter(name: &str) -> ConnInfoError {
    let shown = if name.len() <= 40 && name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
        format!(" {name:?}")
    } else {
        String::new()
    };
    ConnInfoError(format!("unknown connection parameter{shown}"))
}

/// libpq's `options` may set any server option but `search_path`: the relay's
/// sessions resolve catalog names in `pg_catalog` only (docs/security.md).
fn check_options(options: Option<&str>) -> Result<(), ConnInfoError> {
    match options {
        Some(o) if o.to_ascii_lowercase().contains("search_path") => Err(ConnInfoError(
            "options may not set search_path: the relay's sessions use pg_catalog only and name every table with its schema, so remove it from options (or PGOPTIONS)".into(),
        )),
        _ => Ok(()),
    }
}

/// GSSAPI encryption is not spoken: `require` is refused, `disable` and `prefer`
/// mean plain TLS rules.
fn check_gssencmode(mode: Option<&str>) -> Result<(), ConnInfoError> {
    match mode {
        None | Some("disable") | Some("prefer") => Ok(()),
        Some("require") => Err(ConnInfoError(
            "gssencmode=require is not supported (outbox-relay has no GSSAPI encryption): remove it and use sslmode=verify-full".into(),
        )),
        Some(_) => Err(ConnInfoError(
            "gssencmode must be one of disable, prefer, require".into(),
        )),
    }
}

impl PgConnectOptions {
    /// The bound on opening one connection: `connect_timeout`, or
    /// [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_limit(&self) -> Duration {
        self.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT)
    }

    /// Parses a `postgresql://` / `postgres://` URL or a key=value conninfo string.
    /// Missing values fall back to `PGHOST`, `PGHOSTADDR`, `PGPORT`, `PGUSER`,
    /// `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, `PGSSLROOTCERT`, `PGCHANNELBINDING`,
    /// `PGGSSENCMODE`, `PGREQUIREAUTH`, `PGSSLCERT`, `PGSSLKEY`, `PGPASSFILE`, then
    /// libpq's defaults.
    pub fn parse(s: &str) -> Result<PgConnectOptions, ConnInfoError> {
        Self::parse_with_env(s, &|k| std::env::var(k).ok())
    }

    /// [`PgConnectOptions::parse`] with the environment given by `env` (tests use it
    /// to set `HOME` and `PGSSLROOTCERT` without touching the process environment).
    pub fn parse_with_env(
        s: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PgConnectOptions, ConnInfoError> {
        let s = s.trim();
        let pairs = if s.starts_with("postgresql://") || s.starts_with("postgres://") {
            parse_url(s)?
        } else {
            parse_keyvalue(s)?
        };
        let mut o = PgConnectOptions::unset();
        let given = o.apply(pairs)?;
        let env = |k: &str| env(k).filter(|v| !v.is_empty());
        o.login_from_env(given.port, &env)?;
        o.tls_from_env(
            given.sslmode,
            given.channel_binding,
            given.require_auth,
            &env,
        )?;
        check_gssencmode(given.gssencmode.or_else(|| env("PGGSSENCMODE")).as_deref())?;
        if o.host.contains(',') {
            return Err(ConnInfoError(
                "several hosts are not supported: give one host (for HA, point it at a virtual IP or DNS name that follows the primary)".into(),
            ));
        }
        Ok(o)
    }

    /// Options before the connection string and the environment are read.
    fn unset() -> PgConnectOptions {
        PgConnectOptions {
            host: String::new(),
            hostaddr: None,
            port: 0,
            user: String::new(),
            password: None,
            dbname: String::new(),
            sslmode: SslMode::Prefer,
            sslmode_explicit: false,
            sslrootcert: None,
            sslrootcert_explicit: false,
            channel_binding: ChannelBindingMode::Prefer,
            require_auth: RequireAuth::default(),
            sslcert: None,
            sslkey: None,
            sslpassword: None,
            passfile: None,
            application_name: "outbox-relay".into(),
            options: None,
            connect_timeout: None,
        }
    }

    /// Sets what the connection string's pairs give; returns those that the
    /// environment may still supply or that are checked later.
    fn apply(&mut self, pairs: Vec<(String, String)>) -> Result<Given, ConnInfoError> {
        let o = self;
        let mut given = Given::default();
        for (k, v) in pairs {
            match k.as_str() {
                "host" => o.host = v,
                "hostaddr" => o.hostaddr = Some(v).filter(|v| !v.is_empty()),
                "port" => given.port = Some(v),
                "user" => o.user = v,
                "password" => o.password = Some(v),
                "dbname" => o.dbname = v,
                "sslmode" => given.sslmode = Some(SslMode::parse(&v)?),
                "sslrootcert" => {
                    o.sslrootcert = Some(PathBuf::from(v)).filter(|p| !p.as_os_str().is_empty())
                }
                "channel_binding" => given.channel_binding = Some(ChannelBindingMode::parse(&v)?),
                "require_auth" => given.require_auth = Some(RequireAuth::parse(&v)?),
                "sslcert" => o.sslcert = Some(PathBuf::from(v)),
                "sslkey" => o.sslkey = Some(PathBuf::from(v)),
                "sslpassword" => o.sslpassword = Some(v).filter(|v| !v.is_empty()),
                "passfile" => o.passfile = Some(PathBuf::from(v)),
                "gssencmode" => given.gssencmode = Some(v),
                "application_name" => o.application_name = v,
                "options" => o.options = Some(v).filter(|v| !v.trim().is_empty()),
                "connect_timeout" => {
                    let secs: u64 = v.parse().map_err(|_| {
                        ConnInfoError("connect_timeout is not a number of seconds".into())
                    })?;
                    o.connect_timeout = (secs > 0).then(|| Duration::from_secs(secs));
                }
                "target_session_attrs" => check_target_session_attrs(&v)?,
                k if IGNORED.contains(&k) => {}
                other => return Err(unknown_parameter(other)),
            }
        }
        Ok(given)
    }

    /// Host, address, port, user, password and database: the string's, else the
    /// environment's, else libpq's defaults.
    fn login_from_env(
        &mut self,
        port: Option<String>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConnInfoError> {
        let o = self;
        if o.host.is_empty() {
            o.host = env("PGHOST").unwrap_or_else(|| "localhost".into());
        }
        if o.hostaddr.is_none() {
            o.hostaddr = env("PGHOSTADDR");
        }
        if let Some(a) = &o.hostaddr {
            if a.parse::<std::net::IpAddr>().is_err() {
                return Err(ConnInfoError(
                    "hostaddr must be a numeric IP address (host= is the name)".into(),
                ));
            }
        }
        let port = port.or_else(|| env("PGPORT"));
        o.port =
            match port {
                None => 5432,
                Some(p) => p.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
                    ConnInfoError("the port is not a number from 1 to 65535".into())
                })?,
            };
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
        if o.options.is_none() {
            o.options = env("PGOPTIONS").filter(|v| !v.trim().is_empty());
        }
        check_options(o.options.as_deref())
    }

    /// The startup packet's `options`: libpq's `options` as given, then
    /// [`SEARCH_PATH_OPTION`] (the server applies them in order).
    pub fn startup_options(&self) -> String {
        match &self.options {
            Some(given) => format!("{} {SEARCH_PATH_OPTION}", given.trim()),
            None => SEARCH_PATH_OPTION.to_string(),
        }
    }

    /// The root certificate, `sslmode`, `channel_binding`, `require_auth` and the
    /// client files: the string's, else the environment's, else libpq's defaults;
    /// then the combinations libpq refuses.
    fn tls_from_env(
        &mut self,
        sslmode: Option<SslMode>,
        channel_binding: Option<ChannelBindingMode>,
        require_auth: Option<RequireAuth>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConnInfoError> {
        let o = self;
        if o.sslrootcert.is_none() {
            o.sslrootcert = env("PGSSLROOTCERT").map(PathBuf::from);
        }
        o.sslrootcert_explicit = o.sslrootcert.is_some();
        if o.sslrootcert.is_none() {
            // libpq reads ~/.postgresql/root.crt when it exists.
            if let Some(home) = env("HOME") {
                let default = PathBuf::from(home).join(".postgresql/root.crt");
                if default.is_file() {
                    o.sslrootcert = Some(default);
                }
            }
        }
        let sslmode = match sslmode {
            Some(m) => Some(m),
            None => env("PGSSLMODE").map(|m| SslMode::parse(&m)).transpose()?,
        };
        o.sslmode_explicit = sslmode.is_some();
        let system = o.sslrootcert.as_deref() == Some(std::path::Path::new("system"));
        o.sslmode = match sslmode {
            Some(m) => m,
            // libpq: sslrootcert=system makes verify-full the default.
            None if system => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        if system && o.sslmode != SslMode::VerifyFull {
            return Err(ConnInfoError(format!(
                "sslrootcert=system may only be used with sslmode=verify-full (libpq's rule), not sslmode={}",
                o.sslmode.as_str()
            )));
        }
        o.channel_binding = match channel_binding {
            Some(c) => c,
            None => env("PGCHANNELBINDING")
                .map(|c| ChannelBindingMode::parse(&c))
                .transpose()?
                .unwrap_or_default(),
        };
        o.require_auth = match require_auth {
            Some(r) => r,
            None => match env("PGREQUIREAUTH") {
                Some(v) => RequireAuth::parse(&v)?,
                None => RequireAuth::default(),
            },
        };
        o.client_files(env)?;
        if o.channel_binding == ChannelBindingMode::Require && o.sslmode == SslMode::Disable {
            return Err(ConnInfoError(
                "channel_binding=require needs TLS, but sslmode=disable: use sslmode=verify-full"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `sslcert`, `sslkey` and `passfile` with their environment variables and
    /// libpq's defaults under `HOME`; an empty value means "none" (libpq's way to
    /// turn a default file off).
    fn client_files(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConnInfoError> {
        let home = env("HOME").map(PathBuf::from);
        let pick = |given: Option<PathBuf>, var: &str, default: Option<PathBuf>| match given
            .or_else(|| env(var).map(PathBuf::from))
        {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p),
            None => default,
        };
        let default_cert = home
            .as_ref()
            .map(|h| h.join(".postgresql/postgresql.crt"))
            .filter(|p| p.is_file());
        let cert_given = self.sslcert.is_some() || env("PGSSLCERT").is_some();
        self.sslcert = pick(self.sslcert.take(), "PGSSLCERT", default_cert);
        let default_key = self
            .sslcert
            .as_ref()
            .and(home.as_ref())
            .map(|h| h.join(".postgresql/postgresql.key"));
        self.sslkey = pick(self.sslkey.take(), "PGSSLKEY", default_key);
        if self.sslcert.is_some() && self.sslkey.is_none() {
            return Err(ConnInfoError(
                "sslcert is set but sslkey is not: give the client certificate's private key file as sslkey".into(),
            ));
        }
        if cert_given && self.sslmode == SslMode::Disable {
            tracing::debug!("sslcert is ignored with sslmode=disable");
        }
        self.passfile = pick(
            self.passfile.take(),
            "PGPASSFILE",
            home.map(|h| h.join(".pgpass")),
        );
        Ok(())
    }

    /// The password to log in with: `password` (or `PGPASSWORD`), else the matching
    /// line of the password file, read now (so a rotated file is used at the next
    /// reconnect). `None` when neither has one.
    pub fn login_password(&self) -> Option<String> {
        if let Some(p) = &self.password {
            return Some(p.clone());
        }
        let path = self.passfile.as_ref()?;
        let host = match (&self.hostaddr, self.host.is_empty()) {
            (Some(a), true) => a.as_str(),
            _ => self.host.as_str(),
        };
        passfile::lookup(
            path,
            &passfile::Target {
                host,
                port: self.port,
                dbname: &self.dbname,
                user: &self.user,
            },
        )
    }

    /// True when `host` is a Unix socket directory (and no `hostaddr` is given).
    pub fn is_unix_socket(&self) -> bool {
        self.host.starts_with('/') && self.hostaddr.is_none()
    }

    /// The address to connect to: `hostaddr` when given, else `host`.
    pub fn connect_host(&self) -> &str {
        self.hostaddr.as_deref().unwrap_or(&self.host)
    }

    /// `host:port/dbname` for messages (no user, no password).
    pub fn display_target(&self) -> String {
        match &self.hostaddr {
            Some(a) => format!("{} ({a}):{}/{}", self.host, self.port, self.dbname),
            None => format!("{}:{}/{}", self.host, self.port, self.dbname),
        }
    }

    /// Options for an ordinary SQL connection with tokio-postgres. TLS is negotiated
    /// by the connector from [`crate::tls`], which applies `sslmode`'s verification;
    /// `channel_binding` is passed on (the connector supports tls-server-end-point).
    pub fn to_tokio_postgres(&self) -> tokio_postgres::Config {
        use tokio_postgres::config::{ChannelBinding as Cb, SslMode as Tm};
        let mut c = tokio_postgres::Config::new();
        if self.is_unix_socket() {
            c.host_path(&self.host);
        } else {
            c.host(&self.host);
        }
        if let Some(a) = self.hostaddr.as_ref().and_then(|a| a.parse().ok()) {
            c.hostaddr(a);
        }
        c.port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(&self.application_name)
            .options(self.startup_options())
            // libpq ignores sslmode on a Unix socket, as the replication connection
            // does: no TLS request there.
            .ssl_mode(match self.sslmode {
                _ if self.is_unix_socket() => Tm::Disable,
                SslMode::Disable => Tm::Disable,
                SslMode::Allow | SslMode::Prefer => Tm::Prefer,
                _ => Tm::Require,
            })
            .channel_binding(match self.channel_binding {
                ChannelBindingMode::Disable => Cb::Disable,
                ChannelBindingMode::Prefer => Cb::Prefer,
                ChannelBindingMode::Require => Cb::Require,
            });
        if let Some(p) = self.login_password() {
            c.password(p);
        }
        if let Some(t) = self.connect_timeout {
            c.connect_timeout(t);
        }
        c
    }
}
