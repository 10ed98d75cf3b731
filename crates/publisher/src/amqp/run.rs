//! The publishing loop: the I/O shell around [`Engine`]. One task, one `select!` over
//! the connection ([`Connection`]: writes, confirms, returns, blocked notices), the
//! input, the flushed position and the shutdown deadline. Every decision is the
//! engine's (`engine.rs`); this file encodes its sends into the connection's buffer
//! and hands it what the broker sent back (`run/answers.rs`). Exchanges chosen by
//! events are declared before their first publish (`run/exchanges.rs`, with
//! `amqp/destinations.rs`). Failures and the recovery from them are in
//! `run/recover.rs`.
//!
//! Each turn of the loop first ends the channel if a failure waits (so no failure
//! found while declaring, while reading or while publishing is ever left behind),
//! then publishes what the engine allows, then waits for one thing to happen.

use std::convert::Infallible;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use amq_protocol::types::ShortString;
use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::amqp::config::PublisherConfig;
use crate::amqp::connection::{ConnError, Connection, Event};
use crate::amqp::destinations::{Destinations, Policy, Verdict};
use crate::amqp::engine::{Engine, Outgoing};
use crate::amqp::message::{MessageBuilder, OutboundMessage};
use crate::amqp::Publisher;
use crate::error::PublishError;
use crate::progress::{self, changed_lsn, sleep_until_opt};
use crate::report::PublisherReport;
use crate::status::{self, PublisherStatus};
use crate::tls::Tls;
use crate::trace::EventTracer;
use recover::{Episode, Recovered};

mod answers;
mod exchanges;
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
    /// Exchanges named per event (docs/routing.md): which names rows may choose,
    /// and what the broker said of each.
    destinations: Destinations,
    /// Whether any message so far was given an exchange of its own: until one is,
    /// there is nothing to declare and no peek at the next message (the default
    /// single exchange pays nothing for routing per event).
    named_exchanges: bool,
    /// An exchange to declare before the next send.
    to_declare: Option<ShortString>,
    /// Starts each event's `publish` span; `None` while tracing is off.
    tracer: Option<EventTracer>,
    /// The window's front when the status last heard of it.
    front_seen: Option<u64>,
    /// The reconnect failure last logged (each kind once per episode).
    renew_logged: Option<String>,
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
            .with_exchange(crate::message::ExchangeRule::new(
                &config.exchange,
                config.exchange_from_events,
            )?);
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        status.set_poison(None);
        status.set_destination(&config.exchange);
        let blocked = conn.blocked();
        status.set_blocked(blocked);
        let policy = Policy::new(
            &config.exchange,
            &config.allowed_exchanges,
            config.dead_letter_exchange.as_deref(),
        );
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
            )
            .with_max_bytes(config.max_in_flight_bytes),
            destinations: Destinations::new(policy, config.max_declared_exchanges),
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
            named_exchanges: false,
            to_declare: None,
            tracer: EventTracer::get(),
            front_seen: None,
            renew_logged: None,
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
            // A failure found anywhere (reading, publishing, declaring) ends the
            // channel before anything else is done: nothing waits for a connection
            // that has already reported its end.
            if let Some(failure) = self.take_failure() {
                match self.recover(failure, &input).await {
                    Recovered::Yes => {}
                    Recovered::DeadlinePassed => break,
                    Recovered::Refused(e) => {
                        self.status.set_connected(false);
                        return Err(e);
                    }
                }
                continue;
            }
            self.start_publishes();
            if let Some(exchange) = self.to_declare.take() {
                self.declare_exchange(exchange).await;
                self.after_progress();
                continue;
            }
            // Take input only once everything buffered is published (backpressure),
            // but always notice that it closed (the shutdown deadline starts then).
            let want_input =
                input_open && (!self.engine.window().has_unpublished() || input.is_closed());
            self.status.set_queued(!input.is_empty());
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
        }
        Ok(self.finish().await)
    }

    /// Encodes the publishes the engine allows while the broker does not block us
    /// and the socket keeps up.
    fn start_publishes(&mut self) {
        // The connection's own state too: a block (or `channel.flow` off) read
        // during a request is acted on before its notice is handed out.
        if self.blocked || self.conn.blocked() || !self.conn.channel_open() {
            return;
        }
        while self.conn.unwritten() < MAX_UNWRITTEN {
            if let Some(exchange) = self.next_undeclared_exchange() {
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
                destinations,
                ..
            } = self;
            let sent = engine.send_next(|send, original| {
                let own = original.exchange.as_ref().unwrap_or(exchange);
                // A logical message whose content is malformed, or an event whose
                // exchange is refused, is poison before any framing: its notice
                // may go to the DLX (docs/messages.md, docs/routing.md).
                if let Outgoing::Main { .. } = send {
                    let why = match &original.event.malformed {
                        Some(why) => Some(why.to_string()),
                        None => match original.exchange.as_ref().map(|x| destinations.verdict(x)) {
                            Some(Verdict::Refuse(why)) => Some(why.to_string()),
                            _ => MessageBuilder::check_row_properties(&original.event).err(),
                        },
                    };
                    if let Some(why) = why {
                        unfit = Some((send.clone(), why.clone()));
                        return Err(why);
                    }
                }
                let properties = builder.properties_of(original);
                let routing_key = original.routing_key.as_str();
                let published = match send {
                    Outgoing::Main { .. } => {
                        conn.publish(own.as_str(), routing_key, properties, &original.body)
                    }
                    Outgoing::DeadLetter { reason, .. } => {
                        // A copy that cannot be framed (a 200 KB aggregate id in its
                        // headers) is cut down until it fits: it never holds the relay.
                        let dlx = dead_letter.as_ref().map_or("", |d| d.as_str());
                        let copy = original.dead_letter_copy(properties, own.as_str(), reason);
                        let mut sent = conn.publish(
                            dlx,
                            routing_key,
                            builder.properties_of(&copy),
                            &copy.body,
                        );
                        for level in 1..=2 {
                            if sent.is_ok() {
                                break;
                            }
                            let small = copy.shrunk(level);
                            sent = conn.publish(
                                dlx,
                                routing_key,
                                builder.properties_of(&small),
                                &small.body,
                            );
                        }
                        sent
                    }
                };
                match published {
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
        let window = self.engine.window();
        self.status.set_in_flight(
            window.in_flight(),
            window.buffered(),
            window.oldest_message().map(|m| m.event.commit_time_micros),
        );
        // The oldest waiting event, for a stall to name (`crate::watchdog`): told
        // only when the front moves.
        let front = window.front_seq();
        if self.front_seen != Some(front) {
            // The oldest waiting entry settled: progress, for the watchdog.
            self.status.add_progress();
            self.front_seen = Some(front);
            let oldest = window
                .oldest_message()
                .map(|m| m.clone() as Arc<dyn status::Describe>);
            self.status.set_oldest(oldest);
        }
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
