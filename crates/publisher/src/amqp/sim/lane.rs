//! One lane of the simulation: a single-channel publisher (engine and window)
//! against its own scripted channel of the broker, read the way the connection
//! reads it, with the single-channel invariants (see the parent module for the
//! argument).
//!
//! The broker routes the channel's publishes in order; for an unroutable one it
//! sends `basic.return` at once and its ack later; acks go out singly in any order or
//! as `multiple` for a ready prefix; it nacks at random, closes the channel (406) on
//! a message it refuses, drops the connection, and blocks publishers. The client
//! side is the connection's model: frames are read in the order the broker sent
//! them, a few at a time, and every confirm is expanded into one confirm per tag by
//! the connection's own tag bookkeeping (`connection::Tags`) before the engine sees
//! it. Messages whose content header cannot be framed are refused by the
//! connection when the engine sends them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use outbox_event::Lsn;
use rand::rngs::StdRng;
use rand::Rng;

use crate::amqp::connection::Tags;

use super::{Item, Msg, Shared};
use crate::amqp::engine::{
    DeadLetterReason, Engine, Failure, Outgoing, Returned, Settled, Tag, Target,
};

/// Batches a lane's input channel holds (`mpsc::channel(4)` in `lanes.rs`).
pub(super) const INBOX: usize = 4;

/// Frames from the broker to the client, in wire order.
#[derive(Debug, Clone)]
enum Frame {
    Return(Returned),
    Confirm { tag: Tag, multiple: bool, ack: bool },
    Close(u16),
}

#[derive(Debug, Default)]
struct Channel {
    /// Written by the client, not yet routed by the broker: (tag, event, target).
    inbound: VecDeque<(Tag, usize, Target)>,
    /// Confirms the broker decided and has not sent: tag → ack.
    ready: BTreeMap<Tag, bool>,
    /// Tags whose confirm the broker has not sent.
    unsent: BTreeSet<Tag>,
    frames: VecDeque<Frame>,
    /// The client's delivery tags (the connection's bookkeeping).
    tags: Tags,
    closed: Option<u16>,
}

/// How far one lane's in-flight events reach (for the bound across lanes).
pub(super) struct InFlight {
    pub(super) count: usize,
    pub(super) first_tx: usize,
    pub(super) last_tx: usize,
}

pub(super) struct Lane {
    pub(super) index: usize,
    /// Its share of `max_in_flight` (`lanes::lane_window`).
    pub(super) share: usize,
    pub(super) engine: Engine<Msg>,
    /// Batches split to this lane and not yet taken.
    pub(super) inbox: VecDeque<Vec<Item>>,
    /// The lane's events, in the order it received them.
    pub(super) events: Vec<usize>,
    /// The flush position sent to Postgres that this lane has not yet seen.
    pub(super) flushed_news: Option<Lsn>,
    /// The watermark its follower last handed to `lanes::Watermarks`.
    pub(super) reported: Lsn,
    pub(super) blocked: bool,
    ch: Channel,
    restarted: bool,
    acked_since_restart: bool,
    /// Exchanges named per event this lane's shell declared.
    declared: std::collections::HashSet<usize>,
    // ---- what consumers saw of this lane (indexes into `events`)
    order_low: usize,
    passed: usize,
    dlx_last: Option<usize>,
    published_hi: usize,
    unflushed_lo: usize,
}

impl Lane {
    pub(super) fn new(index: usize, share: usize, start: Lsn, dead_letter: bool) -> Lane {
        Lane {
            index,
            share,
            engine: Engine::new(share, start, dead_letter),
            inbox: VecDeque::new(),
            events: Vec::new(),
            flushed_news: None,
            reported: start,
            blocked: false,
            ch: Channel::default(),
            restarted: false,
            acked_since_restart: false,
            declared: std::collections::HashSet::new(),
            order_low: 0,
            passed: 0,
            dlx_last: None,
            published_hi: 0,
            unflushed_lo: 0,
        }
    }

    /// The shell reads one batch from its input: only once everything buffered is
    /// published (the backpressure of `run.rs`), unless the schedule feeds eagerly.
    pub(super) fn take_input(&mut self, s: &mut Shared) {
        if !s.p.eager_input && self.engine.window().has_unpublished() {
            return;
        }
        let Some(batch) = self.inbox.pop_front() else {
            return;
        };
        for item in batch {
            match item {
                Item::Event(e) => {
                    let info = &mut s.events[e];
                    assert!(
                        info.lane.is_none(),
                        "event {e} was split to lanes {:?} and {}",
                        info.lane,
                        self.index
                    );
                    info.lane = Some(self.index);
                    self.events.push(e);
                    self.engine.push_message(Msg {
                        event: e,
                        key: info.key,
                    });
                }
                Item::Mark(lsn) => self.engine.push_mark(lsn),
            }
        }
    }

    /// The shell starting publishes while the engine allows; the connection
    /// refuses to frame an unfit event's message.
    pub(super) fn send(&mut self, s: &mut Shared) {
        if self.blocked || self.ch.closed.is_some() {
            return;
        }
        loop {
            if self.restarted && !self.acked_since_restart {
                assert!(
                    self.engine.outstanding() <= 1,
                    "lane {}: after a failure the oldest unacked message must be sent alone",
                    self.index
                );
            }
            // The shell declares an exchange named per event before the first
            // publish to it (`run.rs`, next_unknown_exchange).
            let peeked = self.engine.peek_next_main().map(|m| m.event);
            if let Some(e) = peeked {
                let x = s.events[e].exchange;
                if x != 0 {
                    self.declared.insert(x);
                }
            }
            let ch = &mut self.ch;
            let declared = &self.declared;
            let sent = self.engine.send_next(|send, message| {
                let event = message.event;
                match send {
                    Outgoing::Main { .. } => {
                        assert_eq!(
                            peeked,
                            Some(event),
                            "the next publish is not the message peek_next_main named"
                        );
                        let x = s.events[event].exchange;
                        assert!(
                            x == 0 || declared.contains(&x),
                            "event {event} published to exchange {x} before it was declared"
                        );
                    }
                    Outgoing::DeadLetter { .. } => assert!(
                        peeked.is_none(),
                        "peek_next_main named a message, but a dead-letter copy went first"
                    ),
                }
                let target = match send {
                    Outgoing::Main { .. } => Target::Exchange,
                    Outgoing::DeadLetter { reason, .. } => {
                        if let DeadLetterReason::Refused { .. } = reason {
                            assert!(
                                s.events[event].poison || s.events[event].unfit,
                                "a message that was never refused was diverted"
                            );
                        }
                        Target::DeadLetter
                    }
                };
                if target == Target::Exchange && s.events[event].unfit {
                    return Err("its content header does not fit a frame".into());
                }
                let tag = ch.tags.publish();
                s.published[event] = true;
                ch.inbound.push_back((tag, event, target));
                ch.unsent.insert(tag);
                Ok(tag)
            });
            if !sent {
                break;
            }
        }
    }

    /// The broker routes the next publishes of the channel, in order.
    pub(super) fn route(&mut self, s: &mut Shared, n: usize) {
        for _ in 0..n {
            if self.ch.closed.is_some() {
                return;
            }
            let Some((tag, event, target)) = self.ch.inbound.pop_front() else {
                return;
            };
            let info = s.events[event].clone();
            let returned = |target| Returned {
                key: Some(info.key),
                target,
                exchange: if target == Target::Exchange {
                    "main"
                } else {
                    "dlx"
                }
                .into(),
                routing_key: format!("rk.{event}"),
            };
            match target {
                Target::DeadLetter => {
                    assert!(
                        info.unroutable || info.poison || info.unfit,
                        "event {event} was routable but went to the dead-letter exchange"
                    );
                    s.dlx_deliveries += 1;
                    if !s.dlx_first[event] {
                        let calm = s.p.p_nack == 0.0
                            && s.p.p_drop == 0.0
                            && s.p.p_poison == 0.0
                            && s.p.p_unfit == 0.0;
                        if calm {
                            assert!(
                                self.dlx_last.is_none_or(|l| l < event),
                                "lane {}: dead-lettered out of order: {event} after {:?}",
                                self.index,
                                self.dlx_last
                            );
                        }
                        self.dlx_last = Some(event);
                    }
                    s.dlx_first[event] = true;
                    self.ch.ready.insert(tag, true);
                }
                Target::Exchange => {
                    if info.poison && s.faults {
                        s.refused[event] = true;
                        self.ch.frames.push_back(Frame::Close(406));
                        self.ch.closed = Some(406);
                        self.ch.inbound.clear();
                        return;
                    }
                    if s.faults && s.rng.gen_bool(s.p.p_nack) {
                        s.refused[event] = true;
                        self.ch.ready.insert(tag, false);
                        continue;
                    }
                    if info.unroutable {
                        s.refused[event] = true;
                        self.ch
                            .frames
                            .push_back(Frame::Return(returned(Target::Exchange)));
                        self.ch.ready.insert(tag, true);
                        continue;
                    }
                    self.deliver_main(s, event);
                    self.ch.ready.insert(tag, true);
                }
            }
        }
    }

    /// The main queue receives `event`. Its first copy must come after every earlier
    /// event of the lane reached a queue or was refused (the lane's commit order),
    /// and after every earlier event of its aggregate did (across lanes).
    fn deliver_main(&mut self, s: &mut Shared, event: usize) {
        assert!(
            !s.events[event].unroutable,
            "an unroutable event reached the main queue"
        );
        s.main_deliveries += 1;
        if s.main_first[event] {
            return;
        }
        while self.order_low < self.events.len() && s.settled(self.events[self.order_low]) {
            self.order_low += 1;
        }
        let pos = self.events.iter().position(|&e| e == event);
        assert!(
            pos.is_some_and(|p| self.order_low >= p),
            "lane {}: event {event} overtook event {} which was never refused",
            self.index,
            self.events[self.order_low]
        );
        s.deliver_aggregate(event);
        s.main_first[event] = true;
    }

    /// The broker sends some of its decided confirms: singly in random order, or a
    /// `multiple` ack for a ready prefix.
    pub(super) fn flush_confirms(&mut self, rng: &mut StdRng) {
        if self.ch.closed.is_some() || self.ch.ready.is_empty() {
            return;
        }
        if rng.gen_bool(0.5) {
            // multiple: the longest run of ready acks from the lowest unsent tag.
            let mut upto = None;
            let first = *self.ch.ready.keys().next().expect("not empty");
            if self.ch.unsent.first() == Some(&first) {
                let mut t = first;
                while self.ch.ready.get(&t) == Some(&true) {
                    upto = Some(t);
                    t += 1;
                }
            }
            if let Some(upto) = upto {
                let upto = first + rng.gen_range(0..=(upto - first));
                for t in first..=upto {
                    self.ch.ready.remove(&t);
                    self.ch.unsent.remove(&t);
                }
                self.ch.frames.push_back(Frame::Confirm {
                    tag: upto,
                    multiple: true,
                    ack: true,
                });
                return;
            }
        }
        let k = rng.gen_range(1..=self.ch.ready.len());
        for _ in 0..k {
            let keys: Vec<Tag> = self.ch.ready.keys().copied().collect();
            let tag = keys[rng.gen_range(0..keys.len())];
            let ack = self.ch.ready.remove(&tag).expect("present");
            self.ch.unsent.remove(&tag);
            self.ch.frames.push_back(Frame::Confirm {
                tag,
                multiple: false,
                ack,
            });
        }
    }

    /// The connection reads the next `n` frames, in the order the broker sent
    /// them: a return goes to the engine as it is, a confirm as one confirm per tag
    /// (the connection's expansion), a channel close ends the channel.
    pub(super) fn read(&mut self, n: usize) {
        for _ in 0..n {
            let Some(frame) = self.ch.frames.pop_front() else {
                return;
            };
            match frame {
                Frame::Return(r) => self.engine.returned(r),
                Frame::Confirm { tag, multiple, ack } => {
                    let mut tags = Vec::new();
                    self.ch
                        .tags
                        .settle(tag, multiple, |t| tags.push(t))
                        .expect("the scripted broker confirms only tags it was sent, once");
                    for t in tags {
                        self.engine.confirmed(t, ack);
                    }
                }
                Frame::Close(code) => {
                    self.ch.closed = Some(code);
                    self.engine.channel_failed(Failure::Channel {
                        code: Some(code),
                        text: "closed".into(),
                    });
                }
            }
            if self
                .engine
                .take_settled()
                .iter()
                .any(|s| matches!(s, Settled::Acked { .. }))
            {
                self.acked_since_restart = true;
            }
        }
    }

    /// The connection drops: the broker routed a prefix of what was written.
    pub(super) fn drop_connection(&mut self, s: &mut Shared) {
        let n = s.rng.gen_range(0..=self.ch.inbound.len());
        self.route(s, n);
        self.ch.inbound.clear();
        self.ch.frames.clear();
        self.engine
            .channel_failed(Failure::Connection("dropped".into()));
        self.ch.closed.get_or_insert(320);
    }

    /// After a failure: close the channel and wait for close-ok (the broker routes
    /// what was written before the close, unless it closed the channel itself), then
    /// a fresh channel.
    pub(super) fn recover(&mut self, s: &mut Shared) {
        let failure = self.engine.force_failure().expect("failed");
        assert_ne!(
            failure,
            Failure::UnknownReturn,
            "a return matched no publish"
        );
        if self.ch.closed.is_none() {
            let n = self.ch.inbound.len();
            self.route(s, n);
        }
        self.ch = Channel::default();
        self.engine.restart();
        self.restarted = true;
        self.acked_since_restart = false;
    }

    /// The lane's shell sees the position last sent to Postgres (its `flushed` watch).
    pub(super) fn see_flushed(&mut self) {
        if let Some(lsn) = self.flushed_news.take() {
            self.engine.flushed(lsn);
        }
    }

    /// The single-channel invariants, after every step: the lane's watermark passes
    /// only events of the lane that reached a queue, and the lane keeps to its share
    /// of the window (measured against what Postgres was sent, `flushed_sent`).
    /// Returns the lane's events in flight.
    pub(super) fn check(&mut self, s: &Shared, flushed_sent: Lsn) -> Option<InFlight> {
        let w = self.engine.watermark();
        while self.passed < self.events.len() && s.events[self.events[self.passed]].end <= w {
            let e = self.events[self.passed];
            assert!(
                s.main_first[e] || s.dlx_first[e],
                "lane {}: its watermark {w} passed event {e} (tx {}) which reached no queue",
                self.index,
                s.events[e].tx
            );
            self.passed += 1;
        }
        // The duplicate bound: published (the window publishes in order, so the
        // lane's published events are a prefix of its events) and not behind a
        // position flushed to Postgres.
        while self.published_hi < self.events.len() && s.published[self.events[self.published_hi]] {
            self.published_hi += 1;
        }
        while self.unflushed_lo < self.events.len()
            && s.events[self.events[self.unflushed_lo]].end <= flushed_sent
        {
            self.unflushed_lo += 1;
        }
        let count = self.published_hi.saturating_sub(self.unflushed_lo);
        let window = self.engine.window();
        assert!(window.counted() <= window.in_flight());
        if count == 0 {
            return None;
        }
        let first_tx = s.events[self.events[self.unflushed_lo]].tx;
        let last_tx = s.events[self.events[self.published_hi - 1]].tx;
        if count > self.share {
            assert_eq!(
                first_tx, last_tx,
                "lane {}: {count} messages in flight across transactions (its share {} of max_in_flight {})",
                self.index, self.share, s.p.max_in_flight
            );
        }
        Some(InFlight {
            count,
            first_tx,
            last_tx,
        })
    }

    /// Whether the lane is done: nothing buffered, nothing waiting in its input.
    pub(super) fn is_drained(&self) -> bool {
        self.engine.window().is_empty() && self.inbox.is_empty()
    }

    /// What is stuck, for a drain that never finishes.
    pub(super) fn describe(&self) -> String {
        format!(
            "lane {}: {} buffered, unpublished {}, inbox {}, solo {}, failed {}, blocked {}, watermark {}\n  channel: inbound {:?} ready {:?} frames {:?} unsent {:?}",
            self.index,
            self.engine.window().buffered(),
            self.engine.window().has_unpublished(),
            self.inbox.len(),
            self.engine.is_solo(),
            self.engine.has_failed(),
            self.blocked,
            self.engine.watermark(),
            self.ch.inbound,
            self.ch.ready,
            self.ch.frames,
            self.ch.unsent
        )
    }
}
