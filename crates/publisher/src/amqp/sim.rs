//! A deterministic simulation of the publisher against a scripted broker, over
//! thousands of seeded random schedules, on one channel (`ordering = "commit"`) and
//! on N lanes (`ordering = "aggregate"`, docs/design.md §4 "Per-aggregate order on
//! N channels"). Invariants are checked after every step; a failing seed prints a
//! one-line reproduction.
//! size: schedule and cross-lane checks are one argument; see "Why this file is over 600 lines"
//!
//! A schedule runs N lanes (N = 1 is the single-channel publisher). Each lane
//! ([`lane::Lane`]) is a whole single-channel publisher, engine and window, against
//! its own channel of the scripted broker, read as the connection reads it: its own nacks,
//! returns, 406 refusals, dropped connections and blocking. The reader's batches are
//! split by the production code (`lanes::split_items`, events to
//! `lanes::lane_of(aggregate_id)`, marks to every lane) and handed to the lanes the
//! way `Lanes::run` does: through its gate (`lanes::Gate`), in lane order, each
//! lane's input holding at most four batches, a lane reading its input only once
//! everything it buffered is published (or, in half the schedules, whenever it
//! likes). Each lane's window is `lanes::lane_window(max_in_flight, N)`; the lanes'
//! watermarks go to the production `lanes::Watermarks`, and the global watermark it
//! keeps is what is sent to Postgres. What the publisher is told was sent (in half
//! the schedules the lesser of that and the stored position of design §3, which
//! moves only once an event ends past it) is what the gate waits for and what every
//! lane sees as flushed, each in its own time. Every step is one thing happening
//! somewhere: the reader sends a batch, Postgres is sent the global watermark, or
//! one lane, picked at random, does one thing.
//!
//! Checked after every step, per lane: the single-channel rules (an event reaches
//! the main queue only after every earlier event of its lane reached a queue or was
//! refused, dead-lettering only what was unroutable or refused, the oldest unacked
//! message sent alone after a failure, the lane's watermark passes only events that
//! reached a queue, the lane's in-flight events within its share unless they are one
//! transaction). Across lanes: (1) per-aggregate order: an event's first copy in the
//! main queue comes after every earlier event of its aggregate reached a queue or was
//! refused; (2) the global watermark is the minimum of the lanes', never goes
//! backwards, and never passes an event that did not reach a queue; (3) the
//! duplicate bound: events published and not behind the position sent to Postgres,
//! over all lanes, at most `max_in_flight` unless they are all one transaction. At
//! the end of a schedule faults stop and everything drains: (4) every event
//! delivered, every lane empty, and the global watermark at the last mark.
//!
//! Why this file is over 600 lines: the schedule over the lanes and the checks
//! across them are one argument, read top to bottom; one lane against its broker
//! is the other half (`sim/lane.rs`). Test code only (`#[cfg(test)]`).
//!
//! `cargo test` runs 3000 schedules on one channel and 1500 on 2 to 4 lanes. Run
//! longer with `OUTBOX_SIM_SCHEDULES=100000 cargo test -p publisher --release sim`;
//! replay one schedule with `OUTBOX_SIM_SEED=<seed>` (the failure message names the
//! test).

mod lane;

use std::collections::VecDeque;

use outbox_event::Lsn;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::amqp::engine::{EventKey, Keyed};
use crate::lanes::{lane_of, lane_window, split_items, Gate, Route, Watermarks};
use lane::{Lane, INBOX};

/// The watermark every schedule starts from.
const START: Lsn = Lsn(100);

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

/// What the reader sends: an event (by index), or a commit end / keepalive.
#[derive(Debug, Clone)]
enum Item {
    Event(usize),
    Mark(Lsn),
}

#[derive(Debug, Clone)]
struct EventInfo {
    tx: usize,
    key: EventKey,
    /// The end LSN of its transaction (the mark after it).
    end: Lsn,
    unroutable: bool,
    poison: bool,
    /// Its content header does not fit a frame (only with a dead-letter exchange:
    /// without one it would hold the lane until an operator skipped it).
    unfit: bool,
    aggregate: usize,
    /// Its index among its aggregate's events.
    in_aggregate: usize,
    /// The lane that received it.
    lane: Option<usize>,
    /// Its exchange: 0 the configured one, else one named per event (declared by
    /// the shell before its first publish: docs/routing.md). Derived from the event
    /// rather than drawn, so the schedules of the regression seeds are unchanged.
    exchange: usize,
}

struct Params {
    aggregates: usize,
    dead_letter: bool,
    max_in_flight: usize,
    events: usize,
    /// A lane reads its input whenever it likes, not only once all is published.
    eager_input: bool,
    /// The relay keeps its position in a table (design §3): the publisher's bound
    /// is the lesser of what Postgres was sent and what is stored, and the stored
    /// one moves only once an event ends past it.
    state_table: bool,
    p_unroutable: f64,
    p_nack: f64,
    p_poison: f64,
    p_unfit: f64,
    p_drop: f64,
    p_block: f64,
    /// Per step, the chance that the shell's wait for the confirms before a nack
    /// runs out while one is pending.
    p_nack_wait_over: f64,
}

/// What the lanes share: the schedule's randomness, the events, and what the
/// consumers saw.
struct Shared {
    rng: StdRng,
    p: Params,
    faults: bool,
    events: Vec<EventInfo>,
    aggregate_ids: Vec<Vec<u8>>,
    /// Each aggregate's events in commit order.
    by_aggregate: Vec<Vec<usize>>,
    /// Per aggregate, how many of its first events have settled (see `settled`).
    aggregate_low: Vec<usize>,
    main_first: Vec<bool>,
    dlx_first: Vec<bool>,
    /// Nacked, returned or refused with a 406 at least once.
    refused: Vec<bool>,
    published: Vec<bool>,
    main_deliveries: usize,
    dlx_deliveries: usize,
}

impl Shared {
    /// The event reached a queue, or the broker refused it once (a refused event
    /// may be overtaken: it reaches the main queue only when it is retried).
    fn settled(&self, e: usize) -> bool {
        self.main_first[e] || self.dlx_first[e] || self.refused[e]
    }

    /// Check (1), per-aggregate order: the first copy of `event` in the main queue
    /// comes after every earlier event of its aggregate reached a queue or was
    /// refused.
    fn deliver_aggregate(&mut self, event: usize) {
        let a = self.events[event].aggregate;
        let mine = &self.by_aggregate[a];
        let mut low = self.aggregate_low[a];
        while low < mine.len() && self.settled(mine[low]) {
            low += 1;
        }
        self.aggregate_low[a] = low;
        let at = self.events[event].in_aggregate;
        if low < at {
            let other = mine[low];
            panic!(
                "aggregate {a}: event {event} (tx {}, lane {:?}) reached the main queue before event {other} (tx {}, lane {:?}) of the same aggregate, which was never refused",
                self.events[event].tx,
                self.events[event].lane,
                self.events[other].tx,
                self.events[other].lane,
            );
        }
    }
}

struct World {
    s: Shared,
    lanes: Vec<Lane>,
    marks: Watermarks,
    gate: Gate,
    /// The rest of the reader's batch, held back by the gate.
    batch: VecDeque<Item>,
    /// What the split let through, being handed to the lanes: the parts not yet
    /// taken, in lane order.
    feeding: VecDeque<(usize, Vec<Item>)>,
    fed: usize,
    next_tx: usize,
    lsn: u64,
    last_mark: Lsn,
    /// The position the publisher is told was sent to Postgres (the bound).
    flushed_sent: Lsn,
    /// The stored position (with `state_table`).
    written: Lsn,
    /// The end of the last transaction with events the reader got past the gate.
    events_read: Lsn,
    /// The global watermark at the last check.
    global: Lsn,
    /// Events (in commit order) the global watermark has passed.
    global_passed: usize,
}

impl World {
    fn new(seed: u64, lanes: std::ops::RangeInclusive<usize>) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.gen_range(lanes);
        // `[rabbitmq] channels` may not exceed max_in_flight.
        let windows: Vec<usize> = [1usize, 2, 3, 5, 8, 20]
            .into_iter()
            .filter(|w| *w >= n)
            .collect();
        let p = Params {
            aggregates: if n == 1 { 1 } else { rng.gen_range(1..=8) },
            dead_letter: rng.gen_bool(0.5),
            max_in_flight: windows[rng.gen_range(0..windows.len())],
            events: rng.gen_range(1..120),
            eager_input: rng.gen_bool(0.5),
            state_table: rng.gen_bool(0.5),
            p_unroutable: [0.0, 0.05, 0.2, 0.6][rng.gen_range(0..4)],
            p_nack: [0.0, 0.02, 0.1][rng.gen_range(0..3)],
            p_poison: [0.0, 0.0, 0.03][rng.gen_range(0..3)],
            p_unfit: [0.0, 0.0, 0.05][rng.gen_range(0..3)],
            p_drop: [0.0, 0.01, 0.03][rng.gen_range(0..3)],
            p_block: [0.0, 0.02][rng.gen_range(0..2)],
            p_nack_wait_over: [0.0, 0.05, 1.0][rng.gen_range(0..3)],
        };
        let share = lane_window(p.max_in_flight, n);
        let lanes = (0..n)
            .map(|i| Lane::new(i, share, START, p.dead_letter))
            .collect();
        let aggregates = p.aggregates;
        World {
            s: Shared {
                rng,
                p,
                faults: true,
                events: Vec::new(),
                aggregate_ids: (0..aggregates)
                    .map(|a| format!("order-{a}").into_bytes())
                    .collect(),
                by_aggregate: vec![Vec::new(); aggregates],
                aggregate_low: vec![0; aggregates],
                main_first: Vec::new(),
                dlx_first: Vec::new(),
                refused: Vec::new(),
                published: Vec::new(),
                main_deliveries: 0,
                dlx_deliveries: 0,
            },
            lanes,
            marks: Watermarks::new(n, START),
            gate: Gate::new(n, share, START),
            batch: VecDeque::new(),
            feeding: VecDeque::new(),
            fed: 0,
            next_tx: 0,
            lsn: 1000,
            last_mark: START,
            flushed_sent: START,
            written: START,
            events_read: START,
            global: START,
            global_passed: 0,
        }
    }

    /// One transaction (sometimes empty, sometimes larger than the window), or a
    /// keepalive.
    fn transaction(&mut self, items: &mut Vec<Item>) {
        let s = &mut self.s;
        if s.rng.gen_bool(0.1) {
            self.lsn += 10;
            self.last_mark = Lsn(self.lsn);
            items.push(Item::Mark(self.last_mark));
            return;
        }
        let max = (s.p.max_in_flight * 3).max(2);
        let size = s.rng.gen_range(0..=max).min(s.p.events - self.fed);
        let tx = self.next_tx;
        self.next_tx += 1;
        let commit = Lsn(self.lsn + 1);
        let end = Lsn(self.lsn + 5);
        self.lsn += 10;
        for index in 0..size {
            let event = s.events.len();
            let aggregate = s.rng.gen_range(0..s.p.aggregates);
            let unroutable = s.rng.gen_bool(s.p.p_unroutable) && (s.faults || s.p.dead_letter);
            let poison = s.rng.gen_bool(s.p.p_poison);
            let unfit = s.p.dead_letter && s.rng.gen_bool(s.p.p_unfit);
            s.events.push(EventInfo {
                tx,
                key: EventKey {
                    commit_lsn: commit,
                    index: index as u64,
                },
                end,
                unroutable,
                poison,
                unfit,
                aggregate,
                in_aggregate: s.by_aggregate[aggregate].len(),
                lane: None,
                exchange: (event + aggregate) % 4,
            });
            s.by_aggregate[aggregate].push(event);
            s.main_first.push(false);
            s.dlx_first.push(false);
            s.refused.push(false);
            s.published.push(false);
            items.push(Item::Event(event));
        }
        self.fed += size;
        self.last_mark = end;
        items.push(Item::Mark(end));
    }

    /// The reader sends a batch (one to three transactions or keepalives), split by
    /// the production code and handed to the lanes in lane order as `Lanes::run`
    /// does: a lane whose input is full holds up the rest of the batch, and the
    /// gate holds back what must wait for a later position sent to Postgres.
    fn feed(&mut self) {
        if self.feeding.is_empty() {
            if self.batch.is_empty() && self.fed < self.s.p.events {
                let mut items = Vec::new();
                for _ in 0..self.s.rng.gen_range(1..=3) {
                    if self.fed < self.s.p.events {
                        self.transaction(&mut items);
                    }
                }
                self.batch = items.into();
            }
            let n = self.lanes.len();
            let before: Vec<Item> = self.batch.iter().cloned().collect();
            let (events, ids) = (&self.s.events, &self.s.aggregate_ids);
            let parts = split_items(
                &mut self.batch,
                n,
                &mut self.gate,
                self.flushed_sent,
                |item| match item {
                    Item::Event(e) => Route::Lane(lane_of(&ids[events[*e].aggregate], n)),
                    Item::Mark(lsn) => Route::Mark(*lsn),
                },
            );
            let mut open = false;
            for item in &before[..before.len() - self.batch.len()] {
                match item {
                    Item::Event(_) => open = true,
                    Item::Mark(lsn) if std::mem::take(&mut open) => self.events_read = *lsn,
                    Item::Mark(_) => {}
                }
            }
            self.feeding = parts
                .into_iter()
                .enumerate()
                .filter(|(_, part)| !part.is_empty())
                .collect();
        }
        while let Some((lane, _)) = self.feeding.front() {
            if self.lanes[*lane].inbox.len() >= INBOX {
                return;
            }
            let (lane, part) = self.feeding.pop_front().expect("front");
            self.lanes[lane].inbox.push_back(part);
        }
    }

    /// A lane's follower hands its watermark to the global one (`follow_lane`).
    fn follow(&mut self, i: usize) {
        let lane = &mut self.lanes[i];
        lane.reported = lane.engine.watermark();
        self.marks.set(i, lane.reported);
    }

    /// The reader sends Postgres the global watermark as flushed (and the state
    /// writer stores it, once an event ended past the stored one); the lanes see the
    /// bound later, each in its own time.
    fn flush_to_postgres(&mut self) {
        let acked = self.marks.global();
        self.flushed_sent = if self.s.p.state_table {
            if acked > self.written && self.events_read > self.written {
                self.written = acked;
            }
            acked.min(self.written)
        } else {
            acked
        };
        for lane in &mut self.lanes {
            lane.flushed_news = Some(self.flushed_sent);
        }
    }

    fn step(&mut self) {
        let acting = self.s.rng.gen_range(0..self.lanes.len());
        match self.s.rng.gen_range(0..100) {
            0..=11 => self.feed(),
            12..=18 => self.flush_to_postgres(),
            19..=23 => self.follow(acting),
            roll => {
                let s = &mut self.s;
                let lane = &mut self.lanes[acting];
                match roll {
                    24..=33 => lane.take_input(s),
                    34..=47 => {
                        let n = s.rng.gen_range(1..4);
                        lane.route(s, n);
                    }
                    48..=58 => lane.flush_confirms(&mut s.rng),
                    59..=84 => {
                        let n = s.rng.gen_range(1..4);
                        lane.read(n);
                    }
                    85..=91 => lane.see_flushed(),
                    92..=94 => {
                        lane.blocked =
                            s.faults && s.rng.gen_bool(s.p.p_block * 10.0) && !lane.blocked;
                    }
                    _ => {
                        if s.faults && s.rng.gen_bool((s.p.p_drop * 20.0).min(1.0)) {
                            lane.drop_connection(s);
                        }
                    }
                }
            }
        }
        let s = &mut self.s;
        for lane in &mut self.lanes {
            // A nack waits for the confirms before it; the shell's wait may also
            // run out first.
            if lane.engine.failure_ready()
                || (lane.index == acting
                    && lane.engine.has_failed()
                    && s.rng.gen_bool(s.p.p_nack_wait_over))
            {
                lane.recover(s);
            }
            lane.send(s);
        }
        self.check();
    }

    /// The invariants, after every step.
    fn check(&mut self) {
        let n = self.lanes.len();
        // (2) The global watermark: the minimum of the lanes', never backwards, and
        // never past an event that did not reach a queue.
        let g = self.marks.global();
        let reported: Vec<Lsn> = self.lanes.iter().map(|l| l.reported).collect();
        let min = reported.iter().copied().min().unwrap_or(START);
        assert_eq!(
            g, min,
            "the global watermark {g} is not the minimum of the lanes' {reported:?}"
        );
        assert!(
            g >= self.global,
            "the global watermark went back from {} to {g}",
            self.global
        );
        self.global = g;
        let s = &self.s;
        while self.global_passed < s.events.len() && s.events[self.global_passed].end <= g {
            let e = self.global_passed;
            assert!(
                s.main_first[e] || s.dlx_first[e],
                "the global watermark {g} passed event {e} (tx {}, lane {:?}) which reached no queue; lanes' watermarks {reported:?}",
                s.events[e].tx,
                s.events[e].lane
            );
            self.global_passed += 1;
        }
        // Per lane, and (3) the duplicate bound over all lanes.
        let mut total = 0;
        let mut txs = (usize::MAX, 0);
        let mut per_lane = Vec::new();
        for lane in &mut self.lanes {
            if let Some(f) = lane.check(s, self.flushed_sent) {
                total += f.count;
                txs = (txs.0.min(f.first_tx), txs.1.max(f.last_tx));
                per_lane.push(format!(
                    "lane {}: {} of txs {}..={}",
                    lane.index, f.count, f.first_tx, f.last_tx
                ));
            }
        }
        if total > s.p.max_in_flight {
            assert_eq!(
                txs.0,
                txs.1,
                "{total} messages in flight on {n} lanes across transactions {} to {} (max_in_flight {}, each lane's share {}; sent to Postgres {}): {}",
                txs.0,
                txs.1,
                s.p.max_in_flight,
                lane_window(s.p.max_in_flight, n),
                self.flushed_sent,
                per_lane.join(", ")
            );
        }
    }

    /// Faults off, unroutable events bound (without a dead-letter exchange), poison
    /// fixed: everything must arrive, and the global watermark reach the last mark.
    fn drain(&mut self) {
        self.s.faults = false;
        for lane in &mut self.lanes {
            lane.blocked = false;
        }
        if !self.s.p.dead_letter {
            for e in &mut self.s.events {
                e.unroutable = false;
            }
        }
        let done = |w: &World| {
            w.fed >= w.s.p.events
                && w.batch.is_empty()
                && w.feeding.is_empty()
                && w.lanes.iter().all(Lane::is_drained)
        };
        for _ in 0..400_000 {
            if self.fed < self.s.p.events || !self.batch.is_empty() || !self.feeding.is_empty() {
                self.feed();
            }
            self.step();
            if done(self) {
                break;
            }
        }
        let stuck: Vec<String> = self.lanes.iter().map(Lane::describe).collect();
        assert!(
            done(self),
            "never drained: fed {}/{}, {} items held by the gate, {} parts not handed over, sent to Postgres {}\n{}",
            self.fed,
            self.s.p.events,
            self.batch.len(),
            self.feeding.len(),
            self.flushed_sent,
            stuck.join("\n")
        );
        for i in 0..self.lanes.len() {
            self.follow(i);
        }
        self.flush_to_postgres();
        for lane in &mut self.lanes {
            lane.see_flushed();
        }
        self.check();
        // (4) Everything arrived; the global watermark is at the last mark.
        let s = &self.s;
        for (e, info) in s.events.iter().enumerate() {
            assert!(
                s.main_first[e] || s.dlx_first[e],
                "event {e} (tx {}, lane {:?}) lost",
                info.tx,
                info.lane
            );
            if s.dlx_first[e] {
                assert!(info.unroutable || info.poison || info.unfit || s.refused[e]);
            }
        }
        let reported: Vec<Lsn> = self.lanes.iter().map(|l| l.reported).collect();
        assert_eq!(
            self.marks.global(),
            self.last_mark,
            "drained, but the global watermark is not at the last mark; lanes' watermarks {reported:?}"
        );
        for lane in &self.lanes {
            assert_eq!(lane.engine.window().in_flight(), 0);
        }
    }
}

fn run_schedule(seed: u64, lanes: std::ops::RangeInclusive<usize>) {
    let mut world = World::new(seed, lanes);
    let steps = world.s.rng.gen_range(50..2000);
    for _ in 0..steps {
        world.step();
    }
    world.drain();
}

/// Runs the schedules (or the one of `OUTBOX_SIM_SEED`) with N in `lanes`
/// (`testkit::sim`).
fn run_schedules(test: &str, base: u64, default: u64, lanes: std::ops::RangeInclusive<usize>) {
    let path = format!("amqp::sim::{test}");
    testkit::sim::Schedules {
        test_path: &path,
        krate: "publisher",
        base,
        default,
        run: &|seed, _| run_schedule(seed, lanes.clone()),
        steps: None,
    }
    .run();
}

#[test]
fn publisher_engine_against_a_scripted_broker() {
    run_schedules(
        "publisher_engine_against_a_scripted_broker",
        0x5eed_0000,
        3000,
        1..=1,
    );
}

#[test]
fn lanes_keep_aggregate_order_and_the_global_watermark() {
    run_schedules(
        "lanes_keep_aggregate_order_and_the_global_watermark",
        0x1a4e_0000,
        1500,
        2..=4,
    );
}

/// Schedules that found a defect, run whatever `OUTBOX_SIM_SCHEDULES` says (seeds of
/// this version of the simulation: a change to it changes what a seed does).
#[test]
fn lanes_regressions() {
    // Without `lanes::Gate`: 26 messages in flight on 3 lanes (max_in_flight 20,
    // each lane's share 6): two lanes each past their share with transaction 1, the
    // only thing *they* had in flight, and the third already on transaction 2.
    run_schedule(0x1a4e_0000, 2..=4);
    // A gate that waited for Postgres to be sent the last *keepalive* before a
    // transaction over a lane's share: with the stored position (which moves only
    // once an event ends past it) the bound never got there, and nothing drained.
    run_schedule(0x1a4e_0006, 2..=4);
}
