//! The stream message of one event (AMQP 1.0, as the stream protocol carries it);
//! see the module docs of `stream` for the fields.

use std::collections::HashSet;

use outbox_event::{Lsn, OutboxEvent};
use rabbitmq_stream_client::types::{Message, SimpleValue};

use super::tail::Tail;
use crate::message::cloudevents::{self, CloudEvents};
use crate::message::{json_headers, HeaderProfile, MessageFormat};

/// Application property naming the producer reference.
pub const PRODUCER_PROPERTY: &str = "x-outbox-producer";
/// Application property holding the publishing id.
pub const PUBLISHING_ID_PROPERTY: &str = "x-outbox-publishing-id";

/// A message ready to publish (and to publish again after a failure).
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub id: u64,
    pub message: Message,
    pub commit_time_micros: i64,
    /// Rough encoded size, for cutting publish frames.
    pub size: usize,
}

/// Builds [`Pending`] messages; holds what is the same for every message.
pub(super) struct StreamMessageBuilder {
    extra: Vec<(String, String)>,
    producer: Option<String>,
    /// Reserved header keys already logged as dropped.
    logged: HashSet<String>,
    /// The CloudEvents attributes' builder (`format = "cloudevents"`).
    cloudevents: Option<CloudEvents>,
    /// Which of the relay's properties are written (`[message] headers`).
    profile: HeaderProfile,
}

fn text(value: Option<&bytes::Bytes>) -> SimpleValue {
    match value {
        Some(v) => SimpleValue::from(String::from_utf8_lossy(v).into_owned()),
        None => SimpleValue::Null,
    }
}

impl StreamMessageBuilder {
    pub fn new(extra: &[(String, String)], producer: Option<String>) -> Self {
        Self {
            extra: extra.to_vec(),
            producer,
            logged: HashSet::new(),
            cloudevents: None,
            profile: HeaderProfile::Full,
        }
    }

    /// The builder that writes the relay's application properties of `profile`
    /// (the default is [`HeaderProfile::Full`]).
    pub fn with_headers(mut self, profile: HeaderProfile) -> Self {
        self.profile = profile;
        self
    }

    /// The builder for messages of `format` (the default is [`MessageFormat::Native`]).
    pub fn with_format(mut self, format: &MessageFormat) -> Self {
        self.cloudevents = format.builder();
        self
    }

    pub fn build(&mut self, event: &OutboxEvent, id: u64) -> Pending {
        let mut properties = Message::builder().body(event.body.to_vec()).properties();
        if let Some(message_id) = &event.id {
            properties = properties.message_id(String::from_utf8_lossy(message_id).into_owned());
        }
        properties = properties.content_type(event.table.content_type);
        if let Some(time) = chrono::DateTime::from_timestamp_micros(event.commit_time_micros) {
            properties = properties.creation_time(time);
        }
        let mut size = event.body.len() + 256;
        let mut app = properties.message_builder().application_properties();
        if let Some(raw) = &event.headers {
            size += raw.len();
            for (key, value) in json_headers(raw, &mut self.logged, self.cloudevents.is_some()) {
                app = app.insert(key, SimpleValue::from(value));
            }
        }
        for (key, value) in &self.extra {
            size += key.len() + value.len();
            app = app.insert(key.as_str(), value.as_str());
        }
        if self.profile.descriptive() {
            app = app
                .insert("aggregate_type", text(event.aggregate_type.as_ref()))
                .insert("aggregate_id", text(event.aggregate_id.as_ref()))
                .insert("table", event.table.qualified_name.as_str())
                .insert("xid", SimpleValue::from(u64::from(event.xid)));
        }
        app = app
            .insert("event_type", text(event.event_type.as_ref()))
            .insert(
                "commit_lsn",
                SimpleValue::from(event.commit_lsn.to_string()),
            )
            .insert("tx_index", SimpleValue::from(event.index));
        if let Some(ce) = &mut self.cloudevents {
            let a = ce.attributes(event);
            size += 160 + a.id.len() + a.source.len() + a.kind.len();
            app = app
                .insert(cloudevents::SPECVERSION_KEY, cloudevents::SPECVERSION)
                .insert(cloudevents::ID, a.id)
                .insert(cloudevents::SOURCE, a.source)
                .insert(cloudevents::TYPE, a.kind)
                .insert(cloudevents::TIME, a.time);
            if let Some(subject) = a.subject {
                size += subject.len();
                app = app.insert(cloudevents::SUBJECT, subject);
            }
        }
        if let Some(producer) = &self.producer {
            app = app
                .insert(PRODUCER_PROPERTY, producer.as_str())
                .insert(PUBLISHING_ID_PROPERTY, SimpleValue::from(id));
        }
        Pending {
            id,
            message: app.message_builder().publising_id(id).build(),
            commit_time_micros: event.commit_time_micros,
            size,
        }
    }
}

/// The `(commit_lsn, tx_index)` of a stored message of `producer` with publishing id
/// `id`, or `None` when the message is another's (or lacks the properties).
pub(super) fn tail_of(message: &Message, producer: &str, id: u64) -> Option<Tail> {
    let app = message.application_properties()?;
    match app.get(PRODUCER_PROPERTY)? {
        SimpleValue::String(p) if p == producer => {}
        _ => return None,
    }
    match app.get(PUBLISHING_ID_PROPERTY)? {
        SimpleValue::Ulong(v) if *v == id => {}
        _ => return None,
    }
    let commit_lsn = match app.get("commit_lsn")? {
        SimpleValue::String(s) => s.parse::<Lsn>().ok()?,
        _ => return None,
    };
    let tx_index = match app.get("tx_index")? {
        SimpleValue::Ulong(v) => *v,
        _ => return None,
    };
    Some(Tail {
        commit_lsn,
        tx_index,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use bytes::Bytes;
    use outbox_event::OutboxTable;

    use super::*;
    use crate::message::cloudevents::CloudEventsFormat;

    fn event() -> OutboxEvent {
        OutboxEvent {
            table: Arc::new(OutboxTable {
                qualified_name: "public.outbox".into(),
                schema: "public".into(),
                name: "outbox".into(),
                payload_type: 0,
                headers_type: None,
                content_type: "application/json",
            }),
            xid: 9,
            commit_lsn: Lsn(0x2_0000_0010),
            commit_time_micros: 1_700_000_000_000_001,
            index: 1,
            id: Some(Bytes::from_static(b"id-1")),
            aggregate_type: Some(Bytes::from_static(b"order")),
            aggregate_id: Some(Bytes::from_static(b"o-1")),
            event_type: Some(Bytes::from_static(b"created")),
            payload: Some(Bytes::from_static(b"{}")),
            body: Bytes::from_static(b"{}"),
            headers: Some(Bytes::from_static(
                br#"{"cloudEvents:source":"spoof","tenant":"t"}"#,
            )),
            correlation_id: None,
        }
    }

    fn prop(m: &Message, key: &str) -> Option<String> {
        match m.application_properties()?.get(key)? {
            SimpleValue::String(s) => Some(s.clone()),
            other => Some(format!("{other:?}")),
        }
    }

    #[test]
    fn minimal_properties_still_find_the_tail() {
        let mut b =
            StreamMessageBuilder::new(&[], Some("p".into())).with_headers(HeaderProfile::Minimal);
        let p = b.build(&event(), 7);
        let app = p.message.application_properties().unwrap();
        let mut keys: Vec<&str> = app.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "cloudEvents:source",
                "commit_lsn",
                "event_type",
                "tenant",
                "tx_index",
                PRODUCER_PROPERTY,
                PUBLISHING_ID_PROPERTY,
            ]
        );
        assert_eq!(
            tail_of(&p.message, "p", 7),
            Some(Tail {
                commit_lsn: Lsn(0x2_0000_0010),
                tx_index: 1
            })
        );
        let full = StreamMessageBuilder::new(&[], Some("p".into())).build(&event(), 7);
        let n = full.message.application_properties().unwrap().len();
        assert_eq!(n, keys.len() + 4);
    }

    #[test]
    fn native_has_no_cloudevents_properties() {
        let mut b = StreamMessageBuilder::new(&[], Some("p".into()));
        let p = b.build(&event(), 7);
        let app = p.message.application_properties().unwrap();
        let ce: Vec<&String> = app
            .keys()
            .filter(|k| k.starts_with("cloudEvents"))
            .collect();
        // Only the headers column's key, copied as is in the native format.
        assert_eq!(ce, ["cloudEvents:source"]);
        assert_eq!(
            prop(&p.message, "cloudEvents:source").as_deref(),
            Some("spoof")
        );
        assert_eq!(prop(&p.message, "tenant").as_deref(), Some("t"));
    }

    #[test]
    fn cloudevents_application_properties() {
        let format = CloudEventsFormat::new("urn:{database}:{table}", "db", "x.").unwrap();
        let mut b = StreamMessageBuilder::new(&[], Some("p".into()))
            .with_format(&MessageFormat::CloudEvents(format));
        let p = b.build(&event(), 7);
        let m = &p.message;
        for (key, value) in [
            ("cloudEvents:specversion", "1.0"),
            ("cloudEvents:id", "id-1"),
            ("cloudEvents:source", "urn:db:public.outbox"),
            ("cloudEvents:type", "x.created"),
            ("cloudEvents:time", "2023-11-14T22:13:20.000001Z"),
            ("cloudEvents:subject", "o-1"),
            ("tenant", "t"),
            ("event_type", "created"),
            ("commit_lsn", "2/10"),
        ] {
            assert_eq!(prop(m, key).as_deref(), Some(value), "{key}");
        }
        let props = m.properties().unwrap();
        assert_eq!(
            props.content_type.as_ref().unwrap().as_ref() as &str,
            "application/json"
        );
        // The stream's own properties still identify the message (exactly once).
        assert_eq!(
            tail_of(m, "p", 7),
            Some(Tail {
                commit_lsn: Lsn(0x2_0000_0010),
                tx_index: 1
            })
        );
    }
}
