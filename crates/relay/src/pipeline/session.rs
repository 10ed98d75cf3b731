//! One session, phase by phase (module docs of `pipeline`): plan, wire, run, finish.

use std::time::Duration;

use outbox_event::Lsn;
use publisher::{Target, TargetConfig};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn, Instrument};
use wal_reader::{ReaderError, ReaderExit, StartInfo, WalReader};

use super::sink::stream_source;
use super::start::{self, Carried, Found, Source, StartPlan, Store};
use super::stored::{read_state, warn_state, StateWriter, STATE_TIMEOUT};
use super::{PipelineConfig, SessionError, POSITION_FALLBACKS};
use crate::health::Health;
use crate::shutdown::Shutdown;
use crate::state::{self, Columns};

/// Batches buffered between reader and publisher (each is one socket read).
const CHANNEL_BATCHES: usize = 64;
/// How often a standby checks whether the slot was released.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// Bound on the reader's end after the publisher failed.
const READER_STOP: Duration = Duration::from_secs(10);

/// The session loop's state across sessions.
pub(super) struct Sessions {
    cfg: PipelineConfig,
    shutdown: Shutdown,
    health: Health,
    /// True while `ctl pause` holds publishing (crate::control): every session's
    /// reader watches it.
    pause: watch::Receiver<bool>,
    /// The acked watermark of the last session, with where it was read.
    carried: Option<Carried>,
    /// A reader has started once (only before that does `run --start-lsn` apply).
    started: bool,
    /// A publisher of this process has connected once (module docs: the policy).
    broker_connected: bool,
    /// The SQL connection to the state table, kept across sessions.
    state_client: Option<tokio_postgres::Client>,
    state_warned: bool,
    standby_logged: bool,
}

/// A session planned and its reader started.
struct Planned {
    reader: WalReader,
    plan: StartPlan,
    /// The state table, when it is usable: the client and its columns.
    state: Option<(tokio_postgres::Client, Columns)>,
}

/// The running state writer: its finish signal and its task.
type Writer = (
    watch::Sender<bool>,
    JoinHandle<Result<Lsn, state::StateError>>,
);

/// A session's running parts.
struct Wired {
    reader: JoinHandle<Result<ReaderExit, ReaderError>>,
    publisher: JoinHandle<Result<publisher::PublisherReport, publisher::PublishError>>,
    stop: watch::Sender<bool>,
    acked: watch::Receiver<Lsn>,
    writer: Option<Writer>,
    info: StartInfo,
}

impl Sessions {
    pub(super) fn new(
        cfg: PipelineConfig,
        shutdown: Shutdown,
        health: Health,
        pause: watch::Receiver<bool>,
    ) -> Self {
        Sessions {
            cfg,
            shutdown,
            health,
            pause,
            carried: None,
            started: false,
            broker_connected: false,
            state_client: None,
            state_warned: false,
            standby_logged: false,
        }
    }

    pub(super) fn stop_requested(&self) -> bool {
        self.shutdown.is_requested()
    }

    pub(super) fn broker_connected(&self) -> bool {
        self.broker_connected
    }

    /// Waits `wait`, or less when a stop is requested.
    pub(super) async fn pause(&mut self, wait: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = self.shutdown.requested() => {}
        }
    }

    /// Leaves the reason publishing stopped in the state table, so that a restarted
    /// relay stops too (best effort: without the table it cannot).
    pub(super) async fn record_halt(&self, reason: &str) {
        let slot = &self.cfg.reader.slot;
        let res = tokio::time::timeout(STATE_TIMEOUT * 2, async {
            let client = crate::sql::connect(&self.cfg.reader.conn)
                .await
                .map_err(|e| e.to_string())?;
            state::halt(&client, slot, reason)
                .await
                .map_err(|e| e.to_string())
        })
        .await;
        match res {
            Ok(Ok(())) => {
                info!(%slot, table = state::TABLE, "recorded why publishing stopped: `run` refuses to start until it is cleared")
            }
            Ok(Err(e)) => {
                warn!(error = %e, "could not record why publishing stopped: a restarted relay would not know")
            }
            Err(_) => warn!(
                "could not record why publishing stopped in time: a restarted relay would not know"
            ),
        }
    }

    /// Runs one session: `Ok` after a clean stop, the reason otherwise.
    pub(super) async fn run_one(&mut self) -> Result<(), SessionError> {
        let Some(planned) = self.plan().await? else {
            return Ok(());
        };
        let Some(wired) = self.wire(planned).await? else {
            return Ok(());
        };
        self.run_and_finish(wired).await
    }

    /// Phase 1: the slot and the server's history over the replication connection,
    /// the stored row, the start plan, and `START_REPLICATION`. `None`: a stop was
    /// requested while standing by.
    async fn plan(&mut self) -> Result<Option<Planned>, SessionError> {
        // `run --start-lsn` names where the first session starts; later ones resume
        // from the slot, which has moved past it (asking for it again would be refused).
        let explicit = if self.started {
            None
        } else {
            self.cfg.reader.start_lsn
        };
        // The reader first: a standby must not hold a broker connection it cannot use.
        let prepared = loop {
            match WalReader::prepare(self.cfg.reader.clone()).await {
                Ok(p) => break p,
                Err(ReaderError::SlotInUse { slot, pid }) => {
                    if !self.standby_logged {
                        info!(%slot, pid, "slot in use by another relay; standing by");
                        self.standby_logged = true;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(STANDBY_POLL) => continue,
                        _ = self.shutdown.requested() => return Ok(None),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        if self.standby_logged {
            info!("slot released; taking over");
            self.standby_logged = false;
        }
        let found_state = read_state(
            &self.cfg.reader,
            &mut self.state_client,
            &mut self.state_warned,
        )
        .await?;
        if let Some(reason) = found_state
            .as_ref()
            .and_then(|f| f.row.as_ref())
            .and_then(|r| r.halted.clone())
        {
            return Err(SessionError::Halted(reason));
        }
        let slot = prepared.slot();
        let history = prepared.history().clone();
        let plan = start::plan(&Found {
            explicit,
            slot_confirmed: slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
            slot_restart: slot.restart_lsn,
            server_wal: slot.current_wal_lsn,
            history: Some(&history),
            carried: self.carried,
            stored: found_state.as_ref().and_then(|f| f.row.as_ref()),
            table: found_state.is_some(),
        });
        for fallback in &plan.fallbacks {
            metrics::counter!(POSITION_FALLBACKS, "position" => fallback.position).increment(1);
            error!(slot = %self.cfg.reader.slot, lsn = %fallback.lsn, timeline = history.timeline,
                "{fallback}; resuming from the slot's own position: what the server has after it is published again (duplicates, never loss)");
        }
        match plan.source {
            Source::Stored => {
                info!(lsn = %plan.start, "resuming from the stored acked position (transactions whose commit ends at or before it were published)")
            }
            Source::Carried => {
                info!(lsn = %plan.start, "resuming from the acked position of the previous session")
            }
            Source::Explicit if Some(plan.start) > slot.confirmed_flush_lsn => {
                warn!(start_lsn = %plan.start, "starting after the slot's position: transactions committed before the start LSN are skipped")
            }
            _ => {}
        }
        let origin = history.origin();
        // The writer of this session takes the connection; the next one reconnects.
        let mut state = found_state.and_then(|f| {
            let client = self.state_client.take()?;
            Some((client, f.columns))
        });
        if let Some((client, columns)) = &state {
            let origin = columns.history.then_some(origin);
            let res = match plan.store {
                Store::Nothing => Ok(()),
                Store::Insert(lsn) => state::save(client, &self.cfg.reader.slot, lsn, origin).await,
                Store::Set(lsn) => state::set(client, &self.cfg.reader.slot, lsn, origin).await,
            };
            if let Err(e) = res {
                warn_state(&mut self.state_warned, &e);
                state = None;
            }
        }
        let reader = prepared
            .start(plan.from)
            .await?
            .with_pause(self.pause.clone());
        self.started = true;
        Ok(Some(Planned {
            reader,
            plan,
            state,
        }))
    }

    /// Phase 2: the reader runs (answering the walsender from now on), then the
    /// publisher connects and runs; the state writer owns the flushed bound. `None`: a
    /// stop was requested while the publisher connected.
    async fn wire(&mut self, planned: Planned) -> Result<Option<Wired>, SessionError> {
        let Planned {
            reader,
            plan,
            state,
        } = planned;
        let info = reader.start_info().clone();
        self.health.set_reader(Some(reader.oldest_unacked()));
        let initial = plan.start;
        self.carried = Some(Carried {
            lsn: initial,
            origin: info.history.origin(),
        });
        let (tx, rx) = mpsc::channel(CHANNEL_BATCHES);
        let (acked_tx, acked_rx) = watch::channel(initial);
        let acked = acked_tx.subscribe();
        let (stop_tx, stop_rx) = watch::channel(false);
        let flushed = reader.flushed();
        self.health.set_confirmed(Some(reader.flushed()));
        let last_event = reader.last_event_commit();
        let mut reader_task = tokio::spawn(
            reader
                .run(tx, acked_rx, stop_rx)
                .instrument(tracing::info_span!("reader", slot = %self.cfg.reader.slot)),
        );
        let source = match &self.cfg.publisher {
            TargetConfig::Stream { producer_name, .. } => Some(stream_source(
                producer_name.as_deref(),
                &self.cfg.reader.slot,
                &info,
            )),
            TargetConfig::Exchange(_) => None,
        };
        let connected = tokio::select! {
            sink = Target::connect(&self.cfg.publisher, source) => Some(sink),
            _ = self.shutdown.requested() => None,
            r = &mut reader_task => {
                return Err(reader_ended(r));
            }
        };
        let sink = match connected {
            Some(Ok(sink)) => sink,
            other => {
                // The reader confirms nothing new and closes.
                let _ = stop_tx.send(true);
                drop(acked_tx);
                let _ = tokio::time::timeout(READER_STOP, &mut reader_task).await;
                reader_task.abort();
                self.health.set_reader(None);
                return match other {
                    Some(Err(e)) => Err(e.into()),
                    _ => Ok(None),
                };
            }
        };
        self.broker_connected = true;
        self.health.set_publisher(Some(sink.status()));
        let (bound, writer) = match state {
            Some((client, columns)) => {
                let (bound_tx, bound_rx) = watch::channel(initial);
                let (finish_tx, finish_rx) = watch::channel(false);
                let writer = StateWriter {
                    client,
                    slot: self.cfg.reader.slot.clone(),
                    origin: columns.history.then_some(info.history.origin()),
                    acked: acked_tx.subscribe(),
                    last_event_end: last_event,
                    status: sink.status(),
                    max_in_flight: self.cfg.reader.max_in_flight,
                    interval: self.cfg.reader.status_interval,
                    written: initial,
                    flushed,
                    bound: bound_tx,
                };
                let task = tokio::spawn(
                    writer
                        .write_until_finished(finish_rx)
                        .instrument(tracing::info_span!("state")),
                );
                (bound_rx, Some((finish_tx, task)))
            }
            None => (flushed, None),
        };
        let publisher_task =
            tokio::spawn(sink.run(rx, acked_tx, Some(bound)).instrument(
                tracing::info_span!("publisher", target = %self.cfg.publisher.target()),
            ));
        self.health.set_streaming(true);
        Ok(Some(Wired {
            reader: reader_task,
            publisher: publisher_task,
            stop: stop_tx,
            acked,
            writer,
            info,
        }))
    }

    /// Phases 3 and 4: runs until a stop or one side ends, then carries the acked
    /// watermark to the next session and stores it.
    async fn run_and_finish(&mut self, wired: Wired) -> Result<(), SessionError> {
        let Wired {
            mut reader,
            mut publisher,
            stop,
            acked,
            writer,
            info,
        } = wired;
        let timeout = self.cfg.shutdown_timeout;
        let outcome = tokio::select! {
            _ = self.shutdown.requested() => {
                info!(timeout = ?timeout, "stopping: finishing the open transaction and awaiting confirms");
                let _ = stop.send(true);
                let both = async {
                    let p = (&mut publisher).await;
                    let r = (&mut reader).await;
                    (r, p)
                };
                // The publisher bounds its own wait for confirms; this bounds the rest
                // (a huge open transaction still being read).
                match tokio::time::timeout(timeout * 2 + Duration::from_secs(5), both).await {
                    Ok((r, p)) => {
                        if let Ok(Ok(report)) = &p {
                            info!(watermark = %report.watermark, abandoned = report.abandoned, "publisher finished");
                        }
                        match r {
                            Ok(Ok(exit)) => info!(flushed = %exit.flushed, "stopped cleanly"),
                            Ok(Err(e)) => warn!(error = %e, "reader ended with an error during shutdown"),
                            Err(e) => warn!(error = %e, "reader task failed during shutdown"),
                        }
                    }
                    Err(_) => {
                        warn!("shutdown timed out; the open transaction will be published again after restart");
                        // The bounded wait is over: abort is the point of the bound. What
                        // is acked is carried; the rest is published again after restart.
                        reader.abort();
                        publisher.abort();
                    }
                }
                Ok(())
            }
            r = &mut reader => {
                self.health.set_streaming(false);
                let ended = reader_ended(r);
                // Said now, not after the drain: a drain that takes long must not hide
                // why the events stopped coming.
                info!(error = %ended, "replication ended; publishing what was already read");
                // The reader dropped its sender: the publisher drains what it has (the
                // watermark it reaches is where the next session starts), within the
                // shutdown bound; the rest is read again by the next session.
                if tokio::time::timeout(timeout * 2 + Duration::from_secs(5), &mut publisher)
                    .await
                    .is_err()
                {
                    warn!("the publisher did not finish what was read within shutdown_timeout; the next session reads it again");
                    publisher.abort();
                }
                Err(ended)
            }
            p = &mut publisher => {
                self.health.set_streaming(false);
                // The publisher returns early only on an error it does not retry
                // itself; the reader sees the watermark sender dropped, confirms what
                // was acked and closes.
                let _ = stop.send(true);
                let _ = tokio::time::timeout(READER_STOP, &mut reader).await;
                // Only a reader still running after that bounded wait is aborted: the
                // next session starts over from the acked position anyway.
                reader.abort();
                Err(match p {
                    Ok(Ok(_)) => SessionError::PublisherEnded,
                    Ok(Err(e)) => SessionError::Broker(e),
                    Err(e) => SessionError::Task("publisher", e.to_string()),
                })
            }
        };
        self.health.set_streaming(false);
        self.health.set_publisher(None);
        self.health.set_reader(None);
        self.health.set_confirmed(None);
        // Only broker acks moved it: where the next session may start.
        self.carried = Some(Carried {
            lsn: *acked.borrow(),
            origin: info.history.origin(),
        });
        // The last write of the stored position: the final watermark of a clean stop (or
        // what a failed session reached, if the server still answers).
        if let Some((finish, task)) = writer {
            let _ = finish.send(true);
            match tokio::time::timeout(STATE_TIMEOUT * 2, task).await {
                Ok(Ok(Ok(lsn))) => debug!(%lsn, "stored the acked position"),
                // The server went away: the next session stores the position.
                Ok(Ok(Err(e))) if e.is_closed() => {
                    debug!(error = %e, "could not store the acked position")
                }
                Ok(Ok(Err(e))) => warn_state(&mut self.state_warned, &e),
                _ => debug!("the last write of the stored position did not finish"),
            }
        }
        outcome
    }
}

/// What a reader task's end means for the session.
fn reader_ended(
    r: Result<Result<ReaderExit, ReaderError>, tokio::task::JoinError>,
) -> SessionError {
    match r {
        Ok(Ok(_)) => SessionError::ReplicationEnded,
        Ok(Err(e)) => SessionError::Postgres(e),
        Err(e) => SessionError::Task("reader", e.to_string()),
    }
}
