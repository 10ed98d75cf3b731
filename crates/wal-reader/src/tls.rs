//! TLS for both Postgres connections (replication and SQL), following libpq's
//! `sslmode`: `require` encrypts without verifying, `verify-ca` verifies the chain
//! against `sslrootcert`, `verify-full` also checks the host name.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::conninfo::{PgConnectOptions, SslMode};

/// TLS could not be set up from the configured files.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read sslrootcert {path}: {source}; point sslrootcert in [postgres] url at a readable PEM file")]
    ReadRoot {
        path: String,
        source: std::io::Error,
    },
    #[error("sslrootcert {0} holds no PEM certificate; give the CA certificate in PEM form")]
    EmptyRoot(String),
    #[error("sslmode={0} needs a CA to verify against: add sslrootcert=/path/to/ca.pem to [postgres] url")]
    NoRoot(&'static str),
    #[error("TLS configuration failed: {0}")]
    Rustls(#[from] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_roots(opts: &PgConnectOptions, mode: &'static str) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    match &opts.sslrootcert {
        Some(path) if path.as_os_str() == "system" => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
        Some(path) => {
            let pem = std::fs::read(path).map_err(|source| TlsSetupError::ReadRoot {
                path: path.display().to_string(),
                source,
            })?;
            for cert in rustls_pemfile::certs(&mut pem.as_slice()).flatten() {
                roots.add(cert)?;
            }
            if roots.is_empty() {
                return Err(TlsSetupError::EmptyRoot(path.display().to_string()));
            }
        }
        None => {
            // libpq reads ~/.postgresql/root.crt by default.
            let home = std::env::var("HOME").unwrap_or_default();
            let default = std::path::Path::new(&home).join(".postgresql/root.crt");
            let pem = std::fs::read(&default).map_err(|_| TlsSetupError::NoRoot(mode))?;
            for cert in rustls_pemfile::certs(&mut pem.as_slice()).flatten() {
                roots.add(cert)?;
            }
            if roots.is_empty() {
                return Err(TlsSetupError::NoRoot(mode));
            }
        }
    }
    Ok(roots)
}

/// The rustls client configuration for `opts.sslmode`, or `None` for `disable`.
pub fn client_config(opts: &PgConnectOptions) -> Result<Option<Arc<ClientConfig>>, TlsSetupError> {
    let builder =
        ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let config = match opts.sslmode {
        SslMode::Disable => return Ok(None),
        SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider())))
            .with_no_client_auth(),
        SslMode::VerifyCa => {
            let roots = load_roots(opts, "verify-ca")?;
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
                .with_no_client_auth()
        }
        SslMode::VerifyFull => {
            let roots = load_roots(opts, "verify-full")?;
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(Some(Arc::new(config)))
}

/// The server name to present and (for verify-full) check.
pub fn server_name(opts: &PgConnectOptions) -> Result<ServerName<'static>, TlsSetupError> {
    ServerName::try_from(opts.host.clone()).map_err(|_| {
        TlsSetupError::Rustls(rustls::Error::General(format!(
            "{:?} is not a valid TLS server name",
            opts.host
        )))
    })
}

/// A connector for tokio-postgres SQL connections with the same TLS rules.
pub fn make_tls_connect(
    opts: &PgConnectOptions,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsSetupError> {
    let config = match client_config(opts)? {
        Some(c) => (*c).clone(),
        // sslmode=disable: tokio-postgres never calls the connector.
        None => ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth(),
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// `sslmode=require`/`prefer`: encryption without authentication (libpq's behaviour).
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must lead to the CA; the name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
