//! The client's side of the checks: polling it and judging what it reports,
//! memory after every step, and the quiet points where everything sent was read.

use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use tokio::time::Instant;

use super::super::frame::FRAME_OVERHEAD;
use super::super::{ConnError, READ_BUFFER, WRITE_KEEP};
use super::model::End;
use super::Sim;

impl Sim {
    /// Polls the client once and checks what it hands out. Whether it was pending.
    pub(super) fn poll(&mut self) -> bool {
        if std::mem::take(&mut self.broker.wrote) {
            self.fed_at = Instant::now();
        }
        let mut cx = Context::from_waker(&self.waker);
        let polled = self.conn.poll_io(&mut cx);
        if polled.is_ready() {
            super::trace(|| format!("client: poll_io -> {polled:?}"));
        }
        match polled {
            Poll::Ready(Ok(events)) => {
                assert!(!events.is_empty(), "poll_io was ready with no event");
                assert!(
                    self.model.reported.is_none(),
                    "events after the end was reported: {events:?}"
                );
                self.model.take(events);
                false
            }
            Poll::Ready(Err(e)) => {
                assert!(
                    self.model.reported.is_none() && !self.model.request_saw_end,
                    "the end reported twice: {e:?}"
                );
                assert!(
                    !self.model.client_closed,
                    "an error after the client closed: {e:?}"
                );
                assert!(!self.conn.is_alive(), "an error, and alive");
                self.matches_end(&e);
                self.model.reported = Some(e);
                false
            }
            Poll::Pending => true,
        }
    }

    /// The end the client reports is one the broker caused.
    pub(super) fn matches_end(&self, e: &ConnError) {
        let ends = &self.model.ends;
        match e {
            ConnError::Io(text) if text.contains("sent nothing") => {
                let interval = self.heartbeat().expect("a silence without heartbeats");
                assert!(
                    Instant::now() >= self.fed_at + interval * 2,
                    "silence reported {:?} after the client last read, with a heartbeat of {interval:?}",
                    Instant::now() - self.fed_at
                );
            }
            ConnError::Closed { code, text } => {
                assert!(
                    ends.contains(&End::Closed(*code, text.clone())),
                    "{e:?} ({ends:?})"
                );
            }
            ConnError::Protocol { code, .. } => {
                assert!(ends.contains(&End::Protocol(*code)), "{e:?} ({ends:?})");
            }
            ConnError::Io(_) => assert!(ends.contains(&End::Eof), "{e:?} ({ends:?})"),
            ConnError::ChannelClosed { .. } => panic!("the connection ended with {e:?}"),
        }
    }

    /// After every step: memory (invariant (c)) and the blocked state.
    pub(super) fn check(&self) {
        let unwritten = self.conn.unwritten();
        let allowance = 1024 + 512 * (self.control + self.broker.asked);
        let bound = (self.encoded + allowance).saturating_sub(self.broker.read_total);
        assert!(
            unwritten <= bound,
            "{unwritten} bytes not written, over what was encoded and not read ({bound})"
        );
        let read = self.conn.read_buffer_len();
        let frame = self.broker.frame_max as usize + FRAME_OVERHEAD;
        assert!(
            read <= READ_BUFFER.max(frame),
            "a read buffer of {read} bytes"
        );
        if unwritten == 0 {
            let capacity = self.conn.write_capacity();
            assert!(
                capacity <= WRITE_KEEP,
                "a write buffer of {capacity} bytes kept once empty (largest message {})",
                self.largest
            );
        }
        if let Some(gen) = self.model.gens.last().filter(|g| !g.bad_tag) {
            // The connection's tags: settled when read, handed out later (a channel
            // the client closed for a bad confirm settles nothing more).
            let unconfirmed = self.conn.unconfirmed();
            let undecided = gen.msgs.iter().filter(|m| m.decided.is_none()).count();
            let unseen = gen.msgs.iter().filter(|m| !m.confirmed).count();
            assert!(
                undecided <= unconfirmed && unconfirmed <= unseen,
                "{unconfirmed} tags unconfirmed; {undecided} without the broker's confirm, {unseen} not handed out"
            );
        }
        if self.conn.is_alive() && self.model.client_blocked != self.conn.blocked() {
            // The notice that says so is read and waits to be handed out.
            assert!(
                self.model.client_blocked != self.model.broker_blocked
                    || !self.model.notices.is_empty(),
                "blocked"
            );
        }
    }

    /// Everything queued on both sides goes out and is read; then nothing sent may
    /// be lost, the client must not wake itself with nothing to do, and bytes that
    /// arrive must wake it.
    pub(super) async fn settle(&mut self) {
        self.broker.paused_until = 0;
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(
                rounds < 10_000,
                "the two sides never settled: {} bytes not written by the client (alive: {}), {} queued by the broker (open: {})",
                self.conn.unwritten(),
                self.conn.is_alive(),
                self.broker.queued(),
                self.broker.open()
            );
            self.broker.write(usize::MAX);
            tokio::task::yield_now().await;
            let wrote = self.broker.wrote;
            let pending = self.poll();
            let read = self.broker.read_total;
            self.broker.read_all(&mut self.model, &mut self.rng);
            let quiet = !wrote && pending && read == self.broker.read_total;
            // A connection that ended reads and writes nothing more.
            let alive = self.conn.is_alive();
            let written = self.conn.unwritten() == 0 || !alive;
            let sent = self.broker.queued() == 0 || !self.broker.open() || !alive;
            if quiet && written && sent {
                break;
            }
        }
        self.check();
        self.model.check_delivered(self.conn.is_alive());
        if !self.conn.is_alive() || !self.broker.open() || self.broker.eof {
            return;
        }
        let before = self.wakes();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert_eq!(
            self.wakes(),
            before,
            "the connection woke itself with nothing to do"
        );
        if self.broker.closing {
            return;
        }
        self.broker.send(&AMQPFrame::Heartbeat);
        self.broker.write_all();
        tokio::task::yield_now().await;
        assert!(
            self.wakes() > before,
            "bytes arrived and the connection was not woken"
        );
        self.poll();
    }

    /// Once the connection ended: it says nothing more, however long it is
    /// polled (`poll` fails on a second end, or events after it).
    pub(super) async fn after_the_end(&mut self) {
        if self.conn.is_alive() {
            return;
        }
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(5)).await;
            self.broker.write(usize::MAX);
            tokio::task::yield_now().await;
            self.poll();
        }
        self.model.check_delivered(false);
    }
}
