//! TLS for both Postgres connections (replication and SQL), following libpq's
//! `sslmode` rules (docs/security.md has the table):
//!
//! - `prefer`, `allow`, `require`: encrypt; when a root certificate is in effect
//!   (`sslrootcert`, `PGSSLROOTCERT`, or `~/.postgresql/root.crt` when it exists) the
//!   chain is verified as for `verify-ca`, otherwise the certificate is not checked;
//! - `verify-ca`: the chain must lead to the root certificate (a name mismatch is
//!   accepted);
//! - `verify-full`: the chain, and the certificate must name `host`;
//!   `sslrootcert=system` uses the system roots (only with verify-full).

mod client_cert;
mod guard;
mod sql;

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::conninfo::{PgConnectOptions, SslMode};
pub use sql::{connect_sql, describe_pg_error, SqlConnectError};

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
    #[error("sslmode={0} needs a root certificate to verify the server against: add sslrootcert=/path/to/ca.pem to [postgres] url (or set PGSSLROOTCERT, or install ~/.postgresql/root.crt)")]
    NoRoot(&'static str),
    #[error("cannot use {key} {path} of [postgres] url: {why}")]
    ClientCert {
        key: &'static str,
        path: String,
        why: String,
    },
    #[error("TLS configuration failed: {0}")]
    Rustls(#[from] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_pem(path: &std::path::Path) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
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
    Ok(roots)
}

/// The root certificates in effect, if any (see the module docs).
fn load_roots(opts: &PgConnectOptions) -> Result<Option<RootCertStore>, TlsSetupError> {
    match &opts.sslrootcert {
        None => Ok(None),
        Some(path) if path.as_os_str() == "system" => {
            let mut roots = RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(TlsSetupError::EmptyRoot(
                    "system (no system root certificates found)".into(),
                ));
            }
            Ok(Some(roots))
        }
        Some(path) => load_pem(path).map(Some),
    }
}

/// How the server's certificate is checked.
enum Verify {
    /// Encryption without authentication (`require`/`prefer` without a root).
    Nothing,
    /// The chain must lead to a root; any name (`verify-ca`, or a weaker mode with
    /// a root certificate in effect).
    Chain(RootCertStore),
    /// The chain and the host name (`verify-full`).
    Full(RootCertStore),
}

/// The rustls client configuration for `opts.sslmode`, or `None` for `disable`.
/// With `sslcert`, the client certificate is presented when the server asks for one.
pub fn client_config(opts: &PgConnectOptions) -> Result<Option<Arc<ClientConfig>>, TlsSetupError> {
    let verify = match opts.sslmode {
        SslMode::Disable => return Ok(None),
        // libpq verifies the chain whenever a root certificate is in effect.
        SslMode::Allow | SslMode::Prefer | SslMode::Require => match load_roots(opts)? {
            Some(roots) => Verify::Chain(roots),
            None => Verify::Nothing,
        },
        SslMode::VerifyCa => {
            Verify::Chain(load_roots(opts)?.ok_or(TlsSetupError::NoRoot("verify-ca"))?)
        }
        SslMode::VerifyFull => {
            Verify::Full(load_roots(opts)?.ok_or(TlsSetupError::NoRoot("verify-full"))?)
        }
    };
    let builder =
        ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match verify {
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider()))),
        Verify::Chain(roots) => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
        }
        Verify::Full(roots) => builder.with_root_certificates(roots),
    };
    let config = match client_cert::load(opts)? {
        None => builder.with_no_client_auth(),
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).map_err(|e| {
            TlsSetupError::ClientCert {
                key: "sslkey",
                path: opts
                    .sslkey
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                why: format!("it does not fit sslcert or cannot be read ({e}); check the pair, and sslpassword for an encrypted key"),
            }
        })?,
    };
    Ok(Some(Arc::new(config)))
}

/// The `tls-server-end-point` channel binding data of RFC 5929 for the server's
/// certificate: its hash with the hash function of its signature algorithm (SHA-256
/// for MD5 and SHA-1). `None` when the algorithm has no such hash we can compute
/// (Ed25519, RSA-PSS, SHA-512): Postgres cannot bind those either.
pub fn tls_server_end_point(cert: &[u8]) -> Option<Vec<u8>> {
    use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
    let oid = signature_algorithm_oid(cert)?;
    // 1.2.840.113549.1.1.{4,5,11,12}: md5/sha1/sha256/sha384 WithRSAEncryption;
    // 1.2.840.10045.4.1 / 4.3.{2,3}: ecdsa-with-SHA1/SHA256/SHA384.
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04];
    let sha384 = match oid {
        [p @ .., 4 | 5 | 11] if p == RSA => false,
        [p @ .., 12] if p == RSA => true,
        [p @ .., 1] if p == ECDSA => false,
        [p @ .., 3, 2] if p == ECDSA => false,
        [p @ .., 3, 3] if p == ECDSA => true,
        _ => return None,
    };
    let suite = if sha384 {
        TLS13_AES_256_GCM_SHA384
    } else {
        TLS13_AES_128_GCM_SHA256
    };
    let hash = suite.tls13()?.common.hash_provider.hash(cert);
    Some(hash.as_ref().to_vec())
}

/// One DER TLV at the start of `b`: (tag, contents, rest).
fn der_tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, &x| (a << 8) | x as usize);
        b = &b[n..];
        len
    };
    if b.len() < len {
        return None;
    }
    Some((tag, &b[..len], &b[len..]))
}

/// The OID bytes of `Certificate.signatureAlgorithm`.
fn signature_algorithm_oid(cert: &[u8]) -> Option<&[u8]> {
    let (0x30, body, _) = der_tlv(cert)? else {
        return None;
    };
    let (0x30, _tbs, rest) = der_tlv(body)? else {
        return None;
    };
    let (0x30, alg, _) = der_tlv(rest)? else {
        return None;
    };
    let (0x06, oid, _) = der_tlv(alg)? else {
        return None;
    };
    Some(oid)
}

/// The number of certificates in `pem` that parse (DER inside PEM `CERTIFICATE`
/// blocks that rustls accepts as trust anchors). The AMQP side uses it to refuse a
/// `ca_file` without one.
pub fn count_pem_certificates(pem: &[u8]) -> usize {
    let mut roots = RootCertStore::empty();
    let certs: Vec<_> = rustls_pemfile::certs(&mut &pem[..]).flatten().collect();
    let (added, _) = roots.add_parsable_certificates(certs);
    added
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

/// `sslmode=require`/`prefer` without a root certificate: encryption without
/// authentication (libpq's behaviour).
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

/// `sslmode=verify-ca` (and `require`/`prefer` with a root certificate): the chain
/// must lead to the root certificate; the name is not checked.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_certificates_and_hashes_the_end_point() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(count_pem_certificates(cert.pem().as_bytes()), 1);
        assert_eq!(count_pem_certificates(b""), 0);
        assert_eq!(
            count_pem_certificates(b"-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n"),
            0
        );
        // rcgen signs with ECDSA P-256 SHA-256: a 32-byte SHA-256 end point.
        let ep = tls_server_end_point(cert.der()).unwrap();
        assert_eq!(ep.len(), 32);
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(tls_server_end_point(cert.der()).unwrap().len(), 48);
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(tls_server_end_point(cert.der()), None);
        assert_eq!(tls_server_end_point(b"\x30\x03garbage"), None);
    }
}
