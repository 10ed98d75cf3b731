//! The per-event `publish` spans (docs/tracing.md, docs/design.md §8).
//!
//! With tracing on, every event gets one span of kind PRODUCER, named
//! `publish <destination>` after OpenTelemetry's messaging conventions. It starts
//! when the publisher takes the event's transaction from the reader (the commit is
//! known then) and ends at the broker's confirm; retries, returns and dead-lettering
//! are events on it. Its parent is the W3C `traceparent` the row carries in its
//! headers column, else it starts a new trace; its own context is written into the
//! published message as `traceparent` (and the row's `tracestate`), so that a
//! consumer's span is its child.
//!
//! The spans are built with the OpenTelemetry API directly, not through `tracing`
//! spans: see docs/design.md §8 for why. With tracing off, [`EventTracer::get`] is
//! `None`, no message carries a span, and the hot path pays one branch.
//!
//! What a span tells the trace backend ([`TraceOptions`], docs/tracing.md): every
//! attribute value is at most [`MAX_ATTRIBUTE_BYTES`] long (cut at a character
//! boundary, as the AMQP properties are); with `attributes = "minimal"` the message
//! id, the routing key (which may hold `{aggregate_id}`) and the names rows chose
//! (an exchange rendered from a template or read from a column) are left out; with
//! `respect_parent_sampled = false` a row's sampled flag decides nothing, and
//! `sampling_ratio` applies to every event.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};
use outbox_event::OutboxEvent;

/// The `traceparent` header (W3C Trace Context).
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header (W3C Trace Context).
pub const TRACESTATE: &str = "tracestate";
/// The longest `tracestate` carried on (W3C: at least 512 bytes must be kept).
const TRACESTATE_MAX: usize = 512;
/// The longest attribute value a span carries, in bytes (an AMQP short string's
/// bound): longer ones are cut at a character boundary.
pub const MAX_ATTRIBUTE_BYTES: usize = 255;
/// The span name of an event whose destination a row chose, with `attributes =
/// "minimal"` (the messaging conventions' name when the destination is not named).
const UNNAMED_DESTINATION: &str = "publish";

/// The span attributes' keys: the messaging conventions' and the relay's own.
pub mod attributes {
    pub const SYSTEM: &str = "messaging.system";
    pub const OPERATION_NAME: &str = "messaging.operation.name";
    pub const OPERATION_TYPE: &str = "messaging.operation.type";
    pub const DESTINATION: &str = "messaging.destination.name";
    pub const DESTINATION_TEMPLATE: &str = "messaging.destination.template";
    pub const ROUTING_KEY: &str = "messaging.rabbitmq.destination.routing_key";
    pub const MESSAGE_ID: &str = "messaging.message.id";
    pub const BODY_SIZE: &str = "messaging.message.body.size";
    pub const COMMIT_LSN: &str = "outbox.commit_lsn";
    pub const TX_INDEX: &str = "outbox.tx_index";
    pub const TABLE: &str = "outbox.table";
}

/// A parsed W3C `traceparent`: `00-<trace id>-<span id>-<flags>`, lower-case hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub flags: TraceFlags,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` for anything W3C Trace Context says to
    /// ignore (wrong length or version `ff`, upper-case or non-hex digits, an all-zero
    /// trace or span id). A later version's extra fields are accepted and ignored.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let b = value.as_bytes();
        if b.len() < 55 {
            return None;
        }
        let version = hex_u8(&b[0..2])?;
        if version == 0xff || (version == 0 && b.len() != 55) {
            return None;
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        let trace_id = hex_u128(&b[3..35])?;
        let span_id = hex_u64(&b[36..52])?;
        let flags = hex_u8(&b[53..55])?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id: TraceId::from(trace_id),
            span_id: SpanId::from(span_id),
            flags: TraceFlags::new(flags),
        })
    }

    /// The `traceparent` value of version `00` (the only one written).
    pub fn format(&self) -> String {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id.to_bytes());
        out.push('-');
        push_hex(&mut out, &self.span_id.to_bytes());
        out.push('-');
        push_hex(&mut out, &[self.flags.to_u8()]);
        out
    }

    fn of(context: &SpanContext) -> TraceParent {
        TraceParent {
            trace_id: context.trace_id(),
            span_id: context.span_id(),
            flags: context.trace_flags(),
        }
    }
}

/// Appends `bytes` in lower-case hex (by hand: `format!`'s machinery was a visible
/// part of a span's cost).
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_u128(digits: &[u8]) -> Option<u128> {
    digits
        .iter()
        .try_fold(0u128, |n, &c| Some(n << 4 | u128::from(hex_digit(c)?)))
}

fn hex_u64(digits: &[u8]) -> Option<u64> {
    digits
        .iter()
        .try_fold(0u64, |n, &c| Some(n << 4 | u64::from(hex_digit(c)?)))
}

fn hex_u8(digits: &[u8]) -> Option<u8> {
    digits
        .iter()
        .try_fold(0u8, |n, &c| Some(n << 4 | hex_digit(c)?))
}

/// The trace context keys of a headers column's JSON object (the rest is skipped
/// without being built).
#[derive(serde::Deserialize)]
struct RowContext<'a> {
    #[serde(borrow, default)]
    traceparent: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tracestate: Option<Cow<'a, str>>,
}

/// The parent a row names in its headers column (`traceparent`, and `tracestate`
/// when it is printable ASCII of at most 512 bytes), if it names a valid one. A
/// malformed or missing `traceparent`, or headers that are not a JSON object, give
/// `None`: the event's span starts a new trace.
pub fn row_parent(headers: Option<&Bytes>) -> Option<(TraceParent, Option<String>)> {
    let row: RowContext<'_> = serde_json::from_slice(headers?).ok()?;
    let parent = TraceParent::parse(row.traceparent.as_deref()?.trim())?;
    let state = row
        .tracestate
        .map(Cow::into_owned)
        .filter(|s| !s.is_empty() && s.len() <= TRACESTATE_MAX)
        .filter(|s| s.bytes().all(|c| (0x20..0x7f).contains(&c)));
    Some((parent, state))
}

/// Which attributes a span carries (`[tracing] attributes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttributeSet {
    /// Every attribute of the messaging conventions the relay knows.
    #[default]
    Full,
    /// Without the message id, the routing key and the names rows chose.
    Minimal,
}

/// How the events' spans are made (`[tracing]`, docs/tracing.md).
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// `attributes`.
    pub attributes: AttributeSet,
    /// `respect_parent_sampled`: a row's sampled `traceparent` is exported and an
    /// unsampled one is not (parent-based sampling). `false`: `sampling_ratio`
    /// decides for every event, the row's flag aside.
    pub respect_parent_sampled: bool,
    /// `sampling_ratio`, 0.0 to 1.0: applied here to the events whose row names a
    /// parent when `respect_parent_sampled` is off (the SDK's sampler applies it to
    /// the others).
    pub sampling_ratio: f64,
    /// The destinations the configuration names (an exchange as written, the
    /// dead-letter exchange, a stream): with `attributes = "minimal"` only these
    /// are named; any other one a row chose.
    pub configured_destinations: Vec<String>,
    /// `[rabbitmq] exchange` when it is a template (`events.{aggregate_type}`):
    /// the `messaging.destination.template` of a span whose destination a row chose.
    pub destination_template: Option<String>,
}

impl Default for TraceOptions {
    fn default() -> TraceOptions {
        TraceOptions {
            attributes: AttributeSet::Full,
            respect_parent_sampled: true,
            sampling_ratio: 1.0,
            configured_destinations: Vec::new(),
            destination_template: None,
        }
    }
}

/// `value`, at most [`MAX_ATTRIBUTE_BYTES`] long.
fn bounded(value: &str) -> &str {
    if value.len() <= MAX_ATTRIBUTE_BYTES {
        return value;
    }
    let mut end = MAX_ATTRIBUTE_BYTES;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// Starts the events' spans (cheap to clone: the SDK's tracer is shared).
#[derive(Clone, Debug)]
pub struct EventTracer {
    tracer: SdkTracer,
    options: Arc<TraceOptions>,
    /// What the last span had, which the next one most often has too (the same
    /// destination, table and transaction): its values are shared, not formatted
    /// again.
    last: Last,
}

/// The span name and attribute values of the last span, with what they were made of.
#[derive(Clone, Debug, Default)]
struct Last {
    /// The destination, and the span name made of it.
    destination: Option<(Arc<str>, String)>,
    table: Option<Arc<str>>,
    commit_lsn: Option<(outbox_event::Lsn, Arc<str>)>,
}

impl Last {
    fn destination(&mut self, destination: &str) -> (String, Arc<str>) {
        let destination = bounded(destination);
        match &self.destination {
            Some((value, name)) if &**value == destination => (name.clone(), Arc::clone(value)),
            _ => {
                let value: Arc<str> = Arc::from(destination);
                let name = format!("publish {destination}");
                self.destination = Some((Arc::clone(&value), name.clone()));
                (name, value)
            }
        }
    }

    fn table(&mut self, name: &str) -> Arc<str> {
        let name = bounded(name);
        match &self.table {
            Some(table) if &**table == name => Arc::clone(table),
            _ => {
                let table: Arc<str> = Arc::from(name);
                self.table = Some(Arc::clone(&table));
                table
            }
        }
    }

    fn commit_lsn(&mut self, lsn: outbox_event::Lsn) -> Arc<str> {
        match &self.commit_lsn {
            Some((last, text)) if *last == lsn => Arc::clone(text),
            _ => {
                let text: Arc<str> = Arc::from(lsn.to_string());
                self.commit_lsn = Some((lsn, Arc::clone(&text)));
                text
            }
        }
    }
}

static TRACER: OnceLock<EventTracer> = OnceLock::new();

impl EventTracer {
    pub fn new(tracer: SdkTracer) -> EventTracer {
        EventTracer {
            tracer,
            options: Arc::new(TraceOptions::default()),
            last: Last::default(),
        }
    }

    /// The tracer whose spans follow `options` (the default: every attribute,
    /// parent-based sampling).
    pub fn with_options(mut self, options: TraceOptions) -> EventTracer {
        self.options = Arc::new(options);
        self
    }

    /// Whether a span may name `destination`: with `attributes = "minimal"`, only a
    /// destination the configuration names.
    fn names(&self, destination: &str) -> bool {
        let o = &self.options;
        o.attributes == AttributeSet::Full
            || o.configured_destinations.iter().any(|d| d == destination)
    }

    /// The flags of a row's parent as this relay samples them: the row's own, or,
    /// with `respect_parent_sampled = false`, `sampling_ratio`'s draw.
    fn parent_flags(&self, row: TraceFlags) -> TraceFlags {
        let o = &self.options;
        if o.respect_parent_sampled {
            return row;
        }
        let sampled = o.sampling_ratio >= 1.0 || rand::random::<f64>() < o.sampling_ratio;
        row.with_sampled(sampled)
    }

    /// Makes `tracer` the one every publisher started afterwards uses (the relay's
    /// `run` with `[tracing]` on). Only the first call counts.
    pub fn install(tracer: EventTracer) {
        let _ = TRACER.set(tracer);
    }

    /// The installed tracer; `None` while tracing is off.
    pub fn get() -> Option<EventTracer> {
        TRACER.get().cloned()
    }

    /// Starts the `publish` span of `event`, bound for `destination` (an exchange
    /// or a stream) with `routing_key` (`None` on a stream).
    pub fn start(
        &mut self,
        event: &OutboxEvent,
        destination: &str,
        routing_key: Option<&str>,
    ) -> Arc<EventSpan> {
        use attributes as a;
        let parent = row_parent(event.headers.as_ref());
        let full = self.options.attributes == AttributeSet::Full;
        let mut attributes = Vec::with_capacity(10);
        attributes.push(KeyValue::new(a::SYSTEM, "rabbitmq"));
        attributes.push(KeyValue::new(a::OPERATION_NAME, "publish"));
        attributes.push(KeyValue::new(a::OPERATION_TYPE, "send"));
        let name = if self.names(destination) {
            let (name, destination) = self.last.destination(destination);
            attributes.push(KeyValue::new(a::DESTINATION, destination));
            name
        } else {
            if let Some(template) = &self.options.destination_template {
                let template = bounded(template).to_string();
                attributes.push(KeyValue::new(a::DESTINATION_TEMPLATE, template));
            }
            UNNAMED_DESTINATION.to_string()
        };
        if let Some(key) = routing_key.filter(|_| full) {
            attributes.push(KeyValue::new(a::ROUTING_KEY, bounded(key).to_string()));
        }
        if let Some(id) = event.id.as_ref().filter(|_| full) {
            let id = String::from_utf8_lossy(id);
            attributes.push(KeyValue::new(a::MESSAGE_ID, bounded(&id).to_string()));
        }
        attributes.push(KeyValue::new(a::BODY_SIZE, event.body.len() as i64));
        attributes.push(KeyValue::new(
            a::COMMIT_LSN,
            self.last.commit_lsn(event.commit_lsn),
        ));
        attributes.push(KeyValue::new(
            a::TX_INDEX,
            i64::try_from(event.index).unwrap_or(i64::MAX),
        ));
        attributes.push(KeyValue::new(
            a::TABLE,
            self.last.table(&event.table.qualified_name),
        ));
        let builder = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Producer)
            .with_attributes(attributes);
        let (span, tracestate) = match parent {
            Some((parent, state)) => {
                let context = Context::new().with_remote_span_context(SpanContext::new(
                    parent.trace_id,
                    parent.span_id,
                    self.parent_flags(parent.flags),
                    true,
                    TraceState::NONE,
                ));
                (self.tracer.build_with_context(builder, &context), state)
            }
            None => (
                self.tracer.build_with_context(builder, &Context::new()),
                None,
            ),
        };
        Arc::new(EventSpan {
            traceparent: TraceParent::of(span.span_context()).format(),
            tracestate,
            sends: AtomicU32::new(0),
            span: Mutex::new(span),
        })
    }
}

/// One event's `publish` span, shared by the message and its retries; it ends at
/// the confirm (or, if the relay stops first, when the last copy is dropped).
#[derive(Debug)]
pub struct EventSpan {
    traceparent: String,
    tracestate: Option<String>,
    /// Publishes of the event so far: every one after the first is a retry.
    sends: AtomicU32,
    span: Mutex<Span>,
}

impl EventSpan {
    /// The `traceparent` the message carries: this span's own context.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` the message carries: the row's, passed on.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// Counts a publish of the event; every one after the first is a `retry` event
    /// with its attempt number.
    pub fn published(&self) {
        let before = self.sends.fetch_add(1, Ordering::Relaxed);
        if before > 0 {
            self.event(
                "retry",
                vec![KeyValue::new("attempt", i64::from(before) + 1)],
            );
        }
    }

    /// Adds an event (`returned`, `dead_lettered`, `refused`...) to the span; its
    /// text values are bounded like the span's.
    pub fn event(&self, name: &'static str, mut attributes: Vec<KeyValue>) {
        for kv in &mut attributes {
            if let opentelemetry::Value::String(text) = &kv.value {
                if text.as_str().len() > MAX_ATTRIBUTE_BYTES {
                    kv.value = bounded(text.as_str()).to_string().into();
                }
            }
        }
        if let Ok(mut span) = self.span.lock() {
            span.add_event(name, attributes);
        }
    }

    /// Ends the span (at the broker's confirm); later calls do nothing.
    pub fn end(&self) {
        if let Ok(mut span) = self.span.lock() {
            span.end();
        }
    }
}

#[cfg(test)]
mod tests;
