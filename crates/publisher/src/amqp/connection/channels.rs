//! The connection's requests: a method sent, then its reply awaited while the I/O
//! loop keeps running (confirms and notices read meanwhile are kept for
//! [`Connection::poll_io`]). Channel open and close, confirm select, exchange and
//! queue declarations, passive checks and bindings on the control channel, and the
//! connection's own close.
//!
//! A refusal of the broker (404 missing, 406 inequivalent arguments, 403 no
//! permission) closes the control channel: the request returns
//! [`ConnError::ChannelClosed`] with the broker's code and text, and the next
//! request opens the control channel again.

use std::future::poll_fn;
use std::task::Poll;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel, confirm, connection, exchange, queue, AMQPClass};
use amq_protocol::types::{FieldTable, ShortString};

use super::{ConnError, Connection, Event, Tags, CONTROL};

/// What an exchange or queue declaration asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Declare {
    /// Create it as described if missing; an existing one must match (its type,
    /// flags and the arguments the broker compares), else 406.
    Active,
    /// Only check that it exists (404 when it does not).
    Passive,
}

/// The flags of `exchange.declare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExchangeFlags {
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
}

/// What `queue.declare-ok` tells of a queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct QueueCounts {
    /// Messages ready in it.
    pub messages: u32,
    /// Its consumers.
    pub consumers: u32,
}

impl Connection {
    /// Sends `method` on `ch` and waits for the reply `want` accepts. A channel
    /// the broker closes meanwhile, or the connection ending, is the error.
    pub(super) async fn call(
        &mut self,
        ch: u16,
        method: AMQPClass,
        want: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, ConnError> {
        if let Some(e) = &self.dead {
            // The end is reported once: here, not again by `poll_io`.
            self.reported = true;
            return Err(e.clone());
        }
        self.replies.clear();
        self.closed = None;
        self.push_frame(&AMQPFrame::Method(ch, method));
        self.expect(ch, want).await
    }

    /// Runs the I/O loop until the reply `want` accepts arrives on `ch`, at most
    /// `request_timeout`: a broker that does not answer in time (alive, sending
    /// heartbeats, but not answering: RabbitMQ while a resource alarm blocks the
    /// connection) fails the connection, which is then given up and replaced.
    pub(super) async fn expect(
        &mut self,
        ch: u16,
        want: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, ConnError> {
        let timeout = self.request_timeout;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        poll_fn(|cx| {
            loop {
                while let Some((c, method)) = self.replies.pop_front() {
                    if c == ch && want(&method) {
                        return Poll::Ready(Ok(method));
                    }
                    // Another reply (a late one of an abandoned request): dropped.
                }
                if let Some((c, e)) = self.closed.take() {
                    if c == ch {
                        return Poll::Ready(Err(e));
                    }
                }
                if let Some(e) = &self.dead {
                    self.reported = true;
                    return Poll::Ready(Err(e.clone()));
                }
                if let Err(e) = self.drive(cx) {
                    self.fail(e);
                    continue;
                }
                if self.replies.is_empty() && self.closed.is_none() {
                    if std::future::Future::poll(deadline.as_mut(), cx).is_ready() {
                        self.fail(ConnError::Io(format!(
                            "no answer from the broker within {timeout:?} (request_timeout)"
                        )));
                        continue;
                    }
                    return Poll::Pending;
                }
            }
        })
        .await
    }

    /// Writes everything buffered.
    pub(super) async fn flush(&mut self) -> Result<(), ConnError> {
        poll_fn(|cx| {
            if let Some(e) = &self.dead {
                return Poll::Ready(Err(e.clone()));
            }
            if let Err(e) = self.poll_write(cx) {
                return Poll::Ready(Err(e));
            }
            if self.unwritten() == 0 {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// Opens the next publishing channel in confirm mode; its delivery tags start
    /// at 1. Confirms and returns of the channel before it that were not handed out
    /// are dropped: they belong to publishes the engine has rewound.
    pub(crate) async fn open_channel(&mut self) -> Result<(), ConnError> {
        self.channel_open = false;
        self.returning = None;
        self.returns_seen = 0;
        if std::mem::take(&mut self.flow_off) && !self.blocked {
            // `channel.flow` stopped the last channel only.
            self.notice(false, String::new());
        }
        self.tags = Tags::default();
        self.events
            .retain(|e| matches!(e, Event::Blocked(_) | Event::Unblocked));
        if let Some(ch) = self.closing_channel {
            // The relay closed the last channel itself: nothing of it may still be
            // routed once its close-ok is here (or the broker closed it too); the
            // dispatch clears `closing_channel` when either arrives.
            let closed = self
                .expect(ch, |m| {
                    matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
                })
                .await;
            match closed {
                Ok(_) | Err(ConnError::ChannelClosed { .. }) => self.closing_channel = None,
                Err(e) => return Err(e),
            }
        }
        let last = self.channel_max.max(2);
        let ch = if self.channel < 2 || self.channel >= last {
            2
        } else {
            self.channel + 1
        };
        self.channel = ch;
        self.call(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
        )
        .await?;
        if self.closed_at_once(ch) {
            return Ok(());
        }
        self.call(
            ch,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
        )
        .await?;
        if self.closed_at_once(ch) {
            return Ok(());
        }
        self.channel_open = true;
        Ok(())
    }

    /// Whether the broker closed channel `ch` right after the reply a request took,
    /// in the same read (its close-ok is already sent): the channel is then not
    /// open, and its close is its first event, as if it came a moment later.
    fn closed_at_once(&mut self, ch: u16) -> bool {
        match self.closed.take() {
            Some((c, ConnError::ChannelClosed { code, text })) if c == ch => {
                self.events.push_back(Event::ChannelClosed { code, text });
                true
            }
            _ => false,
        }
    }

    /// Closes the publishing channel and waits for the broker's close-ok: once it
    /// is here, nothing published on the channel can still be routed.
    pub(crate) async fn close_channel(&mut self) -> Result<(), ConnError> {
        if !self.channel_open() {
            return Ok(());
        }
        let ch = self.channel;
        // Closing: what the channel still receives (confirms, returns) is dropped
        // until the close-ok (AMQP 0-9-1 `channel.close`).
        self.channel_open = false;
        self.returning = None;
        self.closing_channel = Some(ch);
        let closed = self
            .call(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                    reply_code: 200,
                    reply_text: ShortString::from("retrying"),
                    class_id: 0,
                    method_id: 0,
                })),
                |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
            )
            .await;
        match closed {
            // The broker closed it first (both sides sent close): it is closed.
            Ok(_) | Err(ConnError::ChannelClosed { .. }) => {
                self.closing_channel = None;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Declares the exchange `name` on the control channel (opened when needed):
    /// created durable with `kind` if missing ([`Declare::Active`]), or only
    /// checked ([`Declare::Passive`]). The broker's refusal (404 missing, 406 another
    /// type or durability, 403 no permission) is [`ConnError::ChannelClosed`].
    pub(crate) async fn declare_exchange(
        &mut self,
        name: &str,
        kind: &str,
        declare: Declare,
    ) -> Result<(), ConnError> {
        let durable = ExchangeFlags {
            durable: true,
            auto_delete: false,
            internal: false,
        };
        self.declare_exchange_with(name, kind, durable, FieldTable::default(), declare)
            .await
    }

    /// Declares the exchange `name` with these flags and arguments on the control
    /// channel ([`Connection::declare_exchange`] with every field of
    /// `exchange.declare`): a passive declaration only checks it exists.
    pub(crate) async fn declare_exchange_with(
        &mut self,
        name: &str,
        kind: &str,
        flags: ExchangeFlags,
        arguments: FieldTable,
        declare: Declare,
    ) -> Result<(), ConnError> {
        self.open_control().await?;
        self.call(
            CONTROL,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: ShortString::from(name),
                kind: ShortString::from(kind),
                passive: declare == Declare::Passive,
                durable: flags.durable,
                auto_delete: flags.auto_delete,
                internal: flags.internal,
                nowait: false,
                arguments,
            })),
            |m| matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))),
        )
        .await
        .map(|_| ())
    }

    /// Declares the queue `name` on the control channel: created with `durable`
    /// and `arguments` (never exclusive nor auto-delete: the queues of a topology
    /// outlive the relay) when missing ([`Declare::Active`]), or only checked
    /// ([`Declare::Passive`], 404 when missing). An existing queue declared with
    /// other arguments answers 406 PRECONDITION_FAILED, whose text names the
    /// argument (`inequivalent arg 'x-queue-type' for queue 'q' in vhost '/':
    /// received 'quorum' but current is 'classic'`). Returns the broker's counts.
    pub(crate) async fn declare_queue(
        &mut self,
        name: &str,
        durable: bool,
        arguments: FieldTable,
        declare: Declare,
    ) -> Result<QueueCounts, ConnError> {
        self.open_control().await?;
        let reply = self
            .call(
                CONTROL,
                AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                    queue: ShortString::from(name),
                    passive: declare == Declare::Passive,
                    durable,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments,
                })),
                |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))),
            )
            .await?;
        match reply {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(QueueCounts {
                messages: ok.message_count,
                consumers: ok.consumer_count,
            }),
            _ => Ok(QueueCounts::default()),
        }
    }

    /// Binds the queue `queue` to the exchange `exchange` with `routing_key` and
    /// `arguments` (`queue.bind`, idempotent) on the control channel.
    pub(crate) async fn bind_queue(
        &mut self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<(), ConnError> {
        self.open_control().await?;
        self.call(
            CONTROL,
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: ShortString::from(queue),
                exchange: ShortString::from(exchange),
                routing_key: ShortString::from(routing_key),
                nowait: false,
                arguments,
            })),
            |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::BindOk(_))),
        )
        .await
        .map(|_| ())
    }

    /// Binds the exchange `destination` to the exchange `source` (`exchange.bind`,
    /// RabbitMQ's extension, idempotent): what `source` routes with a matching key
    /// is routed on by `destination`.
    pub(crate) async fn bind_exchange(
        &mut self,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<(), ConnError> {
        self.open_control().await?;
        self.call(
            CONTROL,
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
                destination: ShortString::from(destination),
                source: ShortString::from(source),
                routing_key: ShortString::from(routing_key),
                nowait: false,
                arguments,
            })),
            |m| matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::BindOk(_))),
        )
        .await
        .map(|_| ())
    }

    /// Opens the control channel unless it is open.
    async fn open_control(&mut self) -> Result<(), ConnError> {
        if self.control_open {
            return Ok(());
        }
        self.call(
            CONTROL,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
        )
        .await?;
        self.control_open = true;
        Ok(())
    }

    /// Closes the connection politely (waits for close-ok; the caller bounds it),
    /// then the socket.
    pub(crate) async fn close(&mut self) {
        if self.dead.is_none() {
            self.closing = true;
            let _ = self
                .call(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                        reply_code: 200,
                        reply_text: ShortString::from("OK"),
                        class_id: 0,
                        method_id: 0,
                    })),
                    |m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))),
                )
                .await;
        }
        self.abandon();
    }
}
