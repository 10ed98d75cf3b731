//! The publishing state machine, without I/O: what to publish next, what a confirm
//! or a return means, when a message is done, and what a failure leaves to resend.
//!
//! [`crate::amqp::run`] is the thin shell around it that talks to the broker (over
//! the connection, `connection/`); the seeded simulation in `sim.rs` drives the
//! same engine against a scripted broker.
//!
//! # Delivery tags
//!
//! The connection numbers a channel's publishes as the broker does and hands over
//! one confirm per tag (`connection/confirms.rs`); the engine records the tag the
//! connection gave each publish and looks confirms up by it. It never computes a
//! tag itself.
//!
//! # Returns are matched by content, and certified by order
//!
//! `basic.return` carries no delivery tag. The engine identifies the returned
//! publish by the message's own `commit_lsn` and `tx_index` headers (unique per
//! event) and the exchange it was returned from (main or dead-letter).
//!
//! An ack only *settles* a publish once the publish is *certified*: every return of
//! it, if there was one, has been seen. The broker routes a channel's publishes in
//! order and sends every message's `basic.return` before any confirm it sends after
//! routing that message, and the connection hands frames over in the order they
//! arrived (docs/design.md, "Returns"). So when the confirm of publish *Z* is handed
//! over, the returns of every publish up to *Z* were handed over before it: the
//! confirm certifies every publish up to *Z* at once.
//!
//! # Settling, in publish order
//!
//! Certified publishes settle strictly in publish order: an acked, unreturned
//! publish acks its window entry; a returned one is republished to the dead-letter
//! exchange (and its entry waits for that copy's ack) or, without one, fails the
//! channel; a nack fails the channel at once. Settling in order keeps dead-lettered
//! copies in commit order and costs nothing: the watermark only moves at the front.
//!
//! # After a failure
//!
//! A nack ends the channel once every publish before the nacked one has settled
//! (their acks, sent only once the messages are on disk, often arrive after a
//! refusal), within a bound the shell keeps; any other failure ends it at once.
//! The shell closes the channel and waits for the broker's close-ok before
//! [`Engine::restart`], so nothing of the old channel can still be routed. The
//! window rewinds to the oldest unacked message, which is sent *alone* (solo); only
//! once it is acked does pipelining resume. A channel the broker closes for the
//! content of that solo message (406 PRECONDITION_FAILED: too large, bad header)
//! marks it *poison*: with a dead-letter exchange a notice of it goes there instead
//! (without the body, which is what was refused) and the relay moves on; without
//! one it is retried with backoff and reported (log, metric, `/readyz`).
//!
//! # Messages AMQP cannot carry
//!
//! A message whose content header does not fit the connection's frame size is never
//! sent ([`Engine::send_next`] learns it from the shell): with a dead-letter exchange
//! its notice goes there in its place; without one the engine holds before it, as
//! poison, and sends nothing more until a restart (the operator skips it); nothing
//! is retried in a loop.

use std::collections::{BTreeMap, HashMap, VecDeque};

use outbox_event::Lsn;

use crate::window::Window;

mod types;

pub use types::EventKey;
pub(crate) use types::{
    DeadLetterReason, Failure, Keyed, Outgoing, Poison, Returned, Settled, Target,
};

/// A window entry's sequence number.
pub(crate) type Seq = u64;
/// A publish's delivery tag on its channel, as the connection gave it.
pub(crate) type Tag = u64;

/// One publish on the current channel.
#[derive(Debug)]
struct Publish {
    tag: Tag,
    seq: Seq,
    target: Target,
    /// The confirm, once seen: ack (true) or nack.
    confirm: Option<bool>,
    returned: Option<Returned>,
}

/// The state machine; see the module docs.
#[derive(Debug)]
pub(crate) struct Engine<M> {
    window: Window<M>,
    dead_letter: bool,
    // ---- the current channel
    /// Unsettled publishes, in publish order (their tags increase).
    publishes: VecDeque<Publish>,
    by_key: HashMap<(EventKey, Target), Tag>,
    /// Publishes with a tag up to this one are certified.
    certified: Tag,
    /// Copies to send to the dead-letter exchange, in order.
    dead_letters: VecDeque<(Seq, DeadLetterReason)>,
    /// Send only one publish until it is acked (after a failure).
    solo: bool,
    /// After the broker refused a message it cannot be told from the others in
    /// flight (a 406 with several publishes outstanding), every entry up to this one
    /// is sent alone: the refused one is then found in one round trip each, instead
    /// of one failed channel (and backoff) for each message before it.
    careful_until: Option<Seq>,
    failure: Option<Failure>,
    /// The lowest nacked publish of this channel: a nack ends the channel only once
    /// every publish before it has settled ([`Engine::failure_ready`]).
    nacked_tag: Option<Tag>,
    // ---- across channels
    /// Refused messages whose notice goes to the dead-letter exchange instead.
    diverted: BTreeMap<Seq, String>,
    poison: Option<Poison>,
    /// A message that cannot be framed holds the window before it (no dead-letter
    /// exchange): nothing more is sent until a restart.
    held: bool,
    /// Settled publishes not yet taken by the shell (for counters).
    settled: Vec<Settled<M>>,
}

impl<M: Keyed + Clone> crate::progress::Progress<M> for Engine<M> {
    fn push_message(&mut self, message: M) {
        Engine::push_message(self, message)
    }
    fn push_mark(&mut self, lsn: Lsn) {
        Engine::push_mark(self, lsn)
    }
    fn flushed(&mut self, lsn: Lsn) {
        Engine::flushed(self, lsn)
    }
    fn watermark(&self) -> Lsn {
        Engine::watermark(self)
    }
}

impl<M: Keyed + Clone> Engine<M> {
    pub fn new(max_in_flight: usize, watermark: Lsn, dead_letter: bool) -> Self {
        Self {
            window: Window::new(max_in_flight, watermark),
            dead_letter,
            publishes: VecDeque::new(),
            by_key: HashMap::new(),
            certified: 0,
            dead_letters: VecDeque::new(),
            solo: false,
            careful_until: None,
            failure: None,
            nacked_tag: None,
            diverted: BTreeMap::new(),
            poison: None,
            held: false,
            settled: Vec::new(),
        }
    }

    /// Bounds the bytes published and not acked (`max_in_flight_bytes`).
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.window = self.window.with_max_bytes(max_bytes);
        self
    }

    pub fn window(&self) -> &Window<M> {
        &self.window
    }

    pub fn push_message(&mut self, message: M) {
        let bytes = message.bytes();
        self.window.push_sized(message, bytes);
    }

    pub fn push_mark(&mut self, lsn: Lsn) {
        self.window.push_mark(lsn);
        self.window.advance();
    }

    /// Postgres was sent `lsn` as the flush position.
    pub fn flushed(&mut self, lsn: Lsn) {
        self.window.flushed(lsn);
    }

    pub fn watermark(&self) -> Lsn {
        self.window.watermark()
    }

    /// The message of window entry `seq`.
    pub fn message(&self, seq: Seq) -> Option<&M> {
        self.window.get(seq)
    }

    pub fn poison(&self) -> Option<&Poison> {
        self.poison.as_ref()
    }

    /// Publishes of the current channel not settled yet.
    #[cfg(test)]
    pub fn outstanding(&self) -> usize {
        self.publishes.len()
    }

    /// The window entry of the one publish outstanding on the channel, if exactly
    /// one is (what a refusal naming nothing refers to).
    pub fn sole_publish(&self) -> Option<Seq> {
        match (self.publishes.front(), self.publishes.len()) {
            (Some(p), 1) => Some(p.seq),
            _ => None,
        }
    }

    #[cfg(test)]
    pub fn is_solo(&self) -> bool {
        self.solo
    }

    /// True when a failure is waiting to end the current channel.
    pub fn has_failed(&self) -> bool {
        self.failure.is_some()
    }

    /// True when the pending failure may end the channel now: at once, except for a
    /// nack, which waits until every publish before the nacked one has settled. The
    /// broker confirms a refused publish at once but a persisted one only once it is
    /// on disk, so the acks of earlier publishes often arrive after the nack; closing
    /// the channel then would throw them away and send those messages again (and
    /// into a queue that refuses publishes when full, nothing could ever be acked).
    /// The shell bounds the wait ([`Engine::force_failure`]).
    pub fn failure_ready(&self) -> bool {
        match &self.failure {
            None => false,
            Some(Failure::Nack) => self
                .nacked_tag
                .is_none_or(|t| self.publishes.front().is_none_or(|p| p.tag > t)),
            Some(_) => true,
        }
    }

    /// Takes the failure that ends the current channel, once it is ready
    /// ([`Engine::failure_ready`]).
    pub fn take_failure(&mut self) -> Option<Failure> {
        if self.failure_ready() {
            self.failure.take()
        } else {
            None
        }
    }

    /// Takes the pending failure whether or not it is ready (the shell's wait for
    /// the confirms before a nack timed out).
    pub fn force_failure(&mut self) -> Option<Failure> {
        self.failure.take()
    }

    /// Takes what settled since the last call (for counters).
    pub fn take_settled(&mut self) -> Vec<Settled<M>> {
        std::mem::take(&mut self.settled)
    }

    /// Makes the next publish, if the window and the channel allow one: `publish`
    /// sends it (the message of the entry it names is handed along) and returns the delivery tag the connection gave it, or why the
    /// message cannot be framed at all ([`Engine`] module docs). False when there
    /// was nothing to send.
    pub fn send_next(
        &mut self,
        publish: impl FnOnce(&Outgoing, &M) -> Result<Tag, String>,
    ) -> bool {
        let Some(send) = self.next_send() else {
            return false;
        };
        let Some(message) = self.window.get(send.seq()) else {
            return false;
        };
        match publish(&send, message) {
            Ok(tag) => self.record(tag, &send),
            Err(reason) => self.unfit(send, reason),
        }
        true
    }

    /// The message the next send would publish to its own exchange, if the next
    /// send is one (not a dead-letter copy, nothing holding the sends): the shell
    /// makes sure its exchange exists first.
    pub fn peek_next_main(&mut self) -> Option<&M> {
        if self.failure.is_some()
            || self.held
            || (self.one_at_a_time() && !self.publishes.is_empty())
            || !self.dead_letters.is_empty()
        {
            return None;
        }
        let (seq, _) = self.window.peek_next()?;
        if self.diverted.contains_key(&seq) {
            return None;
        }
        self.window.peek_next().map(|(_, m)| m)
    }

    fn next_send(&mut self) -> Option<Outgoing> {
        if self.failure.is_some()
            || self.held
            || (self.one_at_a_time() && !self.publishes.is_empty())
        {
            return None;
        }
        if let Some((seq, reason)) = self.dead_letters.pop_front() {
            return Some(Outgoing::DeadLetter { seq, reason });
        }
        let (seq, _) = self.window.next_to_publish()?;
        if let Some(reason) = self.diverted.get(&seq) {
            let reason = DeadLetterReason::Refused {
                reason: reason.clone(),
            };
            return Some(Outgoing::DeadLetter { seq, reason });
        }
        Some(Outgoing::Main { seq })
    }

    fn record(&mut self, tag: Tag, send: &Outgoing) {
        if let Some(last) = self.publishes.back() {
            // The connection numbers a channel's publishes in order; anything else
            // would pair confirms with the wrong messages: end the channel.
            if tag <= last.tag {
                self.failure.get_or_insert(Failure::Channel {
                    code: None,
                    text: format!("delivery tag {tag} after {}", last.tag),
                });
            }
        }
        let (seq, target) = (send.seq(), send.target());
        if let Some(message) = self.window.get(seq) {
            self.by_key.insert((message.key(), target), tag);
        }
        self.publishes.push_back(Publish {
            tag,
            seq,
            target,
            confirm: None,
            returned: None,
        });
    }

    /// `send` cannot be framed: its notice goes to the dead-letter exchange in its
    /// place (next), or, without one (or for a notice that cannot be framed
    /// either), it is poison and the engine holds before it.
    fn unfit(&mut self, send: Outgoing, reason: String) {
        let seq = send.seq();
        match send {
            Outgoing::Main { .. } if self.dead_letter => {
                self.diverted.insert(seq, reason.clone());
                // After the copies of earlier messages waiting, before any later one.
                self.dead_letters
                    .push_back((seq, DeadLetterReason::Refused { reason }));
            }
            _ => {
                self.poison = Some(Poison { seq, reason });
                self.held = true;
            }
        }
    }

    fn publish_mut(&mut self, tag: Tag) -> Option<&mut Publish> {
        let index = self.publishes.binary_search_by_key(&tag, |p| p.tag).ok()?;
        self.publishes.get_mut(index)
    }

    /// The broker confirmed publish `tag` (`ack` false: a nack). Every return
    /// the connection read before this confirm was handed over already
    /// ([`Engine::returned`]), so it certifies every publish up to `tag`.
    pub fn confirmed(&mut self, tag: Tag, ack: bool) {
        self.certified = self.certified.max(tag);
        let Some(publish) = self.publish_mut(tag) else {
            self.settle();
            return;
        };
        if publish.confirm.is_none() {
            publish.confirm = Some(ack);
            if !ack {
                self.nacked_tag = Some(self.nacked_tag.map_or(tag, |t| t.min(tag)));
                if self.failure.is_none() {
                    self.failure = Some(Failure::Nack);
                }
            }
        }
        self.settle();
    }

    /// The broker returned a message (before its confirm).
    pub fn returned(&mut self, r: Returned) {
        let tag = r.key.and_then(|k| self.by_key.get(&(k, r.target)).copied());
        let Some(tag) = tag else {
            if self.failure.is_none() {
                self.failure = Some(Failure::UnknownReturn);
            }
            return;
        };
        match self.publish_mut(tag) {
            Some(publish) => publish.returned = Some(r),
            // Settled already: it was credited as acked. Certification makes this
            // impossible; fail the channel rather than go on silently.
            None => {
                tracing::error!(tag, "a return arrived for a publish already settled");
                if self.failure.is_none() {
                    self.failure = Some(Failure::UnknownReturn);
                }
            }
        }
    }

    /// Settles certified publishes at the front, in publish order.
    fn settle(&mut self) {
        while let Some(front) = self.publishes.front() {
            if front.tag > self.certified {
                break;
            }
            let Some(ack) = front.confirm else {
                break;
            };
            let Some(publish) = self.publishes.pop_front() else {
                break;
            };
            if let Some(message) = self.window.get(publish.seq) {
                self.by_key.remove(&(message.key(), publish.target));
            }
            if !ack {
                continue;
            }
            match (publish.returned, publish.target) {
                (None, target) => {
                    if let Some(message) = self.window.get(publish.seq).cloned() {
                        self.settled.push(Settled::Acked { message, target });
                    }
                    self.window.ack(publish.seq);
                    self.solo = false;
                    if self.poison.as_ref().is_some_and(|p| p.seq == publish.seq) {
                        self.poison = None;
                    }
                }
                (Some(r), Target::Exchange) => {
                    self.settled.push(Settled::Returned { seq: publish.seq });
                    if self.dead_letter {
                        self.dead_letters.push_back((
                            publish.seq,
                            DeadLetterReason::Unroutable {
                                exchange: r.exchange,
                                routing_key: r.routing_key,
                            },
                        ));
                    } else if self.failure.is_none() {
                        let failure = Failure::Unroutable {
                            exchange: r.exchange,
                            routing_key: r.routing_key,
                        };
                        // Returned again when sent alone: it is this message that no
                        // queue takes. It is named (`/poison`) while it is retried.
                        if self.solo {
                            self.poison = Some(Poison {
                                seq: publish.seq,
                                reason: failure.to_string(),
                            });
                        }
                        self.failure = Some(failure);
                    }
                }
                (Some(r), Target::DeadLetter) => {
                    self.settled.push(Settled::Returned { seq: publish.seq });
                    if self.failure.is_none() {
                        self.failure = Some(Failure::DeadLetterUnroutable {
                            exchange: r.exchange,
                        });
                    }
                }
            }
        }
    }

    /// Whether publishes go one at a time: the first after a failure, or every one
    /// up to the last sent when the broker refused one of several (`careful_until`).
    fn one_at_a_time(&self) -> bool {
        self.solo
            || self
                .careful_until
                .is_some_and(|until| self.window.front_seq() <= until)
    }

    /// The channel or connection failed. If the one publish in flight was sent alone
    /// and the broker refused it for its content, it is poison (see the module docs).
    /// If several were in flight, each of them is sent alone from now on, until the
    /// refused one is found.
    pub fn channel_failed(&mut self, failure: Failure) {
        if failure.is_refusal() && self.publishes.len() > 1 {
            if let Some(last) = self.publishes.back() {
                self.careful_until = Some(self.careful_until.unwrap_or(0).max(last.seq));
            }
        }
        if failure.is_refusal() && self.one_at_a_time() && self.publishes.len() == 1 {
            if let Some(p) = self.publishes.front() {
                let reason = failure.to_string();
                match (p.target, self.dead_letter) {
                    (Target::Exchange, true) => {
                        self.diverted.insert(p.seq, reason);
                    }
                    _ => {
                        self.poison = Some(Poison { seq: p.seq, reason });
                    }
                }
            }
        }
        // A dead channel ends the wait a nack may be in.
        if matches!(self.failure, None | Some(Failure::Nack)) {
            self.failure = Some(failure);
        }
    }

    /// A fresh channel: forget the old one, rewind the window, send the oldest
    /// unacked message alone. Returns how many messages will be sent again.
    pub fn restart(&mut self) -> usize {
        self.publishes.clear();
        self.by_key.clear();
        self.certified = 0;
        self.held = false;
        self.dead_letters.clear();
        self.failure = None;
        self.nacked_tag = None;
        self.solo = true;
        let front = self.window.front_seq();
        self.diverted = self.diverted.split_off(&front);
        self.window.restart()
    }
}
