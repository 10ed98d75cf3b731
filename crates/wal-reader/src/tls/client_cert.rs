//! The client certificate of both Postgres connections (`sslcert`, `sslkey`,
//! `sslpassword`), with libpq's permission check on the key file. Read at every
//! connection, so a renewed certificate is used from the next reconnect on.
//!
//! Keys in PEM: PKCS#8 (`PRIVATE KEY`), PKCS#1 (`RSA PRIVATE KEY`), SEC1
//! (`EC PRIVATE KEY`), and PKCS#8 encrypted with PBES2 (`ENCRYPTED PRIVATE KEY`, what
//! `openssl pkcs8 -topk8 -v2 aes-256-cbc` and OpenSSL 3's `genpkey -aes256` write),
//! decrypted with `sslpassword`. OpenSSL's older encrypted PEM (`Proc-Type:
//! 4,ENCRYPTED`) is refused with the command that converts it.

use std::path::Path;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::TlsSetupError;
use crate::conninfo::PgConnectOptions;

/// A certificate chain and its key.
pub(crate) type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn err(key: &'static str, path: &Path, why: impl std::fmt::Display) -> TlsSetupError {
    TlsSetupError::ClientCert {
        key,
        path: path.display().to_string(),
        why: why.to_string(),
    }
}

/// The client certificate and key of `opts`, if `sslcert` is in effect.
pub(crate) fn load(opts: &PgConnectOptions) -> Result<Option<Identity>, TlsSetupError> {
    let (Some(cert_path), Some(key_path)) = (&opts.sslcert, &opts.sslkey) else {
        return Ok(None);
    };
    let unreadable = |key, path: &Path, e: std::io::Error| {
        err(
            key,
            path,
            format!("{e}; point {key} at the client certificate's PEM file"),
        )
    };
    let pem = std::fs::read(cert_path).map_err(|e| unreadable("sslcert", cert_path, e))?;
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| err("sslcert", cert_path, e))?;
    if chain.is_empty() {
        return Err(err(
            "sslcert",
            cert_path,
            "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    check_key_permissions(key_path)?;
    let key = read_key(key_path, opts.sslpassword.as_deref())?;
    Ok(Some((chain, key)))
}

/// libpq's rule: a key file owned by root may be readable by its group (0640);
/// any other owner's may not be accessible by group or others at all (0600). (libpq
/// checks only files the current user or root owns; the relay checks every file.)
fn check_key_permissions(path: &Path) -> Result<(), TlsSetupError> {
    let meta = std::fs::metadata(path).map_err(|e| {
        err(
            "sslkey",
            path,
            format!("{e}; point sslkey at the client certificate's PEM key file"),
        )
    })?;
    if !meta.is_file() {
        return Err(err("sslkey", path, "it is not a plain file"));
    }
    if let Some(mode) = outbox_event::secret_file::too_open(&meta) {
        return Err(err(
            "sslkey",
            path,
            format!(
                "it has group or world access (mode {mode:o}); permissions must be {}: chmod it (libpq's rule)",
                outbox_event::secret_file::ALLOWED
            ),
        ));
    }
    Ok(())
}

fn read_key(path: &Path, password: Option<&str>) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    let pem = std::fs::read(path).map_err(|e| err("sslkey", path, e))?;
    let text = String::from_utf8_lossy(&pem);
    if text.contains("Proc-Type: 4,ENCRYPTED") {
        return Err(err(
            "sslkey",
            path,
            "it is encrypted in OpenSSL's legacy PEM format; convert it with `openssl pkcs8 -topk8 -v2 aes-256-cbc -in OLD -out NEW` (and give its passphrase as sslpassword)",
        ));
    }
    if let Some(block) = pem_block(&text, "ENCRYPTED PRIVATE KEY") {
        let Some(password) = password else {
            return Err(err(
                "sslkey",
                path,
                "it is encrypted: give its passphrase as sslpassword in [postgres] url",
            ));
        };
        return decrypt_pkcs8(block, password).map_err(|why| err("sslkey", path, why));
    }
    match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(err(
            "sslkey",
            path,
            "it holds no PEM private key (PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)",
        )),
        Err(e) => Err(err("sslkey", path, e)),
    }
}

/// The first PEM block with `label`, boundaries included.
fn pem_block<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = text.find(&begin)?;
    let stop = text[start..].find(&end)? + start + end.len();
    Some(&text[start..stop])
}

/// Decrypts a PBES2 `ENCRYPTED PRIVATE KEY` (RFC 5958 EncryptedPrivateKeyInfo).
fn decrypt_pkcs8(pem: &str, password: &str) -> Result<PrivateKeyDer<'static>, String> {
    use der::{Decode, Reader};
    let (_, doc) =
        der::Document::from_pem(pem).map_err(|e| format!("its PEM is malformed ({e})"))?;
    let (scheme, data) = der::SliceReader::new(doc.as_bytes())
        .and_then(|mut r| {
            r.sequence(|r| {
                let scheme = pkcs5::EncryptionScheme::decode(r)?;
                let data = der::asn1::OctetStringRef::decode(r)?;
                Ok((scheme, data.as_bytes().to_vec()))
            })
        })
        .map_err(|e| format!("it is not a PKCS#8 encrypted key ({e})"))?;
    let plain = scheme.decrypt(password, &data).map_err(|e| {
        format!("it cannot be decrypted with sslpassword ({e}): check the passphrase")
    })?;
    Ok(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(plain)))
}
