//! Returned messages: a `basic.return` on the publishing channel, then its content
//! header and body frames, handed out as one [`Returned`] once whole. Each publish
//! is returned at most once; content out of place ends the connection (505).

use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::protocol::basic;
use amq_protocol::protocol::BasicProperties;

use super::dispatch::unexpected;
use super::{ConnError, Connection, Event};

/// A returned message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Returned {
    pub reply_code: u16,
    pub reply_text: String,
    pub exchange: String,
    pub routing_key: String,
    pub properties: BasicProperties,
}

/// A `basic.return` waiting for its content header and body.
pub(super) struct Returning {
    method: amq_protocol::protocol::basic::Return,
    header: Option<AMQPContentHeader>,
    body_left: u64,
}

impl Connection {
    /// A `basic.return`: its content follows.
    pub(super) fn on_return_method(&mut self, r: basic::Return) -> Result<(), ConnError> {
        // Each publish is returned at most once: more returns than publishes on the
        // channel is a broker flooding the relay (the event queue would grow
        // without bound).
        self.returns_seen += 1;
        let published = self.tags.next() - 1;
        if self.returns_seen > published {
            return Err(ConnError::Protocol {
                code: 406,
                text: format!(
                    "the broker returned {} messages on a channel that published {published}",
                    self.returns_seen
                ),
            });
        }
        self.returning = Some(Returning {
            method: r,
            header: None,
            body_left: 0,
        });
        Ok(())
    }

    /// A content header: the return's, or a frame out of place.
    pub(super) fn on_return_header(
        &mut self,
        ch: u16,
        header: AMQPContentHeader,
    ) -> Result<(), ConnError> {
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

    /// A content body of `len` bytes: the return's, or a frame out of place.
    pub(super) fn on_return_body(&mut self, ch: u16, len: usize) -> Result<(), ConnError> {
        let Some(returning) = self
            .returning
            .as_mut()
            .filter(|r| r.header.is_some() && r.body_left > 0 && ch == self.channel)
        else {
            return Err(unexpected(format!(
                "a content body on channel {ch} without a content header before it"
            )));
        };
        if len as u64 > returning.body_left {
            return Err(unexpected("a content body longer than its header said"));
        }
        returning.body_left -= len as u64;
        self.finish_return();
        Ok(())
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
