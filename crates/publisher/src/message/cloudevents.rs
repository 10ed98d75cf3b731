//! The CloudEvents 1.0 attributes of an event (docs/cloudevents.md): `[message] format
//! = "cloudevents"` adds them to the message in the binary content mode of the AMQP
//! protocol binding, as `cloudEvents:`-prefixed headers (the exchange) or application
//! properties (the stream); the body stays the payload and `datacontenttype` is the
//! message's content-type property, which both targets already set.
//!
//! What is the same for many messages is built once: the `source` of a table is
//! rendered when the table is first seen (not per message), and the `time` of a
//! transaction once for all of its events.

use std::sync::Arc;

use outbox_event::{OutboxEvent, OutboxTable};

/// The `specversion` attribute.
pub const SPECVERSION: &str = "1.0";
/// Prefix of the attributes' header or application-property names (the AMQP binding).
pub const PREFIX: &str = "cloudEvents:";
/// The header / application-property names of the attributes the relay sets.
pub const ID: &str = "cloudEvents:id";
pub const SOURCE: &str = "cloudEvents:source";
pub const TYPE: &str = "cloudEvents:type";
pub const TIME: &str = "cloudEvents:time";
pub const SUBJECT: &str = "cloudEvents:subject";
pub const SPECVERSION_KEY: &str = "cloudEvents:specversion";
/// Attribute names the relay sets itself (with `datacontenttype`, the content-type
/// property): a headers-column key naming one of them under either prefix the
/// binding allows (`cloudEvents:` or `cloudEvents_`) is dropped, so a consumer never
/// sees two values of one attribute.
pub const RELAY_ATTRIBUTES: [&str; 7] = [
    "id",
    "source",
    "type",
    "time",
    "subject",
    "specversion",
    "datacontenttype",
];

/// Default `[message] cloudevents_source`.
pub const DEFAULT_SOURCE: &str = "/outbox-relay/{database}/{table}";
/// The placeholders a `cloudevents_source` template may use.
pub const SOURCE_PLACEHOLDERS: [&str; 2] = ["database", "table"];

/// Whether a headers-column key would set an attribute the relay sets
/// ([`RELAY_ATTRIBUTES`]).
pub(crate) fn is_relay_attribute(key: &str) -> bool {
    key.strip_prefix(PREFIX)
        .or_else(|| key.strip_prefix("cloudEvents_"))
        .is_some_and(|name| RELAY_ATTRIBUTES.contains(&name))
}

/// Why a `cloudevents_source` template is invalid (the sentence follows the key's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("is empty, but the source attribute is required: set a URI reference such as \"/outbox-relay/{{database}}/{{table}}\"")]
    Empty,
    #[error("has a `}}` without a matching `{{`: fix the template")]
    StrayClose,
    #[error("has a `{{` without a closing `}}`: fix the template")]
    Unclosed,
    #[error("unknown placeholder `{{{0}}}`: use only {{database}} and {{table}}")]
    Unknown(String),
    #[error("holds whitespace, which a URI reference cannot: percent-encode it (%20)")]
    Whitespace,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Database,
    Table,
}

/// `[message] format = "cloudevents"` as the publishers need it: the compiled
/// `source` template, the database name it substitutes, and the `type` prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEventsFormat {
    source: Vec<Part>,
    database: String,
    type_prefix: String,
}

impl CloudEventsFormat {
    /// Compiles `source` (literal text and `{database}`, `{table}` placeholders).
    pub fn new(source: &str, database: &str, type_prefix: &str) -> Result<Self, SourceError> {
        Ok(Self {
            source: parse_source(source)?,
            database: database.to_string(),
            type_prefix: type_prefix.to_string(),
        })
    }

    /// [`CloudEventsFormat::new`] with [`DEFAULT_SOURCE`] (which always compiles).
    pub fn with_default_source(database: &str, type_prefix: &str) -> Self {
        Self {
            source: vec![
                Part::Literal("/outbox-relay/".into()),
                Part::Database,
                Part::Literal("/".into()),
                Part::Table,
            ],
            database: database.to_string(),
            type_prefix: type_prefix.to_string(),
        }
    }

    /// The `source` of events of `table`: the template with `{database}` and `{table}`
    /// (`schema.table`) substituted, each percent-encoded where a URI path would
    /// need it.
    pub fn source_of(&self, table: &str) -> String {
        let mut out = String::with_capacity(64);
        for part in &self.source {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Database => push_encoded(&mut out, &self.database),
                Part::Table => push_encoded(&mut out, table),
            }
        }
        out
    }

    /// The `type` prefix (`""` = none).
    pub fn type_prefix(&self) -> &str {
        &self.type_prefix
    }
}

/// Checks a `cloudevents_source` template (the project's one parser of it).
pub fn validate_source(template: &str) -> Result<(), SourceError> {
    parse_source(template).map(|_| ())
}

fn parse_source(template: &str) -> Result<Vec<Part>, SourceError> {
    if template.is_empty() {
        return Err(SourceError::Empty);
    }
    if template.contains(char::is_whitespace) {
        return Err(SourceError::Whitespace);
    }
    let mut parts = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find(['{', '}']) {
        if rest[open..].starts_with('}') {
            return Err(SourceError::StrayClose);
        }
        if open > 0 {
            parts.push(Part::Literal(rest[..open].to_string()));
        }
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or(SourceError::Unclosed)?;
        parts.push(match &after[..close] {
            "database" => Part::Database,
            "table" => Part::Table,
            other => return Err(SourceError::Unknown(other.to_string())),
        });
        rest = &after[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Literal(rest.to_string()));
    }
    Ok(parts)
}

/// Appends `value` with every byte that is not an RFC 3986 path character
/// (unreserved, sub-delims, `:`, `@`) percent-encoded, `/` included: a substituted
/// name is one path segment.
fn push_encoded(out: &mut String, value: &str) {
    for &b in value.as_bytes() {
        let plain = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b);
        if plain {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

/// The attributes of one event, as text (every one is a string in both targets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// The message id column; when it is NULL, `<commit_lsn>:<tx_index>`, which is as
    /// unique within the source and the same on every publish of the event.
    pub id: String,
    pub source: String,
    /// `type_prefix` followed by the event type (NULL: the prefix alone).
    pub kind: String,
    /// The commit time, RFC 3339 in UTC with microseconds.
    pub time: String,
    /// The aggregate id; `None` (no attribute) when NULL.
    pub subject: Option<String>,
}

/// Builds [`Attributes`]; keeps the last table's source and the last commit time's
/// text, so that neither is rebuilt per message.
#[derive(Debug, Clone)]
pub struct CloudEvents {
    format: CloudEventsFormat,
    source_cache: Option<(Arc<OutboxTable>, String)>,
    time_cache: Option<(i64, String)>,
}

impl CloudEvents {
    pub fn new(format: CloudEventsFormat) -> Self {
        Self {
            format,
            source_cache: None,
            time_cache: None,
        }
    }

    /// The attributes of `event`.
    pub fn attributes(&mut self, event: &OutboxEvent) -> Attributes {
        let source = match &self.source_cache {
            Some((table, source)) if Arc::ptr_eq(table, &event.table) => source.clone(),
            _ => {
                let source = self.format.source_of(&event.table.qualified_name);
                self.source_cache = Some((event.table.clone(), source.clone()));
                source
            }
        };
        let time = match &self.time_cache {
            Some((micros, text)) if *micros == event.commit_time_micros => text.clone(),
            _ => {
                let text = rfc3339_micros(event.commit_time_micros);
                self.time_cache = Some((event.commit_time_micros, text.clone()));
                text
            }
        };
        let id = match &event.id {
            Some(id) => String::from_utf8_lossy(id).into_owned(),
            None => format!("{}:{}", event.commit_lsn, event.index),
        };
        let prefix = self.format.type_prefix();
        let mut kind =
            String::with_capacity(prefix.len() + event.event_type.as_ref().map_or(0, |t| t.len()));
        kind.push_str(prefix);
        if let Some(t) = &event.event_type {
            kind.push_str(&String::from_utf8_lossy(t));
        }
        Attributes {
            id,
            source,
            kind,
            time,
            subject: event
                .aggregate_id
                .as_ref()
                .map(|s| String::from_utf8_lossy(s).into_owned()),
        }
    }
}

/// `µs since the Unix epoch` as RFC 3339 in UTC, e.g. `2023-11-14T22:13:20.123456Z`.
pub fn rfc3339_micros(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn source_templates() {
        let f = CloudEventsFormat::new(DEFAULT_SOURCE, "app", "").unwrap();
        assert_eq!(f, CloudEventsFormat::with_default_source("app", ""));
        assert_eq!(
            f.source_of("public.outbox"),
            "/outbox-relay/app/public.outbox"
        );
        let f = CloudEventsFormat::new("urn:x:{table}", "my db/1", "").unwrap();
        assert_eq!(f.source_of("s.t"), "urn:x:s.t");
        let f = CloudEventsFormat::new("//{database}/{table}", "my db/ü", "").unwrap();
        assert_eq!(f.source_of("a\"b.t"), "//my%20db%2F%C3%BC/a%22b.t");
        assert_eq!(validate_source(""), Err(SourceError::Empty));
        assert_eq!(validate_source("/a b"), Err(SourceError::Whitespace));
        assert_eq!(
            validate_source("/{db}"),
            Err(SourceError::Unknown("db".into()))
        );
        assert_eq!(validate_source("/{table"), Err(SourceError::Unclosed));
        assert_eq!(validate_source("/x}"), Err(SourceError::StrayClose));
        assert_eq!(
            SourceError::Unknown("db".into()).to_string(),
            "unknown placeholder `{db}`: use only {database} and {table}"
        );
    }

    #[test]
    fn relay_attributes_under_either_prefix() {
        for key in [
            "cloudEvents:id",
            "cloudEvents_type",
            "cloudEvents:datacontenttype",
        ] {
            assert!(is_relay_attribute(key), "{key}");
        }
        for key in [
            "cloudEvents:traceparent",
            "cloudevents:id",
            "id",
            "x-cloudEvents:id",
        ] {
            assert!(!is_relay_attribute(key), "{key}");
        }
    }

    #[test]
    fn time_is_rfc3339_utc_with_micros() {
        assert_eq!(
            rfc3339_micros(1_700_000_000_123_456),
            "2023-11-14T22:13:20.123456Z"
        );
        assert_eq!(rfc3339_micros(0), "1970-01-01T00:00:00.000000Z");
    }
}
