//! What each frame from the broker means: events of the publishing channel,
//! replies to the request under way, the answers the protocol requires (close-ok),
//! and the frames AMQP forbids, which end the connection with the spec's reply
//! code (505 UNEXPECTED_FRAME for content out of place, 406 for a confirm of a
//! delivery tag the channel never published).

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};

use super::{ConnError, Connection, Event, Returned, Returning, CONTROL};

fn unexpected(text: impl Into<String>) -> ConnError {
    ConnError::Protocol {
        code: 505,
        text: text.into(),
    }
}

impl Connection {
    /// Takes one frame into the state.
    pub(super) fn on_frame(&mut self, frame: AMQPFrame) -> Result<(), ConnError> {
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
        match frame {
            AMQPFrame::Heartbeat => Ok(()),
            AMQPFrame::Method(0, AMQPClass::Connection(method)) => self.on_connection(method),
            AMQPFrame::Method(0, _) => Err(unexpected("a method of another class on channel 0")),
            AMQPFrame::Method(ch, method) => self.on_channel_method(ch, method),
            AMQPFrame::Header(ch, header) => {
                let Some(returning) = self.returning.as_mut().filter(|r| r.header.is_none()) else {
                    return Err(unexpected(format!(
                        "a content header on channel {ch} without the method it belongs to"
                    )));
                };
                if ch != self.channel {
                    return Err(unexpected(format!(
                        "a content header on channel {ch} while channel {} awaits one",
                        self.channel
                    )));
                }
                returning.body_left = header.body_size;
                returning.header = Some(header);
                self.finish_return();
                Ok(())
            }
            AMQPFrame::Body(ch, body) => {
                let Some(returning) = self
                    .returning
                    .as_mut()
                    .filter(|r| r.header.is_some() && r.body_left > 0 && ch == self.channel)
                else {
                    return Err(unexpected(format!(
                        "a content body on channel {ch} without a content header before it"
                    )));
                };
                if body.len() as u64 > returning.body_left {
                    return Err(unexpected("a content body longer than its header said"));
                }
                returning.body_left -= body.len() as u64;
                self.finish_return();
                Ok(())
            }
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
                self.blocked = true;
                self.events.push_back(Event::Blocked(b.reason.to_string()));
                Ok(())
            }
            connection::AMQPMethod::Unblocked(_) => {
                self.blocked = false;
                self.events.push_back(Event::Unblocked);
                Ok(())
            }
            other => {
                self.reply = Some((0, AMQPClass::Connection(other)));
                Ok(())
            }
        }
    }

    fn on_channel_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), ConnError> {
        if self.returning.is_some() && ch == self.channel {
            return Err(unexpected(format!(
                "a method on channel {ch} before the content of a returned message was complete"
            )));
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
        if ch == self.channel && self.channel_open {
            if let AMQPClass::Basic(method) = method {
                return self.on_basic(method);
            }
        }
        if ch == self.channel || ch == CONTROL {
            self.reply = Some((ch, method));
        }
        // Anything else belongs to a channel closed earlier: dropped.
        Ok(())
    }

    fn on_basic(&mut self, method: basic::AMQPMethod) -> Result<(), ConnError> {
        let (tag, multiple, ack) = match method {
            basic::AMQPMethod::Ack(a) => (a.delivery_tag, a.multiple, true),
            basic::AMQPMethod::Nack(n) => (n.delivery_tag, n.multiple, false),
            basic::AMQPMethod::Return(r) => {
                self.returning = Some(Returning {
                    method: r,
                    header: None,
                    body_left: 0,
                });
                return Ok(());
            }
            _ => return Ok(()),
        };
        let events = &mut self.events;
        self.tags
            .settle(tag, multiple, |tag| {
                events.push_back(Event::Confirm { tag, ack })
            })
            .map_err(|e| ConnError::Protocol {
                code: 406,
                text: e.0,
            })
    }

    /// The return, once its header and whole body have arrived.
    fn finish_return(&mut self) {
        let done = matches!(&self.returning, Some(r) if r.header.is_some() && r.body_left == 0);
        if !done {
            return;
        }
        let Some(Returning {
            method,
            header: Some(header),
            ..
        }) = self.returning.take()
        else {
            return;
        };
        self.events.push_back(Event::Return(Box::new(Returned {
            reply_code: method.reply_code,
            reply_text: method.reply_text.to_string(),
            exchange: method.exchange.to_string(),
            routing_key: method.routing_key.to_string(),
            properties: header.properties,
        })));
    }
}
