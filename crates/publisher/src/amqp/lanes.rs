//! Ordered parallel publishing: `[rabbitmq] ordering = "aggregate"` with
//! `channels = N` (docs/design.md §4, "Per-aggregate order on N channels").
//!
//! Each *lane* is a whole single-channel publisher ([`Publisher`], its own
//! connection and confirm-mode channel, its own window and engine), so every rule of
//! the one-channel path (confirms in order, retries from the oldest unacked, returns,
//! dead-lettering, poison) holds inside a lane unchanged. What this file adds is
//! small and pure:
//!
//! - **Routing** ([`lane_of`], [`Split`]): an event goes to the lane of its
//!   `aggregate_id` (the rendered routing key when it has none), so one aggregate's
//!   events are all on one channel, in commit order, and a lane's retries replay its
//!   own buffer in order: no failure can reorder an aggregate.
//! - **Marks to every lane**: each commit end and keepalive is handed to every lane,
//!   so a lane's watermark is "every event of mine before this position is acked".
//! - **The global watermark** ([`Watermarks`]): the minimum of the lanes' watermarks,
//!   the position below which every channel has been acked. Only it is sent to
//!   Postgres.
//!
//! The duplicate bound stays `max_in_flight`: each lane's window takes an equal share
//! of it ([`lane_window`]), and a message counts in flight until the *global*
//! position sent to Postgres passes it (every lane follows the one `flushed` watch).
//! A lane's window lets one transaction exceed its share while that transaction is
//! all the *lane* has in flight; the [`Gate`] makes it all the *relay* has in flight
//! (docs/design.md §1.3): it holds the reader's items back until Postgres was sent
//! the position before such a transaction, and the items after it until it was sent
//! the transaction's own end.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use outbox_event::{Lsn, OutboxEvent, WalBatch, WalItem};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::amqp::config::PublisherConfig;
use crate::error::PublishError;
use crate::message::RoutingKeyTemplate;
use crate::report::PublisherReport;
use crate::status::PublisherStatus;
use crate::Publisher;

/// Most channels `[rabbitmq] channels` allows (defined with the check of it).
pub use crate::amqp::config::MAX_CHANNELS;

/// The lane of a key among `lanes`: FNV-1a (64-bit), stable across runs, versions
/// and machines, so an aggregate keeps its channel over restarts.
pub fn lane_of(key: &[u8], lanes: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % lanes.max(1) as u64) as usize
}

/// Each lane's share of `max_in_flight` (at least 1): the lanes together never hold
/// more than `max_in_flight` in flight.
pub fn lane_window(max_in_flight: usize, lanes: usize) -> usize {
    (max_in_flight / lanes.max(1)).max(1)
}

/// Splits the reader's batches into one batch per lane, through the [`Gate`].
pub(crate) struct Split {
    lanes: usize,
    routing_key: RoutingKeyTemplate,
    gate: Gate,
}

impl Split {
    pub(crate) fn new(
        lanes: usize,
        routing_key: RoutingKeyTemplate,
        max_in_flight: usize,
        start: Lsn,
    ) -> Split {
        Split {
            lanes,
            routing_key,
            gate: Gate::new(lanes, lane_window(max_in_flight, lanes), start),
        }
    }

    /// Events to their lane (that of their `aggregate_id`, or of their routing key
    /// without one), in order; every commit end and keepalive to every lane: as much
    /// of `items` as the gate lets through while Postgres was sent `flushed`.
    pub(crate) fn split(&mut self, items: &mut VecDeque<WalItem>, flushed: Lsn) -> Vec<WalBatch> {
        let Split {
            lanes,
            routing_key,
            gate,
        } = self;
        let lanes = *lanes;
        let lane = |event: &OutboxEvent| match &event.aggregate_id {
            Some(id) if !id.is_empty() => lane_of(id, lanes),
            _ => lane_of(routing_key.render(event).as_bytes(), lanes),
        };
        split_items(items, lanes, gate, flushed, |item| match item {
            WalItem::Event(event) => Route::Lane(lane(event)),
            WalItem::Commit(commit) => Route::Mark(commit.end_lsn),
            WalItem::Keepalive(lsn) => Route::Mark(*lsn),
        })
    }
}

/// Where an item goes: an event to its lane, a mark (commit end, keepalive) to all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Lane(usize),
    Mark(Lsn),
}

/// The split itself, over any item (the simulation drives this with its own items):
/// takes items from the front of `items`, each to its lane or a mark to every lane,
/// while `gate` lets them through with `flushed` sent to Postgres; what it holds back
/// stays in `items`.
pub(crate) fn split_items<I: Clone>(
    items: &mut VecDeque<I>,
    lanes: usize,
    gate: &mut Gate,
    flushed: Lsn,
    route: impl Fn(&I) -> Route,
) -> Vec<Vec<I>> {
    let mut out: Vec<Vec<I>> = (0..lanes).map(|_| Vec::new()).collect();
    while let Some(item) = items.front() {
        let to = route(item);
        if !gate.pass(to, flushed) {
            break;
        }
        let Some(item) = items.pop_front() else {
            break;
        };
        match to {
            Route::Lane(l) => out[l].push(item),
            Route::Mark(_) => {
                for lane_items in &mut out {
                    lane_items.push(item.clone());
                }
            }
        }
    }
    out
}

/// Keeps a transaction that is larger than a lane's share the only thing in flight
/// across the lanes (see the module docs). A lane's window already keeps it the
/// only thing in flight on *that* lane; without the gate the other lanes would go on
/// with other transactions beside it, and a crash would send all of them again.
///
/// Marks delimit what the gate counts, as they do for the windows (a keepalive
/// comes only between transactions). Like the windows, it waits only for marks that
/// end events: the position sent to Postgres need not reach a keepalive (with the
/// stored position, §3, it does not until an event follows).
#[derive(Debug)]
pub(crate) struct Gate {
    share: usize,
    /// Per lane, events let through since the last mark.
    open: Vec<usize>,
    /// The last mark let through that ended events: every event let through is
    /// before it or in the open transaction.
    events_end: Lsn,
    /// Some lane has more than its share of the open transaction.
    oversized: bool,
    /// After an oversized transaction: nothing more until Postgres was sent its end.
    hold: Option<Lsn>,
}

impl Gate {
    pub(crate) fn new(lanes: usize, share: usize, start: Lsn) -> Gate {
        Gate {
            share: share.max(1),
            open: vec![0; lanes],
            events_end: start,
            oversized: false,
            hold: None,
        }
    }

    /// Lets an item through (and counts it), or not yet: `flushed` is the position
    /// last sent to Postgres.
    pub(crate) fn pass(&mut self, route: Route, flushed: Lsn) -> bool {
        if let Some(end) = self.hold {
            if flushed < end {
                return false;
            }
            self.hold = None;
        }
        match route {
            Route::Lane(l) => {
                if self.open[l] >= self.share && !self.oversized {
                    // The lane takes more than its share of this transaction: only
                    // once everything before it is out of flight.
                    if flushed < self.events_end {
                        return false;
                    }
                    self.oversized = true;
                }
                self.open[l] += 1;
            }
            Route::Mark(lsn) => {
                if std::mem::take(&mut self.oversized) {
                    self.hold = Some(lsn);
                }
                if self.open.iter().any(|&n| n > 0) {
                    self.events_end = self.events_end.max(lsn);
                }
                self.open.fill(0);
            }
        }
        true
    }
}

/// The lanes' watermarks and the global one, their minimum.
#[derive(Debug, Clone)]
pub(crate) struct Watermarks {
    lanes: Vec<Lsn>,
    global: Lsn,
}

impl Watermarks {
    pub(crate) fn new(lanes: usize, start: Lsn) -> Watermarks {
        Watermarks {
            lanes: vec![start; lanes],
            global: start,
        }
    }

    /// Lane `lane`'s watermark moved to `lsn`; returns the global watermark when that
    /// moved it forward. A lane's watermark never goes back; one that would is
    /// ignored.
    pub(crate) fn set(&mut self, lane: usize, lsn: Lsn) -> Option<Lsn> {
        if lsn <= self.lanes[lane] {
            return None;
        }
        self.lanes[lane] = lsn;
        let min = self.lanes.iter().copied().min().unwrap_or(lsn);
        (min > self.global).then(|| {
            self.global = min;
            min
        })
    }

    pub(crate) fn global(&self) -> Lsn {
        self.global
    }
}

/// N connected single-channel publishers, run as one target.
pub struct Lanes {
    publishers: Vec<Publisher>,
    routing_key: RoutingKeyTemplate,
    max_in_flight: usize,
    status: PublisherStatus,
}

impl Lanes {
    /// Connects `config.channels` publishers, each on its own connection (named
    /// `<connection_name> channel i/N`) with its share of `max_in_flight`.
    pub async fn connect(config: PublisherConfig) -> Result<Lanes, PublishError> {
        config.validate()?;
        let lanes = config.channels;
        let routing_key = RoutingKeyTemplate::parse(&config.routing_key)?;
        let mut publishers = Vec::with_capacity(lanes);
        for i in 0..lanes {
            let mut lane = config.clone();
            lane.channels = 1;
            lane.max_in_flight = lane_window(config.max_in_flight, lanes);
            // The byte bound and the names a row may have declared are shared the
            // same way (docs/routing.md).
            lane.max_in_flight_bytes = (config.max_in_flight_bytes / lanes).max(1);
            lane.max_declared_exchanges = (config.max_declared_exchanges / lanes).max(1);
            lane.connection_name =
                format!("{} channel {}/{}", config.connection_name, i + 1, lanes);
            publishers.push(Publisher::connect(lane).await?);
        }
        tracing::info!(
            exchange = %config.exchange,
            "publishing per aggregate on {lanes} channels"
        );
        let status = PublisherStatus::of_lanes(publishers.iter().map(Publisher::status).collect());
        Ok(Lanes {
            publishers,
            routing_key,
            max_in_flight: config.max_in_flight,
            status,
        })
    }

    /// The live status: all lanes connected, any blocked or poisoned, their sum in
    /// flight, and the global watermark.
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }

    /// Publishes until `input` ends, as [`Publisher::run`] does, on every lane at
    /// once; `watermark` moves to the minimum of the lanes'. A lane that fails for
    /// good ends the run with its error (the others are stopped: the session starts
    /// again from the global watermark).
    pub async fn run(
        self,
        mut input: mpsc::Receiver<WalBatch>,
        watermark: watch::Sender<Lsn>,
        flushed: Option<watch::Receiver<Lsn>>,
    ) -> Result<PublisherReport, PublishError> {
        let Lanes {
            publishers,
            routing_key,
            max_in_flight,
            status,
        } = self;
        let start = *watermark.borrow();
        let mut split = Split::new(publishers.len(), routing_key, max_in_flight, start);
        // What the gate waits for: the position sent to Postgres (without one, as
        // on one channel, the watermark counts as sent).
        let mut sent_to_pg = flushed.clone().unwrap_or_else(|| watermark.subscribe());
        status.set_acked_lsn(start);
        let marks = Arc::new(Mutex::new(Watermarks::new(publishers.len(), start)));
        let watermark = Arc::new(watermark);
        let mut senders = Vec::with_capacity(publishers.len());
        let mut tasks = JoinSet::new();
        for (i, publisher) in publishers.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel(4);
            senders.push(tx);
            let (lane_tx, lane_rx) = watch::channel(start);
            tasks.spawn(follow_lane(
                i,
                lane_rx,
                Arc::clone(&marks),
                Arc::clone(&watermark),
                status.clone(),
            ));
            let flushed = flushed.clone();
            tasks.spawn(async move { Some(publisher.run(rx, lane_tx, flushed).await) });
        }
        let lanes = senders.len();
        let mut reports = Vec::with_capacity(lanes);
        // Feed the lanes until the input ends; a lane that returns before that
        // failed for good.
        'feed: while let Some(batch) = input.recv().await {
            let mut items = VecDeque::from(batch);
            loop {
                let flushed_now = (*sent_to_pg.borrow_and_update()).max(start);
                for (tx, part) in senders.iter().zip(split.split(&mut items, flushed_now)) {
                    if part.is_empty() {
                        continue;
                    }
                    tokio::select! {
                        sent = tx.send(part) => if sent.is_err() { break 'feed; },
                        ended = tasks.join_next() => {
                            if let Some(done) = lane_result(ended)? {
                                reports.push(done);
                            }
                            break 'feed;
                        }
                    }
                }
                if items.is_empty() {
                    break;
                }
                // The gate holds the rest until Postgres is sent a later position.
                tokio::select! {
                    // The reader is gone: as on one channel, the watermark counts
                    // as sent from now on.
                    changed = sent_to_pg.changed() => if changed.is_err() {
                        sent_to_pg = watermark.subscribe();
                    },
                    ended = tasks.join_next() => {
                        if let Some(done) = lane_result(ended)? {
                            reports.push(done);
                        }
                        break 'feed;
                    }
                }
            }
        }
        drop(senders);
        while let Some(ended) = tasks.join_next().await {
            match lane_result(Some(ended)) {
                Ok(Some(report)) => reports.push(report),
                Ok(None) => {}
                Err(e) => {
                    tasks.abort_all();
                    return Err(e);
                }
            }
        }
        let global = marks.lock().map(|m| m.global()).unwrap_or(start);
        let mut report = PublisherReport {
            watermark: global,
            ..PublisherReport::default()
        };
        for r in &reports {
            report.published += r.published;
            report.acked += r.acked;
            report.nacked += r.nacked;
            report.returned += r.returned;
            report.dead_lettered += r.dead_lettered;
            report.retries += r.retries;
            report.reconnects += r.reconnects;
            report.abandoned += r.abandoned;
        }
        Ok(report)
    }
}

/// What a lane task ended with: a publisher's report (`Some`), a follower's end
/// (`None`), or the publisher's error; a lane's panic goes on unwinding here.
fn lane_result(
    ended: Option<Result<Option<Result<PublisherReport, PublishError>>, tokio::task::JoinError>>,
) -> Result<Option<PublisherReport>, PublishError> {
    match ended {
        None | Some(Ok(None)) => Ok(None),
        Some(Ok(Some(result))) => result.map(Some),
        // A panic in a lane is the panic of the run, as on one channel.
        Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Some(Err(_)) => Ok(None),
    }
}

/// Follows lane `lane`'s watermark into the global one until the lane's publisher
/// is gone.
async fn follow_lane(
    lane: usize,
    mut rx: watch::Receiver<Lsn>,
    marks: Arc<Mutex<Watermarks>>,
    watermark: Arc<watch::Sender<Lsn>>,
    status: PublisherStatus,
) -> Option<Result<PublisherReport, PublishError>> {
    while rx.changed().await.is_ok() {
        let lsn = *rx.borrow_and_update();
        let moved = marks.lock().ok().and_then(|mut m| m.set(lane, lsn));
        if let Some(global) = moved {
            watermark.send_replace(global);
            status.set_acked_lsn(global);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_lane_and_keys_spread_over_all_lanes() {
        assert_eq!(lane_of(b"order-17", 4), lane_of(b"order-17", 4));
        // FNV-1a of the empty key is its offset basis.
        assert_eq!(lane_of(b"", 4), (0xcbf2_9ce4_8422_2325u64 % 4) as usize);
        let mut seen = [0usize; 4];
        for i in 0..400 {
            seen[lane_of(format!("aggregate-{i}").as_bytes(), 4)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
        assert_eq!(lane_of(b"x", 1), 0);
    }

    #[test]
    fn marks_go_to_every_lane_and_items_to_theirs_in_order() {
        // Items: (lane or None for a mark, value).
        let mut items = VecDeque::from(vec![
            (Some(1), 1),
            (None, 2),
            (Some(0), 3),
            (Some(1), 4),
            (None, 5),
        ]);
        let mut gate = Gate::new(3, 10, Lsn(0));
        let out = split_items(&mut items, 3, &mut gate, Lsn(0), route);
        assert!(items.is_empty());
        assert_eq!(
            values(&out),
            vec![vec![2, 3, 5], vec![1, 2, 4, 5], vec![2, 5]]
        );
    }

    fn route(item: &(Option<usize>, u64)) -> Route {
        match item.0 {
            Some(l) => Route::Lane(l),
            None => Route::Mark(Lsn(item.1)),
        }
    }

    fn values(out: &[Vec<(Option<usize>, u64)>]) -> Vec<Vec<u64>> {
        out.iter()
            .map(|l| l.iter().map(|i| i.1).collect())
            .collect()
    }

    #[test]
    fn a_transaction_over_a_lanes_share_is_all_that_is_in_flight() {
        // Share 2 on two lanes; marks at 10 (tx A: one event), a keepalive at 15,
        // 20 (tx B: three events on lane 0), 30 (tx C: one event on lane 1).
        let mut items = VecDeque::from(vec![
            (Some(1), 1),
            (None, 10),
            (None, 15),
            (Some(0), 2),
            (Some(0), 3),
            (Some(0), 4),
            (None, 20),
            (Some(1), 5),
            (None, 30),
        ]);
        let mut gate = Gate::new(2, 2, Lsn(0));
        // B's third event on lane 0 waits until A is out of flight (not for the
        // keepalive: nothing is in flight before it but A).
        let out = split_items(&mut items, 2, &mut gate, Lsn(0), route);
        assert_eq!(values(&out), vec![vec![10, 15, 2, 3], vec![1, 10, 15]]);
        let out = split_items(&mut items, 2, &mut gate, Lsn(9), route);
        assert!(out.iter().all(Vec::is_empty));
        // Then B alone: C waits until B is out of flight.
        let out = split_items(&mut items, 2, &mut gate, Lsn(10), route);
        assert_eq!(values(&out), vec![vec![4, 20], vec![20]]);
        let out = split_items(&mut items, 2, &mut gate, Lsn(19), route);
        assert!(out.iter().all(Vec::is_empty));
        let out = split_items(&mut items, 2, &mut gate, Lsn(20), route);
        assert_eq!(values(&out), vec![vec![30], vec![5, 30]]);
        assert!(items.is_empty());
    }

    #[test]
    fn the_global_watermark_is_the_slowest_lanes() {
        let mut w = Watermarks::new(3, Lsn(10));
        assert_eq!(w.set(0, Lsn(30)), None);
        assert_eq!(w.set(1, Lsn(20)), None);
        assert_eq!(w.set(2, Lsn(25)), Some(Lsn(20)));
        assert_eq!(w.set(1, Lsn(40)), Some(Lsn(25)));
        // Backwards is ignored.
        assert_eq!(w.set(2, Lsn(5)), None);
        assert_eq!(w.global(), Lsn(25));
    }

    #[test]
    fn the_lanes_share_the_window() {
        assert_eq!(lane_window(10_000, 4), 2_500);
        assert_eq!(lane_window(3, 4), 1);
        assert_eq!(lane_window(7, 1), 7);
    }
}
