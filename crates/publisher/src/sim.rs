//! A deterministic simulation of the publishing engine against a scripted broker
//! and a model of lapin's confirm/return handling, over thousands of seeded random
//! schedules. Invariants are checked after every step; a failing seed prints a
//! one-line reproduction.
//!
//! The broker routes a channel's publishes in order; for an unroutable one it sends
//! `basic.return` at once and its ack later; acks go out singly in any order or as
//! `multiple` for a ready prefix; it nacks at random, closes the channel (406) on a
//! message it refuses, drops the connection, and blocks publishers. The lapin model
//! keeps returns in a FIFO, pops one at every completion, completes a `multiple`
//! ack's tags in random order, and its completions reach the engine in rounds with
//! the one ordering guarantee the shell provides: a round sees every completion that
//! happened before anything the previous round saw.
//!
//! Why one file over 600 lines: the broker model, the schedule that drives it and
//! the invariants checked after every step are one argument, read top to bottom;
//! split, each part would need the others' private state to be read at all. It is
//! test code only (`#[cfg(test)]`).
//!
//! Run longer with `OUTBOX_SIM_SCHEDULES=100000 cargo test -p publisher --release sim`;
//! replay one schedule with `OUTBOX_SIM_SEED=<seed>`.

use std::collections::{BTreeMap, VecDeque};

use outbox_event::Lsn;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::engine::{
    DeadLetterReason, Engine, EventKey, Failure, Keyed, Outgoing, Returned, Tag, Target,
};

#[derive(Debug, Clone)]
struct Msg {
    event: usize,
    key: EventKey,
}

impl Keyed for Msg {
    fn key(&self) -> EventKey {
        self.key
    }
}

#[derive(Debug, Clone)]
struct EventInfo {
    tx: usize,
    key: EventKey,
    /// The end LSN of its transaction (the mark after it).
    end: Lsn,
    unroutable: bool,
    poison: bool,
}

/// Frames from the broker to the client, in wire order.
#[derive(Debug, Clone)]
enum Frame {
    Return(Returned),
    Confirm { tag: Tag, multiple: bool, ack: bool },
    Close(u16),
}

/// A completion: `Some((ack, returned))`, or `None` for a confirm rejected
/// because the channel closed.
type Outcome = Option<(bool, Option<Returned>)>;

#[derive(Debug, Default)]
struct Channel {
    /// Written by the client, not yet routed by the broker: (tag, event, target).
    inbound: VecDeque<(Tag, usize, Target)>,
    /// Confirms the broker decided and has not sent: tag → ack.
    ready: BTreeMap<Tag, bool>,
    /// Highest tag routed so far + 1.
    routed: Tag,
    frames: VecDeque<Frame>,
    // ---- the lapin model
    fifo: VecDeque<Returned>,
    pending: Vec<Tag>,
    /// Completions in the order lapin resolved them: (tag, ack, returned); `None`
    /// for a rejected confirm (channel closed).
    resolved: Vec<(Tag, Outcome)>,
    /// Resolved completions not yet seen by the engine, by resolve index.
    unseen: BTreeMap<usize, (Tag, Outcome)>,
    /// Completions resolved before this index must be seen by the end of the round.
    must_see: usize,
    /// Writes done but not yet reported to the engine.
    unseen_writes: Vec<Tag>,
    written_seen: Vec<bool>,
    closed: Option<u16>,
}

struct Params {
    dead_letter: bool,
    max_in_flight: usize,
    events: usize,
    p_unroutable: f64,
    p_nack: f64,
    p_poison: f64,
    p_drop: f64,
    p_block: f64,
    /// Per step, the chance that the shell's wait for the confirms before a nack
    /// runs out while one is pending.
    p_nack_wait_over: f64,
}

struct World {
    rng: StdRng,
    p: Params,
    engine: Engine<Msg>,
    events: Vec<EventInfo>,
    fed: usize,
    next_tx: usize,
    lsn: u64,
    ch: Channel,
    /// Per channel generation: tag → (event, target).
    tags: Vec<(usize, Target)>,
    blocked: bool,
    faults: bool,
    // ---- what consumers saw
    main_first: Vec<bool>,
    dlx_first: Vec<bool>,
    refused: Vec<bool>,
    published: Vec<bool>,
    order_low: usize,
    flushed_sent: Lsn,
    passed: usize,
    restarted: bool,
    acked_since_restart: bool,
    dlx_last: Option<usize>,
    published_hi: usize,
    unflushed_lo: usize,
    main_deliveries: usize,
    dlx_deliveries: usize,
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let p = Params {
            dead_letter: rng.gen_bool(0.5),
            max_in_flight: *[1usize, 2, 3, 5, 8, 20]
                .get(rng.gen_range(0..6))
                .unwrap_or(&5),
            events: rng.gen_range(1..120),
            p_unroutable: [0.0, 0.05, 0.2, 0.6][rng.gen_range(0..4)],
            p_nack: [0.0, 0.02, 0.1][rng.gen_range(0..3)],
            p_poison: [0.0, 0.0, 0.03][rng.gen_range(0..3)],
            p_drop: [0.0, 0.01, 0.03][rng.gen_range(0..3)],
            p_block: [0.0, 0.02][rng.gen_range(0..2)],
            p_nack_wait_over: [0.0, 0.05, 1.0][rng.gen_range(0..3)],
        };
        let engine = Engine::new(p.max_in_flight, Lsn(100), p.dead_letter);
        World {
            rng,
            engine,
            events: Vec::new(),
            fed: 0,
            next_tx: 0,
            lsn: 1000,
            ch: Channel::default(),
            tags: Vec::new(),
            blocked: false,
            faults: true,
            main_first: Vec::new(),
            dlx_first: Vec::new(),
            refused: Vec::new(),
            published: Vec::new(),
            order_low: 0,
            flushed_sent: Lsn(100),
            passed: 0,
            restarted: false,
            acked_since_restart: false,
            dlx_last: None,
            published_hi: 0,
            unflushed_lo: 0,
            main_deliveries: 0,
            dlx_deliveries: 0,
            p,
        }
    }

    /// Appends one transaction (sometimes empty, sometimes larger than the window),
    /// or a keepalive.
    fn feed(&mut self) {
        if self.fed >= self.p.events {
            return;
        }
        if self.rng.gen_bool(0.1) {
            self.lsn += 10;
            self.engine.push_mark(Lsn(self.lsn));
            return;
        }
        let max = (self.p.max_in_flight * 3).max(2);
        let size = self.rng.gen_range(0..=max).min(self.p.events - self.fed);
        let tx = self.next_tx;
        self.next_tx += 1;
        let commit = Lsn(self.lsn + 1);
        let end = Lsn(self.lsn + 5);
        self.lsn += 10;
        for index in 0..size {
            let key = EventKey {
                commit_lsn: commit,
                index: index as u64,
            };
            let event = self.events.len();
            let unroutable =
                self.rng.gen_bool(self.p.p_unroutable) && (self.faults || self.p.dead_letter);
            let poison = self.rng.gen_bool(self.p.p_poison);
            self.events.push(EventInfo {
                tx,
                key,
                end,
                unroutable,
                poison,
            });
            self.main_first.push(false);
            self.dlx_first.push(false);
            self.refused.push(false);
            self.published.push(false);
            self.engine.push_message(Msg { event, key });
        }
        self.fed += size;
        self.engine.push_mark(end);
    }

    /// The shell starting publishes while the engine allows.
    fn send(&mut self) {
        if self.blocked || self.ch.closed.is_some() {
            return;
        }
        while let Some(send) = self.engine.next_send() {
            if self.restarted && !self.acked_since_restart {
                assert!(
                    self.engine.outstanding() <= 1,
                    "after a failure the oldest unacked message must be sent alone"
                );
            }
            let (tag, seq, target) = match send {
                Outgoing::Main { tag, seq } => (tag, seq, Target::Exchange),
                Outgoing::DeadLetter { tag, seq, reason } => {
                    if let DeadLetterReason::Refused { .. } = reason {
                        let e = self.engine.message(seq).map(|m| m.event);
                        assert!(
                            e.is_some_and(|e| self.events[e].poison),
                            "a message that was never refused was diverted"
                        );
                    }
                    (tag, seq, Target::DeadLetter)
                }
            };
            let event = self.engine.message(seq).map(|m| m.event).expect("buffered");
            assert_eq!(tag as usize, self.tags.len(), "tags are dense");
            self.tags.push((event, target));
            self.published[event] = true;
            self.ch.inbound.push_back((tag, event, target));
            self.ch.pending.push(tag);
            self.ch.unseen_writes.push(tag);
            self.ch.written_seen.push(false);
        }
    }

    /// The broker routes the next publishes of the channel, in order.
    fn route(&mut self, n: usize) {
        for _ in 0..n {
            if self.ch.closed.is_some() {
                return;
            }
            let Some((tag, event, target)) = self.ch.inbound.pop_front() else {
                return;
            };
            self.ch.routed = tag + 1;
            let info = self.events[event].clone();
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
                        info.unroutable || info.poison,
                        "event {event} was routable but went to the dead-letter exchange"
                    );
                    self.dlx_deliveries += 1;
                    if !self.dlx_first[event] {
                        let calm =
                            self.p.p_nack == 0.0 && self.p.p_drop == 0.0 && self.p.p_poison == 0.0;
                        if calm {
                            assert!(
                                self.dlx_last.is_none_or(|l| l < event),
                                "dead-lettered out of order: {event} after {:?}",
                                self.dlx_last
                            );
                        }
                        self.dlx_last = Some(event);
                    }
                    self.dlx_first[event] = true;
                    self.ch.ready.insert(tag, true);
                }
                Target::Exchange => {
                    if info.poison && self.faults {
                        self.refused[event] = true;
                        self.ch.frames.push_back(Frame::Close(406));
                        self.ch.closed = Some(406);
                        self.ch.inbound.clear();
                        return;
                    }
                    if self.faults && self.rng.gen_bool(self.p.p_nack) {
                        self.refused[event] = true;
                        self.ch.ready.insert(tag, false);
                        continue;
                    }
                    if info.unroutable {
                        self.refused[event] = true;
                        self.ch
                            .frames
                            .push_back(Frame::Return(returned(Target::Exchange)));
                        self.ch.ready.insert(tag, true);
                        continue;
                    }
                    self.deliver_main(event);
                    self.ch.ready.insert(tag, true);
                }
            }
        }
    }

    fn deliver_main(&mut self, event: usize) {
        assert!(
            !self.events[event].unroutable,
            "an unroutable event reached the main queue"
        );
        self.main_deliveries += 1;
        if !self.main_first[event] {
            // Order: every earlier event reached a queue first, or was refused.
            while self.order_low < self.events.len()
                && (self.main_first[self.order_low]
                    || self.dlx_first[self.order_low]
                    || self.refused[self.order_low])
            {
                self.order_low += 1;
            }
            assert!(
                self.order_low >= event,
                "event {event} overtook event {} which was never refused",
                self.order_low
            );
            self.main_first[event] = true;
        }
    }

    /// The broker sends some of its decided confirms: singly in random order, or a
    /// `multiple` ack for a ready prefix.
    fn flush_confirms(&mut self) {
        if self.ch.closed.is_some() || self.ch.ready.is_empty() {
            return;
        }
        if self.rng.gen_bool(0.5) {
            // multiple: the longest run of ready acks from the lowest unsent tag.
            let mut upto = None;
            let first = *self.ch.ready.keys().next().expect("not empty");
            let lowest_open = self.lowest_unconfirmed();
            if lowest_open == first {
                let mut t = first;
                while self.ch.ready.get(&t) == Some(&true) {
                    upto = Some(t);
                    t += 1;
                }
            }
            if let Some(upto) = upto {
                let n = self.rng.gen_range(0..=(upto - first));
                let upto = first + n;
                for t in first..=upto {
                    self.ch.ready.remove(&t);
                }
                self.ch.frames.push_back(Frame::Confirm {
                    tag: upto,
                    multiple: true,
                    ack: true,
                });
                return;
            }
        }
        let tags: Vec<Tag> = self.ch.ready.keys().copied().collect();
        let k = self.rng.gen_range(1..=tags.len());
        for _ in 0..k {
            let keys: Vec<Tag> = self.ch.ready.keys().copied().collect();
            let tag = keys[self.rng.gen_range(0..keys.len())];
            let ack = self.ch.ready.remove(&tag).expect("present");
            self.ch.frames.push_back(Frame::Confirm {
                tag,
                multiple: false,
                ack,
            });
        }
    }

    /// The lowest tag whose confirm the broker has not sent.
    fn lowest_unconfirmed(&self) -> Tag {
        let sent: std::collections::HashSet<Tag> = self
            .ch
            .frames
            .iter()
            .filter_map(|f| match f {
                Frame::Confirm {
                    tag,
                    multiple: false,
                    ..
                } => Some(*tag),
                _ => None,
            })
            .collect();
        let mut t = self
            .ch
            .pending
            .iter()
            .copied()
            .min()
            .unwrap_or(self.ch.routed);
        while sent.contains(&t) {
            t += 1;
        }
        t
    }

    /// lapin reads frames: returns into the FIFO, confirms complete pending tags
    /// (a `multiple` one in random order), each completion popping the FIFO.
    fn lapin_read(&mut self, n: usize) {
        for _ in 0..n {
            let Some(frame) = self.ch.frames.pop_front() else {
                return;
            };
            match frame {
                Frame::Return(r) => self.ch.fifo.push_back(r),
                Frame::Confirm { tag, multiple, ack } => {
                    let mut done: Vec<Tag> = if multiple {
                        self.ch
                            .pending
                            .iter()
                            .copied()
                            .filter(|t| *t <= tag)
                            .collect()
                    } else {
                        vec![tag]
                    };
                    // HashMap order.
                    for i in (1..done.len()).rev() {
                        let j = self.rng.gen_range(0..=i);
                        done.swap(i, j);
                    }
                    for t in done {
                        if let Some(pos) = self.ch.pending.iter().position(|p| *p == t) {
                            self.ch.pending.swap_remove(pos);
                            let returned = self.ch.fifo.pop_front();
                            self.resolve(t, Some((ack, returned)));
                        }
                    }
                }
                Frame::Close(code) => {
                    self.ch.closed = Some(code);
                    let pending = std::mem::take(&mut self.ch.pending);
                    for t in pending {
                        self.resolve(t, None);
                    }
                }
            }
        }
    }

    fn resolve(&mut self, tag: Tag, outcome: Outcome) {
        let index = self.ch.resolved.len();
        self.ch.resolved.push((tag, outcome.clone()));
        self.ch.unseen.insert(index, (tag, outcome));
    }

    /// One round of the shell's polling: writes, then completions (all that the
    /// previous round's guarantee requires, and a random choice of the others).
    fn round(&mut self) {
        for tag in std::mem::take(&mut self.ch.unseen_writes) {
            self.ch.written_seen[tag as usize] = true;
        }
        let indexes: Vec<usize> = self.ch.unseen.keys().copied().collect();
        let mut seen_max = None;
        for index in indexes {
            let must = index < self.ch.must_see;
            if !must && !self.rng.gen_bool(0.6) {
                continue;
            }
            let (tag, outcome) = self.ch.unseen.remove(&index).expect("present");
            seen_max = Some(seen_max.map_or(index, |m: usize| m.max(index)));
            match outcome {
                Some((ack, returned)) => self.engine.confirmed(tag, ack, returned),
                None => self.engine.channel_failed(Failure::Channel {
                    code: self.ch.closed,
                    text: "closed".into(),
                }),
            }
        }
        if let Some(m) = seen_max {
            self.ch.must_see = self.ch.must_see.max(m + 1);
        }
        self.engine.end_round();
        if self
            .engine
            .take_settled()
            .iter()
            .any(|s| matches!(s, crate::engine::Settled::Acked { .. }))
        {
            self.acked_since_restart = true;
        }
    }

    /// The connection drops: the broker routed a prefix of what was written.
    fn drop_connection(&mut self) {
        let n = self.rng.gen_range(0..=self.ch.inbound.len());
        self.route(n);
        self.ch.inbound.clear();
        self.ch.frames.clear();
        self.engine
            .channel_failed(Failure::Connection("dropped".into()));
        self.ch.closed.get_or_insert(320);
    }

    /// After a failure: close the channel and wait for close-ok (the broker routes
    /// what was written before the close, unless it closed the channel itself), then
    /// a fresh channel.
    fn recover(&mut self) {
        let failure = self.engine.force_failure().expect("failed");
        assert_ne!(
            failure,
            Failure::UnknownReturn,
            "a return matched no publish"
        );
        if self.ch.closed.is_none() {
            let n = self.ch.inbound.len();
            self.route(n);
        }
        self.ch = Channel::default();
        self.tags.clear();
        self.engine.restart();
        self.restarted = true;
        self.acked_since_restart = false;
    }

    fn flush_to_postgres(&mut self) {
        let w = self.engine.watermark();
        self.flushed_sent = w;
        self.engine.flushed(w);
    }

    fn step(&mut self) {
        match self.rng.gen_range(0..100) {
            0..=14 => self.feed(),
            15..=34 => {
                let n = self.rng.gen_range(1..4);
                self.route(n);
            }
            35..=49 => self.flush_confirms(),
            50..=64 => {
                let n = self.rng.gen_range(1..4);
                self.lapin_read(n);
            }
            65..=84 => self.round(),
            85..=92 => self.flush_to_postgres(),
            93..=95 => {
                if self.faults && self.rng.gen_bool(self.p.p_block * 10.0) {
                    self.blocked = !self.blocked;
                } else {
                    self.blocked = false;
                }
            }
            _ => {
                if self.faults && self.rng.gen_bool((self.p.p_drop * 20.0).min(1.0)) {
                    self.drop_connection();
                }
            }
        }
        // A nack waits for the confirms before it; the shell's wait may also run
        // out first.
        if self.engine.failure_ready()
            || (self.engine.has_failed() && self.rng.gen_bool(self.p.p_nack_wait_over))
        {
            self.recover();
        }
        self.send();
        self.check();
    }

    /// The invariants, after every step.
    fn check(&mut self) {
        let w = self.engine.watermark();
        while self.passed < self.events.len() && self.events[self.passed].end <= w {
            let e = self.passed;
            assert!(
                self.main_first[e] || self.dlx_first[e],
                "the watermark {w} passed event {e} (tx {}) which reached no queue",
                self.events[e].tx
            );
            self.passed += 1;
        }
        // The duplicate bound: published (the window publishes in order, so the
        // published events are a prefix) and not behind a flushed position.
        while self.published_hi < self.events.len() && self.published[self.published_hi] {
            self.published_hi += 1;
        }
        while self.unflushed_lo < self.events.len()
            && self.events[self.unflushed_lo].end <= self.flushed_sent
        {
            self.unflushed_lo += 1;
        }
        let in_flight = self.published_hi.saturating_sub(self.unflushed_lo);
        if in_flight > self.p.max_in_flight {
            let first = self.events[self.unflushed_lo].tx;
            let last = self.events[self.published_hi - 1].tx;
            assert_eq!(
                first, last,
                "{in_flight} messages in flight across transactions (max_in_flight {})",
                self.p.max_in_flight
            );
        }
        assert!(self.engine.window().counted() <= self.engine.window().in_flight());
    }

    /// Faults off, unroutable events bound (without a dead-letter exchange), poison
    /// fixed: everything must arrive.
    fn drain(&mut self) {
        self.faults = false;
        self.blocked = false;
        if !self.p.dead_letter {
            for e in &mut self.events {
                e.unroutable = false;
            }
        }
        while self.fed < self.p.events {
            self.feed();
        }
        for _ in 0..200_000 {
            self.step();
            if self.engine.window().is_empty() && self.fed >= self.p.events {
                break;
            }
        }
        self.flush_to_postgres();
        assert!(
            self.engine.window().is_empty(),
            "the window never drained: {} buffered, solo {}, failed {}\nchannel: inbound {:?} ready {:?} frames {:?} pending {:?} unseen {:?}",
            self.engine.window().buffered(),
            self.engine.is_solo(),
            self.engine.has_failed(),
            self.ch.inbound,
            self.ch.ready,
            self.ch.frames,
            self.ch.pending,
            self.ch.unseen
        );
        for (e, info) in self.events.iter().enumerate() {
            assert!(self.main_first[e] || self.dlx_first[e], "event {e} lost");
            if self.dlx_first[e] {
                assert!(info.unroutable || info.poison || self.refused[e]);
            }
        }
        assert_eq!(self.engine.window().in_flight(), 0);
    }
}

fn run_schedule(seed: u64) {
    let mut world = World::new(seed);
    let steps = world.rng.gen_range(50..2000);
    for _ in 0..steps {
        world.step();
    }
    world.drain();
}

fn schedules() -> u64 {
    std::env::var("OUTBOX_SIM_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000)
}

#[test]
fn publisher_engine_against_a_scripted_broker() {
    if let Some(seed) = std::env::var("OUTBOX_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run_schedule(seed);
        return;
    }
    let base: u64 = 0x5eed_0000;
    for i in 0..schedules() {
        let seed = base + i;
        let result = std::panic::catch_unwind(|| run_schedule(seed));
        if let Err(panic) = result {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "schedule failed: {msg}\nreproduce: OUTBOX_SIM_SEED={seed} cargo test -p publisher --lib sim"
            );
        }
    }
}
