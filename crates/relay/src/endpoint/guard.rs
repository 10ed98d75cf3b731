//! What every request to the endpoint passes before a route sees it
//! (docs/security.md, "The metrics endpoint" and "Control"):
//!
//! ```text
//!   Host ─► one of the listener's names? else 421            (every route)
//!   /control/ ─► beyond loopback without credentials? 403
//!             ─► Origin / Sec-Fetch-Site cross-site? 403
//!             ─► POST: form-shaped Content-Type, or no X-Outbox-Relay-Control? 403
//!             ─► /control/proof: answered here (crate::control_token)
//!             ─► the configured credentials or the per-start token? else 401
//!   /metrics, /poison ─► the configured credentials (or the token), if any are set
//! ```
//!
//! The Host check defeats DNS rebinding: a page on `evil.example` whose name a
//! rebinding resolves to 127.0.0.1 still sends `Host: evil.example`. The listener's
//! names are the IP literal it listens on (any IP literal on `0.0.0.0` / `[::]`,
//! any loopback literal on loopback), `localhost` on loopback or a wildcard, and
//! `[relay] metrics_allowed_hosts`. The port is not compared: a port forward
//! (`kubectl port-forward`, `ssh -L`) keeps the name but not the port.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::control_token::{CONTROL_HEADER, PROOF_PATH};
use crate::endpoint::auth::{same, Authorized, Credentials};

/// Paths that need credentials when some are configured.
const GUARDED: &[&str] = &["/metrics", "/poison"];
/// The control routes (crate::endpoint::control).
const CONTROL: &str = "/control/";

/// The names a request's `Host` may carry.
#[derive(Debug, Clone)]
pub struct Hosts {
    listen: IpAddr,
    /// `[relay] metrics_allowed_hosts`, lower case; `*` admits every name.
    names: Vec<String>,
}

impl Hosts {
    pub fn new(listen: IpAddr, names: &[String]) -> Hosts {
        Hosts {
            listen,
            names: names
                .iter()
                .map(|n| n.trim().to_ascii_lowercase())
                .collect(),
        }
    }

    /// True when `host` (a `Host` header's value) names this listener.
    pub fn allows(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        let name = name.strip_suffix('.').unwrap_or(&name);
        if self.names.iter().any(|n| n == "*" || n == name) {
            return true;
        }
        if let Ok(ip) = name.parse::<IpAddr>() {
            return if self.listen.is_unspecified() {
                true
            } else if self.listen.is_loopback() {
                ip.is_loopback()
            } else {
                ip == self.listen
            };
        }
        name == "localhost" && (self.listen.is_loopback() || self.listen.is_unspecified())
    }
}

/// The name of `host` without its port and an IPv6 literal's brackets.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.split_once(':') {
        Some((name, port)) if !port.contains(':') => name,
        _ => host,
    }
}

/// What the middleware checks requests against.
pub struct Guard {
    pub auth: Credentials,
    pub loopback: bool,
    pub hosts: Hosts,
    /// This start's control token (crate::control_token).
    pub token: String,
}

impl Guard {
    /// True when `headers` carry `Authorization: Bearer <this start's token>`.
    fn has_token(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|t| same(t.as_bytes(), self.token.as_bytes()))
    }

    /// Why a control request is refused for its shape or origin, if it is.
    fn refuse_control(&self, req: &Request) -> Option<&'static str> {
        if !self.loopback && !self.auth.is_set() {
            return Some("control refused: the endpoint listens beyond loopback without credentials; set [relay] metrics_bearer_token_file (or metrics_basic_auth_user and metrics_basic_auth_password_file), or listen on 127.0.0.1\n");
        }
        let headers = req.headers();
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let same_origin = match text("origin") {
            None => true,
            Some(origin) => {
                let host = text("host").unwrap_or("");
                let rest = origin
                    .strip_prefix("http://")
                    .or_else(|| origin.strip_prefix("https://"));
                rest.is_some_and(|r| r.eq_ignore_ascii_case(host))
            }
        };
        let fetch_site_ok =
            text("sec-fetch-site").is_none_or(|s| s == "same-origin" || s == "none");
        if !same_origin || !fetch_site_ok {
            return Some("control refused: the request comes from a web page of another origin; send it with `outbox-relay ctl` (or a client that sends no Origin)\n");
        }
        if req.method() != Method::POST {
            return None;
        }
        let form = text("content-type").is_some_and(|t| {
            let media = t
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            matches!(
                media.as_str(),
                "text/plain" | "application/x-www-form-urlencoded" | "multipart/form-data"
            )
        });
        if form {
            return Some("control refused: a form-shaped request (Content-Type text/plain, form-urlencoded or multipart), which any web page can send, changes nothing; send it with `outbox-relay ctl`, or with the header X-Outbox-Relay-Control: 1 and no such body\n");
        }
        if !headers.contains_key(CONTROL_HEADER) {
            return Some("control refused: a change needs the header X-Outbox-Relay-Control: 1, which no web page can send to another site unasked; `outbox-relay ctl` sends it\n");
        }
        None
    }

    /// The answer to `GET /control/proof?nonce=N`: HMAC of the token over N.
    fn proof(&self, req: &Request) -> Response {
        if req.method() != Method::GET {
            return StatusCode::METHOD_NOT_ALLOWED.into_response();
        }
        let nonce = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .find_map(|kv| kv.strip_prefix("nonce="))
            .filter(|n| crate::control_token::valid_nonce(n));
        match nonce {
            Some(n) => {
                let proof = crate::control_token::proof(&self.token, n);
                format!("{}\n", serde_json::json!({ "proof": proof })).into_response()
            }
            None => (
                StatusCode::BAD_REQUEST,
                "a proof needs ?nonce= with 32 to 128 hex digits\n",
            )
                .into_response(),
        }
    }
}

/// The bearer token of `Authorization`, if it has one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let given = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, value) = given.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(value.trim())
}

/// The middleware: the checks above, then the route.
pub async fn check(State(guard): State<Arc<Guard>>, mut req: Request, next: Next) -> Response {
    let host_ok = match req.headers().get(header::HOST) {
        None => true,
        Some(v) => v.to_str().is_ok_and(|h| guard.hosts.allows(h)),
    };
    if !host_ok {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "misdirected request: the Host header names none of this endpoint's names (its IP address, localhost on loopback); add a name it should answer to [relay] metrics_allowed_hosts\n",
        )
            .into_response();
    }
    let path = req.uri().path();
    let control = path.starts_with(CONTROL);
    if control {
        if let Some(why) = guard.refuse_control(&req) {
            return (StatusCode::FORBIDDEN, why).into_response();
        }
        if path == PROOF_PATH {
            return guard.proof(&req);
        }
    }
    let configured = guard.auth.is_set() && guard.auth.allow(req.headers());
    let token = guard.has_token(req.headers());
    let authorized = configured || token || !guard.auth.is_set();
    let guarded = GUARDED.contains(&path);
    req.extensions_mut().insert(Authorized(authorized));
    if control && !(configured || token) {
        let why = if guard.auth.is_set() {
            "credentials required\n"
        } else {
            "control needs this start's control token (Authorization: Bearer): `outbox-relay ctl`, run as the relay's user, reads it from the control token file (docs/operations.md, \"Incident levers\")\n"
        };
        return unauthorized(why);
    }
    if guarded && !authorized {
        return unauthorized("credentials required\n");
    }
    next.run(req).await
}

fn unauthorized(why: &'static str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(
            header::WWW_AUTHENTICATE,
            "Bearer, Basic realm=\"outbox-relay\"",
        )],
        why,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(listen: &str, names: &[&str]) -> Hosts {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        Hosts::new(listen.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])), &names)
    }

    #[test]
    fn a_host_is_one_of_the_listeners_names() {
        let lo = hosts("127.0.0.1", &[]);
        for ok in [
            "127.0.0.1:9187",
            "127.0.0.1",
            "localhost:9187",
            "LOCALHOST.",
            "[::1]:80",
            "127.0.0.2",
        ] {
            assert!(lo.allows(ok), "{ok}");
        }
        for no in [
            "evil.example:9187",
            "10.0.0.1:9187",
            "x",
            "",
            "localhost.evil.example",
        ] {
            assert!(!lo.allows(no), "{no}");
        }
        let any = hosts("0.0.0.0", &["relay", "Metrics.Example"]);
        for ok in [
            "10.1.2.3:9187",
            "[fe80::1]:9187",
            "localhost",
            "relay:9187",
            "metrics.example",
        ] {
            assert!(any.allows(ok), "{ok}");
        }
        assert!(!any.allows("evil.example:9187"));
        let one = hosts("10.0.0.5", &[]);
        assert!(one.allows("10.0.0.5:9187"));
        assert!(!one.allows("10.0.0.6:9187") && !one.allows("localhost"));
        assert!(hosts("10.0.0.5", &["*"]).allows("anything.example"));
    }
}
