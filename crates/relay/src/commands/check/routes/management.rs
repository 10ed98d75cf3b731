//! The broker's own exchanges, bindings and queues, read from the RabbitMQ
//! management plugin's HTTP API (`[rabbitmq] management_url`), read-only.
//!
//! ```text
//!   management_url (http:// or https://, optional user:password@, optional path prefix)
//!     plain http:// beyond loopback: refused unless allow_insecure_http (credentials.rs)
//!     credentials: the URL's own, else management_user and its password file,
//!                  else those of the first [rabbitmq] url (password_file, when
//!                  set, gives the password), never the AMQP password for another user
//!     vhost: that of the first [rabbitmq] url
//!   GET {prefix}/api/exchanges/{vhost}, /api/bindings/{vhost}, /api/queues/{vhost}
//!     ─► routing::Topology (queues_complete: the broker's every queue is known)
//! ```
//!
//! Credentials never appear in an error: the URL is shown through `redact_url`.
//! An `alternate-exchange` may also come from a policy: the exchange names the
//! policy that applies to it, and `GET {prefix}/api/policies/{vhost}` gives its
//! definition (the exchange's own argument wins, as in RabbitMQ). When the
//! policies cannot be read (the API refuses them to this user), an exchange under
//! a policy that routes a key nowhere is reported "not evaluated", never
//! unroutable.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use publisher::routing::{Binding, Destination, Exchange, Kind, Topology};
use rustls::pki_types::ServerName;
use secrecy::ExposeSecret;
use serde_json::Value;

use crate::config::{redact_url, Config};

mod credentials;

/// How long one request may take, connection and TLS included.
const TIMEOUT: Duration = Duration::from_secs(15);
/// The largest answer read.
const MAX_ANSWER: u64 = 64 << 20;

/// Where and as whom to ask.
pub struct Management {
    tls: bool,
    host: String,
    port: u16,
    prefix: String,
    vhost: String,
    authorization: String,
    /// The URL without credentials, for messages.
    pub shown: String,
    /// What `check --routes` warns about the credentials (sent in clear).
    pub warnings: Vec<String>,
}

/// `scheme://[user[:password]@]host[:port][/path]` split up (no query or fragment
/// meaning).
struct Url<'a> {
    scheme: &'a str,
    user: Option<String>,
    password: Option<String>,
    host: &'a str,
    port: Option<u16>,
    path: &'a str,
}

fn parse_url(url: &str) -> Option<Url<'_>> {
    let (scheme, rest) = url.split_once("://")?;
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(i) => (Some(&authority[..i]), &authority[i + 1..]),
        None => (None, authority),
    };
    let (user, password) = match userinfo {
        None => (None, None),
        Some(u) => match u.split_once(':') {
            Some((user, password)) => (Some(decode(user)), Some(decode(password))),
            None => (Some(decode(u)), None),
        },
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        let port = after.strip_prefix(':').map(str::parse).transpose().ok()?;
        (h, port)
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p.parse().ok()?)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    Some(Url {
        scheme,
        user,
        password,
        host,
        port,
        path,
    })
}

/// Percent-decoding (lossy on invalid UTF-8).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encoding of one path segment (everything but unreserved characters).
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Management {
    /// From `[rabbitmq] management_url`; `None` when it is `""`.
    pub fn from_config(cfg: &Config) -> Result<Option<Management>, String> {
        let url = cfg.rabbitmq.management_url.expose_secret();
        if url.is_empty() {
            return Ok(None);
        }
        let shown = redact_url(url);
        let bad = || {
            format!(
                "[rabbitmq] management_url ({shown}) is not an http:// or https:// URL: give e.g. http://127.0.0.1:15672"
            )
        };
        let m = parse_url(url).ok_or_else(bad)?;
        let tls = match m.scheme {
            "http" => false,
            "https" => true,
            _ => return Err(bad()),
        };
        // Before any secret is read.
        let warnings = credentials::in_clear(cfg, url, &shown)?;
        // The broker's credentials and vhost: those of the first AMQP URL.
        let urls = cfg.rabbitmq.expose_urls();
        let amqp = urls.first().and_then(|u| parse_url(u));
        let vhost = match amqp.as_ref().map(|a| a.path) {
            None | Some("") | Some("/") => "/".to_string(),
            Some(p) => decode(&p[1..]),
        };
        let (user, password) = credentials::pick(credentials::Given {
            url_user: m.user,
            url_password: m.password,
            amqp_user: amqp.as_ref().and_then(|a| a.user.clone()),
            amqp_password: amqp.as_ref().and_then(|a| a.password.clone()),
            cfg,
        })?;
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Ok(Some(Management {
            tls,
            host: m.host.to_string(),
            port: m.port.unwrap_or(if tls { 443 } else { 80 }),
            prefix: m.path.trim_end_matches('/').to_string(),
            vhost,
            authorization: format!("Basic {pair}"),
            shown,
            warnings,
        }))
    }

    /// The vhost whose objects are read.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// The broker's exchanges (the default one aside), bindings and queues.
    pub async fn topology(&self, ca_file: Option<&Path>) -> Result<Topology, String> {
        let vhost = encode(&self.vhost);
        let exchanges = self
            .get(&format!("/api/exchanges/{vhost}"), ca_file)
            .await?;
        let bindings = self.get(&format!("/api/bindings/{vhost}"), ca_file).await?;
        let queues = self
            .get(&format!("/api/queues/{vhost}?columns=name"), ca_file)
            .await?;
        // Only needed when some exchange is under a policy; when they cannot be
        // read, such exchanges' alternate exchanges are unknown, not absent.
        let under_policy = exchanges.as_array().is_some_and(|xs| {
            xs.iter()
                .any(|x| x.get("policy").is_some_and(|p| p.is_string()))
        });
        let policies = match under_policy {
            true => self
                .get(&format!("/api/policies/{vhost}"), ca_file)
                .await
                .ok(),
            false => None,
        };
        topology_of(&exchanges, &bindings, &queues, policies.as_ref()).ok_or_else(|| {
            format!(
                "the management API at {} answered with unexpected JSON",
                self.shown
            )
        })
    }

    async fn get(&self, path: &str, ca_file: Option<&Path>) -> Result<Value, String> {
        self.get_if_found(path, ca_file).await?.ok_or_else(|| {
            format!(
                "the management API at {} does not know vhost {:?} (HTTP 404): check [rabbitmq] url's vhost and management_url",
                self.shown, self.vhost
            )
        })
    }

    /// GET `path` of the API (after its prefix); `None` when it answers 404 (an
    /// object, or on an older broker an endpoint, that does not exist).
    pub async fn get_if_found(
        &self,
        path: &str,
        ca_file: Option<&Path>,
    ) -> Result<Option<Value>, String> {
        let body = match tokio::time::timeout(TIMEOUT, self.ask(path, ca_file)).await {
            Ok(answer) => match answer? {
                Some(body) => body,
                None => return Ok(None),
            },
            Err(_) => {
                return Err(format!(
                    "the management API at {} did not answer within {} s",
                    self.shown,
                    TIMEOUT.as_secs()
                ))
            }
        };
        serde_json::from_slice(&body).map(Some).map_err(|e| {
            format!(
                "the management API at {} answered {path} with something other than JSON ({e})",
                self.shown
            )
        })
    }

    /// The body of a 200 answer, `None` for a 404.
    async fn ask(&self, path: &str, ca_file: Option<&Path>) -> Result<Option<Vec<u8>>, String> {
        // HTTP/1.0: the answer ends with the connection, never chunked.
        let request = format!(
            "GET {}{path} HTTP/1.0\r\nHost: {}\r\nAuthorization: {}\r\nAccept: application/json\r\nUser-Agent: outbox-relay\r\n\r\n",
            self.prefix, self.host, self.authorization
        );
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        let tcp = tokio::net::TcpStream::connect((host, self.port))
            .await
            .map_err(|e| {
                format!(
                    "cannot connect to the management API at {}: {e}",
                    self.shown
                )
            })?;
        let answer = if self.tls {
            let config =
                publisher::https_client_config(ca_file).map_err(|e| e.to_string())?;
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let name = ServerName::try_from(host.to_string())
                .map_err(|e| format!("[rabbitmq] management_url: {e}"))?;
            let tls = connector.connect(name, tcp).await.map_err(|e| {
                format!(
                    "the TLS handshake with the management API at {} failed ({e}): give the CA that signed its certificate in [rabbitmq] ca_file",
                    self.shown
                )
            })?;
            let mut tls = tls;
            crate::endpoint::http_exchange::exchange(&mut tls, &request, MAX_ANSWER).await
        } else {
            let mut tcp = tcp;
            crate::endpoint::http_exchange::exchange(&mut tcp, &request, MAX_ANSWER).await
        }
        .map_err(|e| format!("the management API at {}: {e}", self.shown))?;
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| format!("the management API at {} sent no HTTP answer", self.shown))?;
        let head = String::from_utf8_lossy(&answer[..split]);
        let status = head.split(' ').nth(1).unwrap_or("");
        match status {
            "200" => Ok(Some(answer[split + 4..].to_vec())),
            "401" => Err(format!(
                "the management API at {} refused the credentials (HTTP 401): give the broker's user (with the monitoring or management tag) in [rabbitmq] url or management_url",
                self.shown
            )),
            "404" => Ok(None),
            other => Err(format!(
                "the management API at {} answered HTTP {other} to {path}",
                self.shown
            )),
        }
    }
}

fn arguments(v: Option<&Value>) -> BTreeMap<String, Value> {
    match v {
        Some(Value::Object(map)) => map.clone().into_iter().collect(),
        _ => BTreeMap::new(),
    }
}

/// The API's JSON lists as a [`Topology`]; `None` when they are not lists of objects.
/// `policies`: the vhost's policies, `None` when they could not be read.
pub(crate) fn topology_of(
    exchanges: &Value,
    bindings: &Value,
    queues: &Value,
    policies: Option<&Value>,
) -> Option<Topology> {
    let mut t = Topology {
        queues_complete: true,
        ..Topology::default()
    };
    // Policy name → its alternate exchange (None: it sets none).
    let policy_ae: Option<BTreeMap<&str, Option<&str>>> =
        policies.and_then(Value::as_array).map(|ps| {
            ps.iter()
                .filter_map(|p| {
                    let name = p.get("name")?.as_str()?;
                    let ae = p
                        .get("definition")
                        .and_then(|d| d.get("alternate-exchange"))
                        .and_then(Value::as_str);
                    Some((name, ae))
                })
                .collect()
        });
    for x in exchanges.as_array()? {
        let name = x.get("name")?.as_str()?;
        if name.is_empty() {
            continue;
        }
        let args = arguments(x.get("arguments"));
        let mut exchange = Exchange::new(Kind::of(x.get("type")?.as_str()?, &args));
        exchange.internal = x.get("internal").and_then(Value::as_bool).unwrap_or(false);
        exchange.alternate = args
            .get("alternate-exchange")
            .and_then(Value::as_str)
            .map(str::to_string);
        if let (None, Some(policy)) = (
            &exchange.alternate,
            x.get("policy")
                .and_then(Value::as_str)
                .filter(|p| !p.is_empty()),
        ) {
            match policy_ae.as_ref().and_then(|known| known.get(policy)) {
                Some(ae) => exchange.alternate = ae.map(str::to_string),
                None => exchange.unread_policy = Some(policy.to_string()),
            }
        }
        t.exchanges.insert(name.to_string(), exchange);
    }
    for q in queues.as_array()? {
        t.queues.insert(q.get("name")?.as_str()?.to_string());
    }
    for b in bindings.as_array()? {
        let source = b.get("source")?.as_str()?;
        // The default exchange's implicit bindings: routing by queue name.
        if source.is_empty() {
            continue;
        }
        let destination = b.get("destination")?.as_str()?.to_string();
        let destination = match b.get("destination_type")?.as_str()? {
            "exchange" => Destination::Exchange(destination),
            _ => Destination::Queue(destination),
        };
        let binding = Binding {
            destination,
            routing_key: b.get("routing_key")?.as_str()?.to_string(),
            arguments: arguments(b.get("arguments")),
        };
        if let Some(x) = t.exchanges.get_mut(source) {
            x.bindings.push(binding);
        }
    }
    Some(t)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn urls_split_with_credentials_decoded() {
        let u = parse_url("https://us%40r:p%3Ass@mq.example:15443/rabbit/").unwrap();
        assert_eq!(
            (u.scheme, u.host, u.port, u.path),
            ("https", "mq.example", Some(15443), "/rabbit/")
        );
        assert_eq!(
            (u.user.as_deref(), u.password.as_deref()),
            (Some("us@r"), Some("p:ss"))
        );
        let u = parse_url("http://127.0.0.1:15672").unwrap();
        assert_eq!(
            (u.host, u.port, u.path, u.user),
            ("127.0.0.1", Some(15672), "", None)
        );
        let u = parse_url("amqp://guest:guest@[::1]:5672/%2f").unwrap();
        assert_eq!(
            (u.host, u.port, decode(&u.path[1..]).as_str()),
            ("::1", Some(5672), "/")
        );
        assert!(parse_url("no-scheme").is_none());
        assert_eq!(encode("/"), "%2F");
        assert_eq!(encode("a b.c"), "a%20b.c");
        assert_eq!(decode("%2"), "%2");
    }

    #[test]
    fn api_lists_become_a_topology() {
        let exchanges = json!([
            {"name": "", "type": "direct", "internal": false, "arguments": {}},
            {"name": "orders", "type": "topic", "internal": false,
             "arguments": {"alternate-exchange": "unrouted"}},
            {"name": "hash", "type": "x-consistent-hash", "internal": false, "arguments": {}},
            {"name": "inner", "type": "fanout", "internal": true, "arguments": {}}
        ]);
        let bindings = json!([
            {"source": "", "destination": "billing", "destination_type": "queue",
             "routing_key": "billing", "arguments": {}},
            {"source": "orders", "destination": "billing", "destination_type": "queue",
             "routing_key": "order.*", "arguments": {}},
            {"source": "orders", "destination": "inner", "destination_type": "exchange",
             "routing_key": "#", "arguments": {"x-k": 1}}
        ]);
        let queues = json!([{"name": "billing"}]);
        let t = topology_of(&exchanges, &bindings, &queues, None).unwrap();
        assert!(t.queues_complete);
        assert_eq!(t.exchanges.len(), 3);
        let orders = &t.exchanges["orders"];
        assert_eq!(orders.kind, Kind::Topic);
        assert_eq!(orders.alternate.as_deref(), Some("unrouted"));
        assert_eq!(orders.bindings.len(), 2);
        assert_eq!(
            orders.bindings[1].destination,
            Destination::Exchange("inner".into())
        );
        assert_eq!(orders.bindings[1].arguments["x-k"], json!(1));
        assert!(t.exchanges["inner"].internal);
        assert_eq!(
            t.exchanges["hash"].kind,
            Kind::Other("x-consistent-hash".into())
        );
        assert!(topology_of(&json!({}), &bindings, &queues, None).is_none());
    }

    #[test]
    fn an_alternate_exchange_may_come_from_a_policy() {
        let exchanges = json!([
            {"name": "by-policy", "type": "direct", "internal": false, "arguments": {},
             "policy": "ae"},
            {"name": "both", "type": "direct", "internal": false,
             "arguments": {"alternate-exchange": "own"}, "policy": "ae"},
            {"name": "other-policy", "type": "direct", "internal": false, "arguments": {},
             "policy": "ttl-only"},
            {"name": "plain", "type": "direct", "internal": false, "arguments": {}}
        ]);
        let policies = json!([
            {"name": "ae", "pattern": ".*", "apply-to": "exchanges",
             "definition": {"alternate-exchange": "unrouted"}, "priority": 0},
            {"name": "ttl-only", "pattern": "^other", "apply-to": "all",
             "definition": {"message-ttl": 1000}, "priority": 1}
        ]);
        let (b, q) = (json!([]), json!([]));
        let t = topology_of(&exchanges, &b, &q, Some(&policies)).unwrap();
        let ae = |name: &str| t.exchanges[name].alternate.clone();
        assert_eq!(ae("by-policy").as_deref(), Some("unrouted"));
        // The exchange's own argument wins over its policy's.
        assert_eq!(ae("both").as_deref(), Some("own"));
        assert_eq!(ae("other-policy"), None);
        assert_eq!(ae("plain"), None);
        assert!(t.exchanges.values().all(|x| x.unread_policy.is_none()));
        // Policies unread: the alternate exchange of one under a policy is unknown.
        let t = topology_of(&exchanges, &b, &q, None).unwrap();
        assert_eq!(
            t.exchanges["by-policy"].unread_policy.as_deref(),
            Some("ae")
        );
        assert_eq!(t.exchanges["both"].alternate.as_deref(), Some("own"));
        assert_eq!(t.exchanges["plain"].unread_policy, None);
    }
}
