//! What the scripted broker does of its own accord: confirms, returns, notices,
//! closes, and a confirm of a tag never published.

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, connection, AMQPClass};
use amq_protocol::types::ShortString;
use rand::rngs::StdRng;
use rand::Rng;

use super::super::super::frame::FRAME_OVERHEAD;
use super::super::model::{End, Model};
use super::{channel_close, conn_method, Broker, PubChannel};

impl Broker {
    /// `basic.return`, its header, and the body in frames of random sizes.
    pub(super) fn send_return(
        &mut self,
        ch: u16,
        publish: basic::Publish,
        header: AMQPContentHeader,
        body: &[u8],
        rng: &mut StdRng,
    ) {
        let ret = basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: publish.exchange,
            routing_key: publish.routing_key,
        });
        self.send_method(ch, AMQPClass::Basic(ret));
        self.send(&AMQPFrame::Header(ch, header));
        let most = self.frame_max as usize - FRAME_OVERHEAD;
        let mut rest = body;
        while !rest.is_empty() {
            let n = rng.gen_range(1..=rest.len().min(most));
            self.send(&AMQPFrame::Body(ch, rest[..n].to_vec()));
            rest = &rest[n..];
        }
    }

    /// The publishing channel in confirm mode, open on both sides.
    pub(super) fn confirming(&mut self) -> Option<&mut PubChannel> {
        if self.closing || self.client_closing || self.sock.is_none() {
            return None;
        }
        self.pubch
            .as_mut()
            .filter(|p| p.confirm && !p.closing && !p.closed)
    }

    /// Sends one confirm: a single tag picked at random, or a `multiple` one for
    /// a run of tags with the same decision.
    pub(in crate::amqp::connection::sim) fn confirm(
        &mut self,
        model: &mut Model,
        rng: &mut StdRng,
    ) {
        let multiple = rng.gen_bool(0.4);
        let Some(c) = self.confirming() else {
            return;
        };
        if c.pending.is_empty() {
            return;
        }
        let (ch, gen) = (c.ch, c.gen);
        let first = *c.pending.keys().next().expect("pending");
        let ack = c.pending[&first];
        let (tag, tags) = if multiple {
            // Every tag below `first` was confirmed: extend over the pending run
            // with the same decision.
            let mut last = first;
            while c.pending.get(&(last + 1)) == Some(&ack) {
                last += 1;
            }
            let upto = rng.gen_range(first..=last);
            (upto, (first..=upto).collect::<Vec<_>>())
        } else {
            let keys: Vec<u64> = c.pending.keys().copied().collect();
            let tag = keys[rng.gen_range(0..keys.len())];
            (tag, vec![tag])
        };
        let ack = c.pending[&tag];
        for t in &tags {
            c.pending.remove(t);
            model.gens[gen].msgs[(*t - 1) as usize].decided = Some(ack);
        }
        let method = if ack {
            basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: tag,
                multiple,
            })
        } else {
            basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: tag,
                multiple,
                requeue: false,
            })
        };
        self.send_method(ch, AMQPClass::Basic(method));
    }

    /// A confirm of a tag the client never published: it must close with 406.
    pub(in crate::amqp::connection::sim) fn bad_tag(&mut self, model: &mut Model) {
        let Some(c) = self.confirming() else {
            return;
        };
        let (ch, gen) = (c.ch, c.gen);
        let tag = model.gens[gen].msgs.len() as u64 + 1000;
        // The client closes the channel (406), not the connection.
        model.gens[gen].bad_tag = true;
        let ack = basic::Ack {
            delivery_tag: tag,
            multiple: false,
        };
        self.send_method(ch, AMQPClass::Basic(basic::AMQPMethod::Ack(ack)));
    }

    /// A return whose content comes on another channel (its header, or a body frame
    /// after a header on the right one): content interleaved across channels, which
    /// AMQP forbids; the client must close the connection with 505.
    pub(in crate::amqp::connection::sim) fn cross_channel_content(
        &mut self,
        model: &mut Model,
        rng: &mut StdRng,
    ) {
        let Some(c) = self.confirming() else {
            return;
        };
        let ch = c.ch;
        let other = if rng.gen_bool(0.5) { 1 } else { ch + 1 };
        model.end(End::Protocol(505));
        // A return on a channel with nothing left to return is refused first (406).
        model.end(End::Protocol(406));
        let ret = basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: ShortString::from("x"),
            routing_key: ShortString::from("k"),
        });
        self.send_method(ch, AMQPClass::Basic(ret));
        let header = |ch| {
            AMQPFrame::Header(
                ch,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: 4,
                    properties: Default::default(),
                },
            )
        };
        if rng.gen_bool(0.5) {
            self.send(&header(other));
        } else {
            self.send(&header(ch));
            self.send(&AMQPFrame::Body(other, b"body".to_vec()));
        }
    }

    /// Closes the publishing channel (406, as for a refused message).
    pub(in crate::amqp::connection::sim) fn close_channel(&mut self, model: &mut Model) {
        let Some(c) = self.confirming() else {
            return;
        };
        c.closing = true;
        let (ch, gen) = (c.ch, c.gen);
        let text = format!("PRECONDITION_FAILED - sim {ch}");
        model.gens[gen].broker_closed = Some((406, text.clone()));
        self.send_method(ch, channel_close(406, &text));
    }

    /// `connection.blocked` or `unblocked`, whichever changes the state.
    pub(in crate::amqp::connection::sim) fn toggle_blocked(&mut self, model: &mut Model) {
        if self.closing || self.client_closing || self.sock.is_none() {
            return;
        }
        self.blocked = !self.blocked;
        model.broker_blocked = self.blocked;
        let m = if self.blocked {
            model.notices.push_back(Some("low on memory".into()));
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: ShortString::from("low on memory"),
            })
        } else {
            model.notices.push_back(None);
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.send_method(0, conn_method(m));
    }

    /// `connection.close` from the broker.
    pub(in crate::amqp::connection::sim) fn close(&mut self, model: &mut Model) {
        if self.closing || self.client_closing || self.sock.is_none() {
            return;
        }
        self.closing = true;
        let text = "CONNECTION_FORCED - broker forced connection closure".to_string();
        model.end(End::Closed(320, text.clone()));
        let close = connection::Close {
            reply_code: 320,
            reply_text: ShortString::from(text),
            class_id: 0,
            method_id: 0,
        };
        self.send_method(0, conn_method(connection::AMQPMethod::Close(close)));
    }
}
