//! The publishing loop: the I/O shell around [`Engine`]. One task, one `select!` over
//! the connection ([`Connection`]: writes, confirms, returns, blocked notices), the
//! input, the flushed position and the shutdown deadline. Every decision is the
//! engine's (`engine.rs`); this file encodes its sends into the connection's buffer
//! and hands it what the broker sent back. Failures and the recovery from them are
//! in `run/recover.rs`.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use amq_protocol::types::ShortString;
use opentelemetry::KeyValue;
use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::amqp::connection::{ConnError, Connection, Declare, Event, Returned as Return, Tls};
use crate::amqp::engine::{Engine, Failure, Outgoing, Returned, Settled, Target};
use crate::amqp::Publisher;
use crate::config::PublisherConfig;
use crate::error::PublishError;
use crate::message::{returned_key, ExchangeRule, MessageBuilder, OutboundMessage};
use crate::progress::{self, changed_lsn, sleep_until_opt};
use crate::report::PublisherReport;
use crate::status::{self, PublisherStatus};
use crate::trace::EventTracer;
use recover::{Episode, Recovered};

mod recover;
#[cfg(test)]
mod sim;

/// Encoded publishes not yet taken by the socket, at most (bytes): the engine's
/// sends wait while the socket is this far behind.
const MAX_UNWRITTEN: usize = 1024 * 1024;
/// Bound on waiting for a dropped channel's close-ok, or the final connection close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

type Message = Arc<OutboundMessage>;

/// One step of the loop, chosen by `select!`.
enum Step {
    /// What the connection read (empty when the write buffer has room again).
    Io(Result<Vec<Event>, ConnError>),
    Input(Option<WalBatch>),
    Flushed(Option<Lsn>),
    Deadline,
    /// The wait for the confirms before a nack is over.
    NackWait,
}

pub(crate) struct Runner {
    config: PublisherConfig,
    tls: Tls,
    conn: Box<Connection>,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    /// Positions sent to Postgres as flushed; `None`: the watermark counts as sent.
    flushed: Option<watch::Receiver<Lsn>>,
    builder: MessageBuilder,
    exchange: ShortString,
    dead_letter: Option<ShortString>,
    engine: Engine<Message>,
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
    /// Exchanges named per event (docs/routing.md) declared or found on this
    /// connection's broker, and those refused (with why): a message for one of
    /// those is poison.
    exchanges: HashSet<ShortString>,
    /// Whether any message so far was given an exchange of its own: until one is,
    /// there is nothing to declare and no peek at the next message (the default
    /// single exchange pays nothing for routing per event).
    named_exchanges: bool,
    missing_exchanges: HashMap<ShortString, String>,
    /// An exchange to declare before the next send.
    to_declare: Option<ShortString>,
    /// Starts each event's `publish` span; `None` while tracing is off.
    tracer: Option<EventTracer>,
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
            conn,
            status,
        } = publisher;
        let builder = MessageBuilder::new(&config.routing_key, &config.extra_headers)?
            .with_format(&config.format)
            .with_headers(config.headers)
            .with_exchange(ExchangeRule::new(
                &config.exchange,
                config.exchange_from_events,
            )?);
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        let blocked = conn.blocked();
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
            conn,
            status,
            watermark,
            flushed,
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
            exchanges: HashSet::new(),
            named_exchanges: false,
            missing_exchanges: HashMap::new(),
            to_declare: None,
            tracer: EventTracer::get(),
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
            if let Some(exchange) = self.to_declare.take() {
                self.declare_exchange(exchange).await;
                continue;
            }
            // Take input only once everything buffered is published (backpressure),
            // but always notice that it closed (the shutdown deadline starts then).
            let want_input =
                input_open && (!self.engine.window().has_unpublished() || input.is_closed());
            let step = {
                // The sends stopped at a full buffer: come back once it has room.
                let refill = self.conn.unwritten() >= MAX_UNWRITTEN;
                let conn = &mut self.conn;
                let flushed = self.flushed.as_mut();
                let has_flushed = flushed.is_some();
                let deadline = self.deadline;
                let nack_wait = self.nack_wait;
                tokio::select! {
                    biased;
                    io = poll_fn(|cx| poll_conn(conn, refill, cx)) => Step::Io(io),
                    changed = changed_lsn(flushed), if has_flushed => Step::Flushed(changed),
                    batch = input.recv(), if want_input => Step::Input(batch),
                    () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                    () = sleep_until_opt(nack_wait), if nack_wait.is_some() => Step::NackWait,
                }
            };
            match step {
                Step::Io(io) => self.on_io(io),
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
        if self.blocked || !self.conn.channel_open() {
            return;
        }
        while self.conn.unwritten() < MAX_UNWRITTEN {
            if let Some(exchange) = self.next_unknown_exchange() {
                self.to_declare = Some(exchange);
                break;
            }
            let mut unfit = None;
            let Runner {
                engine,
                conn,
                builder,
                exchange,
                dead_letter,
                report,
                missing_exchanges,
                ..
            } = self;
            let sent = engine.send_next(|send, original| {
                let own = original.exchange.as_ref().unwrap_or(exchange);
                // A logical message whose content is malformed, or an event whose
                // exchange is refused, is poison before any framing: its notice
                // may go to the DLX (docs/messages.md, docs/routing.md).
                if let Outgoing::Main { .. } = send {
                    let why = match (&original.event.malformed, missing_exchanges.get(own)) {
                        (Some(why), _) => Some(why.to_string()),
                        (None, Some(why)) => Some(why.clone()),
                        (None, None) if own.as_str().is_empty() && original.exchange.is_some() => {
                            Some("its exchange is empty: the [rabbitmq] exchange template rendered no name (docs/routing.md)".into())
                        }
                        (None, None) => MessageBuilder::check_row_properties(&original.event).err(),
                    };
                    if let Some(why) = why {
                        unfit = Some((send.clone(), why.clone()));
                        return Err(why);
                    }
                }
                let (exchange, message) = match send {
                    Outgoing::Main { .. } => (own.as_str(), original.clone()),
                    Outgoing::DeadLetter { reason, .. } => {
                        let properties = builder.properties_of(original);
                        let copy = original.dead_letter_copy(properties, own.as_str(), reason);
                        (
                            dead_letter.as_ref().map_or("", |d| d.as_str()),
                            Arc::new(copy),
                        )
                    }
                };
                let properties = builder.properties_of(&message);
                let body = &message.body;
                match conn.publish(exchange, message.routing_key.as_str(), properties, body) {
                    Ok(tag) => {
                        if let Outgoing::Main { .. } = send {
                            if let Some(span) = &original.trace {
                                span.published();
                            }
                            report.published += 1;
                            metrics::counter!(status::EVENTS_PUBLISHED).increment(1);
                        }
                        Ok(tag)
                    }
                    Err(e) => {
                        unfit = Some((send.clone(), e.0.clone()));
                        Err(e.0)
                    }
                }
            });
            if let Some((send, reason)) = unfit {
                self.report_unfit(&send, &reason);
            }
            if !sent {
                break;
            }
        }
    }

    fn on_input(&mut self, batch: WalBatch) {
        let builder = &mut self.builder;
        let (tracer, exchange) = (&mut self.tracer, &self.exchange);
        let named = &mut self.named_exchanges;
        let built: Result<(), Infallible> = progress::feed(&mut self.engine, batch, |event| {
            let mut message = builder.build_owned(event);
            *named |= message.exchange.is_some();
            if let Some(tracer) = tracer {
                let to = message.exchange.as_ref().unwrap_or(exchange).as_str();
                let span = tracer.start(&message.event, to, Some(message.routing_key.as_str()));
                message.trace = Some(span);
            }
            Ok(Arc::new(message))
        });
        let Ok(()) = built;
    }

    /// The exchange of the next message to publish when it is named per event and
    /// not yet declared (or checked) on this connection.
    fn next_unknown_exchange(&mut self) -> Option<ShortString> {
        if !self.named_exchanges {
            return None;
        }
        let message = self.engine.peek_next_main()?;
        let name = message.exchange.as_ref()?;
        (!name.as_str().is_empty()
            && name != &self.exchange
            && !self.exchanges.contains(name)
            && !self.missing_exchanges.contains_key(name))
        .then(|| name.clone())
    }

    /// Declares (or, without `declare_exchange`, checks) an exchange named per event
    /// on the control channel, before the first publish to it. A refusal makes its
    /// messages poison; a lost connection is a failure like any other.
    async fn declare_exchange(&mut self, name: ShortString) {
        let how = if self.config.declare_exchange {
            Declare::Active
        } else {
            Declare::Passive
        };
        // An exchange of the declared `[topology]` is declared as configured there
        // (its type, flags and arguments): a plain declaration would be refused.
        let topology = self.config.topology.clone();
        let declared = match topology.as_deref().and_then(|t| t.exchange(name.as_str())) {
            Some(e) => super::topology::declare_exchange(&mut self.conn, e, Declare::Active).await,
            None => {
                self.conn
                    .declare_exchange(name.as_str(), &self.config.exchange_type, how)
                    .await
            }
        };
        match declared {
            Ok(()) => {
                tracing::debug!(exchange = %name, "exchange ready");
                self.exchanges.insert(name);
            }
            Err(ConnError::ChannelClosed { code, text }) => {
                let why = format!(
                    "its exchange {:?} was refused: ({code}) {text}; {}",
                    name.as_str(),
                    match code {
                        403 => "grant the relay's user configure (to declare) and write on it (docs/security.md)",
                        406 => "it exists with another type or arguments: delete it, or declare it in [topology] as it is",
                        404 if !self.config.declare_exchange => {
                            "declare it, or set declare_exchange = true"
                        }
                        _ => "see the broker's answer",
                    }
                );
                tracing::error!(exchange = %name, reason = %why, "an exchange named by an event is refused; its events are poison (docs/routing.md)");
                self.missing_exchanges.insert(name, why);
            }
            Err(e) => self.channel_failed(Failure::Connection(e.to_string())),
        }
    }

    fn on_io(&mut self, io: Result<Vec<Event>, ConnError>) {
        let events = match io {
            Ok(events) => events,
            Err(error) => {
                self.channel_failed(Failure::Connection(error.to_string()));
                return;
            }
        };
        for event in events {
            match event {
                Event::Confirm { tag, ack } => {
                    if !ack {
                        self.report.nacked += 1;
                        metrics::counter!(status::EVENTS_NACKED).increment(1);
                    }
                    self.engine.confirmed(tag, ack);
                }
                Event::Return(returned) => {
                    let returned = self.returned(*returned);
                    self.engine.returned(returned);
                }
                Event::ChannelClosed { code, text } => self.channel_failed(Failure::Channel {
                    code: Some(code),
                    text: format!("({code}) {text}"),
                }),
                Event::Blocked(reason) => {
                    if !self.blocked {
                        tracing::warn!(%reason, "rabbitmq blocked publishing (resource alarm); holding the watermark until it unblocks");
                    }
                    self.blocked = true;
                    self.status.set_blocked(true);
                }
                Event::Unblocked => {
                    if self.blocked {
                        tracing::info!("rabbitmq unblocked publishing; resuming");
                    }
                    self.blocked = false;
                    self.status.set_blocked(false);
                }
            }
        }
        self.count_settled();
    }

    /// A returned message, identified by its own headers (never by the confirm it
    /// arrived on: see `engine.rs`).
    fn returned(&mut self, r: Return) -> Returned {
        let Return {
            reply_text: reply,
            exchange,
            routing_key,
            properties,
            ..
        } = r;
        let target = match &self.dead_letter {
            Some(dlx) if dlx.as_str() == exchange => Target::DeadLetter,
            _ => Target::Exchange,
        };
        let key = returned_key(&properties);
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
                    if let Some(span) = &message.trace {
                        if target == Target::DeadLetter {
                            let dlx = self.dead_letter.as_ref().map_or("", |d| d.as_str());
                            span.event(
                                "dead_lettered",
                                vec![KeyValue::new("exchange", dlx.to_string())],
                            );
                        }
                        span.end();
                    }
                    self.failures = 0;
                }
                Settled::Returned { seq } => {
                    if let Some(span) = self.engine.message(seq).and_then(|m| m.trace.as_ref()) {
                        span.event("returned", Vec::new());
                    }
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
            self.engine.window().buffered(),
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
        if tokio::time::timeout(CLOSE_TIMEOUT, self.conn.close())
            .await
            .is_err()
        {
            self.conn.abandon();
        }
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

/// Polls the connection; ready with nothing when the write buffer that stopped the
/// sends (`refill`) is half empty, so that more are encoded while the socket takes
/// these.
fn poll_conn(
    conn: &mut Connection,
    refill: bool,
    cx: &mut Context<'_>,
) -> Poll<Result<Vec<Event>, ConnError>> {
    match conn.poll_io(cx) {
        Poll::Pending if refill && conn.unwritten() < MAX_UNWRITTEN / 2 => {
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
