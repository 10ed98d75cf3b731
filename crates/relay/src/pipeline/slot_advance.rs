//! Saving the previous session's acked watermark to the slot before the next one
//! streams (`pg_replication_slot_advance`), on whichever server the URL reaches now.

use std::time::Duration;

use outbox_event::Lsn;
use tracing::{debug, info, warn};
use wal_reader::{admin, ReaderConfig};

/// Bound on saving the acked position to the slot (the advance decodes the WAL
/// between the slot's position and the acked one).
const SAVE_TIMEOUT: Duration = Duration::from_secs(60);

/// What [`save_position`] found.
enum Saved {
    /// The slot was advanced from this position.
    Advanced(Option<Lsn>),
    /// The slot is already there, or missing (the reader reports that).
    NotNeeded,
    /// A walsender still holds the slot (ours, not yet gone, or another relay's).
    Busy,
    /// The server's WAL (current, or replayed on a standby) is behind the position.
    PastWal(Option<Lsn>),
}

/// Before a session streams, saves the previous session's acked watermark to the slot
/// on whichever server the URL reaches now, so that nothing the broker acked is
/// published again. The previous server may have died before it saved the slot
/// (Postgres 15 writes a slot's confirmed position only at checkpoints, so a crash
/// brings it back); only the relay still knows the position. It is not applied
/// when the server's WAL does not reach it (a failover to a server that lacks it:
/// it means nothing there). Returns whether it is done (false: the slot is still
/// held, try again before the next attempt), or why the server cannot be reached.
pub(super) async fn save_position(cfg: &ReaderConfig, acked: Lsn) -> Result<bool, String> {
    if acked == Lsn::ZERO {
        return Ok(true);
    }
    let parse = |v: Option<String>| v.and_then(|s| s.parse::<Lsn>().ok());
    let client = match tokio::time::timeout(SAVE_TIMEOUT, crate::sql::connect(&cfg.conn)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("cannot connect to Postgres: {e}")),
        Err(_) => {
            return Err(format!(
                "connecting to Postgres timed out after {SAVE_TIMEOUT:?}"
            ))
        }
    };
    let res = async {
        let Some(row) = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, active, \
                        (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                              ELSE pg_current_wal_lsn() END)::text \
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&cfg.slot],
            )
            .await?
        else {
            return Ok(Saved::NotNeeded);
        };
        let confirmed = parse(row.get(0));
        let active: bool = row.get(1);
        let server_wal = parse(row.get(2));
        if confirmed.is_some_and(|c| c >= acked) {
            return Ok(Saved::NotNeeded);
        }
        if active {
            return Ok(Saved::Busy);
        }
        if server_wal.is_none_or(|w| w < acked) {
            return Ok(Saved::PastWal(server_wal));
        }
        let advanced = admin::advance_slot(&client, &cfg.slot, acked).await?;
        Ok::<_, admin::AdminError>(if advanced {
            Saved::Advanced(confirmed)
        } else {
            Saved::Busy
        })
    };
    match tokio::time::timeout(SAVE_TIMEOUT, res).await {
        Ok(Ok(Saved::Advanced(from))) => {
            let from = from.map(|l| l.to_string()).unwrap_or_default();
            info!(lsn = %acked, %from, "saved the acked position to the slot");
            Ok(true)
        }
        Ok(Ok(Saved::NotNeeded)) => Ok(true),
        Ok(Ok(Saved::Busy)) => Ok(false),
        Ok(Ok(Saved::PastWal(server_wal))) => {
            let server_wal = server_wal.map(|l| l.to_string()).unwrap_or_default();
            warn!(acked = %acked, %server_wal,
                "the acked position is past this server's WAL (a failover?); resuming from the slot's position");
            Ok(true)
        }
        Ok(Err(admin::AdminError::Sql(e))) if e.is_closed() => {
            Err(format!("connection to Postgres lost: {e}"))
        }
        Ok(Err(e)) => {
            warn!(error = %e, lsn = %acked,
                "could not save the acked position to the slot; resuming from the slot's position");
            Ok(true)
        }
        Err(_) => {
            debug!(timeout = ?SAVE_TIMEOUT, "saving the acked position timed out");
            Ok(false)
        }
    }
}
