//! What the client lets the server do during authentication, on both connection
//! kinds (the replication connection's `auth.rs` and the SQL connection's guard in
//! `tls/guard.rs` ask it at each authentication request): docs/security.md.
//!
//! - no cleartext or md5 password over an unencrypted TCP link, unless
//!   `sslmode=disable` was given explicitly;
//! - `require_auth` (libpq 16): only the listed methods, and a login without any
//!   authentication only when `none` is listed;
//! - `channel_binding=require`: the login must be SCRAM-SHA-256-PLUS, completed.
//!
//! Each refusal is a sentence that names the fix; the caller turns it into its
//! definite error (exit 2, never retried).

use postgres_protocol::authentication::sasl::SCRAM_SHA_256_PLUS;

use crate::conninfo::{AuthMethod, ChannelBindingMode, PgConnectOptions, SslMode};

/// What the link under the login is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    Tls {
        /// The server certificate has a `tls-server-end-point` hash the client can
        /// bind to.
        end_point: bool,
    },
    Unix,
    PlainTcp,
}

/// The authentication state of one login.
#[derive(Debug)]
pub(crate) struct AuthPolicy {
    user: String,
    link: Link,
    explicit_plain: bool,
    require_auth: crate::conninfo::RequireAuth,
    channel_binding: ChannelBindingMode,
    /// An authentication request was seen (anything but AuthenticationOk).
    asked: bool,
    /// SASL started, and with SCRAM-SHA-256-PLUS.
    sasl: bool,
    plus: bool,
    /// SASLFinal was seen (the server proved it knows the password).
    sasl_final: bool,
}

/// An authentication request from the server, by its code.
pub(crate) enum Request<'a> {
    Cleartext,
    Md5,
    /// SASL, with the mechanisms offered (NUL-separated in the message).
    Sasl(&'a [u8]),
    SaslContinue,
    SaslFinal,
    /// Kerberos, GSSAPI, SSPI or an unknown code: the relay supports none.
    Other(i32),
}

impl Request<'_> {
    /// The request of an AuthenticationRequest body (after its 4-byte code); `None`
    /// for AuthenticationOk.
    pub(crate) fn parse(code: i32, rest: &[u8]) -> Option<Request<'_>> {
        Some(match code {
            0 => return None,
            3 => Request::Cleartext,
            5 => Request::Md5,
            10 => Request::Sasl(rest),
            11 => Request::SaslContinue,
            12 => Request::SaslFinal,
            other => Request::Other(other),
        })
    }
}

/// The SASL mechanisms of an AuthenticationSASL body.
pub(crate) fn mechanisms(body: &[u8]) -> Vec<&[u8]> {
    body.split(|b| *b == 0).filter(|m| !m.is_empty()).collect()
}

impl AuthPolicy {
    pub(crate) fn new(opts: &PgConnectOptions, link: Link) -> AuthPolicy {
        AuthPolicy {
            user: opts.user.clone(),
            link,
            explicit_plain: opts.sslmode == SslMode::Disable && opts.sslmode_explicit,
            require_auth: opts.require_auth.clone(),
            channel_binding: opts.channel_binding,
            asked: false,
            sasl: false,
            plus: false,
            sasl_final: false,
        }
    }

    /// Whether the client may answer `request`; `Err` is the refusal's sentence.
    pub(crate) fn on_request(&mut self, request: &Request<'_>) -> Result<(), String> {
        self.asked = true;
        match request {
            Request::Cleartext => self.password("cleartext", AuthMethod::Password),
            Request::Md5 => self.password("md5", AuthMethod::Md5),
            Request::Sasl(body) => self.sasl(body),
            Request::SaslContinue => Ok(()),
            Request::SaslFinal => {
                self.sasl_final = true;
                Ok(())
            }
            Request::Other(code) => {
                let method = match code {
                    7 | 8 => Some(AuthMethod::Gss),
                    9 => Some(AuthMethod::Sspi),
                    _ => None,
                };
                match method {
                    Some(m) if !self.require_auth.allows(m) => Err(self.forbidden(m.name())),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Whether the login may end here (AuthenticationOk).
    pub(crate) fn on_ok(&self) -> Result<(), String> {
        if self.channel_binding == ChannelBindingMode::Require && !(self.plus && self.sasl_final) {
            return Err(format!(
                "channel_binding=require, but Postgres logged user {:?} in without SCRAM-SHA-256-PLUS channel binding (trust or another method in pg_hba.conf): use scram-sha-256 over hostssl",
                self.user
            ));
        }
        if !self.asked && !self.require_auth.allows(AuthMethod::None) {
            return Err(format!(
                "require_auth={} forbids a login without authentication, but Postgres let user {:?} in without asking for a password (trust in pg_hba.conf): use scram-sha-256 in pg_hba.conf, or add none to require_auth",
                self.require_auth.as_written(),
                self.user
            ));
        }
        if self.sasl && !self.sasl_final {
            return Err(format!(
                "Postgres ended the SCRAM login of user {:?} without proving that it knows the password: this is not the real server, or something in between tampers with the connection",
                self.user
            ));
        }
        Ok(())
    }

    fn forbidden(&self, what: &str) -> String {
        format!(
            "require_auth={} forbids the {what} authentication Postgres asks user {:?} for: use a method require_auth lists in pg_hba.conf (for scram-sha-256, set password_encryption = scram-sha-256 and reset the role's password), or change require_auth in [postgres] url",
            self.require_auth.as_written(),
            self.user
        )
    }

    fn password(&self, what: &str, method: AuthMethod) -> Result<(), String> {
        if self.channel_binding == ChannelBindingMode::Require {
            return Err(format!(
                "channel_binding=require, but Postgres asks user {:?} for a {what} password instead of SCRAM-SHA-256-PLUS: use scram-sha-256 in the server's pg_hba.conf over hostssl",
                self.user
            ));
        }
        if !self.require_auth.allows(method) {
            return Err(self.forbidden(what));
        }
        if self.link == Link::PlainTcp && !self.explicit_plain {
            return Err(format!(
                "Postgres asks user {:?} for a {what} password over an unencrypted connection, and outbox-relay does not send a password that way: turn TLS on in the server and use sslmode=verify-full, or use scram-sha-256 in pg_hba.conf",
                self.user
            ));
        }
        Ok(())
    }

    fn sasl(&mut self, body: &[u8]) -> Result<(), String> {
        if !self.require_auth.allows(AuthMethod::ScramSha256) {
            return Err(self.forbidden("SCRAM"));
        }
        let offered = mechanisms(body);
        let offers_plus = offered.contains(&SCRAM_SHA_256_PLUS.as_bytes());
        let can_bind = matches!(self.link, Link::Tls { end_point: true })
            && self.channel_binding != ChannelBindingMode::Disable;
        self.sasl = true;
        self.plus = offers_plus && can_bind;
        if self.channel_binding == ChannelBindingMode::Require && !self.plus {
            let why = if !matches!(self.link, Link::Tls { .. }) {
                "the connection is not TLS"
            } else if !offers_plus {
                "the server does not offer SCRAM-SHA-256-PLUS (is the connection TLS, and the role's password stored as SCRAM?)"
            } else {
                "the server certificate's signature algorithm has no tls-server-end-point hash"
            };
            return Err(format!(
                "channel_binding=require cannot be met for user {:?}: {why}; use scram-sha-256 over hostssl",
                self.user
            ));
        }
        // Without SCRAM-SHA-256 in the offer either, the caller reports the
        // mechanisms it cannot use.
        Ok(())
    }

    /// True when the SASL exchange uses SCRAM-SHA-256-PLUS.
    pub(crate) fn binds(&self) -> bool {
        self.plus
    }
}
