//! The two spellings of a connection string: libpq URLs
//! (`postgresql://user:pw@host:port/db?k=v`) and key=value conninfo strings, each
//! parsed into (key, value) pairs. Errors name parameters, never values.

use super::{ConnInfoError, IGNORED};

pub(super) fn parse_keyvalue(s: &str) -> Result<Vec<(String, String)>, ConnInfoError> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            // The "key" may be the tail of an unquoted password: never echo it.
            return Err(ConnInfoError(
                "expected key=value pairs or a postgresql:// URL; quote a value that contains spaces (password='…')".into(),
            ));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        if let Some(n) = chars.next() {
                            value.push(n);
                        }
                    }
                    '\'' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                return Err(ConnInfoError("a quoted value has no closing quote".into()));
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                if c == '\\' {
                    chars.next();
                    if let Some(n) = chars.next() {
                        value.push(n);
                    }
                    continue;
                }
                value.push(c);
                chars.next();
            }
        }
        // After an unquoted password, what follows a space might be its tail: make
        // such a "key" unknown without a printable name.
        let after_password = out.iter().any(|(k, _): &(String, String)| k == "password");
        if after_password && !is_known(&key) {
            return Err(ConnInfoError(
                "unknown connection parameter after password=; quote a password that contains spaces (password='…')".into(),
            ));
        }
        out.push((key, value));
    }
    Ok(out)
}

fn is_known(key: &str) -> bool {
    const KNOWN: &[&str] = &[
        "host",
        "hostaddr",
        "port",
        "user",
        "password",
        "dbname",
        "sslmode",
        "sslrootcert",
        "channel_binding",
        "require_auth",
        "sslcert",
        "sslkey",
        "sslpassword",
        "passfile",
        "gssencmode",
        "application_name",
        "connect_timeout",
    ];
    KNOWN.contains(&key) || IGNORED.contains(&key)
}

fn percent_decode(s: &str, what: &str) -> Result<String, ConnInfoError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    ConnInfoError(format!(
                        "bad percent-encoding in the {what} (a literal % is written %25)"
                    ))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ConnInfoError(format!("the {what} is not UTF-8")))
}

/// The message for a userinfo that cannot be split unambiguously. It names no part
/// of the URL.
pub const PERCENT_ENCODE_PASSWORD: &str = "the user name or password contains an unencoded '/', '?' or '#' (or an '@' follows the host): percent-encode the password (/ is %2F, ? is %3F, # is %23, @ is %40, % is %25)";

pub(super) fn parse_url(s: &str) -> Result<Vec<(String, String)>, ConnInfoError> {
    let rest = s.split_once("://").map(|(_, r)| r).unwrap_or(s);
    let mut out = Vec::new();
    // The userinfo ends at the last '@' (a password may contain '@'); it may not
    // contain '/', '?' or '#', which would make the split ambiguous.
    let rest = match rest.rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            if userinfo.contains(['/', '?', '#']) {
                return Err(ConnInfoError(PERCENT_ENCODE_PASSWORD.into()));
            }
            match userinfo.split_once(':') {
                Some((u, p)) => {
                    out.push(("user".into(), percent_decode(u, "user name")?));
                    out.push(("password".into(), percent_decode(p, "password")?));
                }
                None => out.push(("user".into(), percent_decode(userinfo, "user name")?)),
            }
            &rest[at + 1..]
        }
        None => rest,
    };
    if rest.contains('#') {
        return Err(ConnInfoError(
            "a '#' in the URL must be percent-encoded (%23)".into(),
        ));
    }
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (hostport, path) = match rest.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (rest, None),
    };
    if !hostport.is_empty() {
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| ConnInfoError("an IPv6 host has no closing ']'".into()))?;
            if !after.is_empty() && !after.starts_with(':') {
                return Err(ConnInfoError(
                    "unexpected characters after an IPv6 host's ']'".into(),
                ));
            }
            (h.to_string(), after.strip_prefix(':').map(str::to_string))
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p.to_string())),
                None => (hostport.to_string(), None),
            }
        };
        if !host.is_empty() {
            out.push(("host".into(), percent_decode(&host, "host")?));
        }
        if let Some(p) = port.filter(|p| !p.is_empty()) {
            out.push(("port".into(), p));
        }
    }
    if let Some(db) = path.filter(|p| !p.is_empty()) {
        out.push(("dbname".into(), percent_decode(db, "database name")?));
    }
    if let Some(q) = query {
        for pair in q.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            out.push((percent_decode(k, "query")?, percent_decode(v, "query")?));
        }
    }
    Ok(out)
}
