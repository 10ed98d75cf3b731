//! `replay --from-table [--since] [--until]`: re-publish the rows still in the
//! outbox tables (docs/design.md §7).
//!
//! Rows still in each outbox table, in `(created_at, id)` order, read in batches by
//! keyset pagination (never the whole table), turned into the same events the WAL
//! would give (text form of every mapped column), one commit marker per batch. The
//! publisher's watermark then counts confirmed rows. Rows have no commit LSN: their
//! `commit_lsn` header is `0/0`, `xid` 0 and the timestamp is `created_at`.
//!
//! Rows whose `created_at` is NULL have no place in that order (a keyset
//! comparison `(NULL, id) > (t, i)` is never true) and no time for
//! `--since`/`--until`: every query leaves them out, and the replay says how many
//! it skipped, whatever the window (a NULL row may belong to any).

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use outbox_event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use tracing::warn;
use wal_reader::admin::{self, ident};
use wal_reader::pgtype;

use super::progress::{self, Unit};
use super::{check_report, connect_publisher, drop_stale, Plan};
use crate::cli::{FilterField, Selection};
use crate::config::Config;
use crate::error::CliError;

/// Rows read per query (and confirmed as one batch).
pub const TABLE_BATCH: i64 = 1000;
/// Column `--from-table` orders and filters by, with the id column.
pub const CREATED_AT: &str = "created_at";

/// The `--where` values of the columns filtered in SQL, in the order of the
/// queries' parameters (`NULL`: any).
const SQL_FILTERS: [FilterField; 4] = [
    FilterField::AggregateType,
    FilterField::AggregateId,
    FilterField::EventType,
    FilterField::MessageId,
];

fn sql_filter_values(selection: &Selection) -> Vec<Option<Vec<String>>> {
    SQL_FILTERS
        .iter()
        .map(|f| {
            let v = selection.values(*f);
            (!v.is_empty()).then(|| v.iter().map(|s| s.to_string()).collect())
        })
        .collect()
}

/// Whether `--where table=…` selects this table (`schema.table`, or `table` for
/// schema public).
fn table_selected(selection: &Selection, qualified: &str) -> bool {
    let wanted = selection.values(FilterField::Table);
    wanted.is_empty()
        || wanted
            .iter()
            .any(|w| wal_reader::TableName::parse(w).is_some_and(|t| t.qualified() == qualified))
}

/// Replays the rows whose `created_at` is in `[since, until)` and that the plan
/// selects.
pub(super) async fn replay(
    cfg: &Config,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    plan: &Plan,
) -> Result<(), CliError> {
    if let Some(why) = messages_have_no_table(cfg) {
        if cfg.tables().is_empty() {
            return Err(CliError::Usage(why));
        }
        eprintln!("note: {why}");
    }
    let client = crate::sql::connect_for_command(cfg).await?;
    if !plan.dry_run {
        drop_stale(&client, &cfg.postgres.slot).await?;
    }
    let plans = table_plans(cfg, &client, plan).await?;
    let params = Params {
        since: since.map(|t| humantime::format_rfc3339_micros(t).to_string()),
        until: until.map(|t| humantime::format_rfc3339_micros(t).to_string()),
        filters: sql_filter_values(&plan.selection),
    };
    let (total, skipped) = count_rows(&client, &plans, &params).await?;
    let tables = plans
        .iter()
        .map(|p| p.table.qualified_name.clone())
        .collect::<Vec<_>>()
        .join(", ");
    if plan.dry_run {
        println!(
            "dry run: {total} row{} from {tables}{} would be replayed to {}; nothing was published",
            if total == 1 { "" } else { "s" },
            plan.matching(),
            plan.destination(cfg)
        );
        return Ok(());
    }
    let publisher = connect_publisher(cfg, plan).await?;
    let (pub_tx, pub_rx) = mpsc::channel::<WalBatch>(4);
    let (wm_tx, wm_rx) = watch::channel(Lsn::ZERO);
    let pub_task: JoinHandle<_> = tokio::spawn(publisher.run(pub_rx, wm_tx, None));
    let progress = progress::spawn(wm_rx, total, Unit::Rows, None, plan.format, |l| l.0);
    let (sent, failed) = send_rows(&client, &plans, &params, pub_tx).await;
    let report = check_report(pub_task.await, &plan.destination(cfg));
    progress.finish().await;
    if let Some(e) = failed {
        return Err(e);
    }
    let report = report?;
    if report.watermark < Lsn(sent) {
        return Err(CliError::Runtime(format!(
            "only {} of {sent} rows were confirmed by the broker: check RabbitMQ and run the same replay again",
            report.watermark.0
        )));
    }
    for (table, n) in &skipped {
        let one = if plans.len() > 1 {
            format!(" in {table}")
        } else {
            String::new()
        };
        println!(
            "skipped {n} rows with NULL {CREATED_AT}{one} (they cannot be ordered; re-publish them by id)"
        );
    }
    println!(
        "replayed {sent} row{} from {tables}{} to {} with header replay = true",
        if sent == 1 { "" } else { "s" },
        plan.matching(),
        plan.destination(cfg)
    );
    Ok(())
}

/// With `[postgres] messages` set: why `--from-table` cannot replay logical
/// messages, and what can (docs/messages.md).
fn messages_have_no_table(cfg: &Config) -> Option<String> {
    let prefixes = &cfg.postgres.messages;
    (!prefixes.is_empty()).then(|| {
        format!(
            "logical messages (prefixes {}) have no table to replay from: `replay --from-table` replays only the outbox tables; replay messages with `replay --from-lsn`, within the slot's replay window ([relay] replay_window)",
            prefixes.join(", ")
        )
    })
}

/// The queries' parameters: the time window (text timestamps or NULL) and the
/// `--where` values filtered in SQL ([`SQL_FILTERS`]).
struct Params {
    since: Option<String>,
    until: Option<String>,
    filters: Vec<Option<Vec<String>>>,
}

/// One [`TablePlan`] per configured table that `--where table=…` selects, its
/// columns checked.
async fn table_plans(
    cfg: &Config,
    client: &Client,
    plan: &Plan,
) -> Result<Vec<TablePlan>, CliError> {
    let mapping = cfg.mapping();
    let mut plans = Vec::new();
    for table in cfg.tables() {
        if !table_selected(&plan.selection, &table.qualified()) {
            continue;
        }
        let cols = admin::check_columns(client, &table, &mapping).await?;
        plans.push(TablePlan::new(client, cols).await?);
    }
    if plans.is_empty() {
        let configured: Vec<String> = cfg.tables().iter().map(|t| t.qualified()).collect();
        return Err(CliError::Usage(format!(
            "--where table=… names none of the configured outbox tables ({}): use one of them",
            configured.join(", ")
        )));
    }
    Ok(plans)
}

/// The rows to replay over all tables, and per table the rows skipped for a NULL
/// `created_at` (each warned about).
async fn count_rows(
    client: &Client,
    plans: &[TablePlan],
    params: &Params,
) -> Result<(u64, Vec<(String, u64)>), CliError> {
    let f = &params.filters;
    let mut total = 0u64;
    let mut skipped = Vec::new();
    for p in plans {
        let n: i64 = client
            .query_one(
                &p.count_sql,
                &[&params.since, &params.until, &f[0], &f[1], &f[2], &f[3]],
            )
            .await?
            .get(0);
        total += n as u64;
        let nulls: i64 = client.query_one(&p.null_count_sql, &[]).await?.get(0);
        if nulls > 0 {
            warn!(table = %p.table.qualified_name, rows = nulls,
                "rows with NULL {CREATED_AT} cannot be ordered and are not replayed");
            skipped.push((p.table.qualified_name.clone(), nulls as u64));
        }
    }
    Ok((total, skipped))
}

/// Reads every table page by page and hands each page to the publisher as one
/// batch whose commit marker carries the rows sent so far (the watermark counts
/// rows). Returns the rows sent and the query failure that ended it early, if any.
async fn send_rows(
    client: &Client,
    plans: &[TablePlan],
    params: &Params,
    pub_tx: mpsc::Sender<WalBatch>,
) -> (u64, Option<CliError>) {
    let f = &params.filters;
    let mut sent = 0u64;
    for p in plans {
        let mut after: Option<(String, String)> = None;
        loop {
            let (ac, ai) = match &after {
                Some((c, i)) => (Some(c.clone()), Some(i.clone())),
                None => (None, None),
            };
            let query: [&(dyn ToSql + Sync); 9] = [
                &params.since,
                &params.until,
                &ac,
                &ai,
                &TABLE_BATCH,
                &f[0],
                &f[1],
                &f[2],
                &f[3],
            ];
            let rows = match client.query(&p.page_sql, &query).await {
                Ok(r) => r,
                Err(e) => return (sent, Some(CliError::from(e))),
            };
            if rows.is_empty() {
                break;
            }
            let batch = page_batch(p, &rows, sent);
            let last = &rows[rows.len() - 1];
            after = Some((last.get(7), last.get(8)));
            sent += rows.len() as u64;
            if pub_tx.send(batch).await.is_err() {
                return (sent, None);
            }
            if (rows.len() as i64) < TABLE_BATCH {
                break;
            }
        }
    }
    (sent, None)
}

/// One page of rows as events, then a commit marker at `sent` plus the page's rows.
fn page_batch(p: &TablePlan, rows: &[tokio_postgres::Row], sent: u64) -> WalBatch {
    let mut batch = Vec::with_capacity(rows.len() + 1);
    let mut last_micros = 0;
    for r in rows {
        let text = |i: usize| r.get::<_, Option<String>>(i).map(Bytes::from);
        // Never NULL: the page query leaves NULL created_at out.
        last_micros = r.get::<_, Option<i64>>(9).unwrap_or(0);
        let payload = text(4);
        batch.push(WalItem::Event(OutboxEvent {
            table: p.table.clone(),
            xid: 0,
            commit_lsn: Lsn::ZERO,
            commit_time_micros: last_micros,
            // Rows have no transaction here: a running number keeps
            // (commit_lsn, tx_index) unique, which returns are matched by.
            index: sent + batch.len() as u64,
            id: text(0),
            aggregate_type: text(1),
            aggregate_id: text(2),
            event_type: text(3),
            body: pgtype::body(p.table.payload_type, payload.as_ref()),
            payload,
            headers: text(5),
            correlation_id: text(6),
            exchange: text(10),
            properties: Vec::new(),
            malformed: None,
        }));
    }
    let end = Lsn(sent + rows.len() as u64);
    batch.push(WalItem::Commit(CommitMarker {
        xid: 0,
        commit_lsn: end,
        end_lsn: end,
        commit_time_micros: last_micros,
        events: rows.len() as u64,
    }));
    batch
}

/// The queries and event metadata for one outbox table.
struct TablePlan {
    table: Arc<OutboxTable>,
    /// Params: since, until, then the `--where` values (text arrays or NULL) of
    /// aggregate type, aggregate id, event type, message id.
    count_sql: String,
    /// Rows with a NULL created_at, which no page returns (no params).
    null_count_sql: String,
    /// Params: since, until (text timestamps or NULL), last created_at and id (text
    /// or NULL for the first page), limit, then the `--where` values as above.
    page_sql: String,
}

impl TablePlan {
    async fn new(c: &Client, cols: admin::TableColumns) -> Result<TablePlan, CliError> {
        let created = c
            .query_opt(
                "SELECT pg_catalog.format_type(atttypid, atttypmod) FROM pg_catalog.pg_attribute \
                  WHERE attrelid = $1 AND attname = $2 AND NOT attisdropped",
                &[&cols.table_oid, &CREATED_AT],
            )
            .await?;
        if created.is_none() {
            return Err(CliError::Precondition(format!(
                "table {} has no {CREATED_AT} column, which `replay --from-table` orders by: add one (timestamptz NOT NULL DEFAULT now())",
                cols.table
            )));
        }
        let id_type: String = c
            .query_one(
                "SELECT pg_catalog.format_type($1::oid, NULL::integer)",
                &[&cols.id.type_oid],
            )
            .await?
            .get(0);
        let q = |name: &str| ident::quote_ident(name);
        let text_col = |c: Option<&admin::ColumnInfo>| match c {
            Some(c) => format!("{}::text", q(&c.name)),
            None => "NULL::text".into(),
        };
        let id = q(&cols.id.name);
        let ca = q(CREATED_AT);
        let table = ident::quote_table(&cols.table);
        let filter = format!(
            "{ca} IS NOT NULL AND ($1::text IS NULL OR {ca} >= $1::text::timestamptz) AND ($2::text IS NULL OR {ca} < $2::text::timestamptz)"
        );
        // `--where`: each column against its values, from parameter `first` on.
        let selected = |first: usize| {
            [
                &cols.aggregate_type.name,
                &cols.aggregate_id.name,
                &cols.event_type.name,
                &cols.id.name,
            ]
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let n = first + i;
                format!(
                    " AND (${n}::text[] IS NULL OR {}::text = ANY(${n}::text[]))",
                    q(c)
                )
            })
            .collect::<String>()
        };
        let count_sql = format!(
            "SELECT pg_catalog.count(*) FROM {table} WHERE {filter}{}",
            selected(3)
        );
        let filter = format!("{filter}{}", selected(6));
        let page_sql = format!(
            "SELECT {id}::text, {}, {}, {}, {}, {}, {}, {ca}::text, {id}::text, \
                    (extract(epoch FROM {ca}) * 1000000)::int8, {} \
               FROM {table} \
              WHERE {filter} \
                AND ($3::text IS NULL OR ({ca}, {id}) > ($3::text::timestamptz, $4::text::{id_type})) \
              ORDER BY {ca}, {id} LIMIT $5",
            text_col(Some(&cols.aggregate_type)),
            text_col(Some(&cols.aggregate_id)),
            text_col(Some(&cols.event_type)),
            text_col(Some(&cols.payload)),
            text_col(cols.headers.as_ref()),
            text_col(cols.correlation_id.as_ref()),
            text_col(cols.exchange.as_ref()),
        );
        let null_count_sql = format!("SELECT pg_catalog.count(*) FROM {table} WHERE {ca} IS NULL");
        let t = &cols.table;
        Ok(TablePlan {
            table: Arc::new(pgtype::outbox_table(
                t,
                cols.payload.type_oid,
                cols.headers.as_ref().map(|h| h.type_oid),
            )),
            count_sql,
            null_count_sql,
            page_sql,
        })
    }
}
