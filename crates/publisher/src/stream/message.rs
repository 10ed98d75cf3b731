//! The stream message of one event (AMQP 1.0, as the stream protocol carries it);
//! see the module docs of `stream` for the fields.

use std::collections::HashSet;

use outbox_event::{Lsn, OutboxEvent};
use rabbitmq_stream_client::types::{Message, SimpleValue};

use super::tail::Tail;
use crate::message::json_headers;

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
        }
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
            for (key, value) in json_headers(raw, &mut self.logged) {
                app = app.insert(key, SimpleValue::from(value));
            }
        }
        for (key, value) in &self.extra {
            size += key.len() + value.len();
            app = app.insert(key.as_str(), value.as_str());
        }
        app = app
            .insert("aggregate_type", text(event.aggregate_type.as_ref()))
            .insert("aggregate_id", text(event.aggregate_id.as_ref()))
            .insert("event_type", text(event.event_type.as_ref()))
            .insert("table", event.table.qualified_name.as_str())
            .insert(
                "commit_lsn",
                SimpleValue::from(event.commit_lsn.to_string()),
            )
            .insert("tx_index", SimpleValue::from(event.index))
            .insert("xid", SimpleValue::from(u64::from(event.xid)));
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
