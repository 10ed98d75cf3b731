//! The publishing loop: one task, one `select!` over broker events, finished
//! publish writes, confirms (in publish order), the input and the shutdown deadline.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::{BoxFuture, MaybeDone};
use futures_util::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{Channel, Confirmation, Event, PublisherConfirm};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use wal_reader::event::{Lsn, WalBatch, WalItem};

use crate::connection::{connect_any, open_channel, Session};
use crate::error::{redact_url, PublishError};
use crate::message::{MessageBuilder, OutboundMessage};
use crate::status::{self, PublisherStatus};
use crate::window::Window;
use crate::{Publisher, PublisherConfig, PublisherReport};

/// Publish writes started but not yet handed to the socket, at most.
const MAX_PENDING_WRITES: usize = 256;
/// Bound on closing a dropped channel or the final connection close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

type Message = Arc<OutboundMessage>;
type PublishFuture = Pin<Box<MaybeDone<BoxFuture<'static, lapin::Result<PublisherConfirm>>>>>;

/// Which publish of a buffered message a confirm belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The configured exchange.
    Exchange,
    /// The dead-letter exchange, after the original was returned.
    DeadLetter,
}

struct PendingPublish {
    seq: u64,
    target: Target,
    future: PublishFuture,
    /// Polled once already (its frames are queued).
    started: bool,
}

struct PendingConfirm {
    seq: u64,
    target: Target,
    confirm: PublisherConfirm,
}

/// Why publishing must restart from the oldest unacked message.
#[derive(Debug)]
enum Failure {
    Nack,
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    Channel(lapin::Error),
    ConnectionEvent(lapin::Error),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Nack => f.write_str("the broker nacked a message"),
            Failure::Unroutable {
                exchange,
                routing_key,
            } => write!(
                f,
                "a message was unroutable (exchange {exchange:?}, routing key {routing_key:?}): bind a queue or set dead_letter_exchange"
            ),
            Failure::Channel(e) => write!(f, "channel error: {e}"),
            Failure::ConnectionEvent(e) => write!(f, "connection error: {e}"),
        }
    }
}

/// One step of the loop, chosen by `select!`.
enum Step {
    Event(Option<Event>),
    Written(Vec<(u64, Target, lapin::Result<PublisherConfirm>)>),
    Confirmed(Vec<(u64, Target, lapin::Result<Confirmation>)>),
    Input(Option<WalBatch>),
    Deadline,
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    /// The episode ends when the window's front passes this sequence number.
    until_seq: u64,
    retries: u64,
}

/// Whether recovery succeeded or the shutdown deadline passed first.
enum Recovered {
    Yes,
    DeadlinePassed,
}

pub(crate) struct Runner {
    config: PublisherConfig,
    tls: lapin::tcp::OwnedTLSConfig,
    session: Session,
    status: PublisherStatus,
    watermark: watch::Sender<Lsn>,
    builder: MessageBuilder,
    exchange: ShortString,
    window: Window<Message>,
    publishing: VecDeque<PendingPublish>,
    confirms: VecDeque<PendingConfirm>,
    blocked: bool,
    /// Consecutive failures without an ack in between (drives the backoff).
    failures: u32,
    /// The failure episode under way: it ends once everything that was buffered
    /// when it began is done (one warning per episode, not per retry).
    episode: Option<Episode>,
    report: PublisherReport,
    deadline: Option<Instant>,
}

impl Runner {
    pub(crate) fn new(
        publisher: Publisher,
        watermark: watch::Sender<Lsn>,
    ) -> Result<Self, PublishError> {
        let Publisher {
            config,
            tls,
            session,
            status,
        } = publisher;
        let builder = MessageBuilder::new(&config.routing_key, &config.extra_headers)?;
        let start = *watermark.borrow();
        status.set_acked_lsn(start);
        let blocked = session.connection.status().blocked();
        status.set_blocked(blocked);
        Ok(Self {
            exchange: ShortString::from(config.exchange.as_str()),
            window: Window::new(config.max_in_flight, start),
            builder,
            tls,
            session,
            status,
            watermark,
            publishing: VecDeque::new(),
            confirms: VecDeque::new(),
            blocked,
            failures: 0,
            episode: None,
            report: PublisherReport {
                watermark: start,
                ..PublisherReport::default()
            },
            deadline: None,
            config,
        })
    }

    pub(crate) async fn run(
        mut self,
        mut input: mpsc::Receiver<WalBatch>,
    ) -> Result<PublisherReport, PublishError> {
        let mut input_open = true;
        loop {
            if !input_open && self.window.is_empty() {
                break;
            }
            self.start_publishes();
            let want_input = input_open && !self.window.has_unpublished();
            let step = {
                let publishing = &mut self.publishing;
                let confirms = &mut self.confirms;
                let events = &mut self.session.events;
                let has_writes = !publishing.is_empty();
                let has_confirms = !confirms.is_empty();
                let deadline = self.deadline;
                tokio::select! {
                    biased;
                    event = events.next() => Step::Event(event),
                    done = poll_fn(|cx| poll_writes(publishing, cx)), if has_writes => Step::Written(done),
                    done = poll_fn(|cx| poll_confirms(confirms, cx)), if has_confirms => Step::Confirmed(done),
                    batch = input.recv(), if want_input => Step::Input(batch),
                    () = sleep_until_opt(deadline), if deadline.is_some() => Step::Deadline,
                }
            };
            let failure = match step {
                Step::Event(event) => self.on_event(event),
                Step::Written(done) => self.on_written(done),
                Step::Confirmed(done) => self.on_confirmed(done),
                Step::Input(Some(batch)) => {
                    self.on_input(batch);
                    None
                }
                Step::Input(None) => {
                    input_open = false;
                    self.deadline = Some(Instant::now() + self.config.shutdown_timeout);
                    None
                }
                Step::Deadline => break,
            };
            if let Some(failure) = failure {
                match self.recover(failure).await? {
                    Recovered::Yes => {}
                    Recovered::DeadlinePassed => break,
                }
            }
        }
        Ok(self.finish().await)
    }

    /// Starts publishes while the window has room and the broker does not block us.
    fn start_publishes(&mut self) {
        if self.blocked {
            return;
        }
        while self.publishing.len() < MAX_PENDING_WRITES {
            let Some((seq, message)) = self.window.next_to_publish() else {
                break;
            };
            let future = publish(
                &self.session.channel,
                self.exchange.clone(),
                message.clone(),
            );
            self.publishing.push_back(PendingPublish {
                seq,
                target: Target::Exchange,
                future,
                started: false,
            });
            self.report.published += 1;
            metrics::counter!(status::EVENTS_PUBLISHED).increment(1);
        }
    }

    fn on_input(&mut self, batch: WalBatch) {
        for item in batch {
            match item {
                WalItem::Event(event) => {
                    let message = self.builder.build(&event);
                    self.window.push_message(Arc::new(message));
                }
                WalItem::Commit(commit) => self.window.push_mark(commit.end_lsn),
                WalItem::Keepalive(lsn) => self.window.push_mark(lsn),
            }
        }
        self.after_progress();
    }

    fn on_event(&mut self, event: Option<Event>) -> Option<Failure> {
        match event {
            Some(Event::ConnectionBlocked(reason)) => {
                if !self.blocked {
                    tracing::warn!(%reason, "rabbitmq blocked publishing (resource alarm); holding the watermark until it unblocks");
                }
                self.blocked = true;
                self.status.set_blocked(true);
                None
            }
            Some(Event::ConnectionUnblocked) => {
                if self.blocked {
                    tracing::info!("rabbitmq unblocked publishing; resuming");
                }
                self.blocked = false;
                self.status.set_blocked(false);
                None
            }
            Some(Event::Error(error)) => {
                // Also sent for a channel the broker closed; ignore it when the
                // current channel is fine (the failure was already handled).
                if self.session.channel.status().connected()
                    && self.session.connection.status().connected()
                {
                    tracing::debug!(%error, "rabbitmq error event for an old channel");
                    None
                } else {
                    Some(Failure::ConnectionEvent(error))
                }
            }
            Some(other) => {
                tracing::debug!(event = ?other, "rabbitmq connection event");
                None
            }
            // The listener only ends with the connection itself.
            None => Some(Failure::ConnectionEvent(lapin::Error::from(
                lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed),
            ))),
        }
    }

    fn on_written(
        &mut self,
        done: Vec<(u64, Target, lapin::Result<PublisherConfirm>)>,
    ) -> Option<Failure> {
        for (seq, target, result) in done {
            match result {
                Ok(confirm) => self.confirms.push_back(PendingConfirm {
                    seq,
                    target,
                    confirm,
                }),
                Err(error) => return Some(Failure::Channel(error)),
            }
        }
        None
    }

    fn on_confirmed(
        &mut self,
        done: Vec<(u64, Target, lapin::Result<Confirmation>)>,
    ) -> Option<Failure> {
        let mut failure = None;
        let now = now_micros();
        for (seq, target, result) in done {
            match result {
                Ok(Confirmation::Ack(None)) => self.on_ack(seq, target, now),
                Ok(Confirmation::Ack(Some(returned))) => {
                    self.report.returned += 1;
                    metrics::counter!(status::EVENTS_RETURNED).increment(1);
                    let exchange = returned.delivery.exchange.to_string();
                    let routing_key = returned.delivery.routing_key.to_string();
                    match (&self.config.dead_letter_exchange, target) {
                        (Some(dlx), Target::Exchange) => {
                            let dlx = ShortString::from(dlx.as_str());
                            self.dead_letter(seq, dlx, &exchange, &routing_key);
                        }
                        _ => {
                            failure = Some(Failure::Unroutable {
                                exchange,
                                routing_key,
                            });
                            break;
                        }
                    }
                }
                Ok(Confirmation::Nack(_)) => {
                    self.report.nacked += 1;
                    metrics::counter!(status::EVENTS_NACKED).increment(1);
                    failure = Some(Failure::Nack);
                    break;
                }
                Ok(Confirmation::NotRequested) => {
                    failure = Some(Failure::Channel(lapin::Error::from(
                        lapin::ErrorKind::InvalidChannelState(
                            lapin::ChannelState::Connected,
                            "confirm mode is not enabled on the channel",
                        ),
                    )));
                    break;
                }
                Err(error) => {
                    failure = Some(Failure::Channel(error));
                    break;
                }
            }
        }
        self.after_progress();
        failure
    }

    fn on_ack(&mut self, seq: u64, target: Target, now_micros: i64) {
        if let Some(message) = self.window.get(seq) {
            let latency = now_micros.saturating_sub(message.commit_time_micros);
            metrics::histogram!(status::PUBLISH_LATENCY).record(latency.max(0) as f64 / 1e6);
            // Trace correlation (SPEC §4, §5): at debug level only; the check keeps
            // the header lookups off the hot path at info.
            if tracing::enabled!(tracing::Level::DEBUG) {
                trace_published(message);
            }
        }
        self.report.acked += 1;
        metrics::counter!(status::EVENTS_ACKED).increment(1);
        if target == Target::DeadLetter {
            self.report.dead_lettered += 1;
            metrics::counter!(status::EVENTS_DEAD_LETTERED).increment(1);
        }
        self.failures = 0;
        self.window.ack(seq);
        if let Some(episode) = self.episode {
            if self.window.front_seq() >= episode.until_seq {
                tracing::info!(retries = episode.retries, "publishing recovered");
                self.episode = None;
            }
        }
    }

    /// Republishes a returned message to the dead-letter exchange; its entry stays
    /// unacked until that publish is acked.
    fn dead_letter(&mut self, seq: u64, dlx: ShortString, exchange: &str, routing_key: &str) {
        let Some(original) = self.window.get(seq) else {
            return;
        };
        let mut message = OutboundMessage::clone(original);
        let mut headers = message.properties.headers().clone().unwrap_or_default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        headers.insert("x-outbox-error".into(), text("unroutable"));
        headers.insert("x-original-exchange".into(), text(exchange));
        headers.insert("x-original-routing-key".into(), text(routing_key));
        message.properties = message.properties.with_headers(headers);
        let future = publish(&self.session.channel, dlx, Arc::new(message));
        self.publishing.push_back(PendingPublish {
            seq,
            target: Target::DeadLetter,
            future,
            started: false,
        });
    }

    /// Publishes the watermark if it moved and refreshes the status.
    fn after_progress(&mut self) {
        if let Some(lsn) = self.window.advance() {
            self.report.watermark = lsn;
            self.watermark.send_replace(lsn);
            self.status.set_acked_lsn(lsn);
        }
        let lsn = self.window.watermark();
        if lsn > self.report.watermark {
            self.report.watermark = lsn;
            self.watermark.send_replace(lsn);
            self.status.set_acked_lsn(lsn);
        }
        self.status.set_in_flight(
            self.window.in_flight(),
            self.window.oldest_message().map(|m| m.commit_time_micros),
        );
    }

    /// Drops the channel, backs off, gets a fresh channel (reconnecting through the
    /// URL list when the connection is gone) and rewinds the window.
    async fn recover(&mut self, failure: Failure) -> Result<Recovered, PublishError> {
        let node = redact_url(&self.config.urls[self.session.url_index]);
        match &mut self.episode {
            None => {
                tracing::warn!(cause = %failure, %node, in_flight = self.window.in_flight(),
                    "publish failed; republishing from the oldest unacked message (retrying with backoff)");
                self.episode = Some(Episode {
                    until_seq: self.window.end_seq(),
                    retries: 1,
                });
            }
            Some(episode) => {
                episode.retries += 1;
                tracing::debug!(cause = %failure, "publish failed again");
            }
        }
        self.failures = self.failures.saturating_add(1);
        self.report.retries += 1;
        metrics::counter!(status::PUBLISH_RETRIES).increment(1);
        self.publishing.clear();
        self.confirms.clear();
        let resent = self.window.restart();
        tracing::debug!(resent, "window rewound");
        close_channel(self.session.channel.clone());

        let mut attempt = self.failures;
        loop {
            if !self.sleep_backoff(attempt).await {
                return Ok(Recovered::DeadlinePassed);
            }
            attempt = attempt.saturating_add(1);
            if self.session.connection.status().connected() {
                let opened = until_deadline(
                    self.deadline,
                    open_channel(&self.session.connection, &self.config, &node),
                )
                .await;
                let Some(opened) = opened else {
                    return Ok(Recovered::DeadlinePassed);
                };
                match opened {
                    Ok(channel) => {
                        self.session.channel = channel;
                        self.blocked = self.session.connection.status().blocked();
                        self.status.set_blocked(self.blocked);
                        return Ok(Recovered::Yes);
                    }
                    Err(e) if !e.is_transient() => return Err(e),
                    Err(e) => tracing::debug!(error = %e, "cannot open a channel; reconnecting"),
                }
            }
            self.status.set_connected(false);
            let next = (self.session.url_index + 1) % self.config.urls.len();
            let connected =
                until_deadline(self.deadline, connect_any(&self.config, &self.tls, next)).await;
            let Some(connected) = connected else {
                return Ok(Recovered::DeadlinePassed);
            };
            match connected {
                Ok(session) => {
                    let old = std::mem::replace(&mut self.session, session);
                    close_connection(old);
                    self.report.reconnects += 1;
                    self.status.add_reconnect();
                    tracing::info!(node = %redact_url(&self.config.urls[self.session.url_index]),
                        "reconnected to rabbitmq");
                    self.status.set_connected(true);
                    self.blocked = self.session.connection.status().blocked();
                    self.status.set_blocked(self.blocked);
                    return Ok(Recovered::Yes);
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => tracing::debug!(error = %e, "rabbitmq still unreachable"),
            }
        }
    }

    /// Sleeps the backoff for `attempt` (1-based); false when the shutdown
    /// deadline passes first.
    fn sleep_backoff(&self, attempt: u32) -> impl Future<Output = bool> + Send + 'static {
        let delay = backoff(
            self.config.backoff_initial,
            self.config.backoff_max,
            attempt,
            rand::thread_rng().gen_range(0.5..=1.0),
        );
        Self::sleep_unless_deadline(Instant::now() + delay, self.deadline)
    }

    async fn sleep_unless_deadline(wake: Instant, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(deadline) if deadline <= wake => {
                tokio::time::sleep_until(deadline).await;
                false
            }
            _ => {
                tokio::time::sleep_until(wake).await;
                true
            }
        }
    }

    async fn finish(mut self) -> PublisherReport {
        self.report.abandoned = self.window.in_flight();
        if self.report.abandoned > 0 {
            tracing::warn!(
                unacked = self.report.abandoned,
                watermark = %self.report.watermark,
                "shutdown timeout passed with unacked messages; they will be published again after a restart"
            );
        }
        self.publishing.clear();
        self.confirms.clear();
        let connection = self.session.connection;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "OK".into())).await;
        self.status.set_connected(false);
        self.report
    }
}

/// Starts one publish; the future resolves once lapin wrote the frames.
/// One debug event per acked message, with the fields a trace is correlated by.
fn trace_published(message: &OutboundMessage) {
    let headers = message.properties.headers().as_ref();
    let header = |key: &str| headers.and_then(|h| h.inner().get(key));
    let commit_lsn = match header("commit_lsn") {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        _ => String::new(),
    };
    let xid = match header("xid") {
        Some(AMQPValue::LongLongInt(x)) => *x,
        _ => -1,
    };
    tracing::debug!(
        message_id = message.properties.message_id().as_ref().map_or("", |id| id.as_str()),
        commit_lsn = %commit_lsn,
        xid,
        routing_key = message.routing_key.as_str(),
        "message published"
    );
}

fn publish(channel: &Channel, exchange: ShortString, message: Message) -> PublishFuture {
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
                message.properties.clone(),
            )
            .await
    });
    Box::pin(MaybeDone::Future(future))
}

/// Gives every new write its first poll, in publish order (that poll enqueues the
/// frames, so the order on the wire is the publish order), then takes the finished
/// writes from the front. Only the front is polled again: lapin writes frames in
/// order, so later writes never finish first.
fn poll_writes(
    pending: &mut VecDeque<PendingPublish>,
    cx: &mut Context<'_>,
) -> Poll<Vec<(u64, Target, lapin::Result<PublisherConfirm>)>> {
    let new = pending.iter().rev().take_while(|p| !p.started).count();
    let first_new = pending.len() - new;
    for p in pending.range_mut(first_new..) {
        let _ = p.future.as_mut().poll(cx);
        p.started = true;
    }
    let mut done = Vec::new();
    while let Some(front) = pending.front_mut() {
        if front.future.as_mut().poll(cx).is_pending() {
            break;
        }
        match front.future.as_mut().take_output() {
            Some(result) => {
                let seq = front.seq;
                let target = front.target;
                pending.pop_front();
                done.push((seq, target, result));
            }
            None => break,
        }
    }
    if done.is_empty() {
        Poll::Pending
    } else {
        Poll::Ready(done)
    }
}

/// Polls confirms in publish order and returns every one that is ready at the front.
fn poll_confirms(
    pending: &mut VecDeque<PendingConfirm>,
    cx: &mut Context<'_>,
) -> Poll<Vec<(u64, Target, lapin::Result<Confirmation>)>> {
    let mut done = Vec::new();
    while let Some(front) = pending.front_mut() {
        match Pin::new(&mut front.confirm).poll(cx) {
            Poll::Ready(result) => {
                done.push((front.seq, front.target, result));
                pending.pop_front();
            }
            Poll::Pending => break,
        }
    }
    if done.is_empty() {
        Poll::Pending
    } else {
        Poll::Ready(done)
    }
}

/// Runs `future` unless the deadline passes first (`None` then).
async fn until_deadline<F: Future>(deadline: Option<Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Exponential backoff: `initial * 2^(attempt-1)` capped at `max`, scaled by
/// `jitter` (0.5–1.0).
pub(crate) fn backoff(initial: Duration, max: Duration, attempt: u32, jitter: f64) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    let base = initial.saturating_mul(1u32 << exp).min(max);
    base.mul_f64(jitter.clamp(0.0, 1.0))
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Closes a channel we stopped using without waiting for it.
fn close_channel(channel: Channel) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, "retrying".into())).await;
    });
}

fn close_connection(session: Session) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(
            CLOSE_TIMEOUT,
            session.connection.close(200, "reconnecting".into()),
        )
        .await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let i = Duration::from_millis(100);
        let m = Duration::from_secs(2);
        assert_eq!(backoff(i, m, 1, 1.0), Duration::from_millis(100));
        assert_eq!(backoff(i, m, 2, 1.0), Duration::from_millis(200));
        assert_eq!(backoff(i, m, 4, 1.0), Duration::from_millis(800));
        assert_eq!(backoff(i, m, 10, 1.0), m);
        assert_eq!(backoff(i, m, 100, 1.0), m);
        assert_eq!(backoff(i, m, 2, 0.5), Duration::from_millis(100));
    }
}
