//! The outbox table's columns, as the `[mapping]` section names them.
//!
//! The reader finds columns by name in pgoutput's Relation messages; a mapped column
//! that does not exist would only show up as an event without a payload or id. So
//! before streaming the relay checks every required mapped column (`id`,
//! `aggregate_type`, `aggregate_id`, `event_type`, `payload`) exists, and reports
//! which optional ones do: a missing `headers` column means "no extra headers"
//! (docs/design.md §6); a `correlation_id` column that is configured but missing is an error,
//! because it was configured on purpose and is most likely misspelled. On Postgres
//! 15+ a publication can also publish only some columns (a column list), which
//! [`check_published_columns`] verifies.

use tokio_postgres::Client;

use super::ident::{display_table, validate_publication_name, validate_table_name};
use super::publication::require_table;
use super::{server_version_num, AdminError};
use crate::{ColumnMapping, TableName};

/// A column of the outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnInfo {
    pub name: String,
    /// `pg_attribute.atttypid` (see [`crate::pgtype::oid`]).
    pub type_oid: u32,
    pub not_null: bool,
}

/// The mapped columns of one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableColumns {
    pub table: TableName,
    /// `pg_class.oid` of the table.
    pub table_oid: u32,
    pub id: ColumnInfo,
    pub aggregate_type: ColumnInfo,
    pub aggregate_id: ColumnInfo,
    pub event_type: ColumnInfo,
    pub payload: ColumnInfo,
    /// The headers column, if configured and present.
    pub headers: Option<ColumnInfo>,
    /// The correlation id column, if configured (then it is present).
    pub correlation_id: Option<ColumnInfo>,
    /// The exchange column, if configured (then it is present).
    pub exchange: Option<ColumnInfo>,
    /// The property columns configured, with their `[mapping]` keys.
    pub properties: Vec<(&'static str, ColumnInfo)>,
}

impl TableColumns {
    /// Every mapped column that exists, with its `[mapping]` key.
    pub fn mapped(&self) -> Vec<(&'static str, &ColumnInfo)> {
        let mut all = vec![
            ("id", &self.id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("payload", &self.payload),
        ];
        if let Some(h) = &self.headers {
            all.push(("headers", h));
        }
        if let Some(c) = &self.correlation_id {
            all.push(("correlation_id", c));
        }
        if let Some(c) = &self.exchange {
            all.push(("exchange", c));
        }
        for (key, c) in &self.properties {
            all.push((key, c));
        }
        all
    }
}

/// Checks that `table` exists and has the mapped columns; returns them with their
/// types.
pub async fn check_columns(
    c: &Client,
    table: &TableName,
    mapping: &ColumnMapping,
) -> Result<TableColumns, AdminError> {
    validate_table_name(table)?;
    let table_oid = require_table(c, table).await?.oid;
    let rows = c
        .query(
            "SELECT attname::text, atttypid, attnotnull FROM pg_attribute \
              WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped",
            &[&table_oid],
        )
        .await?;
    let mut columns = Vec::with_capacity(rows.len());
    for row in rows {
        columns.push(ColumnInfo {
            name: row.try_get(0)?,
            type_oid: row.try_get(1)?,
            not_null: row.try_get(2)?,
        });
    }
    resolve(table, table_oid, mapping, &columns)
}

fn resolve(
    table: &TableName,
    table_oid: u32,
    mapping: &ColumnMapping,
    columns: &[ColumnInfo],
) -> Result<TableColumns, AdminError> {
    let find = |name: &str| columns.iter().find(|c| c.name == name).cloned();
    let require = |key: &'static str, name: &str| {
        find(name).ok_or_else(|| AdminError::ColumnMissing {
            table: display_table(table),
            column: name.to_string(),
            key,
        })
    };
    Ok(TableColumns {
        table: table.clone(),
        table_oid,
        id: require("id", &mapping.id)?,
        aggregate_type: require("aggregate_type", &mapping.aggregate_type)?,
        aggregate_id: require("aggregate_id", &mapping.aggregate_id)?,
        event_type: require("event_type", &mapping.event_type)?,
        payload: require("payload", &mapping.payload)?,
        headers: mapping.headers.as_deref().and_then(find),
        correlation_id: match mapping.correlation_id.as_deref() {
            Some(name) => Some(require("correlation_id", name)?),
            None => None,
        },
        exchange: match mapping.exchange.as_deref() {
            Some(name) => Some(require("exchange", name)?),
            None => None,
        },
        properties: mapping
            .properties
            .iter()
            .map(|(key, name)| Ok((*key, require(key, name)?)))
            .collect::<Result<_, AdminError>>()?,
    })
}

/// On Postgres 15+, checks that the publication's column list for the table (if it
/// has one) includes every mapped column; without a column list all columns are
/// published. Earlier versions have no column lists: nothing to check.
pub async fn check_published_columns(
    c: &Client,
    publication: &str,
    columns: &TableColumns,
) -> Result<(), AdminError> {
    validate_publication_name(publication)?;
    if server_version_num(c).await? < 150000 {
        return Ok(());
    }
    let row = c
        .query_opt(
            "SELECT attnames::text[] FROM pg_publication_tables \
              WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[&publication, &columns.table.schema, &columns.table.name],
        )
        .await?;
    let Some(row) = row else {
        return Err(AdminError::TableNotInPublication {
            table: display_table(&columns.table),
            publication: publication.to_string(),
        });
    };
    let published: Option<Vec<String>> = row.try_get(0)?;
    let Some(published) = published else {
        return Ok(());
    };
    for (key, column) in columns.mapped() {
        if !published.contains(&column.name) {
            return Err(AdminError::ColumnNotPublished {
                table: display_table(&columns.table),
                column: column.name.clone(),
                key,
                publication: publication.to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str) -> ColumnInfo {
        ColumnInfo {
            name: name.into(),
            type_oid: 25,
            not_null: false,
        }
    }

    fn table() -> TableName {
        TableName::parse("public.outbox").expect("name")
    }

    fn default_columns() -> Vec<ColumnInfo> {
        [
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
        ]
        .into_iter()
        .map(col)
        .collect()
    }

    #[test]
    fn headers_column_is_optional() {
        let cols =
            resolve(&table(), 1, &ColumnMapping::default(), &default_columns()).expect("resolves");
        assert!(cols.headers.is_none());
        assert_eq!(cols.mapped().len(), 5);
    }

    #[test]
    fn missing_required_column_names_the_key() {
        let mapping = ColumnMapping {
            payload: "body".into(),
            ..ColumnMapping::default()
        };
        let e = resolve(&table(), 1, &mapping, &default_columns()).expect_err("missing");
        assert_eq!(
            e.to_string(),
            "table public.outbox has no column \"body\": add the column, or set [mapping] \
             payload to the name of the column that holds the payload"
        );
    }

    #[test]
    fn configured_correlation_id_must_exist() {
        let mapping = ColumnMapping {
            correlation_id: Some("trace_id".into()),
            ..ColumnMapping::default()
        };
        let e = resolve(&table(), 1, &mapping, &default_columns()).expect_err("missing");
        assert!(matches!(
            e,
            AdminError::ColumnMissing {
                key: "correlation_id",
                ..
            }
        ));
        let mut cols = default_columns();
        cols.push(col("trace_id"));
        let found = resolve(&table(), 1, &mapping, &cols).expect("resolves");
        assert_eq!(found.correlation_id, Some(col("trace_id")));
    }
}
