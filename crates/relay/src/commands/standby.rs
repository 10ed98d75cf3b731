//! `status --standby URL`: the copy of a failover slot on a physical standby
//! (Postgres 17+, docs/failover.md). A failover to a standby whose copy is not
//! *sync-ready* cannot use the slot; one whose copy lags resumes from the copy's
//! older position (the stored position, docs/design.md §3, spares what it can).

use outbox_event::Lsn;
use serde_json::json;
use wal_reader::admin::{AdminError, SlotState, SyncedSlot};
use wal_reader::PgConnectOptions;

pub mod setup;

/// What one standby holds of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotCopy {
    /// No copy of the slot (yet).
    Missing,
    /// The standby runs a Postgres without failover slots.
    Unsupported { version: i32 },
    /// The copy: `sync_ready` once the slot sync worker persisted it (it is
    /// temporary until then); how far its confirmed position trails the primary's.
    Present {
        synced: bool,
        sync_ready: bool,
        confirmed_flush_lsn: Option<Lsn>,
        behind_bytes: Option<u64>,
    },
}

/// One `--standby` and what was found there (or why nothing could be).
#[derive(Debug, Clone)]
pub struct Standby {
    /// host:port/database, never a password.
    pub target: String,
    pub copy: Result<SlotCopy, String>,
    /// Its settings that the copy depends on (Postgres 17+), when readable.
    pub setup: Option<setup::StandbySetup>,
}

/// Asks every standby about its copy of the primary's slot `s`.
pub async fn check_all(urls: &[String], s: &SlotState) -> Vec<Standby> {
    let mut out = Vec::with_capacity(urls.len());
    for url in urls {
        out.push(check(url, s).await);
    }
    out
}

async fn check(url: &str, s: &SlotState) -> Standby {
    let opts = match PgConnectOptions::parse(url) {
        Ok(o) => o,
        Err(e) => {
            return Standby {
                target: "(a --standby value)".into(),
                copy: Err(wal_reader::redact::redact_url(&e.to_string())),
                setup: None,
            }
        }
    };
    let target = opts.display_target();
    let (copy, setup) = match crate::sql::connect(&opts).await {
        Ok(client) => {
            let copy = query(&client, s).await;
            let setup = match &copy {
                Ok(SlotCopy::Unsupported { .. }) | Err(_) => None,
                Ok(_) => setup::read_standby(&client).await,
            };
            (copy, setup)
        }
        Err(e) => (Err(wal_reader::redact::redact_url(&e.to_string())), None),
    };
    Standby {
        target,
        copy,
        setup,
    }
}

async fn query(client: &tokio_postgres::Client, s: &SlotState) -> Result<SlotCopy, String> {
    let version = wal_reader::admin::server_version_num(client)
        .await
        .map_err(|e| e.to_string())?;
    if version < 170000 {
        return Ok(SlotCopy::Unsupported { version });
    }
    let copy = wal_reader::admin::synced_slot(client, &s.slot_name)
        .await
        .map_err(|e| match e {
            AdminError::Sql(e) => crate::sql::describe_pg_error(&e),
            e => e.to_string(),
        })?;
    let Some(SyncedSlot {
        synced,
        temporary,
        confirmed_flush_lsn: confirmed,
    }) = copy
    else {
        return Ok(SlotCopy::Missing);
    };
    let behind_bytes = match (s.confirmed_flush_lsn, confirmed) {
        (Some(primary), Some(copy)) => Some(primary.0.saturating_sub(copy.0)),
        _ => None,
    };
    Ok(SlotCopy::Present {
        synced,
        sync_ready: synced && !temporary,
        confirmed_flush_lsn: confirmed,
        behind_bytes,
    })
}

/// The warnings for `status`: each names what a failover would cost and the fix.
pub fn warnings(standbys: &[Standby], s: &SlotState) -> Vec<String> {
    let mut w = Vec::new();
    if !standbys.is_empty() && !s.failover {
        w.push(format!(
            "slot {} is not a failover slot, so no standby keeps a copy: re-create it with `slot create --failover` (Postgres 17+)",
            s.slot_name
        ));
    }
    for sb in standbys {
        match &sb.copy {
            Err(e) => w.push(format!("standby {}: cannot be checked: {e}", sb.target)),
            Ok(SlotCopy::Unsupported { version }) => w.push(format!(
                "standby {} runs Postgres {}, which has no failover slots: a failover to it loses slot {}",
                sb.target,
                version / 10000,
                s.slot_name
            )),
            Ok(SlotCopy::Missing) if s.failover && sb.setup.is_some() => w.push(format!(
                "standby {} has no copy of slot {} yet: the slot sync worker copies a failover slot once the primary logs a consistent point (pg_log_standby_snapshot() on the primary hastens it; its settings are checked below)",
                sb.target, s.slot_name
            )),
            Ok(SlotCopy::Missing) if s.failover => w.push(format!(
                "standby {} has no copy of slot {}: set sync_replication_slots = on, primary_slot_name and hot_standby_feedback on it (docs/failover.md)",
                sb.target, s.slot_name
            )),
            Ok(SlotCopy::Present {
                sync_ready: false, ..
            }) => w.push(format!(
                "standby {}'s copy of slot {} is not sync-ready yet: a failover now could not continue from it (wait, or call pg_log_standby_snapshot() on the primary)",
                sb.target, s.slot_name
            )),
            _ => {}
        }
    }
    w
}

/// One line per standby for the text output.
pub fn describe(sb: &Standby) -> String {
    match &sb.copy {
        Err(e) => format!("{}: cannot be checked ({e})", sb.target),
        Ok(SlotCopy::Missing) => format!("{}: no copy of the slot", sb.target),
        Ok(SlotCopy::Unsupported { version }) => {
            format!(
                "{}: Postgres {} (no failover slots)",
                sb.target,
                version / 10000
            )
        }
        Ok(SlotCopy::Present {
            sync_ready,
            confirmed_flush_lsn,
            behind_bytes,
            ..
        }) => format!(
            "{}: copy {}, confirmed_flush_lsn {}, {} behind the primary's slot",
            sb.target,
            if *sync_ready {
                "sync-ready"
            } else {
                "not sync-ready"
            },
            confirmed_flush_lsn.map_or("-".into(), |l| l.to_string()),
            behind_bytes.map_or("-".into(), |b| format!("{b} bytes")),
        ),
    }
}

/// The JSON form of one standby.
pub fn to_json(sb: &Standby) -> serde_json::Value {
    match &sb.copy {
        Err(e) => json!({ "target": sb.target, "error": e }),
        Ok(SlotCopy::Missing) => json!({ "target": sb.target, "copy": null, "sync_ready": false }),
        Ok(SlotCopy::Unsupported { version }) => json!({
            "target": sb.target, "server_version_num": version, "copy": null, "sync_ready": false,
        }),
        Ok(SlotCopy::Present {
            synced,
            sync_ready,
            confirmed_flush_lsn,
            behind_bytes,
        }) => json!({
            "target": sb.target,
            "copy": {
                "synced": synced,
                "confirmed_flush_lsn": confirmed_flush_lsn.map(|l| l.to_string()),
            },
            "sync_ready": sync_ready,
            "behind_bytes": behind_bytes,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(failover: bool) -> SlotState {
        SlotState {
            confirmed_flush_lsn: Some(Lsn(500)),
            failover,
            ..crate::commands::status::tests::state()
        }
    }

    fn standby(copy: Result<SlotCopy, String>) -> Standby {
        Standby {
            target: "127.0.0.1:5433/app".into(),
            copy,
            setup: None,
        }
    }

    fn present(sync_ready: bool) -> SlotCopy {
        SlotCopy::Present {
            synced: true,
            sync_ready,
            confirmed_flush_lsn: Some(Lsn(400)),
            behind_bytes: Some(100),
        }
    }

    #[test]
    fn a_sync_ready_copy_has_no_warning() {
        assert!(warnings(&[standby(Ok(present(true)))], &slot(true)).is_empty());
        assert!(describe(&standby(Ok(present(true)))).contains("sync-ready"));
        assert_eq!(to_json(&standby(Ok(present(true))))["behind_bytes"], 100);
    }

    #[test]
    fn every_copy_that_cannot_take_over_is_a_warning() {
        for (copy, words) in [
            (Ok(present(false)), "not sync-ready"),
            (Ok(SlotCopy::Missing), "sync_replication_slots"),
            (Ok(SlotCopy::Unsupported { version: 160004 }), "Postgres 16"),
            (Err("refused".to_string()), "cannot be checked"),
        ] {
            let w = warnings(&[standby(copy)], &slot(true));
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].contains(words), "{w:?}");
        }
        let w = warnings(&[standby(Ok(SlotCopy::Missing))], &slot(false));
        assert!(w[0].contains("--failover"), "{w:?}");
        assert!(warnings(&[], &slot(false)).is_empty());
    }
}
