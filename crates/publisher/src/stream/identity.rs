//! Who publishes into a stream, and under which publishing id (docs/design.md §4,
//! "Exactly once into a stream").
//!
//! A named producer's events are deduplicated by the broker: it stores a message only
//! if its publishing id is above the highest one it stored under that producer
//! reference. The relay makes both the reference and the id pure functions of the
//! event's place in its source's WAL history, so that nothing needs to be read back
//! from the stream to continue after a restart:
//!
//! - **reference** = `<base>/tl<T>` (and `/e<E>` for WAL epochs after the first),
//!   where `<base>` names the source — `outbox-relay/<system id>/<database>/<slot>`,
//!   or `[rabbitmq] producer_name` — `T` is the timeline whose WAL holds the event's
//!   commit record (the current timeline, or an ancestor for a commit before its
//!   switch point), and `E` is the commit LSN's top bits ([`EPOCH_BITS`]);
//! - **publishing id** = the commit LSN's low [`EPOCH_BITS`] bits shifted left by
//!   [`INDEX_BITS`], plus the event's index in its transaction.
//!
//! Commit LSNs strictly increase in commit order on one timeline, and two commit
//! records are at least [`MIN_COMMIT_RECORD`] bytes apart, so the ids of one producer
//! strictly increase in commit order as long as a transaction has fewer than
//! [`MAX_EVENTS_PER_TRANSACTION`] events; a larger one is refused with an error
//! naming the limit. Two sources never share a reference; two timelines of one
//! source never do either, so the WAL a failover or a restore replaced can never make
//! the broker drop an event of the new history as a duplicate.

use std::fmt;

use outbox_event::history::History;
use outbox_event::Lsn;

/// Bits of a commit LSN inside one epoch: 8 TiB of WAL.
pub const EPOCH_BITS: u32 = 43;
/// Bits of the id left for the index in the transaction.
pub const INDEX_BITS: u32 = 64 - 1 - EPOCH_BITS;
/// A commit record is at least this long (a 24-byte record header, the commit's
/// timestamp and its data header, aligned to 8 bytes): the next commit LSN is at least
/// this far away, and so are the ids of the next transaction.
pub const MIN_COMMIT_RECORD: u64 = 32;
/// The most outbox events one transaction may carry into a stream.
pub const MAX_EVENTS_PER_TRANSACTION: u64 = MIN_COMMIT_RECORD << INDEX_BITS;

/// The producer an event belongs to, within one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProducerKey {
    /// The timeline whose WAL holds the commit record.
    pub timeline: u32,
    /// The commit LSN's epoch (`commit_lsn >> EPOCH_BITS`).
    pub epoch: u32,
}

/// What names a relay's stream producers: its source and that source's history as
/// this session found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSource {
    /// The first part of every producer reference (module docs).
    pub reference: String,
    /// `<system id>/<database>/<slot>`, the `x-outbox-source` application property.
    pub source: String,
    /// The server's history now: which timeline holds which commit.
    pub history: History,
    /// The server's WAL end when the session started: a producer whose last stored id
    /// lies beyond the WAL of its own timeline belongs to another history.
    pub server_wal: Lsn,
}

impl StreamSource {
    /// The reference derived from the source: `outbox-relay/<system id>/<database>/<slot>`.
    pub fn derived_reference(system_id: u64, database: &str, slot: &str) -> String {
        format!("outbox-relay/{system_id}/{database}/{slot}")
    }

    /// The producer of an event committed at `commit_lsn`.
    pub fn key(&self, commit_lsn: Lsn) -> ProducerKey {
        ProducerKey {
            timeline: self.history.owner(commit_lsn),
            epoch: (commit_lsn.0 >> EPOCH_BITS) as u32,
        }
    }

    /// The broker's name for producer `key`.
    pub fn reference_of(&self, key: ProducerKey) -> String {
        if key.epoch == 0 {
            format!("{}/tl{}", self.reference, key.timeline)
        } else {
            format!("{}/tl{}/e{}", self.reference, key.timeline, key.epoch)
        }
    }
}

/// A transaction with more events than a stream producer can number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyEvents {
    pub commit_lsn: Lsn,
    pub index: u64,
}

impl fmt::Display for TooManyEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the transaction committed at {} has more than {MAX_EVENTS_PER_TRANSACTION} outbox events, more than a stream producer can number; split such transactions, or publish this one with `replay --from-lsn` and start after it",
            self.commit_lsn
        )
    }
}

/// The publishing id of the event at `index` of the transaction committed at
/// `commit_lsn` (module docs).
pub fn publishing_id(commit_lsn: Lsn, index: u64) -> Result<u64, TooManyEvents> {
    if index >= MAX_EVENTS_PER_TRANSACTION {
        return Err(TooManyEvents { commit_lsn, index });
    }
    let low = commit_lsn.0 & ((1u64 << EPOCH_BITS) - 1);
    Ok((low << INDEX_BITS) + index)
}

/// The commit LSN (within `epoch`) and index of a publishing id: the last event a
/// producer stored. Exact for transactions of fewer than `2^INDEX_BITS` events; past
/// that the index spills into the LSN, which then reads at most
/// `MIN_COMMIT_RECORD - 1` bytes high (still inside the commit record).
pub fn position_of(id: u64, epoch: u32) -> (Lsn, u64) {
    let low = id >> INDEX_BITS;
    let index = id & ((1u64 << INDEX_BITS) - 1);
    (Lsn((u64::from(epoch) << EPOCH_BITS) | low), index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> StreamSource {
        StreamSource {
            reference: StreamSource::derived_reference(7, "app", "outbox_relay"),
            source: "7/app/outbox_relay".into(),
            history: History::parse(7, 3, "1\t0/3000060\tx\n2\t0/5000100\ty\n").unwrap(),
            server_wal: Lsn(u64::MAX),
        }
    }

    #[test]
    fn references_name_the_source_timeline_and_epoch() {
        let s = source();
        let key = s.key(Lsn(0x100));
        assert_eq!(s.reference_of(key), "outbox-relay/7/app/outbox_relay/tl1");
        assert_eq!(
            s.reference_of(s.key(Lsn(0x5000100))),
            "outbox-relay/7/app/outbox_relay/tl3"
        );
        let late = Lsn((3u64 << EPOCH_BITS) | 0x10);
        assert_eq!(
            s.reference_of(s.key(late)),
            "outbox-relay/7/app/outbox_relay/tl3/e3"
        );
    }

    #[test]
    fn ids_increase_in_commit_order_and_decode() {
        // Two commits MIN_COMMIT_RECORD apart, the first with the most events.
        let a = Lsn(0x1_0000_0040);
        let b = Lsn(a.0 + MIN_COMMIT_RECORD);
        let last_of_a = publishing_id(a, MAX_EVENTS_PER_TRANSACTION - 1).unwrap();
        let first_of_b = publishing_id(b, 0).unwrap();
        assert!(last_of_a < first_of_b);
        assert!(publishing_id(a, MAX_EVENTS_PER_TRANSACTION).is_err());
        assert!(publishing_id(a, 0).unwrap() > 0);
        assert_eq!(position_of(publishing_id(a, 5).unwrap(), 0), (a, 5));
        // The highest commit LSN of an epoch with the most events does not overflow.
        let top = Lsn((1u64 << EPOCH_BITS) - MIN_COMMIT_RECORD);
        let id = publishing_id(top, MAX_EVENTS_PER_TRANSACTION - 1).unwrap();
        assert_eq!(id, (1u64 << 63) - 1);
        let (lsn, _) = position_of(id, 0);
        assert!(lsn >= top && lsn.0 < top.0 + MIN_COMMIT_RECORD);
        let next_epoch = Lsn((5u64 << EPOCH_BITS) | 0x28);
        let id = publishing_id(next_epoch, 2).unwrap();
        assert_eq!(position_of(id, 5), (next_epoch, 2));
    }
}
