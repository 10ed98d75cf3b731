//! The routing-key template and the exchange rule (docs/routing.md): the one
//! parser and renderer of `{aggregate_type}`-style templates, which the publisher
//! and `check --routes` share.

use outbox_event::OutboxEvent;

use super::SHORT_STRING_MAX;
use crate::error::PublishError;
pub(crate) use outbox_event::redact::truncate_at_char;

/// The fields a template substitutes, borrowed from an event or from a table row
/// (`check --routes`); a NULL field is `None` and renders as empty text.
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateFields<'a> {
    pub table: &'a str,
    pub aggregate_type: Option<&'a [u8]>,
    pub aggregate_id: Option<&'a [u8]>,
    pub event_type: Option<&'a [u8]>,
}

impl<'a> TemplateFields<'a> {
    /// An event's fields.
    pub fn of(event: &'a OutboxEvent) -> Self {
        Self {
            table: &event.table.qualified_name,
            aggregate_type: event.aggregate_type.as_deref(),
            aggregate_id: event.aggregate_id.as_deref(),
            event_type: event.event_type.as_deref(),
        }
    }
}

/// One field a routing-key template may substitute.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    AggregateType,
    AggregateId,
    EventType,
    Table,
}

/// A compiled `routing_key` template: literal text and `{aggregate_type}`,
/// `{aggregate_id}`, `{event_type}`, `{table}` placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingKeyTemplate {
    parts: Vec<Part>,
}

/// The default `routing_key` template.
pub const DEFAULT_ROUTING_KEY: &str = "{aggregate_type}.{event_type}";

/// The placeholders a routing-key template may use.
pub const PLACEHOLDERS: [&str; 4] = ["aggregate_type", "aggregate_id", "event_type", "table"];

/// Why a routing-key template is invalid (the sentence follows the config key's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoutingKeyError {
    #[error("has a `}}` without a matching `{{`: fix the template")]
    StrayClose,
    #[error("has a `{{` without a closing `}}`: fix the template")]
    Unclosed,
    #[error("unknown placeholder `{{{0}}}`: use only {{aggregate_type}}, {{aggregate_id}}, {{event_type}}, {{table}}")]
    Unknown(String),
}

impl From<RoutingKeyError> for PublishError {
    fn from(e: RoutingKeyError) -> PublishError {
        PublishError::InvalidConfig {
            key: "routing_key",
            reason: e.to_string(),
        }
    }
}

impl RoutingKeyTemplate {
    /// Compiles a template (the project's one parser of it): an unknown or unclosed
    /// placeholder, or a `}` without a `{`, is an error.
    pub fn parse(template: &str) -> Result<Self, RoutingKeyError> {
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find(['{', '}']) {
            if rest[open..].starts_with('}') {
                return Err(RoutingKeyError::StrayClose);
            }
            if open > 0 {
                parts.push(Part::Literal(rest[..open].to_string()));
            }
            let after = &rest[open + 1..];
            let close = after.find('}').ok_or(RoutingKeyError::Unclosed)?;
            parts.push(match &after[..close] {
                "aggregate_type" => Part::AggregateType,
                "aggregate_id" => Part::AggregateId,
                "event_type" => Part::EventType,
                "table" => Part::Table,
                other => return Err(RoutingKeyError::Unknown(other.to_string())),
            });
            rest = &after[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_string()));
        }
        Ok(Self { parts })
    }

    /// Whether the template substitutes anything (else it is its literal text).
    pub fn has_placeholders(&self) -> bool {
        self.parts.iter().any(|p| !matches!(p, Part::Literal(_)))
    }

    /// The routing key of one event (NULL fields render as empty text). Keys longer
    /// than AMQP allows (255 bytes) are cut at a character boundary.
    pub fn render(&self, event: &OutboxEvent) -> String {
        self.render_fields(&TemplateFields::of(event))
    }

    /// [`RoutingKeyTemplate::render`] over fields that need not be an event's.
    pub fn render_fields(&self, fields: &TemplateFields<'_>) -> String {
        let mut key = self.render_whole_fields(fields);
        truncate_at_char(&mut key, SHORT_STRING_MAX);
        key
    }

    /// The template's shape as a glob of `[rabbitmq] allowed_exchanges`: each
    /// placeholder a `*` (`events.{aggregate_type}` is `events.*`).
    pub fn glob(&self) -> String {
        let mut glob = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => glob.push_str(text),
                _ if glob.ends_with('*') => {}
                _ => glob.push('*'),
            }
        }
        glob
    }

    /// The template rendered for one event, however long (an exchange name is
    /// checked, never cut: a cut name would be another exchange).
    pub fn render_whole(&self, event: &OutboxEvent) -> String {
        self.render_whole_fields(&TemplateFields::of(event))
    }

    fn render_whole_fields(&self, f: &TemplateFields<'_>) -> String {
        let mut key = String::with_capacity(64);
        for part in &self.parts {
            match part {
                Part::Literal(text) => key.push_str(text),
                Part::AggregateType => push_text(&mut key, f.aggregate_type),
                Part::AggregateId => push_text(&mut key, f.aggregate_id),
                Part::EventType => push_text(&mut key, f.event_type),
                Part::Table => key.push_str(f.table),
            }
        }
        key
    }
}

/// Which exchange each event goes to (docs/routing.md): its exchange column's value
/// when it has one (`[mapping] exchange`, unless `replay --exchange` sends every copy
/// to one exchange), else `[rabbitmq] exchange`, which may be a template over the
/// routing key's placeholders (`"{aggregate_type}"`, `"events.{table}"`).
#[derive(Debug, Clone)]
pub struct ExchangeRule {
    /// `[rabbitmq] exchange` when it has placeholders; `None`: the name as written.
    template: Option<RoutingKeyTemplate>,
    from_events: bool,
}

impl ExchangeRule {
    /// The rule of `[rabbitmq] exchange` (`exchange`); `from_events`: whether the
    /// events' exchange column counts.
    pub fn new(exchange: &str, from_events: bool) -> Result<Self, PublishError> {
        let template =
            RoutingKeyTemplate::parse(exchange).map_err(|e| PublishError::InvalidConfig {
                key: "exchange",
                reason: e.to_string(),
            })?;
        Ok(Self {
            template: template.has_placeholders().then_some(template),
            from_events,
        })
    }

    /// Whether `[rabbitmq] exchange` is a template (so no one exchange is declared
    /// at the start).
    pub fn is_template(&self) -> bool {
        self.template.is_some()
    }

    /// The exchange of `event` when it is not `[rabbitmq] exchange` as written: the
    /// column's value, or the template rendered (possibly empty, which the publisher
    /// refuses as poison rather than send to the default exchange).
    pub fn of(&self, event: &OutboxEvent) -> Option<String> {
        self.of_fields(event.exchange.as_deref(), &TemplateFields::of(event))
    }

    /// [`ExchangeRule::of`] for a row: its exchange column's value (`column`) and its
    /// fields.
    pub fn of_fields(&self, column: Option<&[u8]>, fields: &TemplateFields<'_>) -> Option<String> {
        if self.from_events {
            if let Some(x) = column.filter(|x| !x.is_empty()) {
                // Checked before it is used, never cut (`amqp/destinations.rs`).
                return Some(String::from_utf8_lossy(x).into_owned());
            }
        }
        self.template
            .as_ref()
            .map(|t| t.render_whole_fields(fields))
    }
}

impl Default for ExchangeRule {
    /// `[rabbitmq] exchange` as written, or the events' column.
    fn default() -> Self {
        Self {
            template: None,
            from_events: true,
        }
    }
}

fn push_text(out: &mut String, value: Option<&[u8]>) {
    if let Some(value) = value {
        out.push_str(&String::from_utf8_lossy(value));
    }
}
