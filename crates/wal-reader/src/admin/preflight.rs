//! Every precondition in order, one result each: what `outbox-relay check` prints.

use std::fmt;

use tokio_postgres::Client;

use super::columns::{check_columns, check_published_columns};
use super::ident::display_table;
use super::publication::check_publication;
use super::server::{check_replication_role, check_server_version, check_wal_level};
use super::slot::require_slot;
use super::AdminError;
use crate::{ColumnMapping, TableName};

/// What to check: the relay's `[postgres]` and `[mapping]` configuration.
#[derive(Debug, Clone, Copy)]
pub struct Preflight<'a> {
    pub slot: &'a str,
    pub publication: &'a str,
    pub tables: &'a [TableName],
    pub mapping: &'a ColumnMapping,
}

/// The outcome of one check.
#[derive(Debug)]
pub enum CheckStatus {
    /// Satisfied; the text says what was found.
    Ok(String),
    /// Not an unmet precondition, but worth saying (e.g. another relay holds the
    /// slot: `run` would wait for it).
    Warning(AdminError),
    Failed(AdminError),
}

/// One line of `outbox-relay check`.
#[derive(Debug)]
pub struct CheckResult {
    /// What was checked, e.g. `wal_level` or `table public.outbox`.
    pub name: String,
    pub status: CheckStatus,
}

impl CheckResult {
    pub fn failed(&self) -> bool {
        matches!(self.status, CheckStatus::Failed(_))
    }

    fn from(name: String, result: Result<String, AdminError>) -> CheckResult {
        let status = match result {
            Ok(detail) => CheckStatus::Ok(detail),
            Err(e) => CheckStatus::Failed(e),
        };
        CheckResult { name, status }
    }
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.status {
            CheckStatus::Ok(detail) => write!(f, "ok    {}: {detail}", self.name),
            CheckStatus::Warning(e) => write!(f, "warn  {}: {e}", self.name),
            CheckStatus::Failed(e) => write!(f, "FAIL  {}: {e}", self.name),
        }
    }
}

impl Preflight<'_> {
    /// Runs every check, in the order an operator fixes them: server settings, role,
    /// publication, tables and columns, slot. A failed check does not stop the
    /// others, so one run lists everything to fix; checks that depend on a failed
    /// one (the column list of a missing publication) are skipped.
    pub async fn run(&self, c: &Client) -> Vec<CheckResult> {
        let mut results = Vec::new();
        results.push(CheckResult::from(
            "server".into(),
            check_server_version(c)
                .await
                .map(|v| format!("Postgres {v}")),
        ));
        results.push(CheckResult::from(
            "wal_level".into(),
            check_wal_level(c).await.map(|()| "logical".into()),
        ));
        results.push(CheckResult::from(
            "replication role".into(),
            check_replication_role(c)
                .await
                .map(|()| "the role may use replication".into()),
        ));
        let publication = check_publication(c, self.publication, self.tables).await;
        let publication_ok = publication.is_ok();
        results.push(CheckResult::from(
            format!("publication {}", self.publication),
            publication.map(|()| {
                format!(
                    "publishes inserts of {} configured table(s)",
                    self.tables.len()
                )
            }),
        ));
        for table in self.tables {
            let result = self.check_table(c, table, publication_ok).await;
            results.push(CheckResult::from(
                format!("table {}", display_table(table)),
                result,
            ));
        }
        let slot = require_slot(c, self.slot).await;
        let held = slot.as_ref().ok().and_then(|s| s.check_free().err());
        let unreserved = slot
            .as_ref()
            .ok()
            .and_then(|s| s.check_wal_reserved().err());
        results.push(CheckResult::from(
            format!("slot {}", self.slot),
            slot.map(|s| {
                format!(
                    "pgoutput slot at {}, wal_status {}",
                    s.confirmed_flush_lsn
                        .map_or_else(|| "?".to_string(), |l| l.to_string()),
                    s.wal_status.as_deref().unwrap_or("?")
                )
            }),
        ));
        if let Some(unreserved) = unreserved {
            results.push(CheckResult {
                name: format!("slot {} WAL", self.slot),
                status: CheckStatus::Warning(unreserved),
            });
        }
        if let Some(held) = held {
            results.push(CheckResult {
                name: format!("slot {} in use", self.slot),
                status: CheckStatus::Warning(held),
            });
        }
        results
    }

    async fn check_table(
        &self,
        c: &Client,
        table: &TableName,
        publication_ok: bool,
    ) -> Result<String, AdminError> {
        let columns = check_columns(c, table, self.mapping).await?;
        if publication_ok {
            check_published_columns(c, self.publication, &columns).await?;
        }
        let optional = |present: bool| if present { "present" } else { "absent" };
        let mut detail = format!(
            "mapped columns present; headers column {}",
            optional(columns.headers.is_some())
        );
        if columns.correlation_id.is_some() {
            detail.push_str("; correlation_id column present");
        }
        Ok(detail)
    }
}
