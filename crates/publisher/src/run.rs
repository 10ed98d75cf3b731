//! The publishing loop: the I/O shell around [`Engine`]. One task, one `select!` over
//! broker events, rounds of finished writes and confirms, the input, the flushed
//! position and the shutdown deadline. Every decision is the engine's (`engine.rs`);
//! this file turns lapin's futures into the engine's inputs and its sends into
//! `basic.publish` calls. Failures and the recovery from them are in
//! `run/recover.rs`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::{BoxFuture, MaybeDone};
use futures_util::StreamExt;
use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Event, PublisherConfirm};
use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::config::PublisherConfig;
use crate::confirms::ConfirmSet;
use crate::connection::Session;
use crate::engine::{Engine, Failure, Outgoing, Returned, Settled, Tag, Target};
use crate::error::PublishError;
use crate::message::{returned_key, MessageBuilder, OutboundMessage};
use crate::progress::{self, changed_lsn, sleep_until_opt};
use crate::report::PublisherReport;
use crate::status::{self, PublisherStatus};
use crate::Publisher;
use recover::{failure_of, Episode, Recovered};

mod recover;

/// Publish writes started but not yet handed to the socket, at most.
const MAX_PENDING_WRITES: usize = 256;
/// Bound on waiting for a dropped channel's close-ok, or the final connection close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

type Message = Arc<OutboundMessage>;
type PublishFuture = Pin<Box<MaybeDone<BoxFuture<'static, lapin::Result<PublisherConfirm>>>>>;

struct PendingPublish {
    tag: Tag,
    future: PublishFuture,
    /// Polled once already (its frames are queued).
    started: bool,
}

/// What one round of polling found.
#[derive(Default)]
struct Round {
    write_errors: Vec<lapin::Error>,
    confirms: Vec<(Tag, lapin::Result<Confirmation>)>,
}

/// One step of the loop, chosen by `select!`.
enum Step {
    Event(Option<Event>),
    Round(Round),
    Input(Option<WalBatch>),
    Flushed(Option<Lsn>),
    Deadline,
    /// The wait for the confirms before a nack is over.
    NackWait,
}

pub(crate) struct Runner {
    config: PublisherConfig,
    tls: crate::connection::Tls,
    session: Session,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    /// Positions sent to Postgres as flushed; `None`: the watermark counts as sent.
    flushed: Option<watch::Receiver<Lsn>>,
    builder: MessageBuilder,
    exchange: ShortString,
    dead_letter: Option<ShortString>,
    engine: Engine<Message>,
    publishing: VecDeque<PendingPublish>,
    confirms: ConfirmSet,
    /// The engine asked for another round at once (a witness waits for it).
    round_due: bool,
    blocked: bool,
    /// Consecutive failures without an ack in between (drives the backoff).
    failures: u32,
    /// The failure episode under way: it ends once everything that was buffered
    /// when it began is done (one warning per episode, not per retry).
    episode: Option<Episode>,
    /// The poison message reported, and when it was last logged.
    poison_logged: Option<(u64, Instant)>,
    report: PublisherReport,
    deadline: Option<Instant>,
    /// How long a nack waits for the confirms of the publishes before it
    /// ([`Engine::failure_ready`]) before the channel is closed anyway.
    nack_wait: Option<Instant>,
}

impl Runner {
    pub(crate) fn new(
        publisher: Publisher,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<Self, PublishError> {
        let Publisher {
            config,
            tls,
            session,
            status,
        } = publisher;
        let builder = MessageBuilder::new(&config.routing_key, &config.extra_headers)?
            .with_format(&config.format)
            .with_headers(config.headers);
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        let blocked = session.connection.status().blocked();
        status.set_blocked(blocked);
        Ok(Self {
            exchange: ShortString::from(config.exchange.as_str()),
            dead_letter: config
                .dead_letter_exchange
                .as_deref()
                .map(ShortString::from),
            engine: Engine::new(
                config.max_in_flight,
                start,
                config.dead_letter_exchange.is_some(),
            ),
            builder,
            tls,
            session,
            status,
            watermark,
            flushed,
            publishing: VecDeque::new(),
            confirms: ConfirmSet::default(),
            round_due: false,
            blocked,
            failures: 0,
            episode: None,
            poison_logged: None,
            report: PublisherReport {
                watermark: start,
                ..PublisherReport::default()
            },
            deadline: None,
            nack_wait: None,
            config,
        })
    }

    pub(crate) async fn run(
        mut self,
        mut input: mpsc::Receiver<WalBatch>,
    ) -> Result<PublisherReport, PublishError> {
        let mut input_open = true;
        loop {
            if !input_open && self.engine.window().is_empty() {
                break;
            }
            self.start_publishes();
            // Take input only once everything buffered is published (backpressure),
            // but always notice that it closed (the shutdown deadline starts then).
            let want_input =
                input_open && (!self.engine.window().has_unpublished() || input.is_closed());
            let step = {
                let publishing = &mut self.publishing;
                let confirms = &mut self.confirms;
                let events = &mut self.session.events;
                let force = self.round_due;
                let has_io = force || !publishing.is_empty() || !confirms.is_empty();
                let flushed = self.flushed.as_mut();
                let has_flushed = flushed.is_some();
                let deadline = self.deadline;
                let nack_wait = self.nack_wait;
                tokio::select! {
                    biased;
                    event = events.next() => Step::Event(event),
                    round = poll_fn(|cx| poll_round(publishing, confirms, force, cx)), if has_io => Step::Round(round),
                    changed = changed_lsn(flushed), if has_flushed => Step::Flushed(changed),
                    batch = input.recv(), if want_input => Step::Input(batch),
                    () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                    () = sleep_until_opt(nack_wait), if nack_wait.is_some() => Step::NackWait,
                }
            };
            match step {
                Step::Event(event) => self.on_event(event),
                Step::Round(round) => self.on_round(round),
                Step::Flushed(changed) => {
                    progress::on_flushed(&mut self.engine, &mut self.flushed, changed)
                }
                Step::Input(Some(batch)) => self.on_input(batch),
                Step::Input(None) => {
                    input_open = false;
                    self.deadline = Some(Instant::now() + self.config.shutdown_timeout);
                }
                Step::Deadline => break,
                Step::NackWait => {}
            }
            self.after_progress();
            if let Some(failure) = self.take_failure() {
                match self.recover(failure).await {
                    Recovered::Yes => {}
                    Recovered::DeadlinePassed => break,
                    Recovered::Refused(e) => {
                        self.status.set_connected(false);
                        return Err(e);
                    }
                }
            }
        }
        Ok(self.finish().await)
    }

    /// Starts the publishes the engine allows while the broker does not block us.
    fn start_publishes(&mut self) {
        if self.blocked {
            return;
        }
        while self.publishing.len() < MAX_PENDING_WRITES {
            let Some(send) = self.engine.next_send() else {
                break;
            };
            let (tag, exchange, message) = match send {
                Outgoing::Main { tag, seq } => {
                    let Some(message) = self.engine.message(seq).cloned() else {
                        continue;
                    };
                    self.report.published += 1;
                    metrics::counter!(status::EVENTS_PUBLISHED).increment(1);
                    (tag, self.exchange.clone(), message)
                }
                Outgoing::DeadLetter { tag, seq, reason } => {
                    let Some(original) = self.engine.message(seq) else {
                        continue;
                    };
                    let properties = self.builder.properties_of(original);
                    let copy =
                        original.dead_letter_copy(properties, &self.config.exchange, &reason);
                    let dlx = self.dead_letter.clone().unwrap_or_default();
                    (tag, dlx, Arc::new(copy))
                }
            };
            let properties = self.builder.properties_of(&message);
            let future = publish(&self.session.channel, exchange, message, properties);
            self.publishing.push_back(PendingPublish {
                tag,
                future,
                started: false,
            });
        }
    }

    fn on_input(&mut self, batch: WalBatch) {
        let builder = &mut self.builder;
        let built: Result<(), Infallible> = progress::feed(&mut self.engine, batch, |event| {
            Ok(Arc::new(builder.build(event)))
        });
        let Ok(()) = built;
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::ConnectionBlocked(reason)) => {
                if !self.blocked {
                    tracing::warn!(%reason, "rabbitmq blocked publishing (resource alarm); holding the watermark until it unblocks");
                }
                self.blocked = true;
                self.status.set_blocked(true);
            }
            Some(Event::ConnectionUnblocked) => {
                if self.blocked {
                    tracing::info!("rabbitmq unblocked publishing; resuming");
                }
                self.blocked = false;
                self.status.set_blocked(false);
            }
            Some(Event::Error(error)) => {
                // Also sent for a channel the broker closed; ignore it when the
                // current channel is fine (the failure was already handled).
                if self.session.channel.status().connected()
                    && self.session.connection.status().connected()
                {
                    tracing::debug!(%error, "rabbitmq error event for an old channel");
                } else if self.session.connection.status().connected() {
                    self.channel_failed(failure_of(&error));
                } else {
                    self.channel_failed(Failure::Connection(error.to_string()));
                }
            }
            Some(other) => tracing::debug!(event = ?other, "rabbitmq connection event"),
            // The listener only ends with the connection itself.
            None => self.channel_failed(Failure::Connection("the connection closed".into())),
        }
    }

    fn on_round(&mut self, round: Round) {
        for error in round.write_errors {
            self.channel_failed(failure_of(&error));
        }
        for (tag, result) in round.confirms {
            match result {
                Ok(Confirmation::Ack(returned)) => {
                    let returned = returned.map(|r| self.returned(r));
                    self.engine.confirmed(tag, true, returned);
                }
                Ok(Confirmation::Nack(returned)) => {
                    self.report.nacked += 1;
                    metrics::counter!(status::EVENTS_NACKED).increment(1);
                    let returned = returned.map(|r| self.returned(r));
                    self.engine.confirmed(tag, false, returned);
                }
                Ok(Confirmation::NotRequested) => self.channel_failed(Failure::Channel {
                    code: None,
                    text: "confirm mode is not enabled on the channel".into(),
                }),
                Err(error) => self.channel_failed(failure_of(&error)),
            }
        }
        self.round_due = self.engine.end_round();
        self.count_settled();
    }

    /// A returned message, identified by its own headers (never by the confirm it
    /// arrived on: see `engine.rs`).
    fn returned(&mut self, r: BasicReturnMessage) -> Returned {
        let exchange = r.delivery.exchange.to_string();
        let target = match &self.dead_letter {
            Some(dlx) if dlx.as_str() == exchange => Target::DeadLetter,
            _ => Target::Exchange,
        };
        let routing_key = r.delivery.routing_key.to_string();
        let key = returned_key(&r.delivery.properties);
        let message_id = r
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if self.dead_letter.is_none() || target == Target::DeadLetter {
            tracing::debug!(%exchange, %routing_key, %message_id, reply = %r.reply_text, "message returned unroutable");
        }
        Returned {
            key,
            target,
            exchange,
            routing_key,
        }
    }

    fn count_settled(&mut self) {
        let now = now_micros();
        for settled in self.engine.take_settled() {
            match settled {
                Settled::Acked { message, target } => {
                    let latency = now.saturating_sub(message.event.commit_time_micros);
                    metrics::histogram!(status::PUBLISH_LATENCY)
                        .record(latency.max(0) as f64 / 1e6);
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        trace_published(&message);
                    }
                    self.report.acked += 1;
                    metrics::counter!(status::EVENTS_ACKED).increment(1);
                    if target == Target::DeadLetter {
                        self.report.dead_lettered += 1;
                        metrics::counter!(status::EVENTS_DEAD_LETTERED).increment(1);
                    }
                    self.failures = 0;
                }
                Settled::Returned { .. } => {
                    self.report.returned += 1;
                    metrics::counter!(status::EVENTS_RETURNED).increment(1);
                }
            }
        }
    }

    /// Publishes the watermark if it moved and refreshes the status.
    fn after_progress(&mut self) {
        let lsn = self.engine.watermark();
        let moved =
            progress::publish_watermark(lsn, &mut self.report, &self.watermark, &self.status);
        if moved && self.flushed.is_none() {
            self.engine.flushed(lsn);
        }
        if self.engine.poison().is_none() && self.poison_logged.take().is_some() {
            tracing::info!("the refused message went through; resuming");
            self.status.set_poison(None);
        }
        self.end_episode_if_over();
        self.status.set_in_flight(
            self.engine.window().in_flight(),
            self.engine
                .window()
                .oldest_message()
                .map(|m| m.event.commit_time_micros),
        );
    }

    async fn finish(mut self) -> PublisherReport {
        self.report.abandoned = self.engine.window().buffered();
        if self.report.abandoned > 0 {
            tracing::warn!(
                unacked = self.report.abandoned,
                watermark = %self.report.watermark,
                "shutdown timeout passed with unacked messages; they will be published again after a restart"
            );
        }
        self.publishing.clear();
        let connection = self.session.connection;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "OK".into())).await;
        self.status.set_connected(false);
        self.report
    }
}

/// One debug event per acked message, with the fields a trace is correlated by.
fn trace_published(message: &OutboundMessage) {
    tracing::debug!(
        message_id = message.message_id(),
        commit_lsn = %message.key().commit_lsn,
        tx_index = message.key().index,
        xid = message.event.xid,
        routing_key = message.routing_key.as_str(),
        "message published"
    );
}

/// Starts one publish; the future resolves once lapin wrote the frames.
fn publish(
    channel: &Channel,
    exchange: ShortString,
    message: Message,
    properties: BasicProperties,
) -> PublishFuture {
    let channel = channel.clone();
    let future: BoxFuture<'static, _> = Box::pin(async move {
        channel
            .basic_publish(
                exchange,
                message.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &message.body,
                properties,
            )
            .await
    });
    Box::pin(MaybeDone::Future(future))
}

/// One round: gives every new write its first poll, in publish order (that poll
/// enqueues the frames, so the order on the wire is the publish order), takes the
/// finished writes from the front (lapin writes frames in order, so later writes
/// never finish first) and adds their confirms, then polls the new and the woken
/// confirms. Ready when anything was found, or at once when `force`.
fn poll_round(
    pending: &mut VecDeque<PendingPublish>,
    confirms: &mut ConfirmSet,
    force: bool,
    cx: &mut Context<'_>,
) -> Poll<Round> {
    let mut round = Round::default();
    let new = pending.iter().rev().take_while(|p| !p.started).count();
    let first_new = pending.len() - new;
    for p in pending.range_mut(first_new..) {
        let _ = p.future.as_mut().poll(cx);
        p.started = true;
    }
    while let Some(front) = pending.front_mut() {
        if front.future.as_mut().poll(cx).is_pending() {
            break;
        }
        let Some(result) = front.future.as_mut().take_output() else {
            break;
        };
        let tag = front.tag;
        pending.pop_front();
        match result {
            Ok(confirm) => confirms.insert(tag, confirm),
            Err(error) => round.write_errors.push(error),
        }
    }
    round.confirms = confirms.poll_resolved(cx);
    if force || !round.confirms.is_empty() || !round.write_errors.is_empty() {
        Poll::Ready(round)
    } else {
        Poll::Pending
    }
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
