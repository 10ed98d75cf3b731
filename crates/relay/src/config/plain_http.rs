//! Credentials over plain `http://` (docs/security.md, "Credentials in clear"):
//! the management API's (`[rabbitmq] management_url`) and the OTLP collector's
//! headers (`[tracing] headers_file`) are refused for a host beyond loopback unless
//! the section's `allow_insecure_http = true` says the operator wants them sent in
//! clear anyway. The host is judged by its name, never resolved: `localhost` and
//! the loopback addresses are loopback, any other name may be anywhere.

use std::net::IpAddr;

/// The host of `url` when `url` is a plain `http://` URL to a host beyond loopback
/// (for messages: the host only, never the URL's credentials); `None` for
/// `https://`, other schemes and loopback hosts.
pub fn beyond_loopback(url: &str) -> Option<String> {
    let url = url.trim();
    let (scheme, rest) = url.split_once("://")?;
    if !scheme.eq_ignore_ascii_case("http") {
        return None;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match hostport.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => hostport.split(':').next().unwrap_or(""),
    };
    (!is_loopback(host)).then(|| host.to_string())
}

/// Why the OTLP request headers (credentials) may not go to `endpoint`, when they
/// may not: plain `http://` beyond loopback without `[tracing] allow_insecure_http`.
/// `from`: where the headers come from, for the sentence.
pub fn tracing_headers_in_clear(endpoint: &str, allow: bool, from: &str) -> Option<String> {
    let host = beyond_loopback(endpoint).filter(|_| !allow)?;
    Some(format!(
        "the OTLP endpoint is plain http:// to {host}, beyond loopback, so the headers of {from} (credentials) would cross the network in clear: use https://, or set [tracing] allow_insecure_http = true to send them anyway"
    ))
}

/// Whether `host` (a name or an address, IPv6 without brackets) is loopback.
fn is_loopback(host: &str) -> bool {
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_beyond_loopback_is_named() {
        for (url, host) in [
            ("http://10.0.0.5:15672", Some("10.0.0.5")),
            ("HTTP://u:p@mq.example/api", Some("mq.example")),
            ("http://[2001:db8::1]:4318", Some("2001:db8::1")),
            ("http://127.0.0.1.example:80", Some("127.0.0.1.example")),
            ("http://u:p@collector?x=@127.0.0.1", Some("collector")),
            ("http://127.0.0.1:15672", None),
            ("http://127.8.9.10", None),
            ("http://localhost:4318/v1/traces", None),
            ("http://u:p@[::1]:15672", None),
            ("http://[::ffff:127.0.0.1]:1", None),
            ("https://mq.example:15671", None),
            ("", None),
            ("mq.example:15672", None),
        ] {
            assert_eq!(beyond_loopback(url).as_deref(), host, "{url}");
        }
    }
}
