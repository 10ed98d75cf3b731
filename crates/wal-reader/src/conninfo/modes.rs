//! libpq's `sslmode` and `channel_binding` values.

use super::ConnInfoError;

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// Plain TCP first; TLS when the server refuses the plain login.
    Allow,
    /// TLS if the server offers it, plain TCP otherwise (libpq's default). With a root
    /// certificate the chain is verified (as libpq does).
    #[default]
    Prefer,
    /// TLS required. With a root certificate (`sslrootcert`, `PGSSLROOTCERT` or
    /// `~/.postgresql/root.crt`) the chain is verified as for `VerifyCa`; without one
    /// the connection is encrypted but not authenticated (libpq's rule).
    Require,
    /// TLS required, certificate chain verified against the root certificate.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host.
    VerifyFull,
}

impl SslMode {
    pub(super) fn parse(v: &str) -> Result<SslMode, ConnInfoError> {
        Ok(match v {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return Err(ConnInfoError(
                "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full"
                    .into(),
            )),
        })
    }

    /// The libpq name of the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// True for the modes that never fall back to a plain connection.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// libpq's `channel_binding` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChannelBindingMode {
    /// Never use channel binding.
    Disable,
    /// Use SCRAM-SHA-256-PLUS when the connection is TLS and the server offers it.
    #[default]
    Prefer,
    /// Authenticate only with SCRAM-SHA-256-PLUS (tls-server-end-point): a server
    /// that logs us in any other way (trust, password, md5, SCRAM without binding) is
    /// refused.
    Require,
}

impl ChannelBindingMode {
    pub(super) fn parse(v: &str) -> Result<ChannelBindingMode, ConnInfoError> {
        Ok(match v {
            "disable" => ChannelBindingMode::Disable,
            "prefer" => ChannelBindingMode::Prefer,
            "require" => ChannelBindingMode::Require,
            _ => {
                return Err(ConnInfoError(
                    "channel_binding must be one of disable, prefer, require".into(),
                ))
            }
        })
    }
}
