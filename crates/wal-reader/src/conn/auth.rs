//! Startup and authentication: the startup packet with `replication=database`,
//! then trust, cleartext, md5, SCRAM-SHA-256 and SCRAM-SHA-256-PLUS (channel
//! binding to the server certificate), under the rules of docs/security.md that
//! `policy.rs` holds for both connection kinds: no cleartext or md5 password over an
//! unencrypted link unless `sslmode=disable` is explicit, `require_auth`, and
//! `channel_binding=require` met or refused.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Buf;
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;

use super::framing::{parse_error, Frame};
use super::policy::{self, AuthPolicy, Link, Request};
use super::transport::Transport;
use super::ReplicationConnection;
use crate::conninfo::{ChannelBindingMode, PgConnectOptions};
use crate::error::ReaderError;
use outbox_event::redact::printable;

/// Set once the superuser warning was logged (once per process).
static SUPERUSER_WARNED: AtomicBool = AtomicBool::new(false);

/// A login in progress: what the rules allow next, and the SCRAM exchange once
/// started.
struct Login {
    policy: AuthPolicy,
    scram: Option<ScramSha256>,
}

impl ReplicationConnection {
    /// The `tls-server-end-point` binding of this connection's server certificate.
    fn server_end_point(&self) -> Option<Vec<u8>> {
        match &self.stream {
            Transport::Tls(t) => {
                let cert = t.get_ref().1.peer_certificates()?.first()?;
                crate::tls::tls_server_end_point(cert.as_ref())
            }
            _ => None,
        }
    }

    /// The link under this login, for [`AuthPolicy`].
    fn link(&self) -> Link {
        match &self.stream {
            Transport::Tls(_) => Link::Tls {
                end_point: self.server_end_point().is_some(),
            },
            Transport::Unix(_) => Link::Unix,
            Transport::Tcp(_) => Link::PlainTcp,
        }
    }

    /// Sends the startup packet and answers the server until it is ready for
    /// queries: authentication requests, parameters, the backend key.
    pub(super) async fn startup(&mut self, opts: &PgConnectOptions) -> Result<(), ReaderError> {
        // `options` as libpq sends it, with the search path of every session
        // (docs/security.md, "SQL sessions"): this connection runs SQL too.
        let options = opts.startup_options();
        let params = [
            ("user", opts.user.as_str()),
            ("database", opts.dbname.as_str()),
            ("replication", "database"),
            ("application_name", opts.application_name.as_str()),
            ("client_encoding", "UTF8"),
            ("options", options.as_str()),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.wbuf)?;
        self.flush().await?;

        let mut login = Login {
            policy: AuthPolicy::new(opts, self.link()),
            scram: None,
        };
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                b'R' => self.authenticate(frame.body(), opts, &mut login).await?,
                b'S' | b'K' => self.on_parameter(frame)?,
                b'Z' => {
                    if self.superuser && !SUPERUSER_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "Postgres role {:?} is a superuser: the relay needs only LOGIN REPLICATION and a few grants; connect as the role of sql/role.sql (docs/security.md)",
                            opts.user
                        );
                    }
                    return Ok(());
                }
                b'E' => {
                    return Err(ReaderError::from_server(
                        parse_error(frame.body()),
                        &opts.user,
                        None,
                    ))
                }
                b'N' => {}
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} during startup",
                        other as char
                    )))
                }
            }
        }
    }

    /// Answers one AuthenticationRequest (`body`: the message after its tag), or
    /// records AuthenticationOk, under the login's policy.
    async fn authenticate(
        &mut self,
        mut body: &[u8],
        opts: &PgConnectOptions,
        login: &mut Login,
    ) -> Result<(), ReaderError> {
        if body.len() < 4 {
            return Err(ReaderError::Protocol("short authentication request".into()));
        }
        let kind = body.get_i32();
        let Some(request) = Request::parse(kind, body) else {
            return login.policy.on_ok().map_err(ReaderError::Precondition);
        };
        login
            .policy
            .on_request(&request)
            .map_err(ReaderError::Precondition)?;
        match request {
            Request::Cleartext => {
                let pw = self.password(opts)?;
                frontend::password_message(pw.as_bytes(), &mut self.wbuf)?;
                self.flush().await?;
            }
            Request::Md5 => {
                if body.len() < 4 {
                    return Err(ReaderError::Protocol("short md5 salt".into()));
                }
                let mut salt = [0u8; 4];
                salt.copy_from_slice(&body[..4]);
                let pw = self.password(opts)?;
                let hash = postgres_protocol::authentication::md5_hash(
                    opts.user.as_bytes(),
                    pw.as_bytes(),
                    salt,
                );
                frontend::password_message(hash.as_bytes(), &mut self.wbuf)?;
                self.flush().await?;
            }
            Request::Sasl(offer) => {
                login.scram = Some(self.sasl_start(offer, opts, &login.policy).await?);
            }
            Request::SaslContinue => {
                let s = login.scram.as_mut().ok_or_else(|| {
                    ReaderError::Protocol("SASL continue without SASL start".into())
                })?;
                s.update(body).map_err(|e| ReaderError::Auth {
                    user: opts.user.clone(),
                    message: format!("SCRAM exchange failed: {e}"),
                })?;
                frontend::sasl_response(s.message(), &mut self.wbuf)?;
                self.flush().await?;
            }
            Request::SaslFinal => {
                let s = login
                    .scram
                    .as_mut()
                    .ok_or_else(|| ReaderError::Protocol("SASL final without SASL start".into()))?;
                s.finish(body).map_err(|e| ReaderError::Auth {
                    user: opts.user.clone(),
                    message: format!("the server's SCRAM proof is invalid: {e}"),
                })?;
            }
            Request::Other(2) => return Err(ReaderError::UnsupportedAuth("Kerberos V5".into())),
            Request::Other(7 | 8) => return Err(ReaderError::UnsupportedAuth("GSSAPI".into())),
            Request::Other(9) => return Err(ReaderError::UnsupportedAuth("SSPI".into())),
            Request::Other(other) => {
                return Err(ReaderError::UnsupportedAuth(format!("code {other}")))
            }
        }
        Ok(())
    }

    /// Chooses the SCRAM mechanism and channel binding for the server's `offer` and
    /// sends the first SASL message.
    async fn sasl_start(
        &mut self,
        offer: &[u8],
        opts: &PgConnectOptions,
        policy: &AuthPolicy,
    ) -> Result<ScramSha256, ReaderError> {
        let mechanisms = policy::mechanisms(offer);
        let offers_plus = mechanisms.contains(&SCRAM_SHA_256_PLUS.as_bytes());
        let (mechanism, binding) = match self.server_end_point() {
            Some(ep) if policy.binds() => {
                (SCRAM_SHA_256_PLUS, ChannelBinding::tls_server_end_point(ep))
            }
            _ if !mechanisms.contains(&SCRAM_SHA_256.as_bytes()) => {
                let names = mechanisms
                    .iter()
                    .map(|m| String::from_utf8_lossy(m).into_owned())
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ReaderError::UnsupportedAuth(
                    printable(&format!("SASL ({names})")).into_owned(),
                ));
            }
            // Over TLS with binding allowed but not offered: 'y' (lets the server
            // detect a stripped PLUS offer).
            _ if self.tls
                && !offers_plus
                && opts.channel_binding != ChannelBindingMode::Disable =>
            {
                (SCRAM_SHA_256, ChannelBinding::unrequested())
            }
            _ => (SCRAM_SHA_256, ChannelBinding::unsupported()),
        };
        let pw = self.password(opts)?;
        let s = ScramSha256::new(pw.as_bytes(), binding);
        frontend::sasl_initial_response(mechanism, s.message(), &mut self.wbuf)?;
        self.flush().await?;
        Ok(s)
    }

    /// ParameterStatus (the server's version, whether the role is a superuser) and
    /// BackendKeyData (the backend's pid).
    fn on_parameter(&mut self, frame: Frame) -> Result<(), ReaderError> {
        match frame.parse()? {
            Message::ParameterStatus(p) => {
                let bad = |e| ReaderError::Protocol(format!("malformed ParameterStatus: {e}"));
                let (name, value) = (p.name().map_err(bad)?, p.value().map_err(bad)?);
                if name == "server_version" {
                    self.server_version = value.to_string();
                }
                if name == "is_superuser" {
                    self.superuser = value == "on";
                }
            }
            Message::BackendKeyData(k) => self.backend_pid = k.process_id(),
            _ => {}
        }
        Ok(())
    }

    fn password(&self, opts: &PgConnectOptions) -> Result<String, ReaderError> {
        opts.login_password()
            .ok_or_else(|| ReaderError::PasswordRequired(opts.user.clone()))
    }
}
