//! The stream publishing loop: one task, one `select!` over the broker's confirms
//! and refusals, the input, the flushed position, the shutdown deadline and the
//! poison retry. Every decision is the engine's (`engine.rs`); this file does the
//! I/O it asks for.

use std::time::Duration;

use outbox_event::{Lsn, WalBatch};
use rabbitmq_stream_client::types::{Message, ResponseCode};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::client::BrokerEvent;
use super::connection::Session;
use super::engine::{Engine, Next};
use super::leader;
use super::liveness::{Due, Liveness};
use super::message::{Pending, StreamMessageBuilder};
use super::{StreamConfig, StreamPublisher};
use crate::error::{redact_url, PublishError};
use crate::progress::{self, changed_lsn, sleep_until_opt};
use crate::report::PublisherReport;
use crate::status::{self, PoisonMessage, PublisherStatus};
use crate::trace::EventTracer;

/// How often a poison message is logged again while it holds the publisher.
const POISON_LOG_EVERY: Duration = Duration::from_secs(60);

enum Step {
    Broker(Option<BrokerEvent>),
    Input(Option<WalBatch>),
    Flushed(Option<Lsn>),
    Deadline,
    PoisonRetry,
    /// The liveness check has something due (`liveness.rs`).
    Liveness,
}

/// Why a connection ended.
enum Failure {
    /// Reconnect and go on.
    Retry(String),
    /// Stop: the error goes to the caller ([`PublishError::Halted`]: retrying would
    /// lose an event).
    Stop(PublishError),
}

pub(super) struct Runner {
    config: StreamConfig,
    session: Option<Session>,
    url_index: usize,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    flushed: Option<watch::Receiver<Lsn>>,
    builder: StreamMessageBuilder,
    engine: Engine<Pending>,
    failures: u32,
    report: PublisherReport,
    deadline: Option<Instant>,
    /// When the connection is renewed to see whether the poison message fits now.
    poison_retry: Option<Instant>,
    poison_logged: Option<Instant>,
    /// A definite error found while taking input.
    halt: Option<PublishError>,
    /// Events sent again although the broker reported them stored, as last logged.
    resends_logged: u64,
    /// Whether the connection is silent for too long (`liveness.rs`).
    liveness: Liveness,
    /// The URL whose connection was given up for silence, until the next connect.
    silent: Option<usize>,
    /// The window's front when the status last heard of it (`after_progress`).
    front_seen: Option<u64>,
}

impl Runner {
    pub(super) fn new(
        publisher: StreamPublisher,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Runner {
        let StreamPublisher {
            config,
            session,
            first,
            status,
        } = publisher;
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        status.set_destination(&config.stream);
        let (named, timeline, wal) = match &config.source {
            Some(s) => (true, s.history.timeline, s.server_wal),
            None => (false, 0, Lsn::ZERO),
        };
        let mut engine = Engine::new(config.max_in_flight, start, named, timeline, wal);
        engine.connected(session.frame_max);
        let halt = first.and_then(|(key, last)| {
            engine
                .declared(key, last)
                .err()
                .map(|d| PublishError::Halted {
                    stream: config.stream.clone(),
                    reason: d.to_string(),
                })
        });
        Runner {
            builder: StreamMessageBuilder::new(&config.extra_properties, config.source.clone())
                .with_format(&config.format)
                .with_filter(config.filter_value.clone())
                .with_headers(config.headers)
                .with_tracer(EventTracer::get(), &config.stream),
            engine,
            url_index: session.url_index,
            session: Some(session),
            status,
            watermark,
            flushed,
            failures: 0,
            report: PublisherReport {
                watermark: start,
                ..PublisherReport::default()
            },
            deadline: None,
            poison_retry: None,
            poison_logged: None,
            halt,
            resends_logged: 0,
            liveness: Liveness::new(config.heartbeat),
            silent: None,
            front_seen: None,
            config,
        }
    }

    pub(super) async fn run(
        mut self,
        mut input: mpsc::Receiver<WalBatch>,
    ) -> Result<PublisherReport, PublishError> {
        let mut input_open = true;
        loop {
            if let Some(halt) = self.halt.take() {
                self.close().await;
                return Err(halt);
            }
            if !input_open && self.engine.window().is_empty() {
                break;
            }
            let mut failure = self.publish().await.err();
            if failure.is_none() {
                let want_input =
                    input_open && (!self.engine.window().has_unpublished() || input.is_closed());
                // What waits for the publisher, for the watchdog.
                self.status.set_queued(!input.is_empty());
                let unacked = self.engine.window().unacked() > 0;
                self.liveness.waiting(unacked, Instant::now());
                let step = {
                    let liveness = self.liveness.wake();
                    let events = self.session.as_mut().map(|s| &mut s.events);
                    let flushed = self.flushed.as_mut();
                    let has_flushed = flushed.is_some();
                    let deadline = self.deadline;
                    let poison_retry = self.poison_retry;
                    tokio::select! {
                        biased;
                        event = recv_opt(events) => Step::Broker(event),
                        changed = changed_lsn(flushed), if has_flushed => Step::Flushed(changed),
                        batch = input.recv(), if want_input => Step::Input(batch),
                        () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                        () = sleep_until_opt(poison_retry), if poison_retry.is_some() => Step::PoisonRetry,
                        () = sleep_until_opt(liveness), if liveness.is_some() => Step::Liveness,
                    }
                };
                match step {
                    Step::Broker(Some(BrokerEvent::Confirmed(publisher_id, ids))) => {
                        self.liveness.heard(Instant::now());
                        self.on_confirmed(publisher_id, &ids)
                    }
                    Step::Broker(Some(BrokerEvent::Refused(publisher_id, refused))) => {
                        failure = Some(self.on_refused(publisher_id, &refused));
                    }
                    Step::Broker(Some(BrokerEvent::Alive)) => self.liveness.heard(Instant::now()),
                    Step::Liveness => failure = self.on_liveness(),
                    Step::Broker(Some(BrokerEvent::Closed(reason))) => {
                        failure = Some(Failure::Retry(reason));
                    }
                    Step::Broker(None) => failure = Some(Failure::Retry("connection lost".into())),
                    Step::Flushed(changed) => {
                        progress::on_flushed(&mut self.engine, &mut self.flushed, changed)
                    }
                    Step::Input(Some(batch)) => self.on_input(batch),
                    Step::Input(None) => {
                        input_open = false;
                        self.deadline = Some(Instant::now() + self.config.shutdown_timeout);
                    }
                    Step::Deadline => break,
                    Step::PoisonRetry => {
                        self.poison_retry = None;
                        if self.engine.window().unacked() == 0 {
                            failure = Some(Failure::Retry(
                                "renewing the connection to see whether the held message fits now"
                                    .into(),
                            ));
                        } else {
                            // Let what was sent before it be confirmed first.
                            self.poison_retry = Some(Instant::now() + self.config.backoff_initial);
                        }
                    }
                }
            }
            self.after_progress();
            let reconnected = match failure {
                None => true,
                Some(Failure::Stop(e)) => {
                    self.close().await;
                    return Err(e);
                }
                Some(Failure::Retry(reason)) => self.recover(reason).await?,
            };
            if !reconnected {
                break;
            }
        }
        Ok(self.finish().await)
    }

    fn on_input(&mut self, batch: WalBatch) {
        let builder = &mut self.builder;
        if let Err(too_many) =
            progress::feed(&mut self.engine, batch, |event| builder.build(&event))
        {
            self.halt = Some(self.halted(too_many.to_string()));
        }
    }

    fn halted(&self, reason: String) -> PublishError {
        PublishError::Halted {
            stream: self.config.stream.clone(),
            reason,
        }
    }

    /// Does what the engine asks until it has nothing to send: declares producers and
    /// sends publish frames.
    async fn publish(&mut self) -> Result<(), Failure> {
        loop {
            let Some(session) = &self.session else {
                return Ok(());
            };
            match self.engine.next() {
                Next::Idle => {
                    self.log_resends();
                    return Ok(());
                }
                Next::Declare { key, publisher_id } => {
                    let reference = self.builder.reference(key);
                    let last = match session
                        .declare(&self.config, publisher_id, reference.as_deref())
                        .await
                    {
                        Ok(last) => last,
                        Err(e) if e.is_transient() => return Err(Failure::Retry(e.to_string())),
                        Err(e) => return Err(Failure::Stop(e)),
                    };
                    if let Err(definite) = self.engine.declared(key, last) {
                        return Err(Failure::Stop(self.halted(definite.to_string())));
                    }
                    tracing::info!(
                        producer = reference.as_deref().unwrap_or("(unnamed)"),
                        publisher_id,
                        last_publishing_id = last,
                        "declared the stream producer"
                    );
                }
                Next::Publish {
                    publisher_id, seqs, ..
                } => {
                    let window = self.engine.window();
                    let messages: Vec<(Message, Option<String>)> = seqs
                        .iter()
                        .filter_map(|seq| window.get(*seq))
                        .map(|p| {
                            if let Some(span) = &p.trace {
                                span.published();
                            }
                            (p.message.clone(), p.filter_value.clone())
                        })
                        .collect();
                    let n = messages.len() as u64;
                    self.report.published += n;
                    metrics::counter!(status::EVENTS_PUBLISHED).increment(n);
                    // A broker that takes no data (paused, its socket full) is as dead
                    // as a silent one (`liveness.rs`).
                    let limit = self.liveness.limit();
                    let sent =
                        tokio::time::timeout(limit, session.client.publish(publisher_id, messages))
                            .await;
                    match sent {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(Failure::Retry(format!("publish failed: {e}"))),
                        Err(_) => {
                            self.silent = Some(self.url_index);
                            return Err(Failure::Retry(format!(
                                "the broker took no publish frame for {:.1} s",
                                limit.as_secs_f64()
                            )));
                        }
                    }
                }
                Next::Poison {
                    seq,
                    frame_bytes,
                    frame_max,
                } => {
                    self.on_poison(seq, frame_bytes, frame_max);
                    return Ok(());
                }
            }
        }
    }

    /// Says how many events the broker already held and got again (it drops them as
    /// duplicates).
    fn log_resends(&mut self) {
        let resent = self.engine.resent();
        if resent > self.resends_logged {
            tracing::info!(
                resent = resent - self.resends_logged,
                "events the stream already held were sent again; the broker drops them as duplicates"
            );
            self.resends_logged = resent;
        }
    }

    /// The next event cannot fit in a frame: report it, and renew the connection
    /// (with backoff) to see whether the broker's limit was raised.
    fn on_poison(&mut self, seq: u64, frame_bytes: usize, frame_max: usize) {
        let Some(pending) = self.engine.window().get(seq) else {
            return;
        };
        let poison = PoisonMessage {
            message_id: pending.message_id.clone(),
            commit_lsn: pending.commit_lsn,
            tx_index: pending.index,
            routing_key: format!("stream={}", self.config.stream),
            reason: match &pending.malformed {
                Some(why) => why.to_string(),
                None => format!(
                    "its publish frame is {frame_bytes} bytes, over the {frame_max} bytes the broker accepts (its stream frame_max)"
                ),
            },
        };
        let due = self
            .poison_logged
            .is_none_or(|t| t.elapsed() >= POISON_LOG_EVERY);
        if due && pending.malformed.is_some() {
            self.poison_logged = Some(Instant::now());
            tracing::error!(
                message_id = %poison.message_id,
                commit_lsn = %poison.commit_lsn,
                tx_index = poison.tx_index,
                stream = %self.config.stream,
                reason = %outbox_event::redact::printable(&poison.reason),
                "this logical message's content is malformed: it holds the relay (nothing after it is published) until it is skipped (docs/messages.md, docs/recovery.md \"A poison message\")"
            );
        } else if due {
            self.poison_logged = Some(Instant::now());
            tracing::error!(
                message_id = %poison.message_id,
                commit_lsn = %poison.commit_lsn,
                tx_index = poison.tx_index,
                stream = %self.config.stream,
                frame_bytes,
                frame_max,
                "a message is larger than the stream's frame maximum: it holds the relay (nothing after it is published) until the broker's stream frame_max is raised, or it is skipped (docs/recovery.md, \"A poison message\")"
            );
        }
        if self.status.poison().as_ref() != Some(&poison) {
            self.status.set_poison(Some(poison));
        }
        if self.poison_retry.is_none() {
            self.failures = self.failures.saturating_add(1);
            let delay = crate::backoff::delay(
                self.config.backoff_initial,
                self.config.backoff_max,
                self.failures,
            );
            self.poison_retry = Some(Instant::now() + delay);
        }
    }

    /// Probes a silent connection, or gives it up (`liveness.rs`).
    fn on_liveness(&mut self) -> Option<Failure> {
        match self.liveness.due(Instant::now())? {
            Due::Probe => {
                if let Some(session) = &self.session {
                    session.probe(&self.config.stream, self.liveness.limit());
                }
                None
            }
            Due::Dead(silent) => {
                self.silent = Some(self.url_index);
                Some(Failure::Retry(format!(
                    "nothing from the broker for {:.1} s with {} message(s) unconfirmed (two heartbeat intervals of {} s)",
                    silent.as_secs_f64(),
                    self.engine.window().unacked(),
                    self.config.heartbeat.as_secs()
                )))
            }
        }
    }

    fn on_confirmed(&mut self, publisher_id: u8, ids: &[u64]) {
        let acked = self.engine.confirmed(publisher_id, ids);
        if acked > 0 {
            if self.engine.poison().is_none() {
                self.failures = 0;
            }
            self.report.acked += acked;
            metrics::counter!(status::EVENTS_ACKED).increment(acked);
        }
    }

    fn on_refused(&mut self, publisher_id: u8, refused: &[(u64, ResponseCode)]) -> Failure {
        let ids: Vec<u64> = refused.iter().map(|(id, _)| *id).collect();
        self.engine.refused(publisher_id, &ids);
        self.report.nacked += ids.len() as u64;
        metrics::counter!(status::EVENTS_NACKED).increment(ids.len() as u64);
        let code = refused
            .first()
            .map(|(_, c)| format!("{c:?}"))
            .unwrap_or_default();
        Failure::Retry(format!(
            "the broker refused {} message(s) from publishing id {} ({code})",
            ids.len(),
            ids.iter().min().copied().unwrap_or_default()
        ))
    }

    fn after_progress(&mut self) {
        if self.flushed.is_none() {
            // Without the reader's flushed positions the watermark counts as sent, or
            // a window full of passed but "unflushed" messages would never publish.
            let watermark = self.engine.watermark();
            self.engine.flushed(watermark);
        }
        let watermark = self.engine.watermark();
        progress::publish_watermark(watermark, &mut self.report, &self.watermark, &self.status);
        if self.engine.poison().is_none() && self.poison_logged.is_some() {
            self.poison_logged = None;
            self.poison_retry = None;
            self.status.set_poison(None);
            tracing::info!(stream = %self.config.stream, "the held message fits now; publishing goes on");
        }
        let window = self.engine.window();
        let oldest = window.oldest_message().map(|p| p.commit_time_micros);
        self.status
            .set_in_flight(window.in_flight(), window.buffered(), oldest);
        // The oldest waiting event, for a stall to name (`crate::watchdog`): told only
        // when the front moves, which is progress.
        let front = window.front_seq();
        if self.front_seen != Some(front) {
            self.status.add_progress();
            self.front_seen = Some(front);
            let oldest = window.oldest_message().map(|p| {
                std::sync::Arc::new(crate::status::Waiting {
                    message_id: p.message_id.clone(),
                    commit_lsn: p.commit_lsn,
                    destination: String::new(),
                }) as std::sync::Arc<dyn crate::status::Describe>
            });
            self.status.set_oldest(oldest);
        }
    }

    /// Ends the connection and connects again (with backoff); `Ok(false)` when the
    /// shutdown deadline passed first.
    async fn recover(&mut self, reason: String) -> Result<bool, PublishError> {
        self.status.set_connected(false);
        self.report.retries += 1;
        metrics::counter!(status::PUBLISH_RETRIES).increment(1);
        let poisoned = self.engine.poison().is_some();
        if !poisoned {
            tracing::warn!(
                stream = %self.config.stream,
                %reason,
                buffered = self.engine.window().buffered(),
                "stream publishing failed; reconnecting and resending what is unconfirmed"
            );
        }
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        self.engine.disconnected();
        loop {
            if !poisoned {
                self.failures = self.failures.saturating_add(1);
                let delay = crate::backoff::delay(
                    self.config.backoff_initial,
                    self.config.backoff_max,
                    self.failures,
                );
                let wake = Instant::now() + delay;
                if self.deadline.is_some_and(|d| d <= wake) {
                    tokio::time::sleep_until(self.deadline.unwrap_or(wake)).await;
                    return Ok(false);
                }
                tokio::time::sleep_until(wake).await;
            }
            // The next node first, as the AMQP publisher does; then its stream's leader.
            let next = (self.url_index + 1) % self.config.urls.len();
            let connected = leader::connect_to_leader(&self.config, next, self.silent).await;
            let session = match connected {
                Ok(session) => session,
                Err(e) if e.is_transient() => {
                    tracing::debug!(error = %e, "stream reconnect failed");
                    continue;
                }
                Err(e) => return Err(e),
            };
            tracing::info!(
                node = %redact_url(&self.config.urls[session.url_index]),
                frame_max = session.frame_max,
                "reconnected to the rabbitmq stream"
            );
            self.url_index = session.url_index;
            self.silent = None;
            self.liveness.reset();
            self.engine.connected(session.frame_max);
            self.session = Some(session);
            self.report.reconnects += 1;
            self.status.add_reconnect();
            self.status.set_connected(true);
            return Ok(true);
        }
    }

    async fn close(&mut self) {
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        self.status.set_connected(false);
    }

    async fn finish(mut self) -> PublisherReport {
        self.report.abandoned = self.engine.window().buffered();
        self.report.watermark = self.engine.watermark();
        self.log_resends();
        self.close().await;
        self.report
    }
}

async fn recv_opt(
    events: Option<&mut mpsc::UnboundedReceiver<BrokerEvent>>,
) -> Option<BrokerEvent> {
    match events {
        Some(events) => events.recv().await,
        None => std::future::pending().await,
    }
}
