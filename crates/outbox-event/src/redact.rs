//! Hiding passwords in URLs, conninfo strings and free text: the one redaction of
//! the program (docs/security.md). The relay's errors, logs, `check` and `status`
//! lines and `Debug` impls, and the publisher's broker errors, all go through
//! [`redact_url`].

/// Replaces every password in `text` with `***`: the password of each
/// `scheme://user:password@host` URL (postgresql, amqp, amqps, ...), and the value of
/// every `password=` parameter (libpq key=value conninfo, quoted or not, and URL query
/// parameters). Works on a single URL and on free text such as an error message.
/// Errs on the side of hiding too much.
pub fn redact_url(text: &str) -> String {
    redact_password_params(&redact_userinfo(text))
}

fn redact_userinfo(text: &str) -> String {
    // A single URL (a configuration value) may hold whitespace in its password: it
    // is one token as a whole.
    let single = text.matches("://").count() == 1
        && text
            .split_once("://")
            .is_some_and(|(scheme, _)| !scheme.is_empty() && !scheme.contains(char::is_whitespace));
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // A URL in text ends at whitespace; the userinfo ends at the token's last '@'
        // (a password may contain '@', '/', '?' or '#').
        let token_end = if single {
            tail.len()
        } else {
            tail.find(char::is_whitespace).unwrap_or(tail.len())
        };
        let token = &tail[..token_end];
        match token.rfind('@') {
            Some(at) => match token[..at].find(':') {
                Some(colon) if !token[..colon].contains(['/', '?', '#']) => {
                    out.push_str(&token[..=colon]);
                    out.push_str("***");
                    out.push_str(&token[at..]);
                }
                // No ':' (a user name only), or one that follows a '/', '?' or '#':
                // the whole userinfo may be password.
                _ if token[..at].contains(['/', '?', '#', ':']) => {
                    out.push_str("***");
                    out.push_str(&token[at..]);
                }
                _ => out.push_str(token),
            },
            None => out.push_str(token),
        }
        rest = &tail[token_end..];
    }
    out.push_str(rest);
    out
}

fn redact_password_params(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut pos = 0;
    while let Some(found) = lower[pos..].find("password") {
        let start = pos + found;
        let after_word = start + "password".len();
        // Only a parameter: `password`, optional spaces, `=`.
        let eq = lower[after_word..]
            .find(|c: char| c != ' ')
            .map(|i| after_word + i)
            .filter(|&i| lower[i..].starts_with('='));
        let Some(eq) = eq else {
            out.push_str(&text[pos..after_word]);
            pos = after_word;
            continue;
        };
        let value_start = lower[eq + 1..]
            .find(|c: char| c != ' ')
            .map_or(text.len(), |i| eq + 1 + i);
        let value_end = if text[value_start..].starts_with('\'') {
            // libpq quoting: 'it''s' is not used; backslash escapes quotes.
            let mut end = text.len();
            let mut escaped = false;
            for (i, c) in text[value_start + 1..].char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '\'' if !escaped => {
                        end = value_start + 1 + i + 1;
                        break;
                    }
                    _ => escaped = false,
                }
            }
            end
        } else {
            text[value_start..]
                .find(|c: char| c.is_whitespace() || c == '&' || c == '"' || c == '`')
                .map_or(text.len(), |i| value_start + i)
        };
        out.push_str(&text[pos..value_start]);
        out.push_str("***");
        pos = value_end;
    }
    out.push_str(&text[pos..]);
    out
}

/// Cuts `s` to at most `max` bytes at a character boundary (AMQP short strings,
/// close reasons).
pub fn truncate_at_char(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// `text` as one printable line: every control character (line breaks, carriage
/// returns, tabs, escape sequences, C1 codes) and every Unicode line separator or
/// bidirectional control is written as an escape (`\n`, `\u{1b}`). Text a server
/// sends (an error message, a broker's close reason) and outbox data (ids, routing
/// keys) go through it before the relay prints it, so it can neither forge a log line
/// nor drive the terminal nor reorder what the operator reads (docs/security.md).
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    escape_unsafe(text, |_| false, Escape::Rust)
}

/// JSON text (serde_json's output, pretty or not) with the characters serde_json
/// leaves raw inside strings (DEL, C1 controls, line separators, bidirectional
/// controls) written as JSON escapes (`\u202e`): the document parses back to the
/// same values, and no raw control reaches a terminal. Line breaks between values
/// (pretty printing) stay.
pub fn printable_json(json: &str) -> std::borrow::Cow<'_, str> {
    escape_unsafe(json, |c| c == '\n', Escape::Json)
}

/// What must never reach a terminal or a log raw: control characters (C0, DEL, C1),
/// the Unicode line and paragraph separators, and the bidirectional controls
/// (embeddings, overrides, isolates, marks) that make a line read other than it is.
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// How [`escape_unsafe`] writes a character it escapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escape {
    /// `\n`, `\r`, `\t`, else Rust's `\u{1b}`: for text.
    Rust,
    /// `\n`, `\r`, `\t`, else JSON's `\u001b`: inside JSON strings.
    Json,
}

/// `text` with every [`is_unsafe_char`] but those `keep` accepts escaped in `style`
/// (the one escaping of the program: [`printable`], [`printable_json`], and the
/// logger's writer, which keeps its own colours).
pub fn escape_unsafe(
    text: &str,
    keep: impl Fn(char) -> bool,
    style: Escape,
) -> std::borrow::Cow<'_, str> {
    let escaped = |c: char| is_unsafe_char(c) && !keep(c);
    if !text.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if !escaped(c) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if style == Escape::Json => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `` `scheme` `` followed by a space when it looks like a URL scheme (letters, digits,
/// `+.-`, at most 16), else nothing: what precedes `://` in a malformed value may be
/// a password.
pub fn quoted_scheme(scheme: &str) -> String {
    let plain = !scheme.is_empty()
        && scheme.len() <= 16
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c));
    if plain {
        format!("`{scheme}` ")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_url_forms() {
        let cases = [
            (
                "postgresql://app:pw@db:5432/app",
                "postgresql://app:***@db:5432/app",
            ),
            ("postgres://app@db/app", "postgres://app@db/app"),
            ("postgresql://db/app", "postgresql://db/app"),
            (
                "postgresql://app:p@ss/w?rd@db/app",
                "postgresql://app:***@db/app",
            ),
            (
                "postgresql://app@db/app?sslmode=require&password=pw&x=1",
                "postgresql://app@db/app?sslmode=require&password=***&x=1",
            ),
            (
                "host=db user=app password=pw dbname=app",
                "host=db user=app password=*** dbname=app",
            ),
            ("host=db password = pw", "host=db password = ***"),
            (
                r"host=db password='p w \' x' dbname=app",
                "host=db password=*** dbname=app",
            ),
            ("host=db PASSWORD=pw", "host=db PASSWORD=***"),
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "amqps://u:p@h:5671/v?heartbeat=5",
                "amqps://u:***@h:5671/v?heartbeat=5",
            ),
            ("amqp://h", "amqp://h"),
            (
                "cannot reach amqp://u:p@n1/%2f nor `amqp://u:q@n2/`: refused",
                "cannot reach amqp://u:***@n1/%2f nor `amqp://u:***@n2/`: refused",
            ),
            (
                "no secrets, password is not a parameter",
                "no secrets, password is not a parameter",
            ),
            // Unencoded '#', '/', '?' or a space in a password: the last '@' ends it.
            (
                "amqp://guest:Qx#j/z?q@host:5672/%2f",
                "amqp://guest:***@host:5672/%2f",
            ),
            ("amqp://guest:Qx j z@host/", "amqp://guest:***@host/"),
            ("amqp://Qx/jz@host/v", "amqp://***@host/v"),
        ];
        for (input, expected) in cases {
            assert_eq!(redact_url(input), expected, "input {input:?}");
        }
    }

    #[test]
    fn printable_escapes_what_could_forge_a_line_or_drive_a_terminal() {
        assert_eq!(printable("plain text: ü €"), "plain text: ü €");
        assert_eq!(
            printable("a\n2026-01-01 INFO forged\r\x1b[2J\u{9b}\u{202e}\t"),
            "a\\n2026-01-01 INFO forged\\r\\u{1b}[2J\\u{9b}\\u{202e}\\t"
        );
        let every =
            "\u{7f}\u{9b}\u{61c}\u{200e}\u{200f}\u{2028}\u{2029}\u{202a}\u{202e}\u{2066}\u{2069}";
        assert_eq!(
            printable(every),
            "\\u{7f}\\u{9b}\\u{61c}\\u{200e}\\u{200f}\\u{2028}\\u{2029}\\u{202a}\\u{202e}\\u{2066}\\u{2069}"
        );
    }

    #[test]
    fn printable_json_keeps_the_values_and_escapes_what_serde_json_leaves_raw() {
        let value = serde_json::json!({"k": "a\u{1b}]0;t\u{7}\u{202e}b\u{2028}c\u{9b}"});
        let pretty = serde_json::to_string_pretty(&value).unwrap();
        let shown = printable_json(&pretty);
        assert!(
            shown.contains("\\u202e") && shown.contains("\\u2028") && shown.contains("\\u009b"),
            "{shown}"
        );
        assert!(
            shown.chars().all(|c| c == '\n' || !is_unsafe_char(c)),
            "{shown}"
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&shown).unwrap(),
            value
        );
    }
}
