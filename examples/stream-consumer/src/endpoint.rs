//! The stream URL: parsed into the client's options, and redacted for logs.

use super::*;

/// A URL or conninfo with its password replaced by `***`, for logs and errors.
pub fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if let Some((userinfo, host)) = authority.rsplit_once('@') {
            if let Some((user, _password)) = userinfo.split_once(':') {
                return format!("{scheme}://{user}:***@{host}{path}");
            }
        }
        return url.to_string();
    }
    // key=value conninfo: hide the value of password=.
    url.split(' ')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A parsed `rabbitmq-stream[+tls]://user:password@host:port/vhost` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    pub user: String,
    pub password: String,
    pub host: String,
    pub port: u16,
    pub vhost: String,
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Endpoint {
    /// Parses a stream URL; the error names the fix.
    pub fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("rabbitmq-stream+tls://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("rabbitmq-stream://") {
            (false, r)
        } else {
            bail!(
                "{} is not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL; fix the \
                 scheme of --stream-url",
                redact(url)
            );
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            Some(u) => {
                let (user, password) = u.split_once(':').unwrap_or((u, ""));
                (percent_decode(user), percent_decode(password))
            }
            None => ("guest".to_string(), "guest".to_string()),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => match p.parse::<u16>() {
                Ok(port) => (h, port),
                Err(_) => bail!("{} has an invalid port; fix --stream-url", redact(url)),
            },
            None => (hostport, if tls { 5551 } else { 5552 }),
        };
        if host.is_empty() {
            bail!("{} has no host; fix --stream-url", redact(url));
        }
        let path = path.split(['?', '#']).next().unwrap_or_default();
        let vhost = if path.is_empty() {
            "/".to_string()
        } else {
            percent_decode(path)
        };
        Ok(Endpoint {
            tls,
            user,
            password,
            host: host.to_string(),
            port,
            vhost,
        })
    }

    fn tls(&self, ca_file: Option<&str>) -> TlsConfiguration {
        let mut tls = TlsConfiguration::default();
        tls.enable(self.tls);
        if self.tls {
            tls.trust_certificates(false);
            tls.add_root_certificates_path(
                ca_file
                    .unwrap_or("/etc/ssl/certs/ca-certificates.crt")
                    .to_string(),
            );
        }
        tls
    }

    pub(crate) fn client_options(&self, ca_file: Option<&str>) -> ClientOptions {
        ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .tls(self.tls(ca_file))
            .build()
    }

    /// A stream-client environment on this endpoint.
    pub async fn environment(&self, ca_file: Option<&str>) -> Result<Environment, ClientError> {
        Environment::builder()
            .host(&self.host)
            .port(self.port)
            .username(&self.user)
            .password(&self.password)
            .virtual_host(&self.vhost)
            .tls(self.tls(ca_file))
            .build()
            .await
    }
}
