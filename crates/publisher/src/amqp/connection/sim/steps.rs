//! The steps of a schedule: one thing happens on one side of the socket.

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use rand::Rng;
use tokio::time::Instant;

use super::super::{ConnError, Unfit};
use super::model::{End, Msg};
use super::{read_size, Req, Sim};

impl Sim {
    pub(super) async fn step(&mut self) {
        self.broker.turns += 1;
        match self.rng.gen_range(0..1000) {
            0..=249 => self.publish(),
            250..=449 => {
                self.poll();
            }
            450..=599 => {
                let n = read_size(&mut self.rng);
                self.broker.read(n, &mut self.model, &mut self.rng);
            }
            600..=749 => {
                let n = read_size(&mut self.rng);
                self.broker.write(n);
            }
            750..=849 => self.broker.confirm(&mut self.model, &mut self.rng),
            850..=864 => self.broker.toggle_blocked(&mut self.model),
            865..=879 => {
                // A broker that stops reading for a while.
                self.broker.paused_until = self.broker.turns + self.rng.gen_range(1..40);
            }
            880..=929 => self.advance().await,
            930..=939 => self.broker.close_channel(&mut self.model),
            940..=949 => self.close_channel(false).await,
            950..=959 => self.declare().await,
            960..=964 => self.close_channel(true).await,
            965..=967 => self.broker.close(&mut self.model),
            968..=970 => self.client_close().await,
            971..=972 => {
                // Both sides close the connection at once.
                self.broker.close(&mut self.model);
                self.client_close().await;
            }
            973 => self.broker.bad_tag(&mut self.model),
            974 => self
                .broker
                .cross_channel_content(&mut self.model, &mut self.rng),
            975..=977 => self.silence().await,
            978..=979 => {
                if self.broker.open() && !self.broker.closing {
                    self.model.end(End::Eof);
                    self.broker.hang_up();
                }
            }
            _ => self.settle().await,
        }
        tokio::task::yield_now().await;
        // A closed channel is opened anew (not always at once).
        let reopen = self
            .model
            .gens
            .last()
            .is_some_and(|g| g.closed_seen || g.client_closed || g.error_seen);
        if reopen && self.live() && self.rng.gen_bool(0.5) {
            self.open().await;
        }
    }

    /// Whether the client can make requests: alive and not closed by the sim.
    pub(super) fn live(&self) -> bool {
        self.conn.is_alive() && !self.model.client_closed
    }

    /// The client publishes a few messages on its channel.
    fn publish(&mut self) {
        if !self.live() || !self.conn.channel_open() {
            return;
        }
        for _ in 0..self.rng.gen_range(1..=4) {
            let g = self.model.current();
            let tag = self.model.gens[g].msgs.len() as u64 + 1;
            let frame_max = self.broker.frame_max as usize;
            let size = match self.rng.gen_range(0..1000) {
                0..=549 => self.rng.gen_range(0..200),
                550..=879 => self.rng.gen_range(200..frame_max),
                880..=994 => self.rng.gen_range(frame_max..3 * frame_max),
                _ => 1_200_000,
            };
            self.largest = self.largest.max(size);
            let pattern: Vec<u8> = (0..251u64)
                .map(|i| (i * 31 + tag * 7 + g as u64) as u8)
                .collect();
            let mut body = Vec::with_capacity(size);
            while body.len() < size {
                let n = (size - body.len()).min(pattern.len());
                body.extend_from_slice(&pattern[..n]);
            }
            let unfit = self.rng.gen_bool(0.01);
            let properties = self.properties(g, tag, unfit);
            let exchange = format!("ex.{}", self.rng.gen_range(0..3));
            let routing_key = format!("rk.{g}.{tag}");
            let before = self.conn.unwritten();
            match self
                .conn
                .publish(&exchange, &routing_key, properties.clone(), &body)
            {
                Ok(t) => {
                    assert!(!unfit, "a header over frame_max was sent");
                    assert_eq!(t, tag, "tags count from 1 on each channel");
                    let encoded = self.conn.unwritten() - before;
                    assert!(
                        encoded > size,
                        "{encoded} bytes encoded for a body of {size}"
                    );
                    self.encoded += encoded;
                    self.model.gens[g].msgs.push(Msg {
                        exchange,
                        routing_key,
                        properties,
                        body,
                        decided: None,
                        returned: false,
                        confirmed: false,
                        return_seen: false,
                    });
                }
                Err(Unfit(why)) => {
                    assert!(unfit, "a message that fits was refused: {why}");
                    assert_eq!(self.conn.unwritten(), before, "an unfit message left bytes");
                }
            }
        }
    }

    fn properties(&mut self, g: usize, tag: u64, unfit: bool) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert("tag".into(), AMQPValue::LongLongInt(tag as i64));
        for i in 0..self.rng.gen_range(0..4) {
            let len = self.rng.gen_range(0..300);
            let text: String = (0..len)
                .map(|j| char::from(b'a' + ((i + j) % 26) as u8))
                .collect();
            headers.insert(
                format!("h{i}").into(),
                AMQPValue::LongString(LongString::from(text)),
            );
        }
        if self.rng.gen_bool(0.2) {
            let mut inner = FieldTable::default();
            inner.insert("depth".into(), AMQPValue::ShortInt(2));
            headers.insert("nested".into(), AMQPValue::FieldTable(inner));
        }
        if unfit {
            let big = "x".repeat(self.broker.frame_max as usize + 100);
            headers.insert("big".into(), AMQPValue::LongString(LongString::from(big)));
        }
        BasicProperties::default()
            .with_message_id(ShortString::from(format!("{g}-{tag}")))
            .with_content_type(ShortString::from("application/json"))
            .with_delivery_mode(2)
            .with_headers(headers)
    }

    /// Paused time moves on by up to one heartbeat interval; the broker sends a
    /// heartbeat first, most of the time. Checks the heartbeats both ways.
    async fn advance(&mut self) {
        self.control += 1;
        let h = u64::from(self.broker.heartbeat.max(1)) * 1000;
        if self.broker.open() && !self.broker.closing && self.rng.gen_bool(0.8) {
            self.broker.send(&AMQPFrame::Heartbeat);
            self.broker.write_all();
        }
        let ms = self.rng.gen_range(0..=h);
        tokio::time::advance(Duration::from_millis(ms)).await;
        let must_die = self.expect_silence();
        self.poll();
        assert!(
            !must_die || !self.conn.is_alive(),
            "the broker was silent for two heartbeat intervals and the client did not give up"
        );
        self.heartbeats_in_time();
    }

    /// Whether the client has heard nothing for two intervals: it must give up
    /// when polled now.
    fn expect_silence(&self) -> bool {
        let Some(interval) = self.heartbeat() else {
            return false;
        };
        let heard = self.broker.wrote && self.broker.open();
        !heard && Instant::now() >= self.fed_at + interval * 2 && self.conn.is_alive()
    }

    pub(super) fn heartbeat(&self) -> Option<Duration> {
        (self.broker.heartbeat > 0).then(|| Duration::from_secs(u64::from(self.broker.heartbeat)))
    }

    /// A client with nothing waiting to be written has written within half an
    /// interval: what the broker reads now came no earlier.
    fn heartbeats_in_time(&mut self) {
        let Some(interval) = self.heartbeat() else {
            return;
        };
        let b = &self.broker;
        if !self.live() || self.conn.unwritten() > 0 || !b.open() || b.eof || b.closing {
            return;
        }
        self.broker.paused_until = 0;
        self.broker.read_all(&mut self.model, &mut self.rng);
        let now = Instant::now();
        assert!(
            self.broker.last_read + interval / 2 >= now,
            "the client wrote nothing for {:?} with a heartbeat of {interval:?}",
            now - self.broker.last_read
        );
    }

    /// The broker goes silent: everything queued goes out first, then nothing for
    /// two heartbeat intervals and more; the client must give up.
    async fn silence(&mut self) {
        let Some(interval) = self.heartbeat() else {
            return;
        };
        self.settle().await;
        if !self.conn.is_alive() || !self.model.ends.is_empty() {
            return;
        }
        for _ in 0..5 {
            tokio::time::advance(interval / 2).await;
            let must_die = self.expect_silence();
            self.poll();
            assert!(
                !must_die || !self.conn.is_alive(),
                "silent for {:?}",
                interval * 2
            );
            self.broker.read_all(&mut self.model, &mut self.rng);
        }
        assert!(
            !self.conn.is_alive(),
            "the broker was silent for {:?} and the client did not give up",
            interval * 5 / 2
        );
    }

    async fn close_channel(&mut self, crossing: bool) {
        if !self.live() || !self.conn.channel_open() {
            return;
        }
        if crossing {
            self.broker.close_channel(&mut self.model);
        }
        let g = self.model.current();
        self.model.gens[g].client_closed = true;
        let r = self.request(Req::CloseChannel).await;
        self.request_result(Req::CloseChannel, r);
        assert!(
            !self.conn.channel_open(),
            "the channel is open after close_channel"
        );
    }

    async fn declare(&mut self) {
        if !self.live() {
            return;
        }
        let passive = self.rng.gen_bool(0.5);
        self.broker.refused_declare = None;
        let r = self.request(Req::Declare { passive }).await;
        self.request_result(Req::Declare { passive }, r);
    }

    pub(super) async fn client_close(&mut self) {
        if !self.live() {
            return;
        }
        self.model.client_closed = true;
        let r = self.request(Req::Close).await;
        self.request_result(Req::Close, r);
        assert!(!self.conn.is_alive(), "alive after close");
    }

    /// What a request returned, against what the broker did.
    pub(super) fn request_result(&mut self, req: Req, r: Result<(), ConnError>) {
        match (req, r) {
            (Req::Declare { .. }, Ok(())) => {
                assert_eq!(self.broker.refused_declare, Some(false), "declared");
            }
            (Req::Declare { .. }, Err(ConnError::ChannelClosed { code: 404, .. })) => {
                assert_eq!(self.broker.refused_declare, Some(true), "refused");
            }
            (_, Ok(())) => {}
            (req, Err(e)) => {
                if self.model.client_closed {
                    return;
                }
                assert!(
                    !matches!(e, ConnError::ChannelClosed { .. }),
                    "{req:?} failed with {e:?}"
                );
                self.model.request_saw_end = true;
                self.matches_end(&e);
            }
        }
    }
}
