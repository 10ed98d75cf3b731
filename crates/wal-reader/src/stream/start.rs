//! Where a stream starts: the server's identity and WAL history, the slot found
//! before `START_REPLICATION` ([`Prepared`]), and `START_REPLICATION` itself.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use outbox_event::history::History;
use outbox_event::Lsn;
use tokio::sync::watch;
use tracing::info;

use super::{LastEventCommit, OldestUnacked, ReaderConfig, WalReader};
use crate::admin;
use crate::admin::ident::{quote_ident, quote_literal};
use crate::assemble::Assembler;
use crate::conn::ReplicationConnection;
use crate::conninfo::PgConnectOptions;
use crate::error::ReaderError;
use crate::messages::MessageSource;

/// Where a reader started, as found on the server.
#[derive(Debug, Clone)]
pub struct StartInfo {
    pub server_version: String,
    /// The slot's `confirmed_flush_lsn` when the reader started.
    pub slot_confirmed: Lsn,
    /// The position passed to `START_REPLICATION`.
    pub start_lsn: Lsn,
    pub wal_sender_timeout: Option<Duration>,
    /// The walsender's process id.
    pub backend_pid: i32,
    /// The server's WAL end when the reader started (the replay position on a standby).
    pub server_wal: Lsn,
    /// The connected database.
    pub database: String,
    /// The server's WAL history: every position this session confirms belongs to it
    /// (docs/design.md §3, "Positions belong to one history").
    pub history: History,
}

/// Opens a replication connection to read the server's identity and WAL history
/// ([`identify`]) and its WAL end, for the commands that report them.
pub async fn identify_server(opts: &PgConnectOptions) -> Result<(History, Lsn), ReaderError> {
    let mut conn = ReplicationConnection::connect(opts).await?;
    let history = identify(&mut conn).await?;
    let rows = conn.simple_query("IDENTIFY_SYSTEM").await?;
    let wal = rows
        .first()
        .and_then(|r| r.get(2).cloned().flatten())
        .and_then(|v| v.parse().ok())
        .unwrap_or(Lsn::ZERO);
    Ok((history, wal))
}

/// Reads the server's system identifier and timeline (`IDENTIFY_SYSTEM`) and, past
/// timeline 1, where each ancestor timeline ended (`TIMELINE_HISTORY`).
pub async fn identify(conn: &mut ReplicationConnection) -> Result<History, ReaderError> {
    let rows = conn.simple_query("IDENTIFY_SYSTEM").await?;
    let field = |i: usize| rows.first().and_then(|r| r.get(i).cloned().flatten());
    let bad = |what: &str| ReaderError::Protocol(format!("IDENTIFY_SYSTEM returned no {what}"));
    let system_id: u64 = field(0)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| bad("system identifier"))?;
    let timeline: u32 = field(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| bad("timeline"))?;
    if timeline <= 1 {
        return Ok(History::first(system_id));
    }
    let rows = conn
        .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
        .await?;
    let content = rows
        .first()
        .and_then(|r| r.get(1).cloned().flatten())
        .ok_or_else(|| bad("timeline history"))?;
    History::parse(system_id, timeline, &content).map_err(|e| ReaderError::Protocol(e.to_string()))
}

/// Parses a Postgres duration setting as `SHOW` prints it ("60s", "1min", "500ms", "0").
pub fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n * 1000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        "us" => n / 1000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// A replication connection that has found its slot and its server's WAL history,
/// before `START_REPLICATION`: where to start is decided from what it read
/// ([`WalReader::prepare`], then [`Prepared::start`]).
pub struct Prepared {
    pub(super) conn: ReplicationConnection,
    pub(super) cfg: ReaderConfig,
    pub(super) timeout: Option<Duration>,
    pub(super) found: admin::StreamStart,
    pub(super) history: History,
}

impl Prepared {
    /// The slot as found (its position, `restart_lsn`, the server's WAL end).
    pub fn slot(&self) -> &admin::SlotState {
        &self.found.state
    }

    /// The server's WAL history (`IDENTIFY_SYSTEM`, `TIMELINE_HISTORY`).
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The connected database.
    pub fn database(&self) -> &str {
        &self.found.database
    }

    /// Starts streaming from `start_lsn` (`None`: the slot's position). It must not be
    /// older than the slot's `confirmed_flush_lsn` (nor the replay window's start).
    pub async fn start(self, start_lsn: Option<Lsn>) -> Result<WalReader, ReaderError> {
        let Prepared {
            mut conn,
            cfg,
            timeout,
            found,
            history,
        } = self;
        let start_lsn = found.check(start_lsn)?;
        let slot_confirmed = found.state.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
        if start_lsn > slot_confirmed {
            info!(start_lsn = %start_lsn, slot_confirmed = %slot_confirmed,
                "starting after the slot's position: transactions whose commit ends at or before the start are not sent again");
        }
        // Logical messages only when some are relayed: pgoutput sends every
        // message of the database otherwise (docs/messages.md).
        let messages = if cfg.messages.is_empty() {
            ""
        } else {
            ", messages 'true'"
        };
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} (proto_version '1', publication_names {}{messages})",
            quote_ident(&cfg.slot),
            start_lsn,
            quote_literal(&quote_ident(&cfg.publication)),
        );
        conn.start_copy_both(&sql, &cfg.slot).await?;
        let source = MessageSource::for_config(&cfg.messages, history.system_id, &found.database);
        let info = StartInfo {
            server_version: conn.server_version().to_string(),
            slot_confirmed,
            start_lsn,
            wal_sender_timeout: timeout,
            backend_pid: conn.backend_pid(),
            server_wal: found.state.current_wal_lsn,
            database: found.database.clone(),
            history,
        };
        info!(slot = %cfg.slot, start = %start_lsn, confirmed = %slot_confirmed,
            timeline = info.history.timeline, server = %info.server_version,
            tls = conn.is_tls(), "replication started");
        Ok(WalReader {
            conn,
            info,
            assembler: Assembler::new(cfg.tables.clone(), cfg.mapping.clone())
                .with_messages(source),
            received: start_lsn,
            flushed: slot_confirmed.max(start_lsn),
            flushed_tx: watch::Sender::new(slot_confirmed.max(start_lsn)),
            last_status: Instant::now(),
            status_buf: BytesMut::with_capacity(64),
            unacked: VecDeque::new(),
            held: Vec::new(),
            held_bytes: 0,
            streaming_tx: false,
            pause: None,
            oldest_unacked: OldestUnacked::default(),
            last_event_commit: LastEventCommit::default(),
            cfg,
        })
    }
}
