//! Every decision of the stream publisher, without I/O: which producer to declare,
//! what goes into the next publish frame, which events are already stored, what a
//! confirm or a refusal means, and when to stop. `run.rs` turns the broker's frames
//! into calls here; the simulation (`sim.rs`) drives the same engine against a
//! scripted broker.
//!
//! The watermark rule is [`Window`]'s, shared with the AMQP publisher. What is
//! particular to a stream:
//!
//! - **Producers.** Each event belongs to one producer (`identity.rs`: the timeline
//!   and epoch of its commit) and carries a publishing id derived from its commit LSN
//!   and index. A producer is declared on a connection the first time one of its
//!   events is next to publish, and the broker then says the last id it stored for it.
//! - **Events the broker says it holds are sent again.** An event whose id is at or
//!   below that last id is in the leader's log (ids increase in commit order, the
//!   relay publishes in order, and a refusal below a stored id stops the relay,
//!   below) — but perhaps not yet on a majority: a leader cut off from its replicas
//!   reports writes it will lose when it rejoins. So it is sent again, not counted as
//!   confirmed: the broker drops the copy as a duplicate and confirms it once the
//!   write is committed (docs/design.md §4).
//! - **Frames fit.** A publish frame holds consecutive events of one producer, at most
//!   [`MAX_BATCH`], and its exact encoded size never exceeds the frame maximum the
//!   connection negotiated. An event that cannot fit even alone is a *poison*
//!   message: nothing after it is sent until a connection with a larger frame maximum
//!   takes it, or an operator skips it. So is a malformed logical message
//!   (docs/messages.md), which no connection takes.
//! - **Refusals stop rather than lose.** A refused id is remembered until it is
//!   confirmed. If the next connection finds the producer's last stored id at or above
//!   a refused one, the broker stored a later event and would drop this one as a
//!   duplicate: a definite error. Otherwise the refused ids are sent again, and the
//!   producer's later ids wait until they are confirmed, so that if that connection
//!   fails too, the broker's last id on the one after can only name the refused ids
//!   themselves.
//! - **Ids from another history stop too.** If the broker's last id of the current
//!   timeline's producer names a commit beyond the server's WAL, it was written by
//!   another history under the same reference (a `producer_name` shared by two
//!   sources, a server restored from a snapshot): a definite error.

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use outbox_event::Lsn;

use super::identity::{position_of, ProducerKey};
use crate::window::Window;

/// Bytes of a publish frame besides its messages: the frame's size, key, version,
/// publisher id and message count.
pub(crate) const FRAME_OVERHEAD: usize = 4 + 2 + 2 + 1 + 4;
/// Bytes a message adds to a publish frame besides its encoding: its publishing id
/// and its length.
pub(crate) const MESSAGE_OVERHEAD: usize = 8 + 4;
/// Messages in one publish frame, at most.
pub(crate) const MAX_BATCH: usize = 1000;

/// What the engine needs to know of a message.
pub(crate) trait StreamMsg {
    /// The producer it is published under.
    fn producer(&self) -> ProducerKey;
    /// Its publishing id.
    fn id(&self) -> u64;
    /// The bytes it adds to a publish frame ([`MESSAGE_OVERHEAD`] included).
    fn frame_bytes(&self) -> usize;
    /// Its event's commit LSN and index in the transaction.
    fn position(&self) -> (Lsn, u64);
    /// Whether it can never be published (a malformed logical message): poison,
    /// whatever the frame maximum.
    fn malformed(&self) -> bool {
        false
    }
    /// The broker confirmed it (ends its `publish` span, crate::trace). Called once
    /// per confirm of a sent copy: a message sent again may hear it twice.
    fn confirmed(&self) {}
}

/// What the shell does next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing to send now.
    Idle,
    /// Declare this producer under `publisher_id`, ask the broker for its last stored
    /// id, and report it with [`Engine::declared`].
    Declare { key: ProducerKey, publisher_id: u8 },
    /// Send these window entries in one publish frame.
    Publish {
        publisher_id: u8,
        seqs: Vec<u64>,
        bytes: usize,
    },
    /// The next event does not fit in a frame on this connection (module docs).
    Poison {
        seq: u64,
        frame_bytes: usize,
        frame_max: usize,
    },
}

/// A reason to stop that retrying cannot fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Definite {
    /// The broker refused `refused` but stored `last` after it: `refused` can no longer
    /// be stored under this producer.
    RefusedButStored {
        key: ProducerKey,
        refused: u64,
        last: u64,
    },
    /// The broker's last id of the current timeline's producer names a commit beyond
    /// the server's WAL.
    ForeignIds {
        key: ProducerKey,
        last: u64,
        commit_lsn: Lsn,
        wal: Lsn,
    },
}

impl fmt::Display for Definite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Definite::RefusedButStored { key, refused, last } => {
                let (lsn, index) = position_of(*refused, key.epoch);
                write!(
                    f,
                    "the broker refused publishing id {refused} (the event at index {index} of the transaction committed at {lsn}) but stored a later one ({last}), so it would now drop that event as a duplicate; the relay stopped instead of losing it: re-publish the refused events with `outbox-relay replay`, then clear the mark the relay left (docs/recovery.md, \"A stream refused an event\")"
                )
            }
            Definite::ForeignIds {
                last,
                commit_lsn,
                wal,
                ..
            } => write!(
                f,
                "the broker already stored publishing id {last} under this producer reference, naming a commit at {commit_lsn}, beyond this server's WAL ({wal}): another source or another WAL history writes under the same reference; give this relay its own `[rabbitmq] producer_name` (docs/streams.md)"
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Producer {
    /// Ids the broker refused and that were not confirmed since.
    refused: BTreeSet<u64>,
    /// The refused ids were sent again (on a connection that found the broker's last
    /// id below them), and nothing after them was sent with them.
    resent: bool,
}

#[derive(Debug, Clone, Copy)]
struct Declared {
    publisher_id: u8,
    /// The broker's last stored id when it was declared on this connection.
    last: u64,
}

#[derive(Debug)]
struct Conn {
    frame_max: usize,
    declared: HashMap<ProducerKey, Declared>,
    /// Declared in the order of publisher ids: index = publisher id.
    ids: Vec<ProducerKey>,
    /// (publisher id, publishing id) → window sequence of what was sent here.
    sent: HashMap<(u8, u64), u64>,
}

/// The stream publisher's state; see the module docs.
#[derive(Debug)]
pub(crate) struct Engine<M> {
    window: Window<M>,
    /// A named producer (deduplication), or replay's unnamed one.
    named: bool,
    producers: HashMap<ProducerKey, Producer>,
    conn: Option<Conn>,
    /// The current timeline (its producer's ids must not lie beyond the WAL).
    timeline: u32,
    /// The server's WAL end as far as known: at the session start, or the latest
    /// commit pushed.
    wal: Lsn,
    /// The event that does not fit, while one holds the engine.
    poison: Option<u64>,
    /// Events sent although the broker's last id covered them.
    resent: u64,
}

impl<M: StreamMsg> crate::progress::Progress<M> for Engine<M> {
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

impl<M: StreamMsg> Engine<M> {
    pub(crate) fn new(
        max_in_flight: usize,
        watermark: Lsn,
        named: bool,
        timeline: u32,
        wal: Lsn,
    ) -> Self {
        Self {
            window: Window::new(max_in_flight, watermark),
            named,
            producers: HashMap::new(),
            conn: None,
            timeline,
            wal,
            poison: None,
            resent: 0,
        }
    }

    pub(crate) fn window(&self) -> &Window<M> {
        &self.window
    }

    pub(crate) fn push_message(&mut self, message: M) {
        self.wal = self.wal.max(message.position().0);
        self.window.push_message(message);
    }

    pub(crate) fn push_mark(&mut self, lsn: Lsn) {
        self.window.push_mark(lsn);
        self.window.advance();
    }

    pub(crate) fn flushed(&mut self, lsn: Lsn) {
        self.window.flushed(lsn);
    }

    pub(crate) fn watermark(&self) -> Lsn {
        self.window.watermark()
    }

    /// The window entry that does not fit, while one holds the engine.
    pub(crate) fn poison(&self) -> Option<u64> {
        self.poison
    }

    /// Events sent although the broker's last id covered them, so far.
    pub(crate) fn resent(&self) -> u64 {
        self.resent
    }

    /// A new connection whose publish frames may hold `frame_max` bytes.
    pub(crate) fn connected(&mut self, frame_max: usize) {
        self.conn = Some(Conn {
            frame_max,
            declared: HashMap::new(),
            ids: Vec::new(),
            sent: HashMap::new(),
        });
    }

    /// The connection is gone: everything unconfirmed is sent again, in order, on
    /// the next one. Returns how many messages that is.
    pub(crate) fn disconnected(&mut self) -> usize {
        self.conn = None;
        self.window.restart()
    }

    /// The broker's last stored id of the producer just declared.
    pub(crate) fn declared(&mut self, key: ProducerKey, last: u64) -> Result<(), Definite> {
        let Some(conn) = &mut self.conn else {
            return Ok(());
        };
        if self.named {
            let producer = self.producers.entry(key).or_default();
            if producer.resent {
                // Sent again alone, their confirms lost: what the broker holds up to
                // `last` is those ids themselves.
                producer.refused.retain(|id| *id > last);
                producer.resent = false;
            } else if let Some(&refused) = producer.refused.iter().next().filter(|r| **r <= last) {
                return Err(Definite::RefusedButStored { key, refused, last });
            }
            if key.timeline == self.timeline && last > 0 {
                let (commit_lsn, _) = position_of(last, key.epoch);
                if commit_lsn > self.wal {
                    return Err(Definite::ForeignIds {
                        key,
                        last,
                        commit_lsn,
                        wal: self.wal,
                    });
                }
            }
        }
        let publisher_id = conn.ids.iter().position(|k| *k == key).unwrap_or_else(|| {
            conn.ids.push(key);
            conn.ids.len() - 1
        }) as u8;
        conn.declared.insert(key, Declared { publisher_id, last });
        Ok(())
    }

    /// What to do next (module docs).
    pub(crate) fn next(&mut self) -> Next {
        let named = self.named;
        let Some(conn) = &mut self.conn else {
            return Next::Idle;
        };
        let mut seqs = Vec::new();
        let mut bytes = FRAME_OVERHEAD;
        let mut frame_of: Option<u8> = None;
        loop {
            if seqs.len() >= MAX_BATCH {
                break;
            }
            let Some((seq, message)) = self.window.peek_next() else {
                break;
            };
            let key = message.producer();
            let Some(declared) = conn.declared.get(&key).copied() else {
                if seqs.is_empty() {
                    if conn.ids.len() > usize::from(u8::MAX) {
                        // Out of publisher ids on this connection (hundreds of
                        // producers): the shell reconnects.
                        return Next::Idle;
                    }
                    let publisher_id = conn.ids.len() as u8;
                    return Next::Declare { key, publisher_id };
                }
                break;
            };
            if frame_of.is_some_and(|p| p != declared.publisher_id) {
                break;
            }
            let id = message.id();
            if named && id <= declared.last {
                // Reported stored, but sent again all the same (module docs).
                self.resent += 1;
            }
            if let Some(p) = self.producers.get_mut(&key) {
                match p.refused.last() {
                    // Later ids wait until the refused ones are confirmed, so that the
                    // broker's last id can only name them (module docs).
                    Some(&highest) if id > highest => break,
                    Some(_) => p.resent = true,
                    None => {}
                }
            }
            let size = message.frame_bytes();
            if message.malformed() || bytes + size > conn.frame_max {
                if seqs.is_empty() {
                    self.poison = Some(seq);
                    return Next::Poison {
                        seq,
                        frame_bytes: FRAME_OVERHEAD + size,
                        frame_max: conn.frame_max,
                    };
                }
                break;
            }
            let _ = self.window.next_to_publish();
            if self.poison == Some(seq) {
                self.poison = None;
            }
            conn.sent.insert((declared.publisher_id, id), seq);
            seqs.push(seq);
            bytes += size;
            frame_of = Some(declared.publisher_id);
        }
        match frame_of {
            Some(publisher_id) if !seqs.is_empty() => Next::Publish {
                publisher_id,
                seqs,
                bytes,
            },
            _ => Next::Idle,
        }
    }

    /// The broker confirmed these ids of `publisher_id`. Returns how many of them
    /// were messages sent on this connection.
    pub(crate) fn confirmed(&mut self, publisher_id: u8, ids: &[u64]) -> u64 {
        let Some(conn) = &mut self.conn else {
            return 0;
        };
        let key = conn.ids.get(usize::from(publisher_id)).copied();
        let mut acked = 0;
        for id in ids {
            if let Some(seq) = conn.sent.remove(&(publisher_id, *id)) {
                if let Some(message) = self.window.get(seq) {
                    message.confirmed();
                }
                self.window.ack(seq);
                acked += 1;
            }
            if let Some(p) = key.and_then(|k| self.producers.get_mut(&k)) {
                p.refused.remove(id);
            }
        }
        acked
    }

    /// The broker refused these ids of `publisher_id`: they stay unconfirmed, and are
    /// remembered until confirmed (module docs). The shell ends the connection.
    pub(crate) fn refused(&mut self, publisher_id: u8, ids: &[u64]) {
        let Some(conn) = &self.conn else {
            return;
        };
        let Some(key) = conn.ids.get(usize::from(publisher_id)).copied() else {
            return;
        };
        if self.named {
            // An id at or below the broker's last at the declaration was in the
            // leader's log: refusing its copy says nothing about it (if the leader
            // loses it, the next connection's last id lies below it, and it is sent
            // again as a new event).
            let held = conn.declared.get(&key).map_or(0, |d| d.last);
            let producer = self.producers.entry(key).or_default();
            producer
                .refused
                .extend(ids.iter().copied().filter(|id| *id > held));
            producer.resent = false;
        }
    }

    /// Refused ids not yet confirmed, over all producers.
    #[cfg(test)]
    pub(crate) fn refused_pending(&self) -> usize {
        self.producers.values().map(|p| p.refused.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::identity::publishing_id;

    #[derive(Debug)]
    struct M(Lsn, u64);

    impl StreamMsg for M {
        fn producer(&self) -> ProducerKey {
            ProducerKey {
                timeline: 1,
                epoch: 0,
            }
        }
        fn id(&self) -> u64 {
            publishing_id(self.0, self.1).unwrap()
        }
        fn frame_bytes(&self) -> usize {
            100
        }
        fn position(&self) -> (Lsn, u64) {
            (self.0, self.1)
        }
    }

    const KEY: ProducerKey = ProducerKey {
        timeline: 1,
        epoch: 0,
    };

    fn drain(e: &mut Engine<M>) -> Vec<u64> {
        let mut sent = Vec::new();
        loop {
            match e.next() {
                Next::Publish { seqs, .. } => sent.extend(seqs),
                Next::Declare { key, .. } => e.declared(key, 0).unwrap(),
                _ => return sent,
            }
        }
    }

    #[test]
    fn a_transaction_larger_than_the_window_resumes_after_a_reconnect() {
        let commit = Lsn(0x1_0000_7100);
        let mut e: Engine<M> = Engine::new(500, Lsn(0x100), true, 1, Lsn(u64::MAX));
        for i in 0..700 {
            e.push_message(M(commit, i));
        }
        e.push_mark(Lsn(0x1_0000_7200));
        e.connected(1 << 20);
        let sent = drain(&mut e);
        assert_eq!(sent.len(), 500);
        let ids: Vec<u64> = (0..500)
            .map(|i| publishing_id(commit, i).unwrap())
            .collect();
        e.confirmed(0, &ids);
        e.disconnected();
        e.connected(1 << 20);
        match e.next() {
            Next::Declare { key, .. } => e.declared(key, ids[499]).unwrap(),
            other => panic!("{other:?}"),
        }
        let sent = drain(&mut e);
        assert_eq!(sent.len(), 200, "the rest of the transaction");
        let _ = KEY;
    }
}
