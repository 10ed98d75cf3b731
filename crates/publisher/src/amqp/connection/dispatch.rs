//! What each frame from the broker means: events of the publishing channel,
//! replies to the request under way, the answers the protocol requires (close-ok),
//! and the frames AMQP forbids, which end the connection with the spec's reply
//! code (505 UNEXPECTED_FRAME for content out of place, 406 for a confirm of a
//! delivery tag the channel never published).

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};

use super::{ConnError, Connection, Event, CONTROL};

pub(super) fn unexpected(text: impl Into<String>) -> ConnError {
    ConnError::Protocol {
        code: 505,
        text: text.into(),
    }
}

impl Connection {
    /// Takes one frame into the state.
    pub(super) fn on_frame(&mut self, frame: AMQPFrame) -> Result<(), ConnError> {
        #[cfg(test)]
        if super::sim_trace_on() {
            tracing::trace!(target: "sim", "client reads {:.200}", format!("{frame:?}"));
        }
        if self.closing
            && !matches!(
                frame,
                AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(
                        connection::AMQPMethod::Close(_) | connection::AMQPMethod::CloseOk(_)
                    )
                )
            )
        {
            // Closing: a confirm (even a wrong one) no longer matters.
            return Ok(());
        }
        if !matches!(frame, AMQPFrame::Heartbeat) {
            // The broker is answering (a large return may stand before a confirm).
            self.answered = true;
        }
        match frame {
            AMQPFrame::Heartbeat => Ok(()),
            AMQPFrame::Method(0, AMQPClass::Connection(method)) => self.on_connection(method),
            AMQPFrame::Method(0, _) => Err(unexpected("a method of another class on channel 0")),
            AMQPFrame::Method(ch, method) => self.on_channel_method(ch, method),
            // Content of a channel the relay closed itself (a return under way):
            // dropped with it, until its close-ok.
            AMQPFrame::Header(ch, _) | AMQPFrame::Body(ch, _)
                if self.closing_channel == Some(ch) && self.returning.is_none() =>
            {
                Ok(())
            }
            AMQPFrame::Header(ch, header) => self.on_return_header(ch, header),
            AMQPFrame::Body(ch, body) => self.on_return_body(ch, body.len()),
            AMQPFrame::ProtocolHeader(_) => Err(unexpected("a protocol header mid-connection")),
            AMQPFrame::InvalidHeartbeat(ch) => Err(ConnError::Protocol {
                code: 501,
                text: format!("a heartbeat frame on channel {ch}"),
            }),
        }
    }

    fn on_connection(&mut self, method: connection::AMQPMethod) -> Result<(), ConnError> {
        match method {
            connection::AMQPMethod::Close(close) => {
                self.push_frame(&AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                ));
                Err(ConnError::Closed {
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                })
            }
            connection::AMQPMethod::Blocked(b) => {
                let was = self.blocked();
                self.blocked = true;
                if !was {
                    self.notice(true, b.reason.to_string());
                }
                Ok(())
            }
            connection::AMQPMethod::Unblocked(_) => {
                self.blocked = false;
                if !self.blocked() {
                    self.confirm_since = tokio::time::Instant::now();
                    self.notice(false, String::new());
                }
                Ok(())
            }
            other => {
                self.reply(0, AMQPClass::Connection(other));
                Ok(())
            }
        }
    }

    fn on_channel_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), ConnError> {
        if self.closing_channel == Some(ch)
            && !matches!(
                method,
                AMQPClass::Channel(channel::AMQPMethod::Close(_) | channel::AMQPMethod::CloseOk(_))
            )
        {
            // The relay closed this channel: until its close-ok, all else is
            // dropped (AMQP 0-9-1 `channel.close`).
            return Ok(());
        }
        if self.returning.is_some() && ch == self.channel {
            return Err(unexpected(format!(
                "a method on channel {ch} before the content of a returned message was complete"
            )));
        }
        if self.closing_channel == Some(ch)
            && matches!(
                method,
                AMQPClass::Channel(channel::AMQPMethod::Close(_) | channel::AMQPMethod::CloseOk(_))
            )
        {
            // The channel the relay closed is closed now (its close-ok, or the
            // broker's own close crossing ours): the next channel may open.
            self.closing_channel = None;
        }
        if let AMQPClass::Channel(channel::AMQPMethod::Close(close)) = &method {
            self.push_frame(&AMQPFrame::Method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
            ));
            let error = ConnError::ChannelClosed {
                code: close.reply_code,
                text: close.reply_text.to_string(),
            };
            if ch == CONTROL {
                self.control_open = false;
            } else if ch == self.channel && self.channel_open {
                self.channel_open = false;
                self.events.push_back(Event::ChannelClosed {
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                });
            }
            self.closed = Some((ch, error));
            return Ok(());
        }
        if let AMQPClass::Channel(channel::AMQPMethod::Flow(flow)) = &method {
            // Answered at once on any channel (AMQP 0-9-1 `channel.flow`); on the
            // publishing channel it stops or resumes publishing like a block.
            let active = flow.active;
            self.push_frame(&AMQPFrame::Method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active })),
            ));
            // The publishing channel, also while it opens (a flow between open-ok
            // and select-ok holds its first publish).
            if ch == self.channel && ch != CONTROL && self.closing_channel != Some(ch) {
                let was = self.blocked();
                self.flow_off = !active;
                match (was, self.blocked()) {
                    (false, true) => self.notice(true, "channel.flow".into()),
                    (true, false) => {
                        self.confirm_since = tokio::time::Instant::now();
                        self.notice(false, String::new());
                    }
                    _ => {}
                }
            }
            return Ok(());
        }
        if ch == self.channel && self.channel_open {
            if let AMQPClass::Basic(method) = method {
                return self.on_basic(method);
            }
        }
        if ch == self.channel || ch == CONTROL {
            self.reply(ch, method);
        }
        // Anything else belongs to a channel closed earlier: dropped.
        Ok(())
    }

    /// Keeps a reply for the request under way (a few at most: they are dropped
    /// oldest first, as no request waits for more than one).
    fn reply(&mut self, ch: u16, method: AMQPClass) {
        if self.replies.len() >= 8 {
            self.replies.pop_front();
        }
        self.replies.push_back((ch, method));
    }

    fn on_basic(&mut self, method: basic::AMQPMethod) -> Result<(), ConnError> {
        let (tag, multiple, ack) = match method {
            basic::AMQPMethod::Ack(a) => (a.delivery_tag, a.multiple, true),
            basic::AMQPMethod::Nack(n) => (n.delivery_tag, n.multiple, false),
            basic::AMQPMethod::Return(r) => return self.on_return_method(r),
            _ => return Ok(()),
        };
        let events = &mut self.events;
        let settled = self.tags.settle(tag, multiple, |tag| {
            events.push_back(Event::Confirm { tag, ack })
        });
        if settled.is_ok() {
            self.confirm_since = tokio::time::Instant::now();
        }
        if let Err(e) = settled {
            // The broker and the relay disagree about this channel, not about the
            // connection: the channel is closed (406), and a new one opened once its
            // close-ok is here (`open_channel`).
            let ch = self.channel;
            self.push_frame(&AMQPFrame::Method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                    reply_code: 406,
                    reply_text: amq_protocol::types::ShortString::from(
                        "PRECONDITION_FAILED - a confirm of a delivery tag never published",
                    ),
                    class_id: 60,
                    method_id: if ack { 80 } else { 120 },
                })),
            ));
            self.channel_open = false;
            self.returning = None;
            self.closing_channel = Some(ch);
            self.events.push_back(Event::ChannelError(e.0));
        }
        Ok(())
    }
}
