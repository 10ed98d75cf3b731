//! `replay --from-lsn X [--to-lsn Y]`: re-publish from a copy of the replay
//! window's anchor slot (docs/design.md §7).
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use outbox_event::{Lsn, WalBatch, WalItem};
use publisher::PublisherReport;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tracing::{info, warn};
use wal_reader::admin::{self, ident};
use wal_reader::WalReader;

use super::progress::{self, Unit};
use super::{check_report, connect_publisher, drop_stale, replay_slot_prefix, Plan};
use crate::anchor::anchor_slot_name;
use crate::cli::FilterField;
use crate::config::Config;
use crate::error::CliError;

/// Replays the commits in `[from, to]` (to the live slot's position by default) that
/// the plan selects.
pub(super) async fn replay(
    cfg: &Config,
    from: Lsn,
    to: Option<Lsn>,
    plan: &Plan,
) -> Result<(), CliError> {
    let client = crate::sql::connect_for_command(cfg).await?;
    let slot = &cfg.postgres.slot;
    drop_stale(&client, slot).await?;
    let anchor_name = anchor_slot_name(slot);
    let anchor = admin::slot_state(&client, &anchor_name)
        .await?
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
    let live = admin::require_slot(&client, slot).await?;
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
    admin::copy_slot(&client, &anchor_name, &tmp)
        .await
        .map_err(|e| {
            CliError::Runtime(format!(
                "cannot copy the anchor slot {anchor_name} to {tmp}: {e}; check max_replication_slots"
            ))
        })?;
    info!(slot = %tmp, from = %from, stop = %stop, "replaying from a copy of the anchor slot");
    let result = tokio::select! {
        r = replay_copy(cfg, &client, &tmp, &anchor_name, (from, stop, end), plan) => r,
        signal = interrupted() => Err(CliError::Runtime(format!(
            "{signal}: the replay stopped before the end of its range; run it again (consumers deduplicate on message_id)"
        ))),
    };
    // Drop the copy whatever happened (its walsender may take a moment to exit).
    if let Err(e) = admin::drop_slot(&client, &tmp, true, true).await {
        warn!(slot = %tmp, error = %e, "cannot drop the replay slot; the next replay drops it");
    }
    let (events, report) = result?;
    match report {
        Some(report) => println!(
            "replayed {events} events committed from {from} to before {stop}{} to {} with header replay = true ({} confirmed by the broker)",
            plan.matching(),
            plan.destination(cfg),
            report.acked
        ),
        None => println!(
            "dry run: {events} event{} committed from {from} to before {stop}{} would be replayed to {}; nothing was published",
            if events == 1 { "" } else { "s" },
            plan.matching(),
            plan.destination(cfg)
        ),
    }
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

/// Whether the plan selects the event.
fn selected(plan: &Plan, e: &outbox_event::OutboxEvent) -> bool {
    let text = |b: Option<&bytes::Bytes>| b.map(|b| String::from_utf8_lossy(b).into_owned());
    plan.selection.matches(|field| match field {
        FilterField::AggregateType => text(e.aggregate_type.as_ref()),
        FilterField::AggregateId => text(e.aggregate_id.as_ref()),
        FilterField::EventType => text(e.event_type.as_ref()),
        FilterField::MessageId => text(e.id.as_ref()),
        FilterField::Table => Some(e.table.qualified_name.clone()),
    })
}

/// The items of `batch` to publish: the selected events committed in
/// `[from, stop)`, the commit markers and keepalives before `stop`; with the number
/// of events among them, and whether the batch reached `stop` (the items from there
/// on are dropped).
fn in_range(batch: WalBatch, (from, stop): (Lsn, Lsn), plan: &Plan) -> (WalBatch, u64, bool) {
    let mut out = Vec::with_capacity(batch.len());
    let mut events = 0;
    for item in batch {
        let keep = match &item {
            WalItem::Event(e) => e.commit_lsn < stop && e.commit_lsn >= from && selected(plan, e),
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
            return (out, events, true);
        }
        if keep {
            if matches!(item, WalItem::Event(_)) {
                events += 1;
            }
            out.push(item);
        }
    }
    (out, events, false)
}

/// A dry run has no publisher: the last position it passed is its watermark.
fn dry_run_progress(wm: &watch::Sender<Lsn>, out: &[WalItem]) {
    let last = out.iter().rev().find_map(|i| match i {
        WalItem::Commit(c) => Some(c.end_lsn),
        WalItem::Keepalive(l) => Some(*l),
        WalItem::Event(_) => None,
    });
    if let Some(l) = last.filter(|l| *l > *wm.borrow()) {
        let _ = wm.send(l);
    }
}

/// Streams the copied slot from `from` and publishes every selected event committed
/// before `stop` (with `--dry-run`, only counts them: no report).
async fn replay_copy(
    cfg: &Config,
    client: &Client,
    tmp: &str,
    anchor_name: &str,
    (from, stop, end): (Lsn, Lsn, Lsn),
    plan: &Plan,
) -> Result<(u64, Option<PublisherReport>), CliError> {
    let copy = admin::require_slot(client, tmp).await?;
    let copied_at = copy.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    if copied_at > from {
        // The anchor moved on since we looked.
        return Err(outside_window(from, copied_at, end, anchor_name));
    }
    if from > copied_at {
        admin::advance_slot(client, tmp, from)
            .await
            .map_err(|e| CliError::Runtime(format!("cannot advance {tmp} to {from}: {e}")))?;
    }
    let mut rcfg = cfg.reader_config(None)?;
    rcfg.slot = tmp.to_string();
    let reader = WalReader::start(rcfg).await?;
    let publisher = match plan.dry_run {
        false => Some(connect_publisher(cfg, plan).await?),
        true => None,
    };

    let (wal_tx, mut wal_rx) = mpsc::channel::<WalBatch>(64);
    let (pub_tx, pub_rx) = mpsc::channel::<WalBatch>(64);
    let (wm_tx, wm_rx) = watch::channel(from);
    let (stop_tx, stop_rx) = watch::channel(false);
    let reader_task = tokio::spawn(reader.run(wal_tx, wm_rx.clone(), stop_rx));
    // A dry run has no publisher: the positions it passes are its watermark.
    let (pub_task, dry_wm) = match publisher {
        Some(publisher) => (Some(tokio::spawn(publisher.run(pub_rx, wm_tx, None))), None),
        None => (None, Some(wm_tx)),
    };
    let total = stop.0.saturating_sub(from.0);
    // Events handed to the publisher, shown beside the WAL position.
    let sent = Arc::new(AtomicU64::new(0));
    let progress = progress::spawn(
        wm_rx,
        total,
        Unit::WalBytes,
        Some(sent.clone()),
        plan.format,
        move |l| l.0.saturating_sub(from.0),
    );

    let mut pub_tx = Some(pub_tx);
    let mut events = 0u64;
    let mut passed = false;
    while let Some(batch) = wal_rx.recv().await {
        let Some(tx) = &pub_tx else { continue };
        let (mut out, kept, past) = in_range(batch, (from, stop), plan);
        events += kept;
        passed |= past;
        sent.store(events, Ordering::Relaxed);
        if let Some(wm) = &dry_wm {
            dry_run_progress(wm, &out);
            out.clear();
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
    let report = match pub_task {
        Some(task) => Some(check_report(task.await, &plan.destination(cfg))),
        None => None,
    };
    drop(dry_wm);
    let reader_result = reader_task.await;
    progress.finish().await;
    let report = report.transpose()?;
    match reader_result {
        Ok(Ok(_)) if passed => {}
        Ok(Ok(_)) => return Err(CliError::Runtime(
            "the replication stream ended before the end of the range: run the same replay again"
                .into(),
        )),
        Ok(Err(e)) if !passed => return Err(e.into()),
        Ok(Err(e)) => warn!(error = %e, "replay stream ended with an error after the range"),
        Err(e) => return Err(CliError::Runtime(format!("the reader task failed: {e}"))),
    }
    Ok((events, report))
}
