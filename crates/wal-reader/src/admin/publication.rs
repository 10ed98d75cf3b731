//! The publication: which tables' changes the `pgoutput` plugin sends to the relay.
//!
//! The relay needs a publication that exists, publishes inserts (updates, deletes
//! and truncates are ignored, so `publish = 'insert'` is the natural setting), and
//! contains every configured outbox table. A table missing from the publication is
//! not an error for Postgres: its inserts are silently not decoded, which is why it
//! is checked here.

use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use super::ident::{
    display_table, quote_ident, quote_table, validate_publication_name, validate_table_name,
};
use super::AdminError;
use crate::TableName;

/// Creates the publication for `tables`, publishing inserts only, unless a
/// publication of that name exists (which is then left as it is: run
/// [`check_publication`] to validate it). Returns whether it was created.
///
/// `CREATE PUBLICATION … FOR TABLE` needs CREATE on the database and ownership of
/// the tables; without them the error gives the statement an administrator can run.
pub async fn ensure_publication(
    c: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<bool, AdminError> {
    validate(publication, tables)?;
    if publication_flags(c, publication).await?.is_some() {
        return Ok(false);
    }
    let mut via_root = false;
    for table in tables {
        via_root |= require_table(c, table).await?.partitioned;
    }
    let statement = create_statement(publication, tables, via_root, quote_table);
    match c.batch_execute(&statement).await {
        Ok(()) => Ok(true),
        Err(e) if e.code() == Some(&SqlState::DUPLICATE_OBJECT) => Ok(false),
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            let row = c.query_one("SELECT current_user::text", &[]).await?;
            Err(AdminError::PublicationCreateDenied {
                publication: publication.to_string(),
                role: row.try_get(0)?,
                reason: e
                    .as_db_error()
                    .map(|db| db.message().to_string())
                    .unwrap_or_else(|| "permission denied".into()),
                statement: create_statement(publication, tables, via_root, display_table),
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// The DDL, with `table_sql` rendering the table names (always quoted to run it,
/// quoted only where needed to show it). Partitioned tables are published through
/// their root, so events carry the configured table's name, not a partition's.
fn create_statement(
    publication: &str,
    tables: &[TableName],
    via_root: bool,
    table_sql: fn(&TableName) -> String,
) -> String {
    let list: Vec<String> = tables.iter().map(table_sql).collect();
    let via_root = if via_root {
        ", publish_via_partition_root = true"
    } else {
        ""
    };
    let for_tables = if list.is_empty() {
        String::new()
    } else {
        format!(" FOR TABLE {}", list.join(", "))
    };
    format!(
        "CREATE PUBLICATION {}{for_tables} WITH (publish = 'insert'{via_root})",
        quote_ident(publication),
    )
}

/// Checks that the publication exists, publishes inserts, and that every table
/// exists and is in it (directly, through `FOR ALL TABLES` or `FOR TABLES IN
/// SCHEMA`: `pg_publication_tables` resolves all three).
pub async fn check_publication(
    c: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<(), AdminError> {
    validate(publication, tables)?;
    let Some(publishes_insert) = publication_flags(c, publication).await? else {
        return Err(publication_missing(c, publication, tables).await);
    };
    if !publishes_insert {
        return Err(AdminError::PublicationNoInserts {
            publication: publication.to_string(),
        });
    }
    for table in tables {
        let found = require_table(c, table).await?;
        let published = c
            .query_opt(
                "SELECT 1 FROM pg_publication_tables \
                  WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&publication, &table.schema, &table.name],
            )
            .await?;
        if published.is_none() {
            // A partitioned table in a publication that does not publish via the
            // root is listed by its partitions only.
            if found.partitioned && publishes_partitions_of(c, publication, found.oid).await? {
                return Err(AdminError::PartitionsNotViaRoot {
                    table: display_table(table),
                    publication: publication.to_string(),
                });
            }
            return Err(AdminError::TableNotInPublication {
                table: display_table(table),
                publication: publication.to_string(),
            });
        }
    }
    Ok(())
}

/// The publication is missing: the error names the statement `slot create` runs
/// ([`ensure_publication`]): through the root for a partitioned table, and without
/// `FOR TABLE` when there is no table (logical messages only).
async fn publication_missing(c: &Client, publication: &str, tables: &[TableName]) -> AdminError {
    let mut via_root = false;
    for table in tables {
        // A table that cannot be found is reported on its own line.
        via_root |= matches!(find_table(c, table).await, Ok(Some(t)) if t.partitioned);
    }
    AdminError::PublicationMissing {
        publication: publication.to_string(),
        statement: create_statement(publication, tables, via_root, display_table),
    }
}

/// Whether the publication lists partitions of the partitioned table `root`.
async fn publishes_partitions_of(
    c: &Client,
    publication: &str,
    root: u32,
) -> Result<bool, AdminError> {
    let row = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables p \
                 JOIN pg_namespace n ON n.nspname = p.schemaname \
                 JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename \
                WHERE p.pubname = $1 \
                  AND c.oid IN (SELECT relid FROM pg_catalog.pg_partition_tree($2::oid)))",
            &[&publication, &root],
        )
        .await?;
    Ok(row.try_get(0)?)
}

fn validate(publication: &str, tables: &[TableName]) -> Result<(), AdminError> {
    // No table is fine when logical messages are relayed (the configuration requires
    // a table or a message prefix): the publication then publishes no table.
    validate_publication_name(publication)?;
    tables.iter().try_for_each(validate_table_name)
}

/// `Some(publishes inserts)` if the publication exists.
async fn publication_flags(c: &Client, publication: &str) -> Result<Option<bool>, AdminError> {
    let row = c
        .query_opt(
            "SELECT pubinsert FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    Ok(match row {
        Some(row) => Some(row.try_get(0)?),
        None => None,
    })
}

/// A configured table as found in `pg_class`.
#[derive(Debug, Clone, Copy)]
pub(super) struct FoundTable {
    pub oid: u32,
    /// A partitioned table (its rows live in partitions).
    pub partitioned: bool,
}

/// The table, if it exists as a table (plain or partitioned).
pub(super) async fn find_table(
    c: &Client,
    table: &TableName,
) -> Result<Option<FoundTable>, AdminError> {
    let row = c
        .query_opt(
            "SELECT c.oid, c.relkind = 'p' FROM pg_class c \
               JOIN pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&table.schema, &table.name],
        )
        .await?;
    Ok(match row {
        Some(row) => Some(FoundTable {
            oid: row.try_get(0)?,
            partitioned: row.try_get(1)?,
        }),
        None => None,
    })
}

pub(super) async fn require_table(c: &Client, table: &TableName) -> Result<FoundTable, AdminError> {
    find_table(c, table)
        .await?
        .ok_or_else(|| AdminError::TableMissing {
            table: display_table(table),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_statement_quotes_every_name() {
        let tables = [
            TableName::parse("public.outbox").expect("name"),
            TableName::parse("App.\"x").expect("name"),
        ];
        assert_eq!(
            create_statement("outbox_relay", &tables, false, quote_table),
            "CREATE PUBLICATION \"outbox_relay\" FOR TABLE \"public\".\"outbox\", \
             \"App\".\"\"\"x\" WITH (publish = 'insert')"
        );
        assert_eq!(
            create_statement("p", &tables[..1], true, display_table),
            "CREATE PUBLICATION \"p\" FOR TABLE public.outbox \
             WITH (publish = 'insert', publish_via_partition_root = true)"
        );
    }

    #[test]
    fn validation_comes_first() {
        assert!(validate("p", &[]).is_ok());
        assert!(matches!(
            validate("P", &[TableName::parse("t").expect("name")]),
            Err(AdminError::InvalidName { .. })
        ));
    }
}
