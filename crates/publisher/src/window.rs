//! The in-flight window and the acked watermark (pure bookkeeping, no I/O).
//!
//! Every item the reader sends is appended to one ordered buffer: messages, and
//! *marks* (a transaction's commit `end_lsn`, or a keepalive position). The buffer
//! holds everything received whose position the watermark has not yet passed:
//!
//! ```text
//!   front (oldest)                                          back (newest)
//!   [m1 acked][m2 unacked][m3 acked][mark 0/1F0][m4 ...][m5 ...]
//!    ^ popped as soon as it is acked     ^ next: first item not yet published
//! ```
//!
//! Entries leave at the front only: an acked message, or a mark (every message
//! before it has left already). Passing a mark moves the watermark to its LSN, so
//! the watermark never passes an unacked message and never goes backwards.
//!
//! After a failure [`Window::restart`] rewinds `next` to the front: everything still
//! buffered is published again, in its original order, on a fresh channel. Keeping
//! these messages (at most `max_in_flight` plus one reader batch) rather than
//! restarting the replication stream keeps retries cheap and local: the reader and
//! Postgres never see a publisher failure, and no message is skipped or reordered.
//!
//! The window limit (the duplicate bound of docs/design.md §1): a message is *in
//! flight* from its publish until a position past it has been sent to Postgres as
//! flushed ([`Window::flushed`]), because until then a crash makes Postgres send it
//! again. Acked messages of an open transaction, and whole transactions the watermark
//! passed but no status update has carried yet, still count. A message may be
//! published while fewer than `max_in_flight` messages are in flight, or, for one
//! transaction larger than the window, while everything in flight belongs to that
//! open transaction (no mark among the published entries, nothing passed and
//! unflushed) and fewer than `max_in_flight` of them are unacked.

use std::collections::VecDeque;

use outbox_event::Lsn;

#[derive(Debug)]
enum Entry<T> {
    Message {
        message: T,
        acked: bool,
        /// Its body's size, for the byte bound.
        bytes: usize,
    },
    Mark(Lsn),
}

/// The buffer of unfinished messages and marks; see the module docs.
#[derive(Debug)]
pub struct Window<T> {
    entries: VecDeque<Entry<T>>,
    /// Sequence number of `entries[0]`; every entry's sequence is stable.
    base_seq: u64,
    /// Index of the first entry not yet published on the current channel.
    next: usize,
    /// Messages in `entries[..next]`.
    published: usize,
    /// Messages in `entries[..next]` not acked.
    unacked: usize,
    /// Marks in `entries[..next]`.
    published_marks: usize,
    /// Messages in the whole buffer.
    messages: usize,
    watermark: Lsn,
    max_in_flight: usize,
    /// Acked messages that left the front while their transaction's mark is still
    /// buffered (the open transaction).
    left_open: usize,
    /// Marks the watermark passed that were not yet flushed to Postgres, with how
    /// many messages left the buffer before each (since the previous mark).
    unflushed: VecDeque<(Lsn, usize)>,
    /// Sum of the counts in `unflushed`.
    unflushed_messages: usize,
    /// The highest position known to be sent to Postgres as flushed.
    flushed: Lsn,
    /// Bytes of the messages in `entries[..next]` (published, still buffered), and
    /// the bound on them (one message always goes, whatever its size).
    published_bytes: usize,
    max_bytes: usize,
}

impl<T> Window<T> {
    pub fn new(max_in_flight: usize, watermark: Lsn) -> Self {
        Self {
            entries: VecDeque::new(),
            base_seq: 0,
            next: 0,
            published: 0,
            unacked: 0,
            published_marks: 0,
            messages: 0,
            watermark,
            max_in_flight: max_in_flight.max(1),
            left_open: 0,
            unflushed: VecDeque::new(),
            unflushed_messages: 0,
            flushed: watermark,
            published_bytes: 0,
            max_bytes: usize::MAX,
        }
    }

    /// Bounds the bytes published and not acked (`max_in_flight_bytes`): no message
    /// is published while that many are, unless it would be the only one.
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes.max(1);
        self
    }

    /// Bytes of the messages published and still buffered.
    pub fn published_bytes(&self) -> usize {
        self.published_bytes
    }

    /// Records that Postgres was sent `lsn` as the flush position: messages before
    /// it stop counting against the window.
    pub fn flushed(&mut self, lsn: Lsn) {
        self.flushed = self.flushed.max(lsn);
        while let Some(&(mark, count)) = self.unflushed.front() {
            if mark > self.flushed {
                break;
            }
            self.unflushed.pop_front();
            self.unflushed_messages -= count;
        }
    }

    /// Messages in flight in the sense of the duplicate bound: published or buffered,
    /// and not yet behind a position flushed to Postgres.
    pub fn counted(&self) -> usize {
        self.published + self.left_open + self.unflushed_messages
    }

    /// Appends a message (not yet published).
    pub fn push_message(&mut self, message: T) {
        self.push_sized(message, 0);
    }

    /// Appends a message of `bytes` (its body) for the byte bound.
    pub fn push_sized(&mut self, message: T, bytes: usize) {
        self.entries.push_back(Entry::Message {
            message,
            acked: false,
            bytes,
        });
        self.messages += 1;
    }

    /// Appends a commit end LSN or keepalive position.
    pub fn push_mark(&mut self, lsn: Lsn) {
        self.entries.push_back(Entry::Mark(lsn));
    }

    /// The acked watermark.
    pub fn watermark(&self) -> Lsn {
        self.watermark
    }

    /// Messages received and not yet behind a position flushed to Postgres.
    pub fn in_flight(&self) -> usize {
        self.messages + self.left_open + self.unflushed_messages
    }

    /// Messages received and not yet acked (still buffered).
    pub fn buffered(&self) -> usize {
        self.messages
    }

    /// Messages published on the current channel and not acked.
    pub fn unacked(&self) -> usize {
        self.unacked
    }

    /// True when nothing is buffered: everything received is below the watermark.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when some buffered entry has not been published on the current channel.
    pub fn has_unpublished(&self) -> bool {
        self.next < self.entries.len()
    }

    /// Whether one more message may be published now (see the module docs).
    pub fn has_room(&self) -> bool {
        let bytes = self.published_bytes < self.max_bytes || self.unacked == 0;
        bytes
            && (self.counted() < self.max_in_flight
                || (self.published_marks == 0
                    && self.unflushed_messages == 0
                    && self.unacked < self.max_in_flight))
    }

    /// The oldest buffered message, if any.
    pub fn oldest_message(&self) -> Option<&T> {
        self.entries.iter().find_map(|e| match e {
            Entry::Message { message, .. } => Some(message),
            Entry::Mark(_) => None,
        })
    }

    /// Takes the next message to publish and its sequence number, stepping over
    /// marks; `None` when everything is published or the window is full.
    pub fn next_to_publish(&mut self) -> Option<(u64, &T)> {
        self.peek_next()?;
        let seq = self.base_seq + self.next as u64;
        self.published += 1;
        self.unacked += 1;
        self.next += 1;
        if let Some(Entry::Message { bytes, .. }) = self.entries.get(self.next - 1) {
            let bytes = *bytes;
            self.published_bytes += bytes;
        }
        match self.entries.get(self.next - 1) {
            Some(Entry::Message { message, .. }) => Some((seq, message)),
            _ => None,
        }
    }

    /// The message [`Window::next_to_publish`] would take, without taking it (marks
    /// before it are stepped over); `None` when everything is published or the window
    /// is full.
    pub fn peek_next(&mut self) -> Option<(u64, &T)> {
        loop {
            match self.entries.get(self.next)? {
                Entry::Mark(_) => {
                    self.published_marks += 1;
                    self.next += 1;
                }
                Entry::Message { .. } => {
                    if !self.has_room() {
                        return None;
                    }
                    let seq = self.base_seq + self.next as u64;
                    return match self.entries.get(self.next) {
                        Some(Entry::Message { message, .. }) => Some((seq, message)),
                        _ => None,
                    };
                }
            }
        }
    }

    /// Sequence number of the oldest buffered entry (everything below it is done).
    pub fn front_seq(&self) -> u64 {
        self.base_seq
    }

    /// Sequence number the next appended entry will get.
    pub fn end_seq(&self) -> u64 {
        self.base_seq + self.entries.len() as u64
    }

    /// The message with sequence number `seq`, if it is still buffered.
    pub fn get(&self, seq: u64) -> Option<&T> {
        let index = usize::try_from(seq.checked_sub(self.base_seq)?).ok()?;
        match self.entries.get(index)? {
            Entry::Message { message, .. } => Some(message),
            Entry::Mark(_) => None,
        }
    }

    /// Records the broker's ack of the published message `seq`. Returns the new
    /// watermark when it advanced. Unknown or repeated sequence numbers are ignored.
    pub fn ack(&mut self, seq: u64) -> Option<Lsn> {
        let index = usize::try_from(seq.checked_sub(self.base_seq)?).ok()?;
        if index < self.next {
            if let Some(Entry::Message { acked, .. }) = self.entries.get_mut(index) {
                if !*acked {
                    *acked = true;
                    self.unacked -= 1;
                }
            }
        }
        self.advance()
    }

    /// Pops finished entries at the front. Returns the new watermark when it moved.
    pub fn advance(&mut self) -> Option<Lsn> {
        let before = self.watermark;
        loop {
            match self.entries.front() {
                Some(Entry::Mark(lsn)) => {
                    if *lsn > self.watermark {
                        self.watermark = *lsn;
                    }
                    let left = std::mem::take(&mut self.left_open);
                    if left > 0 && *lsn > self.flushed {
                        self.unflushed.push_back((*lsn, left));
                        self.unflushed_messages += left;
                    }
                    if self.next > 0 {
                        self.next -= 1;
                        self.published_marks -= 1;
                    }
                }
                Some(Entry::Message {
                    acked: true, bytes, ..
                }) => {
                    let bytes = *bytes;
                    self.published_bytes -= bytes;
                    self.next -= 1;
                    self.published -= 1;
                    self.messages -= 1;
                    self.left_open += 1;
                }
                _ => break,
            }
            self.entries.pop_front();
            self.base_seq += 1;
        }
        (self.watermark > before).then_some(self.watermark)
    }

    /// Rewinds after a failure: every buffered message counts as unacked and will be
    /// published again from the oldest, in order. Returns how many will be resent.
    pub fn restart(&mut self) -> usize {
        for entry in &mut self.entries {
            if let Entry::Message { acked, .. } = entry {
                *acked = false;
            }
        }
        self.next = 0;
        self.published = 0;
        self.unacked = 0;
        self.published_marks = 0;
        self.published_bytes = 0;
        self.messages
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn publish_all(w: &mut Window<u32>) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some((seq, m)) = w.next_to_publish() {
            out.push((seq, *m));
        }
        out
    }

    /// `max_in_flight_bytes` (issue 49): nothing more is published while that many
    /// body bytes are published and unacked, except a message that would be the only
    /// one; acks and a restart give the bytes back. Without it 10,000 messages of
    /// 2 MiB to a broker that does not confirm held 20 GB.
    #[test]
    fn bytes_in_flight_are_bounded() {
        let mut w = Window::new(10_000, Lsn(0)).with_max_bytes(5 * 1024);
        for i in 0..10 {
            w.push_sized(i, 2048);
        }
        w.push_mark(Lsn(10));
        let first = publish_all(&mut w);
        assert_eq!(
            first.len(),
            3,
            "2 KiB each under a 5 KiB bound: the third crosses it"
        );
        assert_eq!(w.published_bytes(), 6 * 1024);
        assert_eq!(w.ack(0), None);
        assert_eq!(w.published_bytes(), 4 * 1024);
        assert_eq!(publish_all(&mut w).len(), 1);
        // A message larger than the bound goes when it is the only one in flight.
        let mut big = Window::new(10, Lsn(0)).with_max_bytes(1024);
        big.push_sized(1, 4096);
        big.push_sized(2, 4096);
        assert_eq!(publish_all(&mut big).len(), 1);
        big.ack(0);
        assert_eq!(publish_all(&mut big).len(), 1);
        // A restart forgets what was published.
        w.restart();
        assert_eq!(w.published_bytes(), 0);
    }

    #[test]
    fn watermark_follows_acks_in_order() {
        let mut w = Window::new(100, Lsn(5));
        w.push_message(1);
        w.push_message(2);
        w.push_mark(Lsn(10));
        w.push_message(3);
        w.push_mark(Lsn(20));
        let published = publish_all(&mut w);
        assert_eq!(published, vec![(0, 1), (1, 2), (3, 3)]);
        // Out-of-order ack: message 2 acked first does not move the watermark.
        assert_eq!(w.ack(1), None);
        assert_eq!(w.watermark(), Lsn(5));
        assert_eq!(w.ack(3), None);
        assert_eq!(w.ack(0), Some(Lsn(20)));
        assert!(w.is_empty());
        // In flight until Postgres was sent a position past them.
        assert_eq!(w.in_flight(), 3);
        w.flushed(Lsn(10));
        assert_eq!(w.in_flight(), 1);
        w.flushed(Lsn(20));
        assert_eq!(w.in_flight(), 0);
        // Repeated and unknown acks are ignored.
        assert_eq!(w.ack(0), None);
        assert_eq!(w.ack(99), None);
    }

    #[test]
    fn keepalive_with_nothing_in_flight_moves_at_once() {
        let mut w: Window<u32> = Window::new(10, Lsn(0));
        w.push_mark(Lsn(7));
        assert_eq!(w.advance(), Some(Lsn(7)));
        // Never backwards.
        w.push_mark(Lsn(3));
        assert_eq!(w.advance(), None);
        assert_eq!(w.watermark(), Lsn(7));
        assert!(w.is_empty());
    }

    #[test]
    fn window_limit_across_transactions() {
        let mut w = Window::new(2, Lsn(0));
        w.push_message(1);
        w.push_message(2);
        w.push_mark(Lsn(10));
        w.push_message(3);
        w.push_mark(Lsn(20));
        assert_eq!(publish_all(&mut w), vec![(0, 1), (1, 2)]);
        assert!(!w.has_room());
        assert_eq!(w.ack(0), None);
        // Message 1 left the buffer, but Postgres would send it again after a crash:
        // it still counts.
        assert_eq!(publish_all(&mut w), vec![]);
        assert_eq!(w.ack(1), Some(Lsn(10)));
        // Passed by the watermark, not yet flushed: still no room.
        assert_eq!(publish_all(&mut w), vec![]);
        w.flushed(Lsn(10));
        assert_eq!(publish_all(&mut w), vec![(3, 3)]);
        assert_eq!(w.ack(3), Some(Lsn(20)));
    }

    #[test]
    fn oversized_transaction_keeps_going_but_bounds_unacked() {
        let mut w = Window::new(2, Lsn(0));
        for m in 0..5 {
            w.push_message(m);
        }
        w.push_mark(Lsn(50));
        assert_eq!(publish_all(&mut w), vec![(0, 0), (1, 1)]);
        // Ack the second: the first is unacked so nothing leaves, but everything in
        // flight is one transaction and only one is unacked: one more may go.
        assert_eq!(w.ack(1), None);
        assert_eq!(publish_all(&mut w), vec![(2, 2)]);
        assert_eq!(w.ack(2), None);
        assert_eq!(publish_all(&mut w), vec![(3, 3)]);
        assert_eq!(w.in_flight(), 5);
        assert_eq!(w.ack(0), None);
        assert_eq!(publish_all(&mut w), vec![(4, 4)]);
        assert_eq!(w.ack(3), None);
        assert_eq!(w.ack(4), Some(Lsn(50)));
    }

    #[test]
    fn no_oversize_when_another_transaction_is_in_flight() {
        let mut w = Window::new(2, Lsn(0));
        w.push_message(1);
        w.push_mark(Lsn(10));
        w.push_message(2);
        w.push_message(3);
        w.push_message(4);
        assert_eq!(publish_all(&mut w), vec![(0, 1), (2, 2)]);
        assert_eq!(w.ack(2), None);
        // A mark is among the published entries: the limit is strict.
        assert_eq!(publish_all(&mut w), vec![]);
        assert_eq!(w.ack(0), Some(Lsn(10)));
        // The first transaction is not flushed yet: the limit stays strict.
        assert_eq!(publish_all(&mut w), vec![]);
        w.flushed(Lsn(10));
        // Now everything in flight is one open transaction: it may exceed the window.
        assert_eq!(publish_all(&mut w), vec![(3, 3), (4, 4)]);
    }

    #[test]
    fn restart_republishes_from_oldest_unacked_in_order() {
        let mut w = Window::new(10, Lsn(0));
        for m in 1..=4 {
            w.push_message(m);
            w.push_mark(Lsn(u64::from(m) * 10));
        }
        publish_all(&mut w);
        assert_eq!(w.ack(0), Some(Lsn(10)));
        // Message 2 (seq 2) is nacked; 3 and 4 were acked.
        assert_eq!(w.ack(4), None);
        assert_eq!(w.ack(6), None);
        assert_eq!(w.restart(), 3);
        assert_eq!(w.watermark(), Lsn(10));
        assert_eq!(publish_all(&mut w), vec![(2, 2), (4, 3), (6, 4)]);
        assert_eq!(w.ack(4), None);
        assert_eq!(w.watermark(), Lsn(10));
        assert_eq!(w.ack(2), Some(Lsn(30)));
        assert_eq!(w.ack(6), Some(Lsn(40)));
        assert!(w.is_empty());
    }

    #[test]
    fn acks_from_before_a_restart_are_not_counted_twice() {
        let mut w = Window::new(10, Lsn(0));
        w.push_message(1);
        w.push_message(2);
        w.push_mark(Lsn(9));
        publish_all(&mut w);
        w.restart();
        // Not republished yet: an ack for seq 0 is ignored.
        assert_eq!(w.ack(0), None);
        assert_eq!(w.get(0), Some(&1));
        publish_all(&mut w);
        assert_eq!(w.ack(1), None);
        assert_eq!(w.ack(0), Some(Lsn(9)));
    }
}
