//! `[retention] keep` (docs/design.md §7): deletes outbox rows that are older than `keep` *and*
//! whose events are certainly published and confirmed, in small batches, on a timer.
//!
//! # Which rows are confirmed
//!
//! Rows carry no LSN, so the task relates transactions to WAL positions through
//! *markers*. Every tick it takes one in a single statement:
//!
//! ```text
//!   SELECT pg_snapshot_xmin(pg_current_snapshot()), pg_current_wal_insert_lsn()
//!                  │ sx                                   │ L
//! ```
//!
//! - `pg_current_snapshot()` is the statement's snapshot, taken before the statement
//!   evaluates anything. Its `xmin` (`sx`) is the oldest transaction id still running
//!   then: every transaction id below `sx` had finished when the snapshot was taken.
//! - A transaction becomes visible (leaves the running set) only after its commit
//!   record is in the WAL, so every transaction below `sx` committed at a position
//!   below the WAL *insert* position read afterwards (`L`). The insert position, not
//!   `pg_current_wal_lsn()` (the write position), because with
//!   `synchronous_commit = off` a commit is visible before its record is written.
//! - Once the slot's `confirmed_flush_lsn` ≥ `L`, the relay has confirmed to Postgres
//!   a position past every one of those commits, and it confirms a position only
//!   after the broker acked every message below it (docs/design.md §1): their events are
//!   published.
//!
//! So a row may go when `created_at < now() - keep` and its `xmin` precedes `sx` of
//! the newest marker the slot has passed. Why `xmin < sx` and not the finer
//! `pg_visible_in_snapshot(xmin, snapshot)`: a row inserted after a `SAVEPOINT` carries
//! the *subtransaction's* id, and `pg_current_snapshot()` lists only top-level ids in
//! progress, so a subtransaction of a transaction still running at the marker would
//! look finished. A subtransaction's id is always greater than its parent's, so
//! `xmin < sx` implies that the top-level transaction was not running either. The
//! price: a long-running writing transaction anywhere in the cluster holds `sx` back
//! and delays retention (never makes it unsafe). A row updated later has the
//! updater's `xmin`; the updater could only see the row after its insert committed,
//! so the rule still holds.
//!
//! `xmin` is a 32-bit id and `sx` a 64-bit `xid8`: the comparison is done modulo 2³²
//! like Postgres's own (`0 < (sx − xmin) mod 2³² < 2³¹`), exact for ids less than 2³¹
//! apart. (Freezing keeps the raw `xmin` since Postgres 9.4, so a frozen row compares
//! correctly too.) Only a row more than 2³¹ transactions old can compare either way;
//! the slot's `catalog_xmin` holds back wraparound, so the server cannot get that far
//! past a transaction the slot has not confirmed: its event was published long ago.
//!
//! ```text
//!   tick ──► take marker (sx, L) ──► queue of markers (oldest first, ≤ MAX_MARKERS)
//!        ──► read the slot's confirmed_flush_lsn = C
//!        ──► newest marker with L ≤ C (older ones dropped)
//!        ──► per table: its row filter, then
//!            DELETE FROM [ONLY] … WHERE (tableoid, ctid) IN (SELECT tableoid, ctid … LIMIT BATCH)
//!            until a batch deletes fewer than BATCH rows
//! ```
//!
//! # Which rows a batch deletes
//!
//! A row is named by `(tableoid, ctid)`, not by `ctid` alone: a ctid is a position
//! (page, item) inside one heap, so in a partitioned outbox (or one with
//! inheritance children) every partition has its own `(0,1)`, `(0,2)`, … A DELETE on
//! the root with `ctid = ANY(…)` removes the rows at those positions in *every*
//! partition: young and unpublished rows with them. `tableoid` names the partition
//! the row was read from, so the pair is unique across the whole table at any
//! instant, needs no key or index, and still plans as a TID scan per partition
//! (nested loop over the batch). Not the primary key: the relay requires none, the
//! id column may carry no unique index, and the primary key of a partitioned table
//! must include the partition key, so the id alone need not be unique there.
//!
//! # Only rows that are published
//!
//! A row the relay never publishes is never deleted (docs/security.md):
//!
//! - A plain table's rows are deleted with `ONLY`: rows of its inheritance children
//!   are published under the child's name, which the relay skips. A partitioned
//!   table's rows live in its partitions and are published under its own name
//!   (`publish_via_partition_root`, which `check` requires), so they are deleted
//!   through it.
//! - A publication row filter (Postgres 15+, `pg_publication_tables.rowfilter`) is
//!   added to the condition: a row goes only when the filter is true for it, as
//!   pgoutput sends only those. The filter is read at every pass, so an `ALTER
//!   PUBLICATION` takes effect at the next one. A table that is no longer in the
//!   publication loses no rows.
//!
//! The tick is `keep / 10`, between 1 s and 60 s. Markers live in memory only: after
//! a restart the first marker is usable as soon as the slot passes it (seconds).
//! Rows with a NULL `created_at` are never deleted.

use std::collections::VecDeque;
use std::time::Duration;

use outbox_event::Lsn;
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tracing::{debug, info, warn, Instrument};
use wal_reader::admin::{self, ident::quote_table, AdminError};
use wal_reader::{PgConnectOptions, TableName};

use crate::background::tick::{every_tick, Task, Then};
use crate::config::Config;
use crate::error::CliError;
use crate::shutdown::Shutdown;

/// The column that tells old rows from new ones (not configurable).
pub const CREATED_AT: &str = "created_at";
/// Rows deleted per statement.
const BATCH: i64 = 1_000;
/// Markers waiting for the slot to pass them, at most.
const MAX_MARKERS: usize = 64;
const TICK_MIN: Duration = Duration::from_secs(1);
const TICK_MAX: Duration = Duration::from_secs(60);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// A DELETE waits at most this long for a table lock (e.g. behind an ALTER TABLE),
/// so that it never queues application inserts behind it for long.
const LOCK_TIMEOUT: &str = "5s";

/// Counter of deleted rows, labelled by table.
pub const DELETED_ROWS: &str = "outbox_relay_retention_deleted_rows_total";

/// Nothing to refuse without a database: `keep` is parsed (and non-zero) at load;
/// the tables are checked by [`preflight`].
pub fn validate(_cfg: &Config) -> Result<(), CliError> {
    Ok(())
}

/// With `keep` set, every outbox table needs a `created_at` timestamp column and
/// the relay's role needs DELETE on it. Fails with the fix.
pub async fn preflight(cfg: &Config, client: &Client) -> Result<(), CliError> {
    if cfg.retention_keep().is_none() {
        return Ok(());
    }
    for table in cfg.tables() {
        let row = client
            .query_opt(
                "SELECT pg_catalog.format_type(a.atttypid, a.atttypmod), \
                        pg_catalog.has_table_privilege(c.oid, 'DELETE'::text), current_user::text \
                   FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                   LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = $3 \
                                            AND a.attnum > 0 AND NOT a.attisdropped \
                  WHERE n.nspname = $1 AND c.relname = $2",
                &[&table.schema, &table.name, &CREATED_AT],
            )
            .await?;
        let Some(row) = row else {
            return Err(CliError::Precondition(format!(
                "outbox table {table} does not exist: create it or fix [postgres] tables"
            )));
        };
        let kind: Option<String> = row.get(0);
        let may_delete: bool = row.get(1);
        let role: String = row.get(2);
        match kind.as_deref() {
            None => {
                return Err(CliError::Precondition(format!(
                    "[retention] keep needs a {CREATED_AT} column in outbox table {table}: add one (ALTER TABLE {q} ADD COLUMN {CREATED_AT} timestamptz NOT NULL DEFAULT now()) or set [retention] keep = \"\"",
                    q = quote_table(&table)
                )))
            }
            Some("timestamp with time zone" | "timestamp without time zone" | "date") => {}
            Some(other) => {
                return Err(CliError::Precondition(format!(
                    "[retention] keep needs {table}.{CREATED_AT} to be a timestamp but it is {other}: change its type to timestamptz or set [retention] keep = \"\""
                )))
            }
        }
        if !may_delete {
            return Err(CliError::Precondition(format!(
                "[retention] keep deletes old rows of {table} but role {role} may not: GRANT DELETE ON {q} TO {role}, or set [retention] keep = \"\"",
                q = quote_table(&table)
            )));
        }
    }
    Ok(())
}

/// [`preflight`] for `check`: one line, `ok` or `FAIL` with the fix (none when
/// retention is off).
pub async fn check(cfg: &Config, client: &Client) -> Result<(), CliError> {
    if cfg.retention_keep().is_none() {
        return Ok(());
    }
    let result = preflight(cfg, client).await;
    match &result {
        Ok(()) => println!(
            "ok    retention: every outbox table has {CREATED_AT} and the role may delete from it"
        ),
        Err(e) => println!("FAIL  retention: {e}"),
    }
    result
}

/// Starts the retention task (none without `keep`). It stops when `stop` turns true.
pub fn spawn(cfg: &Config, stop: Shutdown) -> Option<JoinHandle<()>> {
    let keep = cfg.retention_keep()?;
    let conn = match cfg.pg_options() {
        Ok(c) => c,
        Err(e) => {
            // Cannot happen after the preflight, which parsed the same URL.
            warn!(error = %e, "retention disabled");
            return None;
        }
    };
    let task = Retention {
        conn,
        slot: cfg.postgres.slot.clone(),
        publication: cfg.postgres.publication.clone(),
        tables: cfg.tables(),
        keep,
        tick: tick_for(keep),
        markers: VecDeque::new(),
    };
    for t in &task.tables {
        metrics::counter!(DELETED_ROWS, "table" => t.qualified()).increment(0);
    }
    let span = tracing::info_span!("retention", keep = %humantime::format_duration(keep));
    let tick = task.tick;
    Some(tokio::spawn(every_tick(task, tick, stop).instrument(span)))
}

/// `keep` as a reload set it (crate::reload), in milliseconds; 0: as configured at
/// start. The task's tick stays the one of its start.
static RELOADED_KEEP_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the `keep` the running retention task deletes by (a reload).
pub fn set_keep(keep: Duration) {
    RELOADED_KEEP_MS.store(
        keep.as_millis().clamp(1, u64::MAX as u128) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

fn live_keep(configured: Duration) -> Duration {
    match RELOADED_KEEP_MS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => configured,
        ms => Duration::from_millis(ms),
    }
}

/// How often markers are taken and old rows deleted.
fn tick_for(keep: Duration) -> Duration {
    (keep / 10).clamp(TICK_MIN, TICK_MAX)
}

/// A point that ties transaction ids to the WAL: every transaction id below `xmin`
/// committed (or aborted) before WAL position `lsn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Marker {
    xmin: u64,
    lsn: Lsn,
}

struct Retention {
    conn: PgConnectOptions,
    slot: String,
    publication: String,
    tables: Vec<TableName>,
    keep: Duration,
    tick: Duration,
    /// Markers taken and not yet passed by the slot, oldest first.
    markers: VecDeque<Marker>,
}

impl Task for Retention {
    async fn connect(&mut self) -> Result<Client, String> {
        Retention::connect(self).await
    }

    fn connect_failed(&mut self, error: &str, failures: u32) -> Option<Duration> {
        let backoff = publisher::backoff::delay(self.tick, BACKOFF_MAX, failures);
        warn!(error = %error, retry_in = ?backoff, "retention pass failed");
        Some(backoff)
    }

    /// A marker and a deletion pass.
    async fn step(&mut self, client: &Client, stop: &Shutdown) -> Then {
        if stop.is_requested() {
            return Then::Stop;
        }
        let mut markers = std::mem::take(&mut self.markers);
        let passed = self.pass(client, stop, &mut markers).await;
        self.markers = markers;
        match passed {
            Ok(true) => Then::Tick,
            Ok(false) => Then::Stop,
            Err(e) if client.is_closed() => {
                warn!(error = %e, "retention pass failed; reconnecting");
                Then::Reconnect
            }
            // A statement failed (lock timeout, ...): try again next tick.
            Err(e) => {
                warn!(error = %e, "retention pass failed; retrying next tick");
                Then::Tick
            }
        }
    }
}

impl Retention {
    async fn connect(&self) -> Result<Client, String> {
        let client = crate::sql::connect(&self.conn)
            .await
            .map_err(|e| e.to_string())?;
        client
            .batch_execute(&format!("SET lock_timeout = '{LOCK_TIMEOUT}'"))
            .await
            .map_err(|e| e.to_string())?;
        Ok(client)
    }

    /// Takes a marker, then deletes with the newest marker the slot has passed.
    /// Returns false when a stop was requested in the middle.
    async fn pass(
        &self,
        client: &Client,
        stop: &Shutdown,
        markers: &mut VecDeque<Marker>,
    ) -> Result<bool, AdminError> {
        let confirmed = admin::slot_confirmed_flush(client, &self.slot).await?;
        let marker = take_marker(client).await?;
        push_marker(markers, marker);
        debug!(
            confirmed = %confirmed.map_or_else(|| "none".to_string(), |l| l.to_string()),
            marker_xmin = marker.xmin,
            marker_lsn = %marker.lsn,
            pending = markers.len(),
            "retention tick"
        );
        let Some(confirmed) = confirmed else {
            debug!(slot = %self.slot, "slot not found; nothing deleted");
            return Ok(true);
        };
        let Some(usable) = pop_usable(markers, confirmed) else {
            debug!(%confirmed, "the slot has not passed a marker yet; nothing deleted");
            return Ok(true);
        };
        for table in &self.tables {
            let mut total = 0u64;
            let filter = row_filter(client, &self.publication, table).await?;
            loop {
                if stop.is_requested() {
                    return Ok(false);
                }
                let n = delete_batch(
                    client,
                    table,
                    filter.as_deref(),
                    live_keep(self.keep),
                    usable.xmin,
                )
                .await?;
                total += n;
                metrics::counter!(DELETED_ROWS, "table" => table.qualified()).increment(n);
                if n < BATCH as u64 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            if total > 0 {
                info!(table = %table, rows = total, below_xid = usable.xmin, marker_lsn = %usable.lsn,
                    "retention deleted confirmed outbox rows");
            }
        }
        Ok(true)
    }
}

async fn take_marker(client: &Client) -> Result<Marker, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::text::bigint, \
                    pg_catalog.pg_current_wal_insert_lsn()::text",
            &[],
        )
        .await?;
    let xmin: i64 = row.get(0);
    let lsn: String = row.get(1);
    Ok(Marker {
        xmin: xmin as u64,
        lsn: lsn.parse().unwrap_or(Lsn(u64::MAX)),
    })
}

/// Queues a marker; when the queue is full the newest one is replaced, so the older
/// ones (which the slot passes first) stay.
fn push_marker(markers: &mut VecDeque<Marker>, marker: Marker) {
    if markers.len() >= MAX_MARKERS {
        markers.pop_back();
    }
    markers.push_back(marker);
}

/// The newest marker at or below `confirmed`, removing it and every older one.
fn pop_usable(markers: &mut VecDeque<Marker>, confirmed: Lsn) -> Option<Marker> {
    let mut usable = None;
    while let Some(m) = markers.front() {
        if m.lsn > confirmed {
            break;
        }
        usable = markers.pop_front();
    }
    usable
}

/// Which of `table`'s rows the publication publishes, as an SQL condition: `None`
/// for all of them, the row filter (Postgres 15+), or `false` when the table is not
/// in the publication (any more).
async fn row_filter(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<Option<String>, tokio_postgres::Error> {
    let filters = if client
        .query_one(
            "SELECT pg_catalog.current_setting('server_version_num'::text)::int >= 150000",
            &[],
        )
        .await?
        .get::<_, bool>(0)
    {
        "rowfilter"
    } else {
        "NULL::text"
    };
    let sql = format!(
        "SELECT {filters} FROM pg_publication_tables \
          WHERE pubname = $1 AND schemaname = $2 AND tablename = $3"
    );
    let row = client
        .query_opt(&sql, &[&publication, &table.schema, &table.name])
        .await?;
    Ok(match row {
        None => Some("false".to_string()),
        Some(r) => r.get::<_, Option<String>>(0),
    })
}

/// Deletes up to [`BATCH`] rows older than `keep` whose `xmin` precedes `xmin8`
/// (modulo 2³², see the module docs) and for which `filter` holds, naming each by
/// `(tableoid, ctid)` (unique across partitions), from the table itself only unless
/// it is partitioned (see "Only rows that are published"). Returns the number
/// deleted.
async fn delete_batch(
    client: &Client,
    table: &TableName,
    filter: Option<&str>,
    keep: Duration,
    xmin8: u64,
) -> Result<u64, tokio_postgres::Error> {
    let t = quote_table(table);
    let partitioned: bool = client
        .query_one(
            "SELECT c.relkind = 'p' FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2",
            &[&table.schema, &table.name],
        )
        .await?
        .get(0);
    let only = if partitioned { "" } else { "ONLY " };
    let published = filter.map_or_else(String::new, |f| format!("AND ({f}) IS TRUE"));
    let sql = format!(
        "DELETE FROM {only}{t} WHERE (tableoid, ctid) IN (\
            SELECT tableoid, ctid FROM {only}{t} \
             WHERE {CREATED_AT} < pg_catalog.now() - $1::float8 * interval '1 second' \
               AND (($2::bigint - xmin::text::bigint) % 4294967296 + 4294967296) % 4294967296 \
                   BETWEEN 1 AND 2147483647 \
               {published} \
             LIMIT $3)"
    );
    let sx32 = (xmin8 % (1 << 32)) as i64;
    client
        .execute(&sql, &[&keep.as_secs_f64(), &sx32, &BATCH])
        .await
}

#[cfg(test)]
mod tests;
