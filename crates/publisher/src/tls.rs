//! The files behind a broker connection, for both protocols (AMQP and the stream
//! protocol; docs/security.md): the CA file, the client certificate and its key, and
//! the password file. Every one is read when a connection is opened, so a rotated
//! password or a renewed certificate is used from the next reconnect on; an unusable
//! one is a configuration error that names its key, never a panic.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

use crate::error::{redact_url, PublishError};

/// How the relay authenticates to the broker besides the URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientAuth {
    /// PEM certificate chain presented over TLS (`[rabbitmq] cert_file`); with an
    /// AMQP URL's `?auth_mechanism=external`, RabbitMQ logs the relay in as the
    /// user its certificate names.
    pub cert_file: Option<PathBuf>,
    /// Its PEM private key (`[rabbitmq] key_file`); only its owner may read it.
    pub key_file: Option<PathBuf>,
    /// A file holding the password, which replaces the URL's
    /// (`[rabbitmq] password_file` / `stream_password_file`).
    pub password_file: Option<PathBuf>,
}

/// The key a file belongs to, for errors.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keys {
    Amqp,
    Stream,
}

impl Keys {
    fn password(self) -> &'static str {
        match self {
            Keys::Amqp => "password_file",
            Keys::Stream => "stream_password_file",
        }
    }
}

fn file_error(key: &'static str, path: &Path, reason: impl std::fmt::Display) -> PublishError {
    PublishError::File {
        key,
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The password in `path`: the file's content without a trailing line break.
pub(crate) fn read_password(path: &Path, keys: Keys) -> Result<String, PublishError> {
    // Checked at every read, as at load: a mode changed while the relay runs is
    // caught at the next connect.
    check_mode(keys.password(), path)?;
    let text = std::fs::read_to_string(path).map_err(|e| file_error(keys.password(), path, e))?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(file_error(keys.password(), path, "it is empty"));
    }
    Ok(password.to_string())
}

/// `url` with its password replaced by `password` (percent-encoded). The URL must
/// name a user (checked by [`check_password_file_url`]).
pub(crate) fn with_password(url: &str, password: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some(at) = rest.rfind('@') else {
        return url.to_string();
    };
    let user = rest[..at].split(':').next().unwrap_or_default();
    let mut encoded = String::with_capacity(password.len() * 3);
    for b in password.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    format!("{scheme}://{user}:{encoded}@{}", &rest[at + 1..])
}

/// A password file replaces the password of a URL that names its user.
pub(crate) fn check_password_file_url(url: &str, keys: Keys) -> Result<(), PublishError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let user = rest
        .rfind('@')
        .map(|at| rest[..at].split(':').next().unwrap_or_default());
    if user.is_none_or(str::is_empty) {
        return Err(PublishError::InvalidConfig {
            key: keys.password(),
            reason: format!(
                "{} names no user: write the user in the URL (user@host); the file holds only the password",
                redact_url(url)
            ),
        });
    }
    Ok(())
}

/// The CA file's certificates, or the system's roots without one. Certificates the
/// TLS library cannot use are skipped, but a file without any is an error.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, PublishError> {
    let mut roots = RootCertStore::empty();
    let Some(path) = ca_file else {
        let (added, _) =
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        if added == 0 {
            return Err(PublishError::CaFile {
                path: "(the system's roots)".into(),
                reason: "no system root certificate was found; set [rabbitmq] ca_file".into(),
            });
        }
        return Ok(roots);
    };
    let ca_error = |reason: String| PublishError::CaFile {
        path: path.display().to_string(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut &pem[..]).flatten().collect();
    let (added, _) = roots.add_parsable_certificates(certs);
    // A file without a usable certificate is a configuration error, never a silent
    // fall-back to other roots.
    if added == 0 {
        return Err(ca_error(
            "it holds no parsable PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    Ok(roots)
}

/// Checks the CA file as the stream client reads it, which gives up (panics) on a
/// single bad block: every PEM certificate must decode and be a usable root.
pub(crate) fn check_ca_file_strictly(path: &Path) -> Result<(), PublishError> {
    let ca_error = |reason: String| PublishError::CaFile {
        path: path.display().to_string(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<_, _>>()
        .map_err(|e| ca_error(format!("a PEM block does not decode ({e})")))?;
    if certs.is_empty() {
        return Err(ca_error(
            "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots
            .add(cert)
            .map_err(|e| ca_error(format!("certificate #{} cannot be used ({e})", i + 1)))?;
    }
    Ok(())
}

/// The host as a TLS server name, as the TLS clients require.
pub(crate) fn check_server_name(
    host: &str,
    key: &'static str,
    url: &str,
) -> Result<(), PublishError> {
    ServerName::try_from(host.to_string()).map(|_| ()).map_err(|_| {
        PublishError::InvalidConfig {
            key,
            reason: format!(
                "{} has a host that is not a valid TLS server name (a DNS name or a dotted IPv4 address): use the host name the broker's certificate names",
                redact_url(url)
            ),
        }
    })
}

/// The client certificate chain and key of `auth`, if one is configured.
pub(crate) fn identity(
    auth: &ClientAuth,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>, PublishError> {
    let (cert_path, key_path) = match (&auth.cert_file, &auth.key_file) {
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (c, k),
        (Some(c), None) => {
            return Err(file_error(
                "key_file",
                c,
                "cert_file is set but key_file is not: give the certificate's private key",
            ))
        }
        (None, Some(k)) => {
            return Err(file_error(
                "cert_file",
                k,
                "key_file is set but cert_file is not: give the client certificate",
            ))
        }
    };
    let pem = std::fs::read(cert_path).map_err(|e| file_error("cert_file", cert_path, e))?;
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| {
            file_error(
                "cert_file",
                cert_path,
                format!("a PEM block does not decode ({e})"),
            )
        })?;
    if chain.is_empty() {
        return Err(file_error(
            "cert_file",
            cert_path,
            "it holds no PEM certificate",
        ));
    }
    check_key_permissions(key_path)?;
    let pem = std::fs::read(key_path).map_err(|e| file_error("key_file", key_path, e))?;
    let key = rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| file_error("key_file", key_path, e))?
        .ok_or_else(|| {
            file_error(
                "key_file",
                key_path,
                "it holds no unencrypted PEM private key",
            )
        })?;
    Ok(Some((chain, key)))
}

/// The key file may be read by its owner only (0600; 0640 when root owns it), as
/// libpq requires of its own key files.
fn check_key_permissions(path: &Path) -> Result<(), PublishError> {
    check_mode("key_file", path)
}

/// A secret file must not be open to others: the program's one rule
/// (`outbox_event::secret_file`, docs/security.md).
fn check_mode(key: &'static str, path: &Path) -> Result<(), PublishError> {
    let meta = std::fs::metadata(path).map_err(|e| file_error(key, path, e))?;
    match outbox_event::secret_file::too_open(&meta) {
        Some(mode) => Err(file_error(
            key,
            path,
            format!("it has group or world access (mode {mode:o}): chmod 600 it"),
        )),
        None => Ok(()),
    }
}

/// The key file in the one format the stream client reads (PKCS#8), and the pair
/// usable together: the client unwraps both.
pub(crate) fn check_stream_identity(auth: &ClientAuth) -> Result<(), PublishError> {
    let Some((chain, _)) = identity(auth)? else {
        return Ok(());
    };
    let key_path = auth.key_file.as_deref().unwrap_or(Path::new(""));
    let pem = std::fs::read(key_path).map_err(|e| file_error("key_file", key_path, e))?;
    let key = rustls_pemfile::pkcs8_private_keys(&mut pem.as_slice())
        .next()
        .and_then(Result::ok)
        .ok_or_else(|| {
            file_error(
                "key_file",
                key_path,
                "the stream client reads only PKCS#8 keys (-----BEGIN PRIVATE KEY-----): convert it with `openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY.pk8`",
            )
        })?;
    client_config(
        RootCertStore::empty(),
        Some((chain, PrivateKeyDer::Pkcs8(key))),
    )
    .map(|_| ())
    .map_err(|e| {
        file_error(
            "key_file",
            key_path,
            format!("it does not fit cert_file ({e})"),
        )
    })
}

fn client_config(
    roots: RootCertStore,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some((chain, key)) => builder.with_client_auth_cert(chain, key),
    }
}

/// The rustls configuration of an AMQPS connection: the roots of `ca_file` (instead
/// of the system's) or the system's, and the client certificate if configured.
pub(crate) fn amqps_config(
    ca_file: Option<&Path>,
    auth: &ClientAuth,
) -> Result<ClientConfig, PublishError> {
    let roots = roots(ca_file)?;
    let identity = identity(auth)?;
    client_config(roots, identity).map_err(|e| match &auth.key_file {
        Some(k) => file_error("key_file", k, format!("it does not fit cert_file ({e})")),
        None => PublishError::InvalidConfig {
            key: "ca_file",
            reason: e.to_string(),
        },
    })
}

/// How AMQPS connections set up TLS.
#[derive(Clone, Debug)]
pub(crate) enum Tls {
    /// The operating system's roots, no client certificate.
    SystemRoots,
    /// Built at every connect from the files ([`amqps_config`]): only the
    /// certificates of `[rabbitmq] ca_file` when it is set (the system's roots are
    /// then not trusted, so a private CA is enforced), and the client certificate
    /// when one is configured (docs/security.md).
    Own,
}

/// Logs once per URL (per process) that a connection sends the broker credentials
/// unencrypted to a host other than this one.
pub(crate) fn warn_if_plaintext_beyond_loopback(url: &str, host: &str, tls: bool) {
    static WARNED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if tls || loopback {
        return;
    }
    let redacted = redact_url(url);
    let Ok(mut warned) = WARNED.lock() else {
        return;
    };
    if warned.contains(&redacted) {
        return;
    }
    tracing::warn!(url = %redacted,
        "the broker connection is not encrypted: its credentials (PLAIN) and every message cross the network in clear; use amqps:// or rabbitmq-stream+tls:// (docs/security.md)");
    warned.push(redacted);
}

/// The TLS configuration of an `https://` management API, as for AMQPS: the roots
/// of `ca_file`, else the system's (for `check --routes`).
pub fn https_client_config(
    ca_file: Option<&std::path::Path>,
) -> Result<rustls::ClientConfig, crate::PublishError> {
    amqps_config(ca_file, &crate::ClientAuth::default())
}

/// The password in `[rabbitmq] password_file`, read by the program's one secret-file
/// rule (for the management API's credentials, which are the broker's).
pub fn read_password_file(path: &std::path::Path) -> Result<String, crate::PublishError> {
    read_password(path, Keys::Amqp)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_password_file_replaces_the_urls_password() {
        assert_eq!(
            with_password("amqp://u:old@h:5672/%2f", "n/w@p:ss"),
            "amqp://u:n%2Fw%40p%3Ass@h:5672/%2f"
        );
        assert_eq!(with_password("amqp://u@h/", "p"), "amqp://u:p@h/");
        assert!(check_password_file_url("amqp://h/", Keys::Amqp).is_err());
        assert!(check_password_file_url("amqp://:x@h/", Keys::Amqp).is_err());
        assert!(check_password_file_url("rabbitmq-stream://u@h", Keys::Stream).is_ok());
        let uri: amq_protocol::uri::AMQPUri =
            with_password("amqp://u@h/", "a b%c").parse().unwrap();
        assert_eq!(uri.authority.userinfo.password, "a b%c");
    }
}
