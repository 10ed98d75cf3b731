//! The stream message of one event (AMQP 1.0, as the stream protocol carries it);
//! see the module docs of `stream` for the fields.

use std::collections::{HashMap, HashSet};

use outbox_event::{Lsn, OutboxEvent};
use rabbitmq_stream_client::types::{Message, SimpleValue};
use rabbitmq_stream_protocol::codec::Encoder;

use super::engine::{StreamMsg, MESSAGE_OVERHEAD};
use super::identity::{publishing_id, ProducerKey, StreamSource, TooManyEvents};
use crate::message::cloudevents::{self, CloudEvents};
use crate::message::{
    json_headers, HeaderProfile, MessageFormat, RoutingKeyTemplate, TemplateFields,
};
use crate::trace::{EventSpan, EventTracer, TRACEPARENT, TRACESTATE};

/// Application property naming the producer reference.
pub const PRODUCER_PROPERTY: &str = "x-outbox-producer";
/// Application property holding the publishing id.
pub const PUBLISHING_ID_PROPERTY: &str = "x-outbox-publishing-id";
/// Application property naming the source: `<system id>/<database>/<slot>`.
pub const SOURCE_PROPERTY: &str = "x-outbox-source";
/// Application property holding the timeline whose WAL holds the event's commit.
pub const TIMELINE_PROPERTY: &str = "x-outbox-timeline";

/// The relay's own application properties (the stream's `table` is the exchange
/// target's `outbox_table`): a row's headers column never sets them, whatever
/// `[message] headers` writes.
const RELAY_KEYS: [&str; 7] = [
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "table",
    "commit_lsn",
    "tx_index",
    "xid",
];

/// The producer of replay's unnamed messages (no deduplication).
pub(super) const UNNAMED: ProducerKey = ProducerKey {
    timeline: 0,
    epoch: 0,
};

/// A message ready to publish (and to publish again after a failure).
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub key: ProducerKey,
    pub id: u64,
    pub message: Message,
    pub commit_lsn: Lsn,
    pub index: u64,
    pub commit_time_micros: i64,
    /// Exact bytes it adds to a publish frame.
    pub frame_bytes: usize,
    /// Its filter value (`[rabbitmq] stream_filter_value`, sent in publish v2 by
    /// `raw.rs`); `None`: not configured.
    pub filter_value: Option<String>,
    /// The `message-id` property, for reports.
    pub message_id: String,
    /// Why its event cannot be published: a malformed logical message (poison).
    pub malformed: Option<std::sync::Arc<str>>,
    /// Its `publish` span, with `[tracing]` on (crate::trace): its context is the
    /// message's `traceparent`; it ends at the confirm.
    pub trace: Option<std::sync::Arc<EventSpan>>,
}

impl StreamMsg for Pending {
    fn producer(&self) -> ProducerKey {
        self.key
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn frame_bytes(&self) -> usize {
        self.frame_bytes
    }

    fn position(&self) -> (Lsn, u64) {
        (self.commit_lsn, self.index)
    }

    fn malformed(&self) -> bool {
        self.malformed.is_some()
    }

    fn confirmed(&self) {
        if let Some(span) = &self.trace {
            span.end();
        }
    }
}

/// Builds [`Pending`] messages; holds what is the same for every message.
pub(super) struct StreamMessageBuilder {
    extra: Vec<(String, String)>,
    /// The named producers' source; `None`: replay's unnamed producer.
    source: Option<StreamSource>,
    /// Producer references already made.
    references: HashMap<ProducerKey, String>,
    /// The next id of the unnamed producer.
    next_unnamed: u64,
    /// Reserved header keys already logged as dropped.
    logged: HashSet<String>,
    /// The CloudEvents attributes' builder (`format = "cloudevents"`).
    cloudevents: Option<CloudEvents>,
    /// Which of the relay's properties are written (`[message] headers`).
    profile: HeaderProfile,
    /// With `[tracing]` on: the tracer and the stream's name, the spans' destination.
    tracer: Option<(EventTracer, String)>,
    /// The filter value's template (`[rabbitmq] stream_filter_value`).
    filter: Option<RoutingKeyTemplate>,
}

fn text(value: Option<&bytes::Bytes>) -> SimpleValue {
    match value {
        Some(v) => SimpleValue::from(String::from_utf8_lossy(v).into_owned()),
        None => SimpleValue::Null,
    }
}

impl StreamMessageBuilder {
    pub fn new(extra: &[(String, String)], source: Option<StreamSource>) -> Self {
        Self {
            extra: extra.to_vec(),
            source,
            references: HashMap::new(),
            next_unnamed: 1,
            logged: HashSet::new(),
            cloudevents: None,
            profile: HeaderProfile::Full,
            tracer: None,
            filter: None,
        }
    }

    /// The builder that gives each message the filter value `template` renders for
    /// its event, as `routing_key` is rendered (docs/streams.md, "Filter values").
    pub fn with_filter(mut self, template: Option<RoutingKeyTemplate>) -> Self {
        self.filter = template;
        self
    }

    /// The builder that starts a `publish` span per message, bound for `stream`,
    /// when `tracer` is some (tracing on).
    pub fn with_tracer(mut self, tracer: Option<EventTracer>, stream: &str) -> Self {
        self.tracer = tracer.map(|t| (t, stream.to_string()));
        self
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

    /// The reference of producer `key` (named producers only).
    pub fn reference(&mut self, key: ProducerKey) -> Option<String> {
        let source = self.source.as_ref()?;
        Some(
            self.references
                .entry(key)
                .or_insert_with(|| source.reference_of(key))
                .clone(),
        )
    }

    pub fn build(&mut self, event: &OutboxEvent) -> Result<Pending, TooManyEvents> {
        let (key, id) = match &self.source {
            Some(source) => (
                source.key(event.commit_lsn),
                publishing_id(event.commit_lsn, event.index)?,
            ),
            None => {
                self.next_unnamed += 1;
                (UNNAMED, self.next_unnamed - 1)
            }
        };
        let message_id = event
            .id
            .as_ref()
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_default();
        let mut properties = Message::builder().body(event.body.to_vec()).properties();
        if event.id.is_some() {
            properties = properties.message_id(message_id.clone());
        }
        properties = properties.content_type(event.table.content_type);
        if let Some(time) = chrono::DateTime::from_timestamp_micros(event.commit_time_micros) {
            properties = properties.creation_time(time);
        }
        let mut app = properties.message_builder().application_properties();
        if let Some(raw) = &event.headers {
            let cloudevents = self.cloudevents.is_some();
            for (key, value) in json_headers(raw, &mut self.logged, cloudevents, &RELAY_KEYS) {
                app = app.insert(key, SimpleValue::from(value));
            }
        }
        for (key, value) in &self.extra {
            app = app.insert(key.as_str(), value.as_str());
        }
        // The span's own context replaces the row's, whose span is its parent.
        let trace = self
            .tracer
            .as_mut()
            .map(|(tracer, stream)| tracer.start(event, stream, None));
        if let Some(span) = &trace {
            app = app.insert(TRACEPARENT, span.traceparent());
            if let Some(state) = span.tracestate() {
                app = app.insert(TRACESTATE, state);
            }
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
            app = app
                .insert(cloudevents::SPECVERSION_KEY, cloudevents::SPECVERSION)
                .insert(cloudevents::ID, a.id)
                .insert(cloudevents::SOURCE, a.source)
                .insert(cloudevents::TYPE, a.kind)
                .insert(cloudevents::TIME, a.time);
            if let Some(subject) = a.subject {
                app = app.insert(cloudevents::SUBJECT, subject);
            }
        }
        if let Some(reference) = self.reference(key) {
            let source = self
                .source
                .as_ref()
                .map(|s| s.source.as_str())
                .unwrap_or("");
            app = app
                .insert(PRODUCER_PROPERTY, reference)
                .insert(PUBLISHING_ID_PROPERTY, SimpleValue::from(id))
                .insert(SOURCE_PROPERTY, source)
                .insert(
                    TIMELINE_PROPERTY,
                    SimpleValue::from(u64::from(key.timeline)),
                );
        }
        let message = app.message_builder().publishing_id(id).build();
        let filter_value = self
            .filter
            .as_ref()
            .map(|t| t.render_fields(&TemplateFields::of(event)));
        // Publish v2 adds the value as a string (int16 length) to each message.
        let filter_bytes = filter_value.as_ref().map_or(0, |v| 2 + v.len());
        let frame_bytes = MESSAGE_OVERHEAD + filter_bytes + message.encoded_size() as usize;
        Ok(Pending {
            key,
            id,
            message,
            commit_lsn: event.commit_lsn,
            index: event.index,
            commit_time_micros: event.commit_time_micros,
            frame_bytes,
            filter_value,
            message_id,
            malformed: event.malformed.clone(),
            trace,
        })
    }
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
            exchange: None,
            properties: Vec::new(),
            malformed: None,
        }
    }

    fn prop(m: &Message, key: &str) -> Option<String> {
        match m.application_properties()?.get(key)? {
            SimpleValue::String(s) => Some(s.clone()),
            other => Some(format!("{other:?}")),
        }
    }

    fn source() -> StreamSource {
        StreamSource {
            reference: "p".into(),
            source: "7/db/slot".into(),
            history: outbox_event::history::History::first(7),
            server_wal: Lsn(u64::MAX),
        }
    }

    /// With tracing on, the message carries its span's context in place of the
    /// row's, whose trace it continues; the row's tracestate passes on.
    #[test]
    fn a_traced_message_carries_its_spans_traceparent() {
        use opentelemetry::trace::TracerProvider as _;
        const ROW: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let tracer = EventTracer::new(provider.tracer("test"));
        let mut b =
            StreamMessageBuilder::new(&[], Some(source())).with_tracer(Some(tracer), "events");
        let mut e = event();
        e.headers = Some(Bytes::from(format!(
            r#"{{"traceparent":"{ROW}","tracestate":"vendor=1"}}"#
        )));
        let p = b.build(&e).unwrap();
        let span = p.trace.as_ref().expect("a span");
        let carried = prop(&p.message, TRACEPARENT).unwrap();
        assert_eq!(carried, span.traceparent());
        assert_ne!(carried, ROW);
        assert_eq!(&carried[..36], &ROW[..36], "same trace: {carried}");
        assert_eq!(prop(&p.message, TRACESTATE).as_deref(), Some("vendor=1"));
        // The frame size counts the properties as sent.
        assert_eq!(
            p.frame_bytes,
            MESSAGE_OVERHEAD + p.message.encoded_size() as usize
        );
        // Without a tracer: the row's traceparent as it was, no span.
        let p = StreamMessageBuilder::new(&[], Some(source()))
            .build(&e)
            .unwrap();
        assert!(p.trace.is_none());
        assert_eq!(prop(&p.message, TRACEPARENT).as_deref(), Some(ROW));
    }

    #[test]
    fn minimal_properties_keep_the_producer_and_source() {
        let mut b =
            StreamMessageBuilder::new(&[], Some(source())).with_headers(HeaderProfile::Minimal);
        let p = b.build(&event()).unwrap();
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
                SOURCE_PROPERTY,
                TIMELINE_PROPERTY,
            ]
        );
        assert_eq!(
            prop(&p.message, PRODUCER_PROPERTY).as_deref(),
            Some("p/tl1")
        );
        assert_eq!(
            prop(&p.message, SOURCE_PROPERTY).as_deref(),
            Some("7/db/slot")
        );
        assert_eq!(p.id, publishing_id(Lsn(0x2_0000_0010), 1).unwrap());
        let full = StreamMessageBuilder::new(&[], Some(source()))
            .build(&event())
            .unwrap();
        let n = full.message.application_properties().unwrap().len();
        assert_eq!(n, keys.len() + 4);
    }

    /// A row's headers column never sets the relay's own properties, with
    /// `headers = "minimal"` (which leaves the descriptive ones out) as with `full`.
    #[test]
    fn a_row_never_sets_the_relays_own_properties() {
        let mut e = event();
        e.headers = Some(Bytes::from_static(
            br#"{"aggregate_type":"forged","aggregate_id":"forged","table":"forged","xid":"forged","event_type":"forged","tenant":"t"}"#,
        ));
        for profile in [HeaderProfile::Minimal, HeaderProfile::Full] {
            let mut b = StreamMessageBuilder::new(&[], Some(source())).with_headers(profile);
            let p = b.build(&e).unwrap();
            let app = p.message.application_properties().unwrap();
            for key in app.keys() {
                assert_ne!(prop(&p.message, key).as_deref(), Some("forged"), "{key}");
            }
            assert_eq!(prop(&p.message, "tenant").as_deref(), Some("t"));
            assert_eq!(
                app.contains_key("table"),
                profile == HeaderProfile::Full,
                "{profile:?}"
            );
        }
    }

    #[test]
    fn frame_bytes_is_the_exact_encoding() {
        let p = StreamMessageBuilder::new(&[], Some(source()))
            .build(&event())
            .unwrap();
        let mut encoded = Vec::new();
        p.message.encode(&mut encoded).unwrap();
        assert_eq!(p.frame_bytes, encoded.len() + MESSAGE_OVERHEAD);
    }

    /// `stream_filter_value` is rendered per event by the routing key's renderer
    /// (NULL fields as empty text), and the frame size counts it as publish v2
    /// encodes it: a frame of two messages is exactly the frame overhead plus both.
    #[test]
    fn the_filter_value_is_rendered_per_event_and_counted_in_the_frame() {
        let template = RoutingKeyTemplate::parse("{aggregate_type}-{event_type}").unwrap();
        let mut b = StreamMessageBuilder::new(&[], Some(source())).with_filter(Some(template));
        let p = b.build(&event()).unwrap();
        assert_eq!(p.filter_value.as_deref(), Some("order-created"));
        let mut other = event();
        other.aggregate_type = None;
        other.index = 2;
        let q = b.build(&other).unwrap();
        assert_eq!(q.filter_value.as_deref(), Some("-created"));
        let request = crate::stream::raw::publish_v2(
            0,
            vec![
                (p.message.clone(), p.filter_value.clone()),
                (q.message.clone(), q.filter_value.clone()),
            ],
        )
        .unwrap();
        let frame = crate::stream::raw::encode(&request).unwrap();
        assert_eq!(
            frame.len(),
            super::super::engine::FRAME_OVERHEAD + p.frame_bytes + q.frame_bytes
        );
        // Without the key: no value, and the v1 size.
        let plain = StreamMessageBuilder::new(&[], Some(source()))
            .build(&event())
            .unwrap();
        assert_eq!(plain.filter_value, None);
        assert_eq!(plain.frame_bytes + 2 + "order-created".len(), p.frame_bytes);
    }

    #[test]
    fn unnamed_messages_have_no_producer_properties() {
        let mut b = StreamMessageBuilder::new(&[("replay".into(), "true".into())], None);
        let first = b.build(&event()).unwrap();
        let second = b.build(&event()).unwrap();
        assert_eq!((first.id, second.id), (1, 2));
        assert_eq!(first.key, UNNAMED);
        let app = first.message.application_properties().unwrap();
        assert!(!app.contains_key(PRODUCER_PROPERTY));
        assert!(!app.contains_key(SOURCE_PROPERTY));
        assert_eq!(prop(&first.message, "replay").as_deref(), Some("true"));
    }

    #[test]
    fn native_has_no_cloudevents_properties() {
        let mut b = StreamMessageBuilder::new(&[], Some(source()));
        let p = b.build(&event()).unwrap();
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
        let mut b = StreamMessageBuilder::new(&[], Some(source()))
            .with_format(&MessageFormat::CloudEvents(format));
        let p = b.build(&event()).unwrap();
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
        assert_eq!(prop(m, PRODUCER_PROPERTY).as_deref(), Some("p/tl1"));
    }
}
