//! The stream publishing loop: one task, one `select!` over the broker's confirms
//! and refusals, the input, the flushed position and the shutdown deadline. The
//! bookkeeping is [`Window`]'s, as for the AMQP publisher; ids are assigned here
//! (module docs of `stream`).

use std::collections::HashMap;

use outbox_event::{Lsn, WalBatch, WalItem};
use rabbitmq_stream_client::types::{Message, ResponseCode};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::connection::{self, BrokerEvent, Session, PUBLISHER_ID};
use super::message::{Pending, StreamMessageBuilder};
use super::tail::Tail;
use super::{StreamConfig, StreamPublisher};
use crate::error::{redact_url, PublishError};
use crate::status::{self, PublisherStatus};
use crate::window::Window;
use crate::PublisherReport;

/// Messages in one publish frame, at most.
const MAX_BATCH: usize = 1000;
/// Estimated bytes in one publish frame, at most (the frame limit is 1 MiB).
const MAX_BATCH_BYTES: usize = 512 * 1024;

enum Step {
    Broker(Option<BrokerEvent>),
    Input(Option<WalBatch>),
    Flushed(Option<Lsn>),
    Deadline,
}

/// Why a session ended.
struct Failure(String);

pub(super) struct Runner {
    config: StreamConfig,
    session: Option<Session>,
    url_index: usize,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    flushed: Option<watch::Receiver<Lsn>>,
    builder: StreamMessageBuilder,
    window: Window<Pending>,
    /// Publishing id → window sequence of the messages sent on this connection.
    sent: HashMap<u64, u64>,
    /// The next publishing id to assign.
    next_id: u64,
    /// Ids up to this one are stored (named producer): confirmed without sending.
    stored_upto: u64,
    /// Events at or below it are already in the stream (skipped).
    tail: Option<Tail>,
    /// The lowest publishing id the broker refused.
    refused_min: Option<u64>,
    failures: u32,
    report: PublisherReport,
    deadline: Option<Instant>,
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
            tail,
            status,
        } = publisher;
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        let named = config.producer_reference.is_some();
        let last = if named { session.last_id } else { 0 };
        Runner {
            builder: StreamMessageBuilder::new(
                &config.extra_properties,
                config.producer_reference.clone(),
            )
            .with_format(&config.format)
            .with_headers(config.headers),
            window: Window::new(config.max_in_flight, start),
            url_index: session.url_index,
            session: Some(session),
            status,
            watermark,
            flushed,
            sent: HashMap::new(),
            next_id: last + 1,
            stored_upto: last,
            tail,
            refused_min: None,
            failures: 0,
            report: PublisherReport {
                watermark: start,
                ..PublisherReport::default()
            },
            deadline: None,
            config,
        }
    }

    fn named(&self) -> bool {
        self.config.producer_reference.is_some()
    }

    pub(super) async fn run(
        mut self,
        mut input: mpsc::Receiver<WalBatch>,
    ) -> Result<PublisherReport, PublishError> {
        let mut input_open = true;
        loop {
            if !input_open && self.window.is_empty() {
                break;
            }
            let mut failure = self.publish().await.err();
            if failure.is_none() {
                let want_input =
                    input_open && (!self.window.has_unpublished() || input.is_closed());
                let step = {
                    let events = self.session.as_mut().map(|s| &mut s.events);
                    let flushed = self.flushed.as_mut();
                    let has_flushed = flushed.is_some();
                    let deadline = self.deadline;
                    tokio::select! {
                        biased;
                        event = recv_opt(events) => Step::Broker(event),
                        changed = changed_lsn(flushed), if has_flushed => Step::Flushed(changed),
                        batch = input.recv(), if want_input => Step::Input(batch),
                        () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                    }
                };
                match step {
                    Step::Broker(Some(BrokerEvent::Confirmed(ids))) => self.on_confirmed(&ids),
                    Step::Broker(Some(BrokerEvent::Refused(refused))) => {
                        failure = Some(self.on_refused(&refused));
                    }
                    Step::Broker(Some(BrokerEvent::Closed(reason))) => {
                        failure = Some(Failure(reason));
                    }
                    Step::Broker(None) => failure = Some(Failure("connection lost".into())),
                    Step::Flushed(Some(lsn)) => self.window.flushed(lsn),
                    Step::Flushed(None) => {
                        self.flushed = None;
                        let lsn = self.window.watermark();
                        self.window.flushed(lsn);
                    }
                    Step::Input(Some(batch)) => self.on_input(batch),
                    Step::Input(None) => {
                        input_open = false;
                        self.deadline = Some(Instant::now() + self.config.shutdown_timeout);
                    }
                    Step::Deadline => break,
                }
            }
            self.after_progress();
            if let Some(failure) = failure {
                if !self.recover(failure).await? {
                    break;
                }
            }
        }
        Ok(self.finish().await)
    }

    fn on_input(&mut self, batch: WalBatch) {
        for item in batch {
            match item {
                WalItem::Event(event) => {
                    if let Some(tail) = self.tail {
                        let key = Tail {
                            commit_lsn: event.commit_lsn,
                            tx_index: event.index,
                        };
                        if key <= tail {
                            // Already in the stream (stored by an earlier session).
                            continue;
                        }
                        tracing::info!(
                            ?tail,
                            "skipped the events already in the stream; publishing from the next one"
                        );
                        self.tail = None;
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    let pending = self.builder.build(&event, id);
                    self.window.push_message(pending);
                }
                WalItem::Commit(commit) => self.window.push_mark(commit.end_lsn),
                WalItem::Keepalive(lsn) => self.window.push_mark(lsn),
            }
        }
        self.window.advance();
    }

    /// Sends what the window allows, in publish frames; messages already stored
    /// (ids up to `stored_upto`) are confirmed without sending.
    async fn publish(&mut self) -> Result<(), Failure> {
        let Some(session) = &self.session else {
            return Ok(());
        };
        loop {
            let mut batch: Vec<Message> = Vec::new();
            let mut stored = Vec::new();
            let mut bytes = 0;
            while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
                let Some((seq, pending)) = self.window.next_to_publish() else {
                    break;
                };
                if self.config.producer_reference.is_some() && pending.id <= self.stored_upto {
                    stored.push(seq);
                    continue;
                }
                self.sent.insert(pending.id, seq);
                bytes += pending.size;
                batch.push(pending.message.clone());
            }
            let progress = !stored.is_empty() || !batch.is_empty();
            for seq in stored {
                self.window.ack(seq);
            }
            // As `watermark_counts_as_flushed` (the session is borrowed here).
            if self.flushed.is_none() {
                let watermark = self.window.watermark();
                self.window.flushed(watermark);
            }
            if !batch.is_empty() {
                let n = batch.len() as u64;
                self.report.published += n;
                metrics::counter!(status::EVENTS_PUBLISHED).increment(n);
                if let Err(e) = session.client.publish(PUBLISHER_ID, batch).await {
                    return Err(Failure(format!("publish failed: {e}")));
                }
            }
            if !progress {
                return Ok(());
            }
        }
    }

    fn on_confirmed(&mut self, ids: &[u64]) {
        let mut acked = 0;
        for id in ids {
            if let Some(seq) = self.sent.remove(id) {
                self.window.ack(seq);
                acked += 1;
            }
        }
        if acked > 0 {
            self.failures = 0;
            self.report.acked += acked;
            metrics::counter!(status::EVENTS_ACKED).increment(acked);
        }
    }

    fn on_refused(&mut self, refused: &[(u64, ResponseCode)]) -> Failure {
        let min = refused.iter().map(|(id, _)| *id).min();
        if let Some(min) = min {
            self.refused_min = Some(self.refused_min.map_or(min, |m| m.min(min)));
        }
        self.report.nacked += refused.len() as u64;
        metrics::counter!(status::EVENTS_NACKED).increment(refused.len() as u64);
        let code = refused
            .first()
            .map(|(_, c)| format!("{c:?}"))
            .unwrap_or_default();
        Failure(format!(
            "the broker refused {} message(s) from publishing id {} ({code})",
            refused.len(),
            min.unwrap_or_default()
        ))
    }

    /// Without the reader's flushed positions the watermark counts as sent; done at
    /// every ack, or a window full of passed but "unflushed" messages would never
    /// publish again.
    fn watermark_counts_as_flushed(&mut self) {
        if self.flushed.is_none() {
            let watermark = self.window.watermark();
            self.window.flushed(watermark);
        }
    }

    fn after_progress(&mut self) {
        let watermark = self.window.watermark();
        self.watermark_counts_as_flushed();
        if watermark > self.report.watermark {
            self.report.watermark = watermark;
            self.status.set_acked_lsn(watermark);
            self.watermark.send_replace(watermark);
        }
        let oldest = self.window.oldest_message().map(|p| p.commit_time_micros);
        self.status.set_in_flight(self.window.in_flight(), oldest);
    }

    /// Ends the session and connects again (with backoff), checking the producer's
    /// last id; `Ok(false)` when the shutdown deadline passed first.
    async fn recover(&mut self, failure: Failure) -> Result<bool, PublishError> {
        self.status.set_connected(false);
        self.report.retries += 1;
        metrics::counter!(status::PUBLISH_RETRIES).increment(1);
        tracing::warn!(
            stream = %self.config.stream,
            reason = %failure.0,
            buffered = self.window.buffered(),
            "stream publishing failed; reconnecting and resending what is unconfirmed"
        );
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        self.sent.clear();
        loop {
            self.failures += 1;
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
            let session = match connection::connect_any(&self.config, self.url_index).await {
                Ok(session) => session,
                Err(e) if e.is_transient() => {
                    tracing::debug!(error = %e, "stream reconnect failed");
                    continue;
                }
                Err(e) => return Err(e),
            };
            if self.named() {
                self.check_last(session.last_id)?;
                self.stored_upto = session.last_id;
            }
            tracing::info!(
                node = %redact_url(&self.config.urls[session.url_index]),
                last_publishing_id = session.last_id,
                "reconnected to the rabbitmq stream"
            );
            self.url_index = session.url_index;
            self.session = Some(session);
            self.window.restart();
            self.report.reconnects += 1;
            self.status.add_reconnect();
            self.status.set_connected(true);
            return Ok(true);
        }
    }

    /// The broker's `last` must be an id this process assigned, and not at or past
    /// a refused one (module docs).
    fn check_last(&self, last: u64) -> Result<(), PublishError> {
        let stream = self.config.stream.clone();
        if last >= self.next_id {
            return Err(PublishError::Stream {
                stream,
                reason: format!(
                    "another writer uses producer reference {:?}: the broker stored publishing id {last}, this relay assigned ids below {} only; run one relay per slot",
                    self.config.producer_reference, self.next_id
                ),
            });
        }
        if let Some(refused) = self.refused_min.filter(|r| *r <= last) {
            return Err(PublishError::Stream {
                stream,
                reason: format!(
                    "the broker refused publishing id {refused} but stored a later one ({last}): that event can no longer be published under this producer reference"
                ),
            });
        }
        Ok(())
    }

    async fn finish(mut self) -> PublisherReport {
        self.report.abandoned = self.window.buffered();
        self.report.watermark = self.window.watermark();
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        self.status.set_connected(false);
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

async fn changed_lsn(flushed: Option<&mut watch::Receiver<Lsn>>) -> Option<Lsn> {
    let flushed = flushed?;
    flushed.changed().await.ok()?;
    let lsn = *flushed.borrow_and_update();
    Some(lsn)
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
