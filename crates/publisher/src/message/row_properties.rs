//! AMQP properties set per event (docs/routing.md, "Properties per event"): keys of
//! the headers column that RabbitMQ users expect as properties rather than headers.
//!
//! | key | property | value |
//! |---|---|---|
//! | `expiration` | `expiration` (a per-message TTL) | `"30s"`, `"5m"`, `"250ms"`, `"1h"`, or milliseconds as a number or digits |
//! | `priority` | `priority` | 0–255, a number or digits |
//! | `content_type` | `content_type` (instead of the payload type's) | text |
//! | `content_encoding` | `content_encoding` | text |
//! | `reply_to` | `reply_to` | text |
//!
//! Columns can set them too (`[mapping] expiration`, `priority`, `content_type`,
//! `content_encoding`, `reply_to`); a column's value (not NULL) wins over the headers
//! column's key. They are taken out of the message's headers. An invalid value makes the event
//! poison, naming the key (it is held, or a notice goes to the dead-letter
//! exchange), rather than being sent without the property its producer asked for.
//! On the stream target they stay application properties (a stream keeps every
//! message; it has no per-message TTL or priority).

use std::time::Duration;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::ShortString;
use outbox_event::OutboxEvent;

/// The headers-column keys that set properties.
pub const PROPERTY_KEYS: [&str; 5] = [
    "expiration",
    "priority",
    "content_type",
    "content_encoding",
    "reply_to",
];

/// [`PROPERTY_KEYS`] as they appear in JSON text.
const QUOTED_KEYS: [&[u8]; 5] = [
    b"\"expiration\"",
    b"\"priority\"",
    b"\"content_type\"",
    b"\"content_encoding\"",
    b"\"reply_to\"",
];

/// Whether `key` sets a property rather than a header.
pub fn is_property_key(key: &str) -> bool {
    PROPERTY_KEYS.contains(&key)
}

/// The properties one event's headers column sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowProperties {
    /// Milliseconds, as AMQP's `expiration` carries them.
    pub expiration: Option<u64>,
    pub priority: Option<u8>,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub reply_to: Option<String>,
}

impl RowProperties {
    /// The properties of a headers column's JSON text; why one is invalid otherwise.
    /// Text that is not a JSON object sets none (the headers' own warning says so).
    pub fn of(raw: &[u8]) -> Result<RowProperties, String> {
        let mut out = RowProperties::default();
        // Most headers set no property: look before parsing.
        if !names_a_key(raw) {
            return Ok(out);
        }
        let Ok(map) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(raw)
        else {
            return Ok(out);
        };
        for (key, value) in map {
            out.set(&key, &value)
                .map_err(|why| format!("header {key:?} = {value} {why}"))?;
        }
        Ok(out)
    }

    /// The properties of `event`: its headers column's keys, then its property
    /// columns (`[mapping] priority`, …), whose values win.
    pub fn of_event(event: &OutboxEvent) -> Result<RowProperties, String> {
        let mut out = match event.headers.as_deref() {
            Some(raw) => RowProperties::of(raw)?,
            None => RowProperties::default(),
        };
        for (key, value) in &event.properties {
            let value = serde_json::Value::String(String::from_utf8_lossy(value).into_owned());
            out.set(key, &value)
                .map_err(|why| format!("the column of [mapping] {key} = {value} {why}"))?;
        }
        Ok(out)
    }

    /// The properties of `event` when it sets any ([`Self::of_event`]); `None`, at
    /// the cost of one scan of its headers, for the many events that set none.
    pub fn of_event_if_any(event: &OutboxEvent) -> Result<Option<RowProperties>, String> {
        let in_headers = event.headers.as_deref().is_some_and(names_a_key);
        if !in_headers && event.properties.is_empty() {
            return Ok(None);
        }
        Self::of_event(event).map(Some)
    }

    /// Sets the property `key` names (other keys are not properties); why `value`
    /// is not one.
    fn set(&mut self, key: &str, value: &serde_json::Value) -> Result<(), &'static str> {
        match key {
            "expiration" => {
                self.expiration = Some(expiration(value).ok_or(
                    "is not a TTL: give \"30s\", \"5m\", \"250ms\", \"1h\" or milliseconds",
                )?)
            }
            "priority" => {
                self.priority = Some(
                    whole(value)
                        .and_then(|n| u8::try_from(n).ok())
                        .ok_or("is not a priority: give a whole number from 0 to 255")?,
                )
            }
            "content_type" | "content_encoding" | "reply_to" => {
                let text = match value {
                    serde_json::Value::String(s) if !s.is_empty() && s.len() <= 255 => s.clone(),
                    _ => return Err("is not a text of 1 to 255 bytes"),
                };
                match key {
                    "content_type" => self.content_type = Some(text),
                    "content_encoding" => self.content_encoding = Some(text),
                    _ => self.reply_to = Some(text),
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// `properties` with these set.
    pub fn apply(&self, mut properties: BasicProperties) -> BasicProperties {
        if let Some(ms) = self.expiration {
            properties = properties.with_expiration(ShortString::from(ms.to_string()));
        }
        if let Some(p) = self.priority {
            properties = properties.with_priority(p);
        }
        if let Some(t) = &self.content_type {
            properties = properties.with_content_type(ShortString::from(t.as_str()));
        }
        if let Some(e) = &self.content_encoding {
            properties = properties.with_content_encoding(ShortString::from(e.as_str()));
        }
        if let Some(r) = &self.reply_to {
            properties = properties.with_reply_to(ShortString::from(r.as_str()));
        }
        properties
    }
}

/// Whether JSON text `raw` may hold a property key: one pass over its quotes
/// rather than one search per key (this runs for every event). A key is compared
/// as JSON reads it, after unescaping (`"pri\u006frity"` is `priority`): text
/// with any escape is parsed, since its keys cannot be told from the bytes.
fn names_a_key(raw: &[u8]) -> bool {
    raw.iter().enumerate().any(|(at, &b)| {
        b == b'\\' || (b == b'"' && QUOTED_KEYS.iter().any(|k| raw[at..].starts_with(k)))
    })
}

/// A whole non-negative number, as a JSON number or digits.
fn whole(value: &serde_json::Value) -> Option<u64> {
    match value {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse().ok()
        }
        _ => None,
    }
}

/// A TTL in milliseconds: a whole number of them, or a duration with its unit.
fn expiration(value: &serde_json::Value) -> Option<u64> {
    if let Some(ms) = whole(value) {
        return Some(ms);
    }
    let serde_json::Value::String(s) = value else {
        return None;
    };
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.checked_mul(60)?),
        "h" => Duration::from_secs(n.checked_mul(3600)?),
        _ => return None,
    };
    u64::try_from(d.as_millis()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_set_properties_and_invalid_values_name_the_key() {
        let p = RowProperties::of(
            br#"{"expiration":"5m","priority":"7","content_type":"text/csv","content_encoding":"gzip","reply_to":"replies","tenant":"a"}"#,
        )
        .unwrap();
        assert_eq!(
            p,
            RowProperties {
                expiration: Some(300_000),
                priority: Some(7),
                content_type: Some("text/csv".into()),
                content_encoding: Some("gzip".into()),
                reply_to: Some("replies".into()),
            }
        );
        assert_eq!(
            RowProperties::of(br#"{"expiration":1500}"#)
                .unwrap()
                .expiration,
            Some(1500)
        );
        assert_eq!(
            RowProperties::of(br#"{"expiration":"250ms"}"#)
                .unwrap()
                .expiration,
            Some(250)
        );
        assert_eq!(
            RowProperties::of(br#"{"tenant":"a"}"#).unwrap(),
            RowProperties::default()
        );
        for (bad, key) in [
            (r#"{"priority":256}"#, "priority"),
            (r#"{"priority":-1}"#, "priority"),
            (r#"{"priority":"high"}"#, "priority"),
            (r#"{"expiration":"soon"}"#, "expiration"),
            (r#"{"expiration":"5 m"}"#, "expiration"),
            (r#"{"reply_to":""}"#, "reply_to"),
            (r#"{"content_type":1}"#, "content_type"),
        ] {
            let e = RowProperties::of(bad.as_bytes()).expect_err(bad);
            assert!(e.starts_with(&format!("header {key:?}")), "{e}");
        }
    }

    #[test]
    fn the_quick_look_finds_every_key_wherever_it_is() {
        for key in PROPERTY_KEYS {
            for text in [
                format!(r#"{{"{key}":"1"}}"#),
                format!(r#"{{"a":1, "{key}" :"1"}}"#),
                format!(r#""{key}""#),
            ] {
                assert!(names_a_key(text.as_bytes()), "{text}");
            }
            // A longer key, or the name without its quotes, sets nothing.
            for text in [format!(r#"{{"{key}s":1}}"#), format!("{{{key}:1}}")] {
                assert!(!names_a_key(text.as_bytes()), "{text}");
            }
        }
        assert!(!names_a_key(br#"{"tenant":"a","traceparent":"00-x"}"#));
        assert!(!names_a_key(b""));
    }

    /// A key spelled with JSON escapes is the key JSON reads: `"pri\u006frity"`
    /// is `priority`, applied or refused like it, never dropped without a word
    /// (the quick look once missed it, and the headers then skipped it as a
    /// property key).
    #[test]
    fn an_escaped_property_key_is_the_key_it_spells() {
        let raw: &[u8] = b"{\"pri\\u006frity\": 300}";
        assert_eq!(raw, br#"{"pri\u006frity": 300}"#);
        let e = RowProperties::of(raw).expect_err("priority 300 passed");
        assert!(e.starts_with("header \"priority\""), "{e}");
        let p = RowProperties::of(br#"{"pri\u006frity": 7, "reply\u005fto": "r"}"#).unwrap();
        assert_eq!((p.priority, p.reply_to.as_deref()), (Some(7), Some("r")));
        // A key that only looks escaped sets nothing.
        assert_eq!(
            RowProperties::of(br#"{"pri\\u006frity": 300}"#).unwrap(),
            RowProperties::default()
        );
    }

    #[test]
    fn applied_properties_replace_the_derived_ones() {
        let p = RowProperties::of(br#"{"content_type":"text/csv","priority":3,"expiration":"1s"}"#)
            .unwrap()
            .apply(BasicProperties::default().with_content_type("application/json".into()));
        assert_eq!(p.content_type().as_ref().unwrap().as_str(), "text/csv");
        assert_eq!(*p.priority(), Some(3));
        assert_eq!(p.expiration().as_ref().unwrap().as_str(), "1000");
    }
}
