//! The `[postgres]` section (docs/design.md §6), owned by the reader: the relay's
//! TOML deserializes straight into [`PostgresConfig`], whose defaults are the
//! `DEFAULT_*` constants here and whose checks are [`PostgresConfig::validate`];
//! [`PostgresConfig::reader_config`] turns it, with `[mapping]`
//! ([`MappingConfig`]) and the two values of other sections, into what the reader
//! runs with.

use std::fmt;
use std::time::Duration;

use outbox_event::redact::{quoted_scheme, redact_url};
use outbox_event::setting::SettingError;
use outbox_event::Lsn;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer};

use crate::conninfo::{ConnInfoError, PgConnectOptions};
use crate::mapping::{MappingConfig, TableName};
use crate::stream::ReaderConfig;

/// Default `postgres.url`.
pub const DEFAULT_POSTGRES_URL: &str = "postgresql://postgres@127.0.0.1:5432/app";
/// Default `postgres.slot`.
pub const DEFAULT_SLOT: &str = "outbox_relay";
/// Default `postgres.publication`.
pub const DEFAULT_PUBLICATION: &str = "outbox_relay";
/// Default `postgres.tables`.
pub const DEFAULT_TABLES: &[&str] = &["public.outbox"];

/// `[postgres]`.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// libpq-style URL (`postgresql://user:pw@host:port/db?sslmode=...`) or key=value
    /// conninfo (`host=... user=... password=...`). Holds a password: secret.
    #[serde(deserialize_with = "de_secret")]
    pub url: SecretString,
    /// Name of the pgoutput logical replication slot.
    pub slot: String,
    /// Name of the publication the slot streams.
    pub publication: String,
    /// Outbox tables, `schema.table` or `table` (schema `public`): a list, or one
    /// string of comma-separated names (as the environment variable). Checked at load.
    #[serde(deserialize_with = "de_string_list")]
    pub tables: Vec<String>,
    /// Prefixes of the transactional logical messages relayed as events
    /// (docs/messages.md), as `tables` takes them; empty: none (the default).
    #[serde(deserialize_with = "de_string_list")]
    pub messages: Vec<String>,
}

impl Default for PostgresConfig {
    fn default() -> PostgresConfig {
        PostgresConfig {
            url: SecretString::from(DEFAULT_POSTGRES_URL),
            slot: DEFAULT_SLOT.to_string(),
            publication: DEFAULT_PUBLICATION.to_string(),
            tables: DEFAULT_TABLES.iter().map(|t| t.to_string()).collect(),
            messages: Vec::new(),
        }
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(self.url.expose_secret()))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("tables", &self.tables)
            .field("messages", &self.messages)
            .finish()
    }
}

impl PostgresConfig {
    /// Checks the values serde cannot: the URL (every parameter read as at connect),
    /// the slot's and the publication's names, the tables. Every offending key is
    /// reported, in the order of the section.
    pub fn validate(&self) -> Vec<SettingError> {
        [
            validate_pg_url(self.url.expose_secret()),
            validate_identifier("postgres.slot", &self.slot, true),
            validate_identifier("postgres.publication", &self.publication, false),
            validate_tables(&self.tables, !self.messages.is_empty()),
            validate_messages(&self.messages),
        ]
        .into_iter()
        .filter_map(Result::err)
        .collect()
    }

    /// The outbox tables (validated at load).
    pub fn tables(&self) -> Vec<TableName> {
        self.tables
            .iter()
            .filter_map(|t| TableName::parse(t))
            .collect()
    }

    /// What the reader runs with: this section, `[mapping]`, where to start
    /// (`run --start-lsn`), the status interval (`[relay] status_interval_ms`) and the
    /// flow limit (`[rabbitmq] max_in_flight`).
    pub fn reader_config(
        &self,
        mapping: &MappingConfig,
        start_lsn: Option<Lsn>,
        status_interval: Duration,
        max_in_flight: usize,
    ) -> Result<ReaderConfig, ConnInfoError> {
        Ok(ReaderConfig {
            conn: PgConnectOptions::parse(self.url.expose_secret())?,
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            tables: self.tables(),
            messages: self.messages.clone(),
            mapping: mapping.columns(),
            start_lsn,
            status_interval,
            max_in_flight,
        })
    }
}

fn de_secret<'de, D: Deserializer<'de>>(d: D) -> Result<SecretString, D::Error> {
    String::deserialize(d).map(SecretString::from)
}

/// A list of strings: a TOML array, or one string of comma-separated items (the
/// form the environment variable takes too).
fn de_string_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or a list of strings")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push(s);
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

/// `postgres.tables`: each a table name, at least one unless logical messages are
/// relayed (an outbox without a table, docs/messages.md).
fn validate_tables(tables: &[String], messages: bool) -> Result<(), SettingError> {
    if tables.is_empty() && !messages {
        return Err(SettingError::new(
            "postgres.tables",
            "the list is empty: name at least one outbox table, e.g. [\"public.outbox\"], or relay logical messages with [postgres] messages",
        ));
    }
    for t in tables {
        if TableName::parse(t).is_none() {
            return Err(SettingError::new(
                "postgres.tables",
                format!("{t:?} is not a table name: use \"schema.table\" or \"table\""),
            ));
        }
    }
    Ok(())
}

/// `postgres.messages`: prefixes, none empty, none twice.
fn validate_messages(prefixes: &[String]) -> Result<(), SettingError> {
    const KEY: &str = "postgres.messages";
    for (i, p) in prefixes.iter().enumerate() {
        if p.trim().is_empty() {
            return Err(SettingError::new(
                KEY,
                "a prefix is empty: list the prefixes your pg_logical_emit_message calls use, e.g. [\"outbox\"]",
            ));
        }
        if p.contains('\0') {
            return Err(SettingError::new(
                KEY,
                format!("{p:?} contains a NUL byte, which Postgres text cannot hold: remove it"),
            ));
        }
        if prefixes[..i].contains(p) {
            return Err(SettingError::new(
                KEY,
                format!("{p:?} is listed twice: list each prefix once"),
            ));
        }
    }
    Ok(())
}

fn validate_pg_url(url: &str) -> Result<(), SettingError> {
    const KEY: &str = "postgres.url";
    if url.trim().is_empty() {
        return Err(SettingError::new(
            KEY,
            "it is empty: set a URL like postgresql://user@host:5432/db or a conninfo like \"host=... dbname=...\"",
        ));
    }
    if let Some((scheme, _)) = url.split_once("://") {
        if scheme != "postgresql" && scheme != "postgres" {
            return Err(SettingError::new(
                KEY,
                format!(
                    "the URL scheme {}is not postgresql:// or postgres://: fix the URL",
                    quoted_scheme(scheme)
                ),
            ));
        }
    } else if !url.contains('=') {
        return Err(SettingError::new(
            KEY,
            "it is neither a postgresql:// URL nor key=value conninfo: fix it",
        ));
    }
    // Every parameter is read now, as at connect (the message names parameters,
    // never values).
    PgConnectOptions::parse(url)
        .map(|_| ())
        .map_err(|e| SettingError::new(KEY, e.0))
}

/// Slot names: lower-case letters, digits, underscores, at most 63 bytes. Publications:
/// any non-empty name of at most 63 bytes (it is quoted when used).
fn validate_identifier(
    key: &'static str,
    value: &str,
    slot_rules: bool,
) -> Result<(), SettingError> {
    if value.is_empty() || value.len() > 63 {
        return Err(SettingError::new(
            key,
            format!("{value:?} must be 1 to 63 bytes long: choose another name"),
        ));
    }
    if slot_rules
        && !value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(SettingError::new(
            key,
            format!("{value:?} is not a valid slot name: use only lower-case letters, digits and underscores"),
        ));
    }
    Ok(())
}
