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

use std::sync::{Arc, Mutex};

use outbox_event::{Lsn, OutboxEvent, WalBatch, WalItem};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::config::PublisherConfig;
use crate::error::PublishError;
use crate::message::RoutingKeyTemplate;
use crate::report::PublisherReport;
use crate::status::PublisherStatus;
use crate::Publisher;

/// Most channels `[rabbitmq] channels` allows.
pub const MAX_CHANNELS: usize = 64;

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

/// Splits the reader's batches into one batch per lane.
pub(crate) struct Split {
    lanes: usize,
    routing_key: RoutingKeyTemplate,
}

impl Split {
    pub(crate) fn new(lanes: usize, routing_key: RoutingKeyTemplate) -> Split {
        Split { lanes, routing_key }
    }

    /// The lane of an event: its `aggregate_id`, or its routing key without one.
    pub(crate) fn lane(&self, event: &OutboxEvent) -> usize {
        match &event.aggregate_id {
            Some(id) if !id.is_empty() => lane_of(id, self.lanes),
            _ => lane_of(self.routing_key.render(event).as_bytes(), self.lanes),
        }
    }

    /// Events to their lane, in order; every commit end and keepalive to every lane.
    pub(crate) fn split(&self, batch: WalBatch) -> Vec<WalBatch> {
        split_items(batch, self.lanes, |item| match item {
            WalItem::Event(event) => Some(self.lane(event)),
            WalItem::Commit(_) | WalItem::Keepalive(_) => None,
        })
    }
}

/// The split itself, over any item: `lane` names an item's lane, or `None` for a
/// mark that goes to every lane (the simulation drives this with its own items).
pub(crate) fn split_items<I: Clone>(
    items: Vec<I>,
    lanes: usize,
    lane: impl Fn(&I) -> Option<usize>,
) -> Vec<Vec<I>> {
    let mut out: Vec<Vec<I>> = (0..lanes).map(|_| Vec::new()).collect();
    for item in items {
        match lane(&item) {
            Some(l) => out[l].push(item),
            None => {
                for lane_items in &mut out {
                    lane_items.push(item.clone());
                }
            }
        }
    }
    out
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
    split: Split,
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
            split: Split::new(lanes, routing_key),
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
            split,
            status,
        } = self;
        let start = *watermark.borrow();
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
            for (tx, part) in senders.iter().zip(split.split(batch)) {
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
/// (`None`), or the publisher's error (a panic is reported as one).
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
        let items = vec![
            (Some(1), 1),
            (None, 2),
            (Some(0), 3),
            (Some(1), 4),
            (None, 5),
        ];
        let out = split_items(items, 3, |i| i.0);
        let values: Vec<Vec<i32>> = out
            .iter()
            .map(|l| l.iter().map(|i| i.1).collect())
            .collect();
        assert_eq!(values, vec![vec![2, 3, 5], vec![1, 2, 4, 5], vec![2, 5]]);
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
