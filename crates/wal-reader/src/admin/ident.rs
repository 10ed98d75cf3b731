//! Name validation and SQL quoting.
//!
//! Configuration values reach SQL in two ways only: as bind parameters (`$1`), or,
//! where Postgres takes no parameters (DDL such as `CREATE PUBLICATION`), as identifiers
//! quoted here. Slot and publication names are validated first, so that a bad name is
//! reported as a configuration error rather than a server error, and so that a name
//! longer than Postgres' 63-byte limit is not silently truncated into another name.

use super::AdminError;
use crate::TableName;

/// Longest identifier Postgres keeps (NAMEDATALEN - 1).
pub const MAX_NAME_LEN: usize = 63;

/// Checks a replication slot name: Postgres itself only accepts lowercase letters,
/// digits and underscores, at most 63 characters.
pub fn validate_slot_name(name: &str) -> Result<(), AdminError> {
    validate_simple_name("replication slot", name)
}

/// Checks a publication name against the same rules as slot names. Postgres would
/// accept any identifier, but the relay's messages and the operator's SQL stay simple
/// (no quoting) with these, and a longer name would be truncated by the server.
pub fn validate_publication_name(name: &str) -> Result<(), AdminError> {
    validate_simple_name("publication", name)
}

fn validate_simple_name(kind: &'static str, name: &str) -> Result<(), AdminError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("it is longer than 63 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        Some("it contains a character other than a-z, 0-9 and _")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(AdminError::InvalidName {
            kind,
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Checks that both parts of a table name can be identifiers (non-empty, no NUL,
/// at most 63 bytes). Any other character is fine: the name is quoted.
pub fn validate_table_name(table: &TableName) -> Result<(), AdminError> {
    for part in [&table.schema, &table.name] {
        let reason = if part.is_empty() {
            Some("a part of it is empty")
        } else if part.len() > MAX_NAME_LEN {
            Some("a part of it is longer than 63 bytes")
        } else if part.contains('\0') {
            Some("it contains a NUL character")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(AdminError::InvalidTableName {
                name: table.qualified(),
                reason,
            });
        }
    }
    Ok(())
}

/// Quotes an identifier for SQL: `"name"`, with embedded double quotes doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for SQL: `'text'`, with embedded single quotes doubled.
/// (Valid with `standard_conforming_strings = on`, the default since Postgres 9.1;
/// the relay prefers bind parameters wherever Postgres accepts them.)
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `"schema"."table"`, always quoted: safe for any name.
pub fn quote_table(table: &TableName) -> String {
    format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&table.name)
    )
}

/// A table as an operator would type it: `schema.table`, quoting only the parts that
/// need it (anything but lowercase letters, digits and underscores, not starting with
/// a digit). Used in messages that contain SQL to run.
pub fn display_table(table: &TableName) -> String {
    format!(
        "{}.{}",
        display_ident(&table.schema),
        display_ident(&table.name)
    )
}

fn display_ident(name: &str) -> String {
    let simple = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if simple {
        name.to_string()
    } else {
        quote_ident(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(schema: &str, name: &str) -> TableName {
        TableName {
            schema: schema.into(),
            name: name.into(),
        }
    }

    #[test]
    fn accepts_simple_names() {
        for ok in ["outbox_relay", "s1", "_x", &"a".repeat(63)] {
            assert!(validate_slot_name(ok).is_ok(), "{ok}");
            assert!(validate_publication_name(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_bad_names_with_the_rule() {
        for bad in [
            "",
            "Outbox",
            "a-b",
            "a b",
            "x'; drop table t; --",
            "é",
            &"a".repeat(64),
        ] {
            let e = validate_slot_name(bad).expect_err(bad);
            assert!(e.is_precondition());
            let msg = e.to_string();
            assert!(msg.contains("replication slot name"), "{msg}");
            assert!(msg.contains("lowercase letters"), "{msg}");
            assert!(validate_publication_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quotes_identifiers_and_literals() {
        assert_eq!(quote_ident("outbox"), "\"outbox\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(
            quote_table(&table("public", "Out\"box")),
            "\"public\".\"Out\"\"box\""
        );
    }

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal(&quote_ident("p")), "'\"p\"'");
    }

    #[test]
    fn displays_tables_as_typed() {
        assert_eq!(display_table(&table("public", "outbox")), "public.outbox");
        assert_eq!(display_table(&table("App", "1x")), "\"App\".\"1x\"");
    }

    #[test]
    fn validates_table_names() {
        assert!(validate_table_name(&table("public", "outbox")).is_ok());
        assert!(validate_table_name(&table("public", "")).is_err());
        assert!(validate_table_name(&table("public", "a\0b")).is_err());
        assert!(validate_table_name(&table(&"s".repeat(64), "t")).is_err());
    }
}
