//! Which outbox columns carry which message field (docs/design.md §6 `[mapping]`).

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
}

impl Default for ColumnMapping {
    fn default() -> ColumnMapping {
        ColumnMapping {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: Some("headers".into()),
            correlation_id: None,
        }
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
