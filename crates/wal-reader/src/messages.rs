//! Logical decoding messages as events (docs/messages.md).
//!
//! `pg_logical_emit_message(true, prefix, content)` writes a message into the WAL
//! inside the caller's transaction; pgoutput (Postgres 14+, option `messages`)
//! decodes it at commit, in order with the transaction's row changes. A
//! [`MessageSource`] says which prefixes are events and turns each such message into
//! an [`OutboxEvent`] of its transaction, so every guarantee of the table source
//! (commit order, nothing rolled back, confirm after the broker's acks) holds for it
//! unchanged.
//!
//! - The content is a JSON object with `aggregate_type`, `aggregate_id`,
//!   `event_type`, `payload` (any JSON value: the body), and optional `headers` (an
//!   object) and `id`. Without `id`, the message id is derived from the server's
//!   system identifier, the database and the message's own LSN
//!   ([`MessageSource::derived_id`]): the same on every redelivery and every replay,
//!   and different on every other cluster.
//! - Content that is not such an object becomes an event all the same, marked
//!   [`OutboxEvent::malformed`]: the publisher holds it as poison (or sends a notice
//!   of it to the dead-letter exchange), named by its id and LSN, so nothing behind
//!   it is lost and an operator can skip it.
//! - Non-transactional messages survive their transaction's rollback, so relaying
//!   them would break the outbox contract: they are counted
//!   ([`MESSAGES_IGNORED`], `reason="non_transactional"`) and logged at most once a
//!   minute. Messages with other prefixes belong to other tools: counted
//!   (`reason="other_prefix"`), never logged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use outbox_event::{Lsn, OutboxEvent, OutboxTable};
use pgoutput::logical::LogicalDecodingMessage;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::pgtype::oid;

/// Logical messages the reader ignored, by `reason` (`non_transactional`,
/// `other_prefix`).
pub const MESSAGES_IGNORED: &str = "outbox_relay_messages_ignored_total";

/// How often an ignored non-transactional message is logged (the counter counts
/// every one).
const IGNORED_LOG_EVERY: Duration = Duration::from_secs(60);

/// The value of the `outbox_table` header (and `{table}` placeholder) of a message
/// event with this prefix.
pub fn table_name(prefix: &str) -> String {
    format!("message:{prefix}")
}

/// Which logical messages are events (`[postgres] messages`), and how their ids are
/// derived.
#[derive(Debug, Clone)]
pub struct MessageSource {
    /// The relayed prefixes, each with the table its events name.
    prefixes: Vec<(String, Arc<OutboxTable>)>,
    /// `outbox-relay/<system identifier>/<database>/`: derived ids append the LSN.
    id_base: String,
    /// When a non-transactional message was last logged.
    ignored_logged: Option<Instant>,
}

impl MessageSource {
    /// The messages with one of `prefixes` on the server with `system_id`, in
    /// `database`.
    pub fn new(prefixes: &[String], system_id: u64, database: &str) -> MessageSource {
        MessageSource {
            prefixes: prefixes
                .iter()
                .map(|p| {
                    let table = OutboxTable {
                        qualified_name: table_name(p),
                        schema: String::new(),
                        name: p.clone(),
                        payload_type: oid::JSONB,
                        headers_type: Some(oid::JSONB),
                        content_type: "application/json",
                    };
                    (p.clone(), Arc::new(table))
                })
                .collect(),
            id_base: format!("outbox-relay/{system_id}/{database}/"),
            ignored_logged: None,
        }
    }

    /// The source of `[postgres] messages` (`prefixes`), `None` when it lists none.
    pub fn for_config(
        prefixes: &[String],
        system_id: u64,
        database: &str,
    ) -> Option<MessageSource> {
        (!prefixes.is_empty()).then(|| MessageSource::new(prefixes, system_id, database))
    }

    /// The id of a message without its own: the source and the message's LSN.
    pub fn derived_id(&self, lsn: Lsn) -> String {
        format!("{}{lsn}", self.id_base)
    }

    /// The event of `message` if it is one (a transactional message with a relayed
    /// prefix); `tx` gives its transaction's xid, commit LSN and time and its
    /// position among the transaction's events. Other messages are counted (and a
    /// non-transactional one logged) and give `None`.
    pub fn event(&mut self, message: &LogicalDecodingMessage, tx: TxOf) -> Option<OutboxEvent> {
        let Some((_, table)) = self.prefixes.iter().find(|(p, _)| *p == message.prefix) else {
            metrics::counter!(MESSAGES_IGNORED, "reason" => "other_prefix").increment(1);
            return None;
        };
        if message.flags & 1 == 0 {
            metrics::counter!(MESSAGES_IGNORED, "reason" => "non_transactional").increment(1);
            if self
                .ignored_logged
                .is_none_or(|t| t.elapsed() >= IGNORED_LOG_EVERY)
            {
                self.ignored_logged = Some(Instant::now());
                tracing::warn!(
                    lsn = %message.lsn,
                    prefix = %outbox_event::redact::printable(&message.prefix),
                    "a non-transactional logical message with a relayed prefix was ignored: it is sent even when its transaction rolls back, so it is never relayed; emit it with pg_logical_emit_message(true, ...) (docs/messages.md)"
                );
            }
            return None;
        }
        let table = table.clone();
        let id = || Bytes::from(self.derived_id(message.lsn));
        let event = match parse(&message.content) {
            Ok(c) => OutboxEvent {
                table,
                xid: tx.xid,
                commit_lsn: tx.commit_lsn,
                commit_time_micros: tx.commit_time_micros,
                index: tx.index,
                id: Some(c.id.map(Bytes::from).unwrap_or_else(id)),
                aggregate_type: Some(Bytes::from(c.aggregate_type)),
                aggregate_id: Some(Bytes::from(c.aggregate_id.into_text())),
                event_type: Some(Bytes::from(c.event_type)),
                payload: Some(c.payload.clone()),
                body: c.payload,
                headers: c.headers,
                correlation_id: None,
                exchange: None,
                properties: Vec::new(),
                malformed: None,
            },
            Err(reason) => OutboxEvent {
                table,
                xid: tx.xid,
                commit_lsn: tx.commit_lsn,
                commit_time_micros: tx.commit_time_micros,
                index: tx.index,
                id: Some(id()),
                aggregate_type: None,
                aggregate_id: None,
                event_type: None,
                payload: Some(message.content.clone()),
                body: message.content.clone(),
                headers: None,
                correlation_id: None,
                exchange: None,
                properties: Vec::new(),
                malformed: Some(Arc::from(format!(
                    "the logical message at LSN {} (prefix {:?}) is not the JSON object docs/messages.md describes: {reason}",
                    message.lsn,
                    message.prefix
                ))),
            },
        };
        Some(event)
    }
}

/// What a message event takes from its transaction.
#[derive(Debug, Clone, Copy)]
pub struct TxOf {
    pub xid: u32,
    pub commit_lsn: Lsn,
    pub commit_time_micros: i64,
    /// The event's position among its transaction's relayed events.
    pub index: u64,
}

/// A message's content, checked.
struct Content {
    aggregate_type: String,
    aggregate_id: AggregateId,
    event_type: String,
    /// The payload's JSON text, as written.
    payload: Bytes,
    /// The headers object's JSON text, as written.
    headers: Option<Bytes>,
    id: Option<String>,
}

/// `aggregate_id` as a string or, as applications often key aggregates, a number.
#[derive(Deserialize)]
#[serde(untagged)]
enum AggregateId {
    Text(String),
    Number(serde_json::Number),
}

impl AggregateId {
    fn into_text(self) -> String {
        match self {
            AggregateId::Text(s) => s,
            AggregateId::Number(n) => n.to_string(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw<'a> {
    aggregate_type: String,
    aggregate_id: AggregateId,
    event_type: String,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(default, borrow)]
    headers: Option<&'a RawValue>,
    #[serde(default)]
    id: Option<String>,
}

/// Checks a message's content (module docs); the error says what is wrong.
fn parse(content: &Bytes) -> Result<Content, String> {
    let raw: Raw<'_> = serde_json::from_slice(content).map_err(|e| {
        if e.is_data() || e.is_syntax() || e.is_eof() {
            format!("{e}")
        } else {
            format!("not JSON: {e}")
        }
    })?;
    let slice = |v: &RawValue| content.slice_ref(v.get().as_bytes());
    let headers = match raw.headers {
        Some(h) if h.get() == "null" => None,
        Some(h) if !h.get().starts_with('{') => {
            return Err("`headers` is not a JSON object".into());
        }
        Some(h) => Some(slice(h)),
        None => None,
    };
    if let Some(id) = &raw.id {
        if id.is_empty() {
            return Err("`id` is empty: leave it out for a derived id".into());
        }
    }
    Ok(Content {
        aggregate_type: raw.aggregate_type,
        aggregate_id: raw.aggregate_id,
        event_type: raw.event_type,
        payload: slice(raw.payload),
        headers,
        id: raw.id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(flags: u8, prefix: &str, content: &str) -> LogicalDecodingMessage {
        LogicalDecodingMessage {
            xid: None,
            flags,
            lsn: "0/1A2B3C4".parse().unwrap(),
            prefix: prefix.into(),
            content: Bytes::from(content.to_string()),
        }
    }

    fn tx() -> TxOf {
        TxOf {
            xid: 7,
            commit_lsn: "0/1A2B400".parse().unwrap(),
            commit_time_micros: 1,
            index: 3,
        }
    }

    fn source() -> MessageSource {
        MessageSource::new(&["outbox".to_string()], 7_300_000_000_000_000_001, "app")
    }

    #[test]
    fn a_well_formed_message_is_an_event_of_its_transaction() {
        let m = message(
            1,
            "outbox",
            r#"{"aggregate_type":"order","aggregate_id":42,"event_type":"created","payload":{"a": [1, 2]},"headers":{"k":"v"}}"#,
        );
        let e = source().event(&m, tx()).expect("an event");
        assert_eq!(e.table.qualified_name, "message:outbox");
        assert_eq!(e.table.content_type, "application/json");
        assert_eq!(
            e.id.as_deref(),
            Some(&b"outbox-relay/7300000000000000001/app/0/1A2B3C4"[..])
        );
        assert_eq!(e.aggregate_id.as_deref(), Some(&b"42"[..]));
        assert_eq!(&e.body[..], br#"{"a": [1, 2]}"#);
        assert_eq!(e.headers.as_deref(), Some(&br#"{"k":"v"}"#[..]));
        assert_eq!((e.xid, e.index), (7, 3));
        assert_eq!(e.commit_lsn, tx().commit_lsn);
        assert!(e.malformed.is_none());
    }

    #[test]
    fn an_id_of_its_own_is_kept() {
        let m = message(
            1,
            "outbox",
            r#"{"id":"abc","aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":null}"#,
        );
        let e = source().event(&m, tx()).unwrap();
        assert_eq!(e.id.as_deref(), Some(&b"abc"[..]));
        assert_eq!(&e.body[..], b"null");
        assert!(e.headers.is_none());
    }

    #[test]
    fn other_prefixes_and_non_transactional_messages_are_not_events() {
        let ok = r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":1}"#;
        let mut s = source();
        assert!(s.event(&message(1, "other", ok), tx()).is_none());
        assert!(s.event(&message(0, "outbox", ok), tx()).is_none());
        assert!(s.event(&message(1, "outbox", ok), tx()).is_some());
    }

    #[test]
    fn malformed_content_is_an_event_marked_malformed_naming_its_lsn() {
        for bad in [
            "not json",
            "[1,2]",
            r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e"}"#,
            r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":1,"headers":[1]}"#,
            r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":1,"id":""}"#,
            r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":1,"extra":1}"#,
            r#"{"aggregate_type":1,"aggregate_id":"1","event_type":"e","payload":1}"#,
        ] {
            let e = source()
                .event(&message(1, "outbox", bad), tx())
                .expect("an event");
            let why = e
                .malformed
                .as_deref()
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(why.contains("0/1A2B3C4"), "{why}");
            assert_eq!(&e.body[..], bad.as_bytes());
            assert_eq!(
                e.id.as_deref(),
                Some(&b"outbox-relay/7300000000000000001/app/0/1A2B3C4"[..])
            );
        }
    }
}
