//! Which outbox columns carry which message field (docs/design.md §6 `[mapping]`):
//! [`MappingConfig`], the `[mapping]` section as written (deserialized straight into,
//! its defaults and checks beside it), and [`ColumnMapping`], what the reader uses.

use outbox_event::setting::SettingError;
use serde::Deserialize;

/// Default `mapping.id`.
pub const DEFAULT_ID_COLUMN: &str = "id";
/// Default `mapping.aggregate_type`.
pub const DEFAULT_AGGREGATE_TYPE_COLUMN: &str = "aggregate_type";
/// Default `mapping.aggregate_id`.
pub const DEFAULT_AGGREGATE_ID_COLUMN: &str = "aggregate_id";
/// Default `mapping.event_type`.
pub const DEFAULT_EVENT_TYPE_COLUMN: &str = "event_type";
/// Default `mapping.payload`.
pub const DEFAULT_PAYLOAD_COLUMN: &str = "payload";
/// Default `mapping.headers`.
pub const DEFAULT_HEADERS_COLUMN: &str = "headers";
/// Default `mapping.correlation_id` (none).
pub const DEFAULT_CORRELATION_ID_COLUMN: &str = "";
/// Default `mapping.exchange` (none: every event goes to `[rabbitmq] exchange`).
pub const DEFAULT_EXCHANGE_COLUMN: &str = "";

/// The `[mapping]` section: column names of the outbox table, as configured. An
/// optional column written as `""` means the table has none.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MappingConfig {
    /// Column holding the message id (`message_id` property).
    pub id: String,
    /// Column holding the aggregate type.
    pub aggregate_type: String,
    /// Column holding the aggregate id.
    pub aggregate_id: String,
    /// Column holding the event type (`type` property).
    pub event_type: String,
    /// Column holding the body.
    pub payload: String,
    /// Optional JSON column of extra headers; `""` means the table has none.
    pub headers: String,
    /// Optional column for the `correlation_id` property; `""` means none.
    pub correlation_id: String,
    /// Optional column naming each event's exchange (docs/routing.md); `""` means
    /// none, and an empty value the configured `[rabbitmq] exchange`.
    pub exchange: String,
    /// Optional columns setting the AMQP properties of the same names per event
    /// (docs/routing.md, "Properties per event"); `""` means none. A column's value
    /// wins over the headers column's key of the same name.
    pub expiration: String,
    pub priority: String,
    pub content_type: String,
    pub content_encoding: String,
    pub reply_to: String,
}

impl Default for MappingConfig {
    fn default() -> MappingConfig {
        MappingConfig {
            id: DEFAULT_ID_COLUMN.into(),
            aggregate_type: DEFAULT_AGGREGATE_TYPE_COLUMN.into(),
            aggregate_id: DEFAULT_AGGREGATE_ID_COLUMN.into(),
            event_type: DEFAULT_EVENT_TYPE_COLUMN.into(),
            payload: DEFAULT_PAYLOAD_COLUMN.into(),
            headers: DEFAULT_HEADERS_COLUMN.into(),
            correlation_id: DEFAULT_CORRELATION_ID_COLUMN.into(),
            exchange: DEFAULT_EXCHANGE_COLUMN.into(),
            expiration: String::new(),
            priority: String::new(),
            content_type: String::new(),
            content_encoding: String::new(),
            reply_to: String::new(),
        }
    }
}

impl MappingConfig {
    /// Every required column left empty (docs/design.md §6 `[mapping]`).
    pub fn validate(&self) -> Vec<SettingError> {
        let required = [
            ("mapping.id", &self.id),
            ("mapping.aggregate_type", &self.aggregate_type),
            ("mapping.aggregate_id", &self.aggregate_id),
            ("mapping.event_type", &self.event_type),
            ("mapping.payload", &self.payload),
        ];
        required
            .into_iter()
            .filter(|(_, column)| column.trim().is_empty())
            .map(|(key, _)| {
                SettingError::new(
                    key,
                    "the column name is empty: name the outbox column that holds this field",
                )
            })
            .collect()
    }

    /// The mapping the reader uses: an optional column written as `""` is `None`.
    pub fn columns(&self) -> ColumnMapping {
        let optional = |s: &str| Some(s.to_string()).filter(|s| !s.is_empty());
        ColumnMapping {
            id: self.id.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            event_type: self.event_type.clone(),
            payload: self.payload.clone(),
            headers: optional(&self.headers),
            correlation_id: optional(&self.correlation_id),
            exchange: optional(&self.exchange),
            properties: [
                ("expiration", &self.expiration),
                ("priority", &self.priority),
                ("content_type", &self.content_type),
                ("content_encoding", &self.content_encoding),
                ("reply_to", &self.reply_to),
            ]
            .into_iter()
            .filter(|(_, column)| !column.is_empty())
            .map(|(key, column)| (key, column.clone()))
            .collect(),
        }
    }
}

/// Column names of the outbox table. `headers` and `correlation_id` are optional:
/// `None` means the table has no such column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMapping {
    pub id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub headers: Option<String>,
    pub correlation_id: Option<String>,
    /// The column naming each event's exchange, if any.
    pub exchange: Option<String>,
    /// Property columns: (`[mapping]` key, which is the property's name, column).
    pub properties: Vec<(&'static str, String)>,
}

impl Default for ColumnMapping {
    /// The default `[mapping]` ([`MappingConfig::default`]).
    fn default() -> ColumnMapping {
        MappingConfig::default().columns()
    }
}

impl ColumnMapping {
    /// The columns every outbox table must have, as (config key, column name).
    pub fn required(&self) -> [(&'static str, &str); 5] {
        [
            ("id", &self.id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("payload", &self.payload),
        ]
    }
}

/// A table name as configured: `schema.table`, or `table` meaning `public.table`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    /// Parses `schema.table` or `table` (schema `public`). Names are taken as written
    /// (no quoting rules): Postgres folds unquoted identifiers to lower case, so
    /// configure them as they appear in `pg_class`.
    pub fn parse(s: &str) -> Option<TableName> {
        let s = s.trim();
        let (schema, name) = match s.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", s),
        };
        if schema.is_empty() || name.is_empty() || name.contains('.') {
            return None;
        }
        Some(TableName {
            schema: schema.to_string(),
            name: name.to_string(),
        })
    }

    /// `schema.table`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_optional_column_is_none_and_an_empty_required_one_is_refused() {
        assert_eq!(MappingConfig::default().columns(), ColumnMapping::default());
        assert!(MappingConfig::default().validate().is_empty());
        let m = MappingConfig {
            headers: String::new(),
            correlation_id: "trace".into(),
            payload: " ".into(),
            ..MappingConfig::default()
        };
        let columns = m.columns();
        assert_eq!(columns.headers, None);
        assert_eq!(columns.correlation_id.as_deref(), Some("trace"));
        let keys: Vec<&str> = m.validate().iter().map(|e| e.key).collect();
        assert_eq!(keys, ["mapping.payload"]);
    }
}
