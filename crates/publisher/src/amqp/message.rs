//! The AMQP message of an event (docs/design.md §5): [`OutboundMessage`], what the
//! publishing loop keeps and publishes again after a failure, and [`MessageBuilder`],
//! which gives it its AMQP properties and headers. What both targets share (the
//! format, the header profile, the templates, the headers column) is in
//! `crate::message`.

use std::collections::HashSet;
use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::Bytes;
use outbox_event::{Lsn, OutboxEvent, OutboxTable};

use crate::amqp::engine::{DeadLetterReason, EventKey, Keyed};
use crate::error::PublishError;
use crate::message::cloudevents::{self, CloudEvents};
use crate::message::row_properties::{is_property_key, RowProperties};
use crate::message::{
    json_headers, truncate_at_char, ExchangeRule, HeaderProfile, MessageFormat, RoutingKeyTemplate,
    RELAY_HEADERS, SHORT_STRING_MAX,
};
use crate::trace::{EventSpan, TRACEPARENT, TRACESTATE};

fn short(value: Option<&Bytes>) -> Option<ShortString> {
    value.map(|v| {
        let mut s = String::from_utf8_lossy(v).into_owned();
        truncate_at_char(&mut s, SHORT_STRING_MAX);
        ShortString::from(s)
    })
}

fn long(value: Option<&Bytes>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(
        value.map(|v| v.to_vec()).unwrap_or_default(),
    ))
}

/// A message ready to publish (and to publish again after a failure).
///
/// It keeps the event instead of its AMQP properties: the connection takes the
/// properties by value, so a kept copy would be copied again (every header allocated twice) at
/// every publish; building them from the event at publish time
/// ([`MessageBuilder::properties_of`]) costs one copy and gives the same bytes
/// every time (the builder's output depends on the event alone).
#[derive(Debug, Clone)]
pub struct OutboundMessage {
    /// Its exchange when it is not `[rabbitmq] exchange` ([`ExchangeRule::of`]).
    pub exchange: Option<ShortString>,
    pub routing_key: ShortString,
    pub body: Bytes,
    /// The event the properties are built from.
    pub event: OutboxEvent,
    /// Properties published instead of the built ones (the dead-letter copies).
    pub fixed_properties: Option<BasicProperties>,
    /// Its `publish` span, with `[tracing]` on (crate::trace): its context is the
    /// message's `traceparent`.
    pub trace: Option<Arc<EventSpan>>,
}

impl Keyed for Arc<OutboundMessage> {
    fn key(&self) -> EventKey {
        OutboundMessage::key(self)
    }
    fn bytes(&self) -> usize {
        self.body.len()
    }
}

impl crate::status::Describe for OutboundMessage {
    fn waiting(&self) -> crate::status::Waiting {
        crate::status::Waiting {
            message_id: self.message_id(),
            commit_lsn: self.event.commit_lsn,
            // Empty: the publisher's own destination (`PublisherStatus::oldest`).
            destination: self
                .exchange
                .as_ref()
                .map(|x| x.to_string())
                .unwrap_or_default(),
        }
    }
}

impl OutboundMessage {
    /// The copy of this message for the dead-letter exchange: the same message with
    /// `x-outbox-error`, `x-original-exchange` and `x-original-routing-key`; for a
    /// message the broker refused, a notice without the body (what was refused) that
    /// keeps only the relay's own headers and says how large the body was.
    /// `properties` are this message's ([`MessageBuilder::properties_of`]).
    pub(crate) fn dead_letter_copy(
        &self,
        properties: BasicProperties,
        exchange: &str,
        reason: &DeadLetterReason,
    ) -> Self {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        let mut message = self.clone();
        let original = properties.headers().clone().unwrap_or_default();
        let mut headers = match reason {
            DeadLetterReason::Unroutable { .. } => original,
            DeadLetterReason::Refused { .. } => {
                let mut kept = FieldTable::default();
                for (key, value) in original.inner() {
                    if RELAY_HEADERS.contains(&key.as_str()) || key.as_str() == "replay" {
                        kept.insert(key.clone(), value.clone());
                    }
                }
                kept
            }
        };
        match reason {
            DeadLetterReason::Unroutable {
                exchange,
                routing_key,
            } => {
                headers.insert("x-outbox-error".into(), text("unroutable"));
                headers.insert("x-original-exchange".into(), text(exchange));
                headers.insert("x-original-routing-key".into(), text(routing_key));
            }
            DeadLetterReason::Refused { reason } => {
                // A malformed logical message keeps its content as the body: it is
                // what its producer must fix (docs/messages.md).
                let malformed = self.event.malformed.is_some();
                headers.insert(
                    "x-outbox-error".into(),
                    text(&if malformed {
                        format!("malformed: {reason}")
                    } else {
                        format!("refused by the broker: {reason}")
                    }),
                );
                headers.insert("x-original-exchange".into(), text(exchange));
                headers.insert(
                    "x-original-routing-key".into(),
                    text(self.routing_key.as_str()),
                );
                if !malformed {
                    headers.insert(
                        "x-outbox-body-bytes".into(),
                        AMQPValue::LongLongInt(i64::try_from(self.body.len()).unwrap_or(i64::MAX)),
                    );
                    message.body = Bytes::new();
                }
            }
        }
        message.fixed_properties = Some(properties.with_headers(headers));
        message
    }

    /// A dead-letter copy cut down to fit a frame (`level` 1: every header value
    /// and the routing key cut to 255 bytes; 2: only the headers that identify the
    /// event and say why, and no body), marked `x-outbox-truncated`. The message id
    /// property stays: the notice still names the event.
    pub(crate) fn shrunk(&self, level: u8) -> Self {
        const KEEP: [&str; 5] = [
            "commit_lsn",
            "tx_index",
            "x-outbox-error",
            "x-original-exchange",
            "x-outbox-body-bytes",
        ];
        let mut message = self.clone();
        let properties = self.fixed_properties.clone().unwrap_or_default();
        let mut headers = FieldTable::default();
        for (key, value) in properties.headers().clone().unwrap_or_default().inner() {
            if level >= 2 && !KEEP.contains(&key.as_str()) {
                continue;
            }
            let value = match value {
                AMQPValue::LongString(s) if s.as_bytes().len() > SHORT_STRING_MAX => {
                    let mut text = String::from_utf8_lossy(s.as_bytes()).into_owned();
                    truncate_at_char(&mut text, SHORT_STRING_MAX);
                    AMQPValue::LongString(LongString::from(text))
                }
                AMQPValue::FieldTable(_) | AMQPValue::FieldArray(_) if level >= 1 => continue,
                other => other.clone(),
            };
            headers.insert(key.clone(), value);
        }
        headers.insert("x-outbox-truncated".into(), AMQPValue::Boolean(true));
        if level >= 2 {
            if !message.body.is_empty() {
                headers.insert(
                    "x-outbox-body-bytes".into(),
                    AMQPValue::LongLongInt(i64::try_from(message.body.len()).unwrap_or(i64::MAX)),
                );
            }
            message.body = Bytes::new();
        }
        message.fixed_properties = Some(properties.with_headers(headers));
        message
    }

    /// `(commit_lsn, tx_index)`: what a returned copy of this message is matched by.
    pub fn key(&self) -> EventKey {
        EventKey {
            commit_lsn: self.event.commit_lsn,
            index: self.event.index,
        }
    }

    /// The message id property (for logs).
    pub(crate) fn message_id(&self) -> String {
        short(self.event.id.as_ref())
            .map(|id| id.to_string())
            .unwrap_or_default()
    }
}

/// Reads the `(commit_lsn, tx_index)` of a message the broker returned.
pub(crate) fn returned_key(properties: &BasicProperties) -> Option<EventKey> {
    let headers = properties.headers().as_ref()?.inner();
    let commit_lsn = match headers.get("commit_lsn")? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .ok()?
            .parse::<Lsn>()
            .ok()?,
        _ => return None,
    };
    let index = match headers.get("tx_index")? {
        AMQPValue::LongLongInt(i) => u64::try_from(*i).ok()?,
        _ => return None,
    };
    Some(EventKey { commit_lsn, index })
}

/// Builds [`OutboundMessage`]s; holds everything that is the same for every message.
#[derive(Debug, Clone)]
pub struct MessageBuilder {
    template: RoutingKeyTemplate,
    /// The operator's extra headers (e.g. `replay = "true"`), built once.
    extra_headers: Vec<(ShortString, AMQPValue)>,
    app_id: ShortString,
    delivery_mode: u8,
    /// The last table seen and its `outbox_table` header value, so the value is not
    /// rebuilt per message.
    table_cache: Option<(Arc<OutboxTable>, AMQPValue)>,
    /// Reserved header keys already logged as dropped (once each).
    dropped_logged: HashSet<String>,
    /// The CloudEvents attributes' builder (`format = "cloudevents"`).
    cloudevents: Option<CloudEvents>,
    /// Which of the relay's headers are written (`[message] headers`).
    profile: HeaderProfile,
    /// Which exchange each message goes to.
    exchange: ExchangeRule,
}

impl MessageBuilder {
    pub fn new(
        routing_key: &str,
        extra_headers: &[(String, String)],
    ) -> Result<Self, PublishError> {
        Ok(Self {
            template: RoutingKeyTemplate::parse(routing_key)?,
            extra_headers: extra_headers
                .iter()
                .map(|(k, v)| {
                    (
                        ShortString::from(k.as_str()),
                        AMQPValue::LongString(LongString::from(v.as_str())),
                    )
                })
                .collect(),
            app_id: ShortString::from("outbox-relay"),
            delivery_mode: 2,
            table_cache: None,
            dropped_logged: HashSet::new(),
            cloudevents: None,
            profile: HeaderProfile::Full,
            exchange: ExchangeRule::default(),
        })
    }

    /// The builder whose messages go to the exchanges `rule` names.
    pub fn with_exchange(mut self, rule: ExchangeRule) -> Self {
        self.exchange = rule;
        self
    }

    /// The builder that writes the relay's headers of `profile`
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

    /// The headers table of one event (docs/design.md §5): the headers column's keys first, so
    /// the relay's own headers and the extra headers win on a name clash.
    pub fn headers(&mut self, event: &OutboxEvent) -> FieldTable {
        let mut table = FieldTable::default();
        if let Some(raw) = &event.headers {
            add_json_headers(
                &mut table,
                raw,
                &mut self.dropped_logged,
                self.cloudevents.is_some(),
            );
        }
        for (key, value) in &self.extra_headers {
            table.insert(key.clone(), value.clone());
        }
        if self.profile.descriptive() {
            let outbox_table = match &self.table_cache {
                Some((cached, value)) if Arc::ptr_eq(cached, &event.table) => value.clone(),
                _ => {
                    let value = AMQPValue::LongString(LongString::from(
                        event.table.qualified_name.as_str(),
                    ));
                    self.table_cache = Some((event.table.clone(), value.clone()));
                    value
                }
            };
            table.insert("aggregate_type".into(), long(event.aggregate_type.as_ref()));
            table.insert("aggregate_id".into(), long(event.aggregate_id.as_ref()));
            table.insert("outbox_table".into(), outbox_table);
            table.insert("xid".into(), AMQPValue::LongLongInt(i64::from(event.xid)));
        }
        table.insert("event_type".into(), long(event.event_type.as_ref()));
        table.insert(
            "commit_lsn".into(),
            AMQPValue::LongString(LongString::from(event.commit_lsn.to_string())),
        );
        table.insert(
            "tx_index".into(),
            AMQPValue::LongLongInt(i64::try_from(event.index).unwrap_or(i64::MAX)),
        );
        if let Some(ce) = &mut self.cloudevents {
            let a = ce.attributes(event);
            let text = |s: String| AMQPValue::LongString(LongString::from(s));
            table.insert(
                cloudevents::SPECVERSION_KEY.into(),
                AMQPValue::LongString(LongString::from(cloudevents::SPECVERSION)),
            );
            table.insert(cloudevents::ID.into(), text(a.id));
            table.insert(cloudevents::SOURCE.into(), text(a.source));
            table.insert(cloudevents::TYPE.into(), text(a.kind));
            table.insert(cloudevents::TIME.into(), text(a.time));
            if let Some(subject) = a.subject {
                table.insert(cloudevents::SUBJECT.into(), text(subject));
            }
        }
        table
    }

    /// The message of one event, to publish with [`Self::properties_of`].
    pub fn build(&mut self, event: &OutboxEvent) -> OutboundMessage {
        self.build_owned(event.clone())
    }

    /// [`Self::build`] of an event the caller gives up: the hot path's, which
    /// saves a copy of every event.
    pub fn build_owned(&mut self, event: OutboxEvent) -> OutboundMessage {
        OutboundMessage {
            exchange: self.exchange.of(&event).map(ShortString::from),
            routing_key: ShortString::from(self.template.render(&event)),
            body: event.body.clone(),
            event,
            fixed_properties: None,
            trace: None,
        }
    }

    /// The AMQP properties of `message`, headers included: built from its event, or
    /// the fixed ones of a dead-letter copy.
    pub fn properties_of(&mut self, message: &OutboundMessage) -> BasicProperties {
        match &message.fixed_properties {
            Some(fixed) => fixed.clone(),
            None => self.properties_traced(&message.event, message.trace.as_deref()),
        }
    }

    /// The AMQP properties of one event (docs/design.md §5).
    pub fn properties(&mut self, event: &OutboxEvent) -> BasicProperties {
        self.properties_traced(event, None)
    }

    /// The AMQP properties of one event whose `publish` span is `trace`: its
    /// `traceparent` and `tracestate` replace the row's (docs/tracing.md).
    fn properties_traced(
        &mut self,
        event: &OutboxEvent,
        trace: Option<&EventSpan>,
    ) -> BasicProperties {
        let mut headers = self.headers(event);
        if let Some(span) = trace {
            let text = |s: &str| AMQPValue::LongString(LongString::from(s));
            headers.insert(TRACEPARENT.into(), text(span.traceparent()));
            match span.tracestate() {
                Some(state) => {
                    headers.insert(TRACESTATE.into(), text(state));
                }
                // The row's, if it has one, belongs to a parent the span did not take.
                None if headers.contains_key(TRACESTATE) => {
                    headers.insert(TRACESTATE.into(), text(""));
                }
                None => {}
            }
        }
        let mut properties = BasicProperties::default()
            .with_content_type(event.table.content_type.into())
            .with_delivery_mode(self.delivery_mode)
            .with_timestamp(u64::try_from(event.commit_time_micros / 1_000_000).unwrap_or(0))
            .with_app_id(self.app_id.clone())
            .with_headers(headers);
        if let Some(id) = short(event.id.as_ref()) {
            properties = properties.with_message_id(id);
        }
        if let Some(kind) = short(event.event_type.as_ref()) {
            properties = properties.with_type(kind);
        }
        if let Some(correlation) = short(event.correlation_id.as_ref()) {
            properties = properties.with_correlation_id(correlation);
        }
        // Checked before the publish (`check_row_properties`): invalid ones are
        // poison and never reach here for the event itself.
        match RowProperties::of_event_if_any(event) {
            Ok(Some(row)) => row.apply(properties),
            Ok(None) | Err(_) => properties,
        }
    }

    /// Why the properties `event`'s headers column sets are invalid, if they are
    /// ([`row_properties`]): the event is then poison, named by the key.
    pub fn check_row_properties(event: &OutboxEvent) -> Result<(), String> {
        RowProperties::of_event_if_any(event).map(|_| ())
    }
}

/// Adds every key of a JSON object: strings as strings, other values as their JSON
/// text. Anything that is not a JSON object adds nothing (and is logged).
fn add_json_headers(
    table: &mut FieldTable,
    raw: &[u8],
    logged: &mut HashSet<String>,
    cloudevents: bool,
) {
    for (key, value) in json_headers(raw, logged, cloudevents, &RELAY_HEADERS) {
        // Keys that set properties are not headers (`row_properties`).
        if is_property_key(&key) {
            continue;
        }
        if key.len() > SHORT_STRING_MAX {
            tracing::warn!(
                key_len = key.len(),
                "header name longer than 255 bytes skipped"
            );
            continue;
        }
        table.insert(
            ShortString::from(key),
            AMQPValue::LongString(LongString::from(value)),
        );
    }
}
