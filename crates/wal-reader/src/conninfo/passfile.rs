//! libpq's password file (`passfile`, `PGPASSFILE`, `~/.pgpass`): lines of
//! `hostname:port:database:username:password`, `*` matching anything, `\` escaping
//! `:` and `\`, `#` starting a comment. As in libpq, the file is read when a
//! connection logs in (so a rotated password is picked up at the next reconnect), a
//! missing file is no error, and a file that group or others may access is ignored
//! with a warning (the secret files' rule, `outbox_event::secret_file`, which unlike
//! libpq's for this file accepts 0640 when root owns it, as a Kubernetes secret
//! volume with `fsGroup` lays it out); so is one that cannot be read (the relay's
//! user lacks the right), which libpq drops without a word.

use std::path::Path;

/// Socket directories libpq treats as "localhost" when matching the file.
const DEFAULT_SOCKET_DIRS: &[&str] = &["/tmp", "/var/run/postgresql", "/run/postgresql"];

/// What a connection is matched against.
pub(super) struct Target<'a> {
    pub host: &'a str,
    pub port: u16,
    pub dbname: &'a str,
    pub user: &'a str,
}

/// The password for `target` from the file at `path`, if the file is usable and a
/// line matches.
pub(super) fn lookup(path: &Path, target: &Target<'_>) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        tracing::warn!(path = %path.display(), "the password file is not a plain file and is ignored");
        return None;
    }
    if let Some(mode) = outbox_event::secret_file::too_open(&meta) {
        tracing::warn!(path = %path.display(),
            "the password file has group or world access (mode {mode:o}) and is ignored: chmod 600 it (0640 is accepted when root owns it)");
        return None;
    }
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(
                "the password file {} cannot be read ({e}) and is ignored: make it readable by the relay's user (on a Kubernetes secret volume, with the pod's fsGroup; docs/security.md)",
                path.display()
            );
            return None;
        }
    };
    find(&text, target)
}

fn find(text: &str, target: &Target<'_>) -> Option<String> {
    let host = if target.host.is_empty() || DEFAULT_SOCKET_DIRS.contains(&target.host) {
        "localhost"
    } else {
        target.host
    };
    let port = target.port.to_string();
    let wanted = [host, port.as_str(), target.dbname, target.user];
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields = split(line);
        if fields.len() < 5 {
            continue;
        }
        let matches = wanted
            .iter()
            .zip(&fields)
            .all(|(want, field)| field == "*" || field == want);
        if matches {
            // The password is everything after the fourth separator.
            return Some(fields[4..].join(":"));
        }
    }
    None
}

/// Splits a line at unescaped `:`, removing the escapes.
fn split(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    fields.last_mut().expect("one field").push(n);
                }
            }
            ':' => fields.push(String::new()),
            c => fields.last_mut().expect("one field").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(host: &'a str, port: u16, dbname: &'a str, user: &'a str) -> Target<'a> {
        Target {
            host,
            port,
            dbname,
            user,
        }
    }

    #[test]
    fn matches_like_libpq() {
        let file = "# comment\n\
                    db.example:5432:app:relay:first\n\
                    *:5433:*:relay:with\\:colon\\\\and:more\n\
                    localhost:*:*:*:local\n";
        assert_eq!(
            find(file, &t("db.example", 5432, "app", "relay")).as_deref(),
            Some("first")
        );
        assert_eq!(
            find(file, &t("other", 5433, "x", "relay")).as_deref(),
            Some("with:colon\\and:more")
        );
        assert_eq!(
            find(file, &t("/var/run/postgresql", 1, "x", "y")).as_deref(),
            Some("local")
        );
        assert_eq!(find(file, &t("db.example", 5432, "app", "other")), None);
        assert_eq!(find("h:1:d:u\n", &t("h", 1, "d", "u")), None);
    }
}
