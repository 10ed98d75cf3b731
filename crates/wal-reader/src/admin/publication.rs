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
    for table in tables {
        require_table(c, table).await?;
    }
    let statement = create_statement(publication, tables, quote_table);
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
                statement: create_statement(publication, tables, display_table),
            })
        }
        Err(e) => Err(e.into()),
    }
}

fn create_statement(
    publication: &str,
    tables: &[TableName],
    table_sql: fn(&TableName) -> String,
) -> String {
    let list: Vec<String> = tables.iter().map(table_sql).collect();
    format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')",
        quote_ident(publication),
        list.join(", ")
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
    let publishes_insert =
        publication_flags(c, publication)
            .await?
            .ok_or_else(|| AdminError::PublicationMissing {
                publication: publication.to_string(),
            })?;
    if !publishes_insert {
        return Err(AdminError::PublicationNoInserts {
            publication: publication.to_string(),
        });
    }
    for table in tables {
        require_table(c, table).await?;
        let published = c
            .query_opt(
                "SELECT 1 FROM pg_publication_tables \
                  WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&publication, &table.schema, &table.name],
            )
            .await?;
        if published.is_none() {
            return Err(AdminError::TableNotInPublication {
                table: display_table(table),
                publication: publication.to_string(),
            });
        }
    }
    Ok(())
}

fn validate(publication: &str, tables: &[TableName]) -> Result<(), AdminError> {
    validate_publication_name(publication)?;
    if tables.is_empty() {
        return Err(AdminError::NoTables);
    }
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

/// The table's OID, if it exists as a table (plain or partitioned).
pub(super) async fn table_oid(c: &Client, table: &TableName) -> Result<Option<u32>, AdminError> {
    let row = c
        .query_opt(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&table.schema, &table.name],
        )
        .await?;
    Ok(match row {
        Some(row) => Some(row.try_get(0)?),
        None => None,
    })
}

pub(super) async fn require_table(c: &Client, table: &TableName) -> Result<u32, AdminError> {
    table_oid(c, table)
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
            create_statement("outbox_relay", &tables, quote_table),
            "CREATE PUBLICATION \"outbox_relay\" FOR TABLE \"public\".\"outbox\", \
             \"App\".\"\"\"x\" WITH (publish = 'insert')"
        );
        assert_eq!(
            create_statement("p", &tables[..1], display_table),
            "CREATE PUBLICATION \"p\" FOR TABLE public.outbox WITH (publish = 'insert')"
        );
    }

    #[test]
    fn validation_comes_first() {
        assert!(matches!(validate("p", &[]), Err(AdminError::NoTables)));
        assert!(matches!(
            validate("P", &[TableName::parse("t").expect("name")]),
            Err(AdminError::InvalidName { .. })
        ));
    }
}
