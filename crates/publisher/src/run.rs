//! The publishing loop: the I/O shell around [`Engine`]. One task, one `select!` over
//! the publishing connection ([`Wire`]: writes, confirms, returns, blocked notices),
//! the session's events, the input, the flushed position and the shutdown deadline.
//! Every decision is the engine's (`engine.rs`); this file encodes its sends into
//! the connection's buffer and turns what the broker sent back into its inputs.
//! Failures and the recovery from them are in `run/recover.rs`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::types::ShortString;
use lapin::Event;
use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::config::PublisherConfig;
use crate::connection::Session;
use crate::engine::{Engine, Failure, Outgoing, Returned, Settled, Target};
use crate::error::PublishError;
use crate::message::{returned_key, MessageBuilder, OutboundMessage};
use crate::progress::{self, changed_lsn, sleep_until_opt};
use crate::report::PublisherReport;
use crate::status::{self, PublisherStatus};
use crate::wire::{Wire, WireError, WireEvent};
use crate::Publisher;
use recover::{Episode, Recovered};

mod recover;

/// Encoded publishes not yet taken by the socket, at most (bytes): the engine's
/// sends wait while the socket is this far behind.
const MAX_UNWRITTEN: usize = 1024 * 1024;
/// Bound on waiting for a dropped channel's close-ok, or the final connection close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

type Message = Arc<OutboundMessage>;

/// One step of the loop, chosen by `select!`.
enum Step {
    Event(Option<Event>),
    /// What the publishing connection read (empty for a round the engine asked for).
    Wire(Result<Vec<WireEvent>, WireError>),
    Input(Option<WalBatch>),
    Flushed(Option<Lsn>),
    Deadline,
    /// The wait for the confirms before a nack is over.
    NackWait,
}

/// The delivery tags of the current channel that are not confirmed yet.
#[derive(Default)]
struct Unconfirmed {
    /// The lowest tag not confirmed (tags start at 1).
    first: u64,
    /// Whether each tag from `first` on is confirmed.
    done: VecDeque<bool>,
}

impl Unconfirmed {
    fn reset(&mut self) {
        self.first = 1;
        self.done.clear();
    }

    fn published(&mut self, tag: u64) {
        debug_assert_eq!(tag, self.first + self.done.len() as u64);
        self.done.push_back(false);
    }

    /// The tags a confirm settles, in ascending order: `tag` alone, or with
    /// `multiple` every unconfirmed tag up to it. Tags confirmed already (or never
    /// published on this channel) are left out.
    fn settle(&mut self, tag: u64, multiple: bool, mut each: impl FnMut(u64)) {
        let end = self.first + self.done.len() as u64;
        if tag < self.first || tag >= end {
            return;
        }
        let from = if multiple { self.first } else { tag };
        for t in from..=tag {
            let slot = &mut self.done[(t - self.first) as usize];
            if !*slot {
                *slot = true;
                each(t);
            }
        }
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.first += 1;
        }
    }
}

pub(crate) struct Runner {
    config: PublisherConfig,
    tls: crate::connection::Tls,
    session: Session,
    /// The publishing connection.
    wire: Box<Wire>,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    /// Positions sent to Postgres as flushed; `None`: the watermark counts as sent.
    flushed: Option<watch::Receiver<Lsn>>,
    builder: MessageBuilder,
    exchange: ShortString,
    dead_letter: Option<ShortString>,
    engine: Engine<Message>,
    /// Delivery tags of the current channel awaiting their confirm.
    unconfirmed: Unconfirmed,
    /// Returns not yet attached to a confirm (the broker sends a message's return
    /// before its confirm; see `engine.rs` for why any confirm may carry it).
    returns: VecDeque<Returned>,
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
            wire,
            status,
        } = publisher;
        let builder = MessageBuilder::new(&config.routing_key, &config.extra_headers)?
            .with_format(&config.format)
            .with_headers(config.headers);
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        let blocked = wire.blocked();
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
            wire,
            status,
            watermark,
            flushed,
            unconfirmed: Unconfirmed {
                first: 1,
                done: VecDeque::new(),
            },
            returns: VecDeque::new(),
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
                // The sends stopped at a full buffer: come back once it has room.
                let refill = self.wire.unwritten() >= MAX_UNWRITTEN;
                let wire = &mut self.wire;
                let events = &mut self.session.events;
                let force = self.round_due;
                let flushed = self.flushed.as_mut();
                let has_flushed = flushed.is_some();
                let deadline = self.deadline;
                let nack_wait = self.nack_wait;
                tokio::select! {
                    biased;
                    event = events.next() => Step::Event(event),
                    io = poll_fn(|cx| poll_wire(wire, force, refill, cx)) => Step::Wire(io),
                    changed = changed_lsn(flushed), if has_flushed => Step::Flushed(changed),
                    batch = input.recv(), if want_input => Step::Input(batch),
                    () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                    () = sleep_until_opt(nack_wait), if nack_wait.is_some() => Step::NackWait,
                }
            };
            match step {
                Step::Event(event) => self.on_event(event),
                Step::Wire(io) => self.on_wire(io),
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

    /// Encodes the publishes the engine allows while the broker does not block us
    /// and the socket keeps up.
    fn start_publishes(&mut self) {
        if self.blocked || !self.wire.channel_open() {
            return;
        }
        while self.wire.unwritten() < MAX_UNWRITTEN {
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
            let sent = self.wire.publish(
                exchange.as_str(),
                message.routing_key.as_str(),
                true,
                properties,
                &message.body,
            );
            // The engine numbers a channel's publishes from 0, the broker from 1.
            debug_assert_eq!(sent, tag + 1, "the engine's tags follow the channel's");
            self.unconfirmed.published(sent);
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
            // The publishing connection's own notices count (`on_wire`): the
            // session publishes nothing.
            Some(Event::ConnectionBlocked(_) | Event::ConnectionUnblocked) => {}
            Some(Event::Error(error)) => {
                // Also sent for a channel the broker closed; ignore it when the
                // current channel is fine (the failure was already handled).
                if self.session.channel.status().connected()
                    && self.session.connection.status().connected()
                {
                    tracing::debug!(%error, "rabbitmq error event for an old channel");
                } else if self.session.connection.status().connected() {
                    self.channel_failed(recover::failure_of(&error));
                } else {
                    self.channel_failed(Failure::Connection(error.to_string()));
                }
            }
            Some(other) => tracing::debug!(event = ?other, "rabbitmq connection event"),
            // The listener only ends with the connection itself.
            None => self.channel_failed(Failure::Connection("the connection closed".into())),
        }
    }

    fn on_wire(&mut self, io: Result<Vec<WireEvent>, WireError>) {
        let events = match io {
            Ok(events) => events,
            Err(error) => {
                self.channel_failed(Failure::Connection(error.to_string()));
                return;
            }
        };
        for event in events {
            match event {
                WireEvent::Ack { tag, multiple } => self.confirm(tag, multiple, true),
                WireEvent::Nack { tag, multiple } => self.confirm(tag, multiple, false),
                WireEvent::Return {
                    reply_text,
                    exchange,
                    routing_key,
                    properties,
                    ..
                } => {
                    let returned = self.returned(exchange, routing_key, &reply_text, &properties);
                    self.returns.push_back(returned);
                }
                WireEvent::ChannelClosed { code, text } => self.channel_failed(Failure::Channel {
                    code: Some(code),
                    text: format!("({code}) {text}"),
                }),
                WireEvent::Blocked(reason) => {
                    if !self.blocked {
                        tracing::warn!(%reason, "rabbitmq blocked publishing (resource alarm); holding the watermark until it unblocks");
                    }
                    self.blocked = true;
                    self.status.set_blocked(true);
                }
                WireEvent::Unblocked => {
                    if self.blocked {
                        tracing::info!("rabbitmq unblocked publishing; resuming");
                    }
                    self.blocked = false;
                    self.status.set_blocked(false);
                }
            }
        }
        self.round_due = self.engine.end_round();
        self.count_settled();
    }

    /// Hands the engine the confirms of `tag` (and with `multiple` of every
    /// unconfirmed tag before it), in tag order, each with the oldest return not yet
    /// attached: a confirm that carries none is a witness (`engine.rs`).
    fn confirm(&mut self, tag: u64, multiple: bool, ack: bool) {
        let engine = &mut self.engine;
        let returns = &mut self.returns;
        let mut nacked = 0u64;
        self.unconfirmed.settle(tag, multiple, |t| {
            if !ack {
                nacked += 1;
            }
            engine.confirmed(t - 1, ack, returns.pop_front());
        });
        if nacked > 0 {
            self.report.nacked += nacked;
            metrics::counter!(status::EVENTS_NACKED).increment(nacked);
        }
    }

    /// A returned message, identified by its own headers (never by the confirm it
    /// arrived on: see `engine.rs`).
    fn returned(
        &mut self,
        exchange: String,
        routing_key: String,
        reply: &str,
        properties: &lapin::BasicProperties,
    ) -> Returned {
        let target = match &self.dead_letter {
            Some(dlx) if dlx.as_str() == exchange => Target::DeadLetter,
            _ => Target::Exchange,
        };
        let key = returned_key(properties);
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if self.dead_letter.is_none() || target == Target::DeadLetter {
            tracing::debug!(%exchange, %routing_key, %message_id, %reply, "message returned unroutable");
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
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.wire.close()).await;
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

/// Polls the publishing connection; ready with nothing when the engine asked for
/// another round (`force`), or when the write buffer that stopped the sends
/// (`refill`) is half empty, so that more are encoded while the socket takes these.
fn poll_wire(
    wire: &mut Wire,
    force: bool,
    refill: bool,
    cx: &mut Context<'_>,
) -> Poll<Result<Vec<WireEvent>, WireError>> {
    match wire.poll_io(cx) {
        Poll::Pending if force || (refill && wire.unwritten() < MAX_UNWRITTEN / 2) => {
            Poll::Ready(Ok(Vec::new()))
        }
        other => other,
    }
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::Unconfirmed;

    fn settled(u: &mut Unconfirmed, tag: u64, multiple: bool) -> Vec<u64> {
        let mut tags = Vec::new();
        u.settle(tag, multiple, |t| tags.push(t));
        tags
    }

    #[test]
    fn confirms_settle_each_tag_once_in_order() {
        let mut u = Unconfirmed::default();
        u.reset();
        for tag in 1..=6 {
            u.published(tag);
        }
        // A single ack out of order, then a multiple ack below and past it.
        assert_eq!(settled(&mut u, 3, false), [3]);
        assert_eq!(settled(&mut u, 4, true), [1, 2, 4]);
        assert_eq!(u.first, 5, "the front moved past everything confirmed");
        // Confirmed already, or never published: nothing.
        assert_eq!(settled(&mut u, 4, false), Vec::<u64>::new());
        assert_eq!(settled(&mut u, 9, true), Vec::<u64>::new());
        assert_eq!(settled(&mut u, 6, true), [5, 6]);
        assert!(u.done.is_empty());
        // A new channel numbers from 1 again.
        u.reset();
        u.published(1);
        assert_eq!(settled(&mut u, 1, true), [1]);
    }
}
