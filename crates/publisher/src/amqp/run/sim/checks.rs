//! The invariants of the publisher's simulation (see `sim.rs`), checked after
//! every step and at the end of a schedule.

use std::collections::HashMap;
use std::time::Duration;

use outbox_event::Lsn;
use tokio::time::Instant;

use super::broker::Cluster;
use super::{Ev, Kind, Log, Params};
use crate::amqp::engine::EventKey;
use crate::status::PublisherStatus;

/// What a step left, as the checks read it.
pub(super) struct Seen<'a> {
    pub cluster: &'a Cluster,
    pub watermark: Lsn,
    /// The message id `/poison` names.
    pub poison: Option<String>,
    /// The stall the watchdog names, and after how long it should.
    pub stalled: Option<crate::status::Stall>,
    pub stall_after: Duration,
    /// The publisher's progress count (its oldest waiting entry settled).
    pub progress: u64,
    pub healthy: bool,
    /// Events handed to the publisher (sent on its input) so far.
    pub fed: usize,
    pub log: &'a Log,
    pub p: &'a Params,
}

pub(super) struct Checks {
    /// `max_declared_exchanges`.
    max_declared: usize,
    by_key: HashMap<EventKey, usize>,
    /// Per event: in the main queue, in the dead-letter queue.
    main: Vec<bool>,
    dead: Vec<bool>,
    /// Deliveries checked so far.
    seen: usize,
    /// Events before this one are all settled (in a queue, or refused).
    low: usize,
    watermark: Lsn,
    /// When an event last settled (or the oldest waiting one was named), or the
    /// wait was excused.
    progress_at: Instant,
    /// When an event last settled (nothing excuses a silence).
    loud_at: Instant,
    relay_progress: u64,
    /// Since when the cluster is healthy.
    healthy_since: Option<Instant>,
    settled: usize,
    named: Option<String>,
}

impl Checks {
    pub(super) fn new(events: &[Ev], max_declared: usize) -> Checks {
        Checks {
            max_declared,
            by_key: events.iter().enumerate().map(|(i, e)| (e.key, i)).collect(),
            main: vec![false; events.len()],
            dead: vec![false; events.len()],
            seen: 0,
            low: 0,
            watermark: Lsn(0),
            progress_at: Instant::now(),
            loud_at: Instant::now(),
            relay_progress: 0,
            healthy_since: None,
            settled: 0,
            named: None,
        }
    }

    fn event(&self, key: EventKey) -> usize {
        *self
            .by_key
            .get(&key)
            .unwrap_or_else(|| panic!("the broker got an event never written: {key:?}"))
    }

    /// Whether the relay may refuse event `e` (poison, or a notice of it to the DLX):
    /// its content or name is refused by the broker or the relay's rules, or the
    /// broker refused its own exchange.
    fn refusable(&self, e: &Ev, cluster: &Cluster) -> bool {
        matches!(
            e.kind,
            Kind::Poison | Kind::Unfit | Kind::BadName | Kind::Forbidden
        ) || e.exchange.as_ref().is_some_and(|x| {
            cluster.refused_exchanges.contains(x)
                // Past `max_declared_exchanges`, a name never declared is refused.
                || (!cluster.declared.contains(x) && self.chosen(cluster) >= self.max_declared)
        })
    }

    /// Exchanges chosen by events that the relay declared (the configured one and
    /// the DLX are not).
    fn chosen(&self, cluster: &Cluster) -> usize {
        cluster
            .declared
            .iter()
            .filter(|x| x.as_str() != super::OUTBOX && x.as_str() != super::broker::DLX)
            .count()
    }

    /// Checks what step `step` left.
    pub(super) fn after_step(&mut self, step: usize, events: &[Ev], s: Seen<'_>) {
        let c = s.cluster;
        self.protocol_kept(step, c);
        let before = self.settled;
        self.take_deliveries(step, events, c);
        self.watermark_kept(step, events, &s);
        self.poison_refusable(step, events, &s);
        self.no_silent_wait(step, events, &s, before);
        let _ = s.log;
    }

    /// The broker saw no protocol violation, no publish after `channel.flow(false)`,
    /// and no more exchanges declared for events than `max_declared_exchanges`.
    fn protocol_kept(&self, step: usize, c: &Cluster) {
        assert!(
            c.violations.is_empty(),
            "step {step}: the relay broke the protocol: {:?}",
            c.violations
        );
        for server in &c.conns {
            assert!(
                server.violations.is_empty(),
                "step {step}: the relay broke the protocol: {:?}",
                server.violations
            );
            assert_eq!(
                server.flow_violations, 0,
                "step {step}: the relay published after channel.flow(false) was acknowledged"
            );
        }
        let chosen = self.chosen(c);
        assert!(
            chosen <= self.max_declared,
            "step {step}: the relay declared {chosen} exchanges chosen by events, over max_declared_exchanges = {}",
            self.max_declared
        );
    }

    /// Reads the deliveries since the last step, in the order the queues received
    /// them: a dead-letter copy only of an event unroutable or refusable, every
    /// event to its own exchange, and an event's first copy in the main queue only
    /// after every earlier event reached a queue or was refused.
    fn take_deliveries(&mut self, step: usize, events: &[Ev], c: &Cluster) {
        for d in &c.deliveries[self.seen..] {
            let e = self.event(d.key);
            let ev = &events[e];
            if d.dead {
                let unroutable = d.error.as_deref() == Some("unroutable");
                assert!(
                    (unroutable && ev.kind == Kind::Lost) || (!unroutable && self.refusable(ev, c)),
                    "step {step}: event {e} ({}, {:?}, exchange {:?}) dead-lettered as {:?} for no reason",
                    ev.id,
                    ev.kind,
                    ev.exchange,
                    d.error
                );
                if !self.dead[e] {
                    self.dead[e] = true;
                    if !self.main[e] {
                        self.settled += 1;
                    }
                }
                continue;
            }
            assert!(
                d.exchange == ev.exchange.as_deref().unwrap_or(super::OUTBOX),
                "step {step}: event {e} went to exchange {:?}, not its own {:?}",
                d.exchange,
                ev.exchange
            );
            if !self.main[e] {
                self.main[e] = true;
                if !self.dead[e] {
                    self.settled += 1;
                }
                self.advance_low(events, c);
                if self.low < e {
                    let other = self.low;
                    panic!(
                        "step {step}: event {e} ({}) reached the queue before event {other} ({}), which was never refused",
                        events[e].id, events[other].id
                    );
                }
            }
        }
        self.seen = c.deliveries.len();
        self.advance_low(events, c);
    }

    /// The watermark: never back, never past an event in no queue.
    fn watermark_kept(&mut self, step: usize, events: &[Ev], s: &Seen<'_>) {
        assert!(
            s.watermark >= self.watermark,
            "step {step}: the watermark went back from {} to {}",
            self.watermark,
            s.watermark
        );
        self.watermark = s.watermark;
        if let Some((i, e)) = events
            .iter()
            .enumerate()
            .find(|(i, e)| e.end <= s.watermark && !self.main[*i] && !self.dead[*i])
        {
            panic!(
                "step {step}: the watermark {} passed event {i} ({}), which is in no queue",
                s.watermark, e.id
            );
        }
    }

    /// A poison named must be refusable.
    fn poison_refusable(&self, step: usize, events: &[Ev], s: &Seen<'_>) {
        let c = s.cluster;
        if let Some(id) = &s.poison {
            if let Some(e) = events.iter().find(|e| &e.id == id) {
                assert!(
                    self.refusable(e, c) || (e.kind == Kind::Lost && !s.p.dead_letter),
                    "step {step}: event {} ({:?}, exchange {:?}) named as poison for no reason",
                    e.id,
                    e.kind,
                    e.exchange
                );
            }
        }
    }

    /// No event waits silently: while events wait and the cluster has been healthy
    /// for `healthy_bound`, some event settled or the oldest waiting one is excused;
    /// a wait longer than `stall_after` (and 5 s) is named by `/poison` or a stall.
    /// `before`: the events settled before this step's deliveries.
    fn no_silent_wait(&mut self, step: usize, events: &[Ev], s: &Seen<'_>, before: usize) {
        let c = s.cluster;
        let now = Instant::now();
        if self.settled > before || s.poison != self.named {
            self.progress_at = now;
            self.loud_at = now;
        }
        if s.progress != self.relay_progress {
            // The relay's oldest entry settled (perhaps an event delivered before,
            // again): the watchdog counts it, and so does this check.
            self.relay_progress = s.progress;
            self.loud_at = now;
        }
        self.named = s.poison.clone();
        let first = (0..s.fed).find(|i| !self.main[*i] && !self.dead[*i]);
        let named = s.poison.is_some() || s.stalled.is_some();
        // The oldest waiting event may hold the relay only if the broker or the
        // rules refuse it (or it is unroutable with no dead-letter exchange), and
        // only while the relay names it.
        let excused = first.is_some_and(|i| {
            named
                && (self.refusable(&events[i], c)
                    || (events[i].kind == Kind::Lost && !s.p.dead_letter))
        });
        if first.is_none() || excused {
            self.progress_at = now;
        }
        if first.is_none() {
            self.loud_at = now;
        }
        if s.healthy {
            self.healthy_since.get_or_insert(now);
        } else {
            self.healthy_since = None;
        }
        let describe = |i: usize| {
            let e = &events[i];
            format!("event {} ({:?}, exchange {:?})", e.id, e.kind, e.exchange)
        };
        let bound = healthy_bound(s.p);
        if let (Some(since), Some(i)) = (self.healthy_since, first) {
            let quiet = now.duration_since(since.max(self.progress_at));
            assert!(
                quiet <= bound,
                "step {step}: {} waits, the cluster has been healthy for {:?}, and nothing settled for {:?} (bound {bound:?}); /poison names {:?}, the stall {:?}",
                describe(i),
                now.duration_since(since),
                now.duration_since(self.progress_at),
                s.poison,
                s.stalled,
            );
        }
        if let Some(i) = first {
            let silent = now.duration_since(self.loud_at);
            assert!(
                named || silent <= s.stall_after + Duration::from_secs(5),
                "step {step}: {} waits silently: nothing settled for {silent:?} (stall_after {:?}) and neither /poison nor a stall names anything",
                describe(i),
                s.stall_after,
            );
        }
    }

    fn advance_low(&mut self, events: &[Ev], c: &Cluster) {
        while self.low < events.len()
            && (self.main[self.low]
                || self.dead[self.low]
                || c.refused.contains(&events[self.low].key))
        {
            self.low += 1;
        }
    }

    /// The oldest event in no queue, if it may hold the relay while it is named: the
    /// broker or the rules refuse it, or it is unroutable with no dead-letter
    /// exchange.
    fn holding(
        &self,
        events: &[Ev],
        c: &Cluster,
        status: &PublisherStatus,
        p: &Params,
    ) -> Result<(), String> {
        let Some(i) = (0..events.len()).find(|i| !self.main[*i] && !self.dead[*i]) else {
            return Ok(());
        };
        let e = &events[i];
        let holdable = self.refusable(e, c) || (e.kind == Kind::Lost && !p.dead_letter);
        let poison = status.poison().map(|p| p.message_id);
        let stalled = status.stalled();
        if holdable
            && (poison.as_deref() == Some(e.id.as_str())
                || (e.kind == Kind::Lost && stalled.is_some()))
        {
            return Ok(());
        }
        Err(format!(
            "event {} ({:?}, exchange {:?}) is in no queue; /poison names {poison:?}, the stall {stalled:?}",
            e.id, e.kind, e.exchange
        ))
    }

    /// Every event in a queue, or the oldest waiting one holds the relay, named; and
    /// the publisher's window empty unless a poison holds it (a tag-0 confirm it
    /// rightly ignored leaves a delivered event waiting for its confirm's deadline).
    pub(super) fn all_settled(
        &self,
        events: &[Ev],
        c: &Cluster,
        status: &PublisherStatus,
        p: &Params,
    ) -> bool {
        let idle = status.buffered() == 0 || status.poison().is_some();
        self.holding(events, c, status, p).is_ok() && idle
    }

    /// The end of a schedule, after every fault stopped.
    pub(super) fn at_the_end(
        &self,
        events: &[Ev],
        c: &Cluster,
        status: &PublisherStatus,
        p: &Params,
    ) {
        if let Err(why) = self.holding(events, c, status, p) {
            panic!("after every fault ended: {why}");
        }
        if let Some(poison) = status.poison() {
            assert!(
                !p.dead_letter,
                "{} is named as poison although a dead-letter exchange takes refused events",
                poison.message_id
            );
        }
    }
}

/// How long events may wait without settling while the cluster is healthy: a
/// request that went unanswered (its deadline), a backoff, and slack.
pub(super) fn healthy_bound(p: &Params) -> Duration {
    p.request_timeout + p.backoff_max + Duration::from_secs(10)
}
