//! `replay --from-lsn X [--to-lsn Y]` and `replay --from-table [--since] [--until]`
//! (docs/design.md §7): re-publish past events with the header `replay = true` and their
//! original `message_id`, with publisher confirms, while a live relay keeps running.
//!
//! # From the WAL
//!
//! ```text
//!   drop stale <slot>_replay_* slots (left by a killed replay)
//!   pg_copy_logical_replication_slot(<slot>_anchor → <slot>_replay_<pid>)
//!   pg_replication_slot_advance(copy, X)            confirmed_flush = X
//!   WalReader(copy) ──► keep commits in [X, stop) ──► Publisher (replay = true)
//!        ▲ stop at the first item past the range       │ watermark (progress)
//!        └──────────────── acked ◄──────────────────────┘
//!   drop the copy (also on failure)
//! ```
//!
//! Postgres skips transactions whose commit record is before a slot's confirmed
//! position, so advancing the copy to X makes it deliver exactly the transactions
//! committed at or after X. The range ends after `--to-lsn` (inclusive: a commit at
//! Y is replayed) or, by default, at the live slot's `confirmed_flush_lsn` (what the
//! live relay has delivered). The window is `[anchor's confirmed_flush_lsn, live
//! slot's confirmed_flush_lsn]`; a start outside it exits 2.
//!
//! # From the table
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
//!
//! # Restart safety
//!
//! A replay stopped by SIGINT/SIGTERM drops its slot before exiting. Every replay
//! first drops inactive `<slot>_replay_*` slots, so a replay killed halfway
//! (SIGKILL, crash) leaves nothing behind after the next one; a replay can simply be
//! run again (consumers deduplicate on `message_id`).

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
use publisher::{Publisher, PublisherConfig, PublisherReport};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use tracing::{info, warn};
use wal_reader::admin::{self, ident};
use wal_reader::{pgtype, ReaderError, WalReader};

use super::{admin_error, publisher_config, reader_config, sql_client};
use crate::anchor::anchor_slot_name;
use crate::cli::{ReplayArgs, ReplaySource};
use crate::config::Config;
use crate::error::CliError;

/// Rows read per query (and confirmed as one batch) by `--from-table`.
pub const TABLE_BATCH: i64 = 1000;
/// Column `--from-table` orders and filters by, with the id column.
pub const CREATED_AT: &str = "created_at";
/// Interval of the plain progress lines (no terminal).
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Runs the replay the arguments ask for.
pub async fn replay(cfg: &Config, args: &ReplayArgs) -> Result<(), CliError> {
    match args.source()? {
        ReplaySource::Wal { from, to } => from_wal(cfg, from, to).await,
        ReplaySource::Table { since, until } => from_table(cfg, since, until).await,
    }
}

/// The prefix of the temporary replay slots of `slot`.
pub fn replay_slot_prefix(slot: &str) -> String {
    format!("{slot}_replay_")
}

/// Every replay slot of `slot` (`<slot>_replay_<pid>`) with whether it is active.
pub async fn replay_slots(c: &Client, slot: &str) -> Result<Vec<(String, bool)>, CliError> {
    let prefix = replay_slot_prefix(slot);
    let rows = c
        .query(
            "SELECT slot_name::text, active FROM pg_replication_slots \
              WHERE left(slot_name::text, length($1)) = $1",
            &[&prefix],
        )
        .await
        .map_err(super::sql_error)?;
    let mut out = Vec::new();
    for r in rows {
        let name: String = r.get(0);
        let active: bool = r.get(1);
        if name[prefix.len()..].chars().all(|c| c.is_ascii_digit()) {
            out.push((name, active));
        }
    }
    Ok(out)
}

/// Drops the replay slots nobody streams from (left by a killed replay).
async fn drop_stale(c: &Client, slot: &str) -> Result<(), CliError> {
    for (name, active) in replay_slots(c, slot).await? {
        if active {
            info!(slot = %name, "another replay is running on its own slot; leaving it");
            continue;
        }
        match admin::drop_slot(c, &name, true, false).await {
            Ok(true) => {
                info!(slot = %name, "dropped a replay slot left behind by an earlier replay")
            }
            Ok(false) => {}
            Err(e) => warn!(slot = %name, error = %e, "cannot drop a stale replay slot"),
        }
    }
    Ok(())
}

/// The replay connection's publisher: the relay's, plus `replay = true`.
fn replay_publisher_config(cfg: &Config) -> PublisherConfig {
    let mut p = publisher_config(cfg);
    p.extra_headers = vec![("replay".into(), "true".into())];
    p.connection_name = format!("outbox-relay replay {}", cfg.postgres.slot);
    p
}

async fn connect_publisher(cfg: &Config) -> Result<Publisher, CliError> {
    Publisher::connect(replay_publisher_config(cfg))
        .await
        .map_err(|e| {
            if e.is_transient() {
                CliError::Runtime(e.to_string())
            } else {
                CliError::Precondition(e.to_string())
            }
        })
}

fn reader_error(e: ReaderError) -> CliError {
    if e.is_precondition() {
        CliError::Precondition(e.to_string())
    } else {
        CliError::Runtime(e.to_string())
    }
}

/// Checks what the publisher reports at the end.
fn check_report(
    res: Result<Result<PublisherReport, publisher::PublishError>, tokio::task::JoinError>,
) -> Result<PublisherReport, CliError> {
    let report = res
        .map_err(|e| CliError::Runtime(format!("the publisher task failed: {e}")))?
        .map_err(|e| CliError::Runtime(format!("{e}: fix it and run the same replay again")))?;
    if report.abandoned > 0 {
        return Err(CliError::Runtime(format!(
            "{} replayed messages were not confirmed by the broker in time: check RabbitMQ and run the same replay again",
            report.abandoned
        )));
    }
    Ok(report)
}

// ---------------------------------------------------------------------------------
// --from-lsn
// ---------------------------------------------------------------------------------

async fn from_wal(cfg: &Config, from: Lsn, to: Option<Lsn>) -> Result<(), CliError> {
    let client = sql_client(cfg).await?;
    let slot = &cfg.postgres.slot;
    drop_stale(&client, slot).await?;
    let anchor_name = anchor_slot_name(slot);
    let anchor = admin::slot_state(&client, &anchor_name)
        .await
        .map_err(admin_error)?
        .ok_or_else(|| {
            CliError::Precondition(format!(
                "no replay window is kept (slot {anchor_name} does not exist): set [relay] replay_window and run `outbox-relay slot create --if-not-exists` to keep one from now on; re-publish older events with `outbox-relay replay --from-table`"
            ))
        })?;
    if anchor.wal_status.as_deref() == Some("lost") {
        return Err(CliError::Precondition(format!(
            "the replay window's anchor slot {anchor_name} was invalidated and its WAL is gone: re-publish with `outbox-relay replay --from-table`, then drop the anchor (the relay recreates it) and raise max_slot_wal_keep_size"
        )));
    }
    let live = admin::require_slot(&client, slot)
        .await
        .map_err(admin_error)?;
    let start = anchor.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    let end = live.confirmed_flush_lsn.unwrap_or(live.current_wal_lsn);
    if from < start || from > end {
        return Err(outside_window(from, start, end, &anchor_name));
    }
    // Commits in [from, stop) are replayed.
    let stop = match to {
        Some(y) => Lsn(y.0.saturating_add(1)).min(live.current_wal_lsn),
        None => end,
    };
    if from >= stop {
        println!("nothing to replay: no transaction can have committed in {from} .. {end}");
        return Ok(());
    }

    let tmp = format!("{}{}", replay_slot_prefix(slot), std::process::id());
    ident::validate_slot_name(&tmp).map_err(|e| {
        CliError::Precondition(format!(
            "the replay slot name {tmp:?} is not valid ({e}): choose a shorter `postgres.slot`"
        ))
    })?;
    client
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&anchor_name, &tmp],
        )
        .await
        .map_err(|e| {
            CliError::Runtime(format!(
                "cannot copy the anchor slot {anchor_name} to {tmp}: {e}; check max_replication_slots"
            ))
        })?;
    info!(slot = %tmp, from = %from, stop = %stop, "replaying from a copy of the anchor slot");
    let result = tokio::select! {
        r = replay_copy(cfg, &client, &tmp, &anchor_name, from, stop, end) => r,
        signal = interrupted() => Err(CliError::Runtime(format!(
            "{signal}: the replay stopped before the end of its range; run it again (consumers deduplicate on message_id)"
        ))),
    };
    // Drop the copy whatever happened (its walsender may take a moment to exit).
    if let Err(e) = admin::drop_slot(&client, &tmp, true, true).await {
        warn!(slot = %tmp, error = %e, "cannot drop the replay slot; the next replay drops it");
    }
    let (events, report) = result?;
    println!(
        "replayed {events} events committed from {from} to before {stop} with header replay = true ({} confirmed by the broker)",
        report.acked
    );
    Ok(())
}

/// Resolves on SIGINT or SIGTERM (never, if the handlers cannot be installed), so
/// that an interrupted replay still drops its slot.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "interrupted (SIGINT)",
            _ = term.recv() => "terminated (SIGTERM)",
        },
        _ => std::future::pending().await,
    }
}

fn outside_window(from: Lsn, start: Lsn, end: Lsn, anchor: &str) -> CliError {
    CliError::Precondition(format!(
        "--from-lsn {from} is outside the replay window {start} .. {end} (kept by slot {anchor}): give a position inside it, or re-publish older events with `outbox-relay replay --from-table`"
    ))
}

/// Streams the copied slot from `from` and publishes every commit before `stop`.
async fn replay_copy(
    cfg: &Config,
    client: &Client,
    tmp: &str,
    anchor_name: &str,
    from: Lsn,
    stop: Lsn,
    end: Lsn,
) -> Result<(u64, PublisherReport), CliError> {
    let copy = admin::require_slot(client, tmp)
        .await
        .map_err(admin_error)?;
    let copied_at = copy.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    if copied_at > from {
        // The anchor moved on since we looked.
        return Err(outside_window(from, copied_at, end, anchor_name));
    }
    if from > copied_at {
        client
            .execute(
                "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
                &[&tmp, &from.to_string()],
            )
            .await
            .map_err(|e| CliError::Runtime(format!("cannot advance {tmp} to {from}: {e}")))?;
    }
    let mut rcfg = reader_config(cfg, None)?;
    rcfg.slot = tmp.to_string();
    let reader = WalReader::start(rcfg).await.map_err(reader_error)?;
    let publisher = connect_publisher(cfg).await?;

    let (wal_tx, mut wal_rx) = mpsc::channel::<WalBatch>(64);
    let (pub_tx, pub_rx) = mpsc::channel::<WalBatch>(64);
    let (wm_tx, wm_rx) = watch::channel(from);
    let (stop_tx, stop_rx) = watch::channel(false);
    let reader_task = tokio::spawn(reader.run(wal_tx, wm_rx.clone(), stop_rx));
    let pub_task = tokio::spawn(publisher.run(pub_rx, wm_tx));
    let total = stop.0.saturating_sub(from.0);
    let progress = spawn_progress(wm_rx, total, "WAL bytes", move |l| {
        l.0.saturating_sub(from.0)
    });

    let mut pub_tx = Some(pub_tx);
    let mut events = 0u64;
    let mut passed = false;
    while let Some(batch) = wal_rx.recv().await {
        let Some(tx) = &pub_tx else { continue };
        let mut out = Vec::with_capacity(batch.len());
        for item in batch {
            let keep = match &item {
                WalItem::Event(e) => e.commit_lsn < stop && e.commit_lsn >= from,
                WalItem::Commit(c) => c.commit_lsn < stop,
                WalItem::Keepalive(l) => *l < stop,
            };
            let past = match &item {
                WalItem::Event(e) => e.commit_lsn >= stop,
                WalItem::Commit(c) => c.commit_lsn >= stop,
                // Every record ending at or before `l` has been decoded.
                WalItem::Keepalive(l) => *l >= stop,
            };
            if past {
                passed = true;
                break;
            }
            if keep {
                if matches!(item, WalItem::Event(_)) {
                    events += 1;
                }
                out.push(item);
            }
        }
        if !out.is_empty() && tx.send(out).await.is_err() {
            // The publisher ended early: its result says why.
            pub_tx = None;
            let _ = stop_tx.send(true);
        }
        if passed {
            pub_tx = None;
            let _ = stop_tx.send(true);
        }
    }
    drop(pub_tx);
    let report = check_report(pub_task.await);
    let reader_result = reader_task.await;
    progress.finish();
    let report = report?;
    match reader_result {
        Ok(Ok(_)) if passed => {}
        Ok(Ok(_)) => return Err(CliError::Runtime(
            "the replication stream ended before the end of the range: run the same replay again"
                .into(),
        )),
        Ok(Err(e)) if !passed => return Err(reader_error(e)),
        Ok(Err(e)) => warn!(error = %e, "replay stream ended with an error after the range"),
        Err(e) => return Err(CliError::Runtime(format!("the reader task failed: {e}"))),
    }
    Ok((events, report))
}

// ---------------------------------------------------------------------------------
// --from-table
// ---------------------------------------------------------------------------------

async fn from_table(
    cfg: &Config,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
) -> Result<(), CliError> {
    let client = sql_client(cfg).await?;
    drop_stale(&client, &cfg.postgres.slot).await?;
    let mapping = cfg.mapping();
    let mut plans = Vec::new();
    for table in cfg.tables() {
        let cols = admin::check_columns(&client, &table, &mapping)
            .await
            .map_err(admin_error)?;
        plans.push(TablePlan::new(&client, cols).await?);
    }
    let since = since.map(|t| humantime::format_rfc3339_micros(t).to_string());
    let until = until.map(|t| humantime::format_rfc3339_micros(t).to_string());
    let mut total = 0u64;
    let mut skipped = Vec::new();
    for p in &plans {
        let n: i64 = client
            .query_one(&p.count_sql, &[&since, &until])
            .await
            .map_err(super::sql_error)?
            .get(0);
        total += n as u64;
        let nulls: i64 = client
            .query_one(&p.null_count_sql, &[])
            .await
            .map_err(super::sql_error)?
            .get(0);
        if nulls > 0 {
            warn!(table = %p.table.qualified_name, rows = nulls,
                "rows with NULL {CREATED_AT} cannot be ordered and are not replayed");
            skipped.push((p.table.qualified_name.clone(), nulls as u64));
        }
    }
    let publisher = connect_publisher(cfg).await?;
    let (pub_tx, pub_rx) = mpsc::channel::<WalBatch>(4);
    let (wm_tx, wm_rx) = watch::channel(Lsn::ZERO);
    let pub_task: JoinHandle<_> = tokio::spawn(publisher.run(pub_rx, wm_tx));
    let progress = spawn_progress(wm_rx, total, "rows", |l| l.0);

    // The watermark is the number of rows sent: each batch's marker carries it.
    let mut sent = 0u64;
    let mut failed = None;
    'tables: for p in &plans {
        let mut after: Option<(String, String)> = None;
        loop {
            let (ac, ai) = match &after {
                Some((c, i)) => (Some(c.clone()), Some(i.clone())),
                None => (None, None),
            };
            let params: [&(dyn ToSql + Sync); 5] = [&since, &until, &ac, &ai, &TABLE_BATCH];
            let rows = match client.query(&p.page_sql, &params).await {
                Ok(r) => r,
                Err(e) => {
                    failed = Some(super::sql_error(e));
                    break 'tables;
                }
            };
            if rows.is_empty() {
                break;
            }
            let mut batch = Vec::with_capacity(rows.len() + 1);
            let mut last_micros = 0;
            for r in &rows {
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
                }));
            }
            let last = &rows[rows.len() - 1];
            after = Some((last.get(7), last.get(8)));
            sent += rows.len() as u64;
            batch.push(WalItem::Commit(CommitMarker {
                xid: 0,
                commit_lsn: Lsn(sent),
                end_lsn: Lsn(sent),
                commit_time_micros: last_micros,
                events: rows.len() as u64,
            }));
            if pub_tx.send(batch).await.is_err() {
                break 'tables;
            }
            if (rows.len() as i64) < TABLE_BATCH {
                break;
            }
        }
    }
    drop(pub_tx);
    let report = check_report(pub_task.await);
    progress.finish();
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
        "replayed {sent} rows from {} with header replay = true",
        plans
            .iter()
            .map(|p| p.table.qualified_name.clone())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The queries and event metadata for one outbox table.
struct TablePlan {
    table: Arc<OutboxTable>,
    count_sql: String,
    /// Rows with a NULL created_at, which no page returns (no params).
    null_count_sql: String,
    /// Params: since, until (text timestamps or NULL), last created_at and id (text
    /// or NULL for the first page), limit.
    page_sql: String,
}

impl TablePlan {
    async fn new(c: &Client, cols: admin::TableColumns) -> Result<TablePlan, CliError> {
        let created = c
            .query_opt(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                  WHERE attrelid = $1 AND attname = $2 AND NOT attisdropped",
                &[&cols.table_oid, &CREATED_AT],
            )
            .await
            .map_err(super::sql_error)?;
        if created.is_none() {
            return Err(CliError::Precondition(format!(
                "table {} has no {CREATED_AT} column, which `replay --from-table` orders by: add one (timestamptz NOT NULL DEFAULT now())",
                cols.table
            )));
        }
        let id_type: String = c
            .query_one("SELECT format_type($1, NULL)", &[&cols.id.type_oid])
            .await
            .map_err(super::sql_error)?
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
        let page_sql = format!(
            "SELECT {id}::text, {}, {}, {}, {}, {}, {}, {ca}::text, {id}::text, \
                    (extract(epoch FROM {ca}) * 1000000)::int8 \
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
        );
        let count_sql = format!("SELECT count(*) FROM {table} WHERE {filter}");
        let null_count_sql = format!("SELECT count(*) FROM {table} WHERE {ca} IS NULL");
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

// ---------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------

/// Shows progress from the publisher's watermark: a bar on a terminal, a plain line
/// every few seconds otherwise (both on stderr).
struct Progress {
    task: JoinHandle<()>,
    bar: Option<ProgressBar>,
}

impl Progress {
    fn finish(self) {
        self.task.abort();
        if let Some(bar) = self.bar {
            bar.finish();
        }
    }
}

fn spawn_progress(
    mut wm: watch::Receiver<Lsn>,
    total: u64,
    unit: &'static str,
    done: impl Fn(Lsn) -> u64 + Send + 'static,
) -> Progress {
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(&format!(
            "{{spinner}} replay [{{bar:40}}] {{pos}}/{{len}} {unit} confirmed ({{elapsed}})"
        )) {
            bar.set_style(style);
        }
        bar
    });
    let shown = bar.clone();
    let task = tokio::spawn(async move {
        let mut last_line = Instant::now();
        loop {
            let d = done(*wm.borrow_and_update()).min(total);
            match &shown {
                Some(bar) => bar.set_position(d),
                None if last_line.elapsed() >= PLAIN_PROGRESS_EVERY => {
                    eprintln!("replay: {d} of {total} {unit} confirmed");
                    last_line = Instant::now();
                }
                None => {}
            }
            tokio::select! {
                res = wm.changed() => if res.is_err() { return },
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    });
    Progress { task, bar }
}
