//! The publishing connection: the relay's own AMQP 0-9-1 client for the one thing
//! the hot path does (docs/design.md §4, "A publish path of our own").
//!
//! lapin opens the *session* (login, virtual host, exchange declarations, the error
//! an operator reads: `connection.rs`); the publishes and their confirms go over a
//! second connection, this one, which the publisher's task drives itself:
//!
//! - `basic.publish` frames are encoded on the publisher's thread into one buffer
//!   and written with as few system calls as the socket takes (no future, promise or
//!   hand-off to another thread per message);
//! - what the broker sends back is read in the same task and turned into
//!   [`WireEvent`]s, in the order it arrived: confirms as delivery tags (a
//!   `multiple` ack is one event), returns with their properties, a channel or
//!   connection the broker closed, `connection.blocked` / `unblocked`;
//! - heartbeats are sent when the connection has been quiet for half the negotiated
//!   interval, and a broker silent for two intervals is given up.
//!
//! Frames are encoded and parsed by the `amq-protocol` crate (lapin's own codec);
//! the frame boundaries, the connection and channel handshakes and the state are
//! here. Nothing in this file decides what to publish or what a confirm means: that
//! is `engine.rs`; `run.rs` connects the two.

use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::{AMQPScheme, AMQPUri, SASLMechanism};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::config::PublisherConfig;
use crate::connection::{Tls, CONNECT_TIMEOUT};
use crate::error::{is_certificate_error, redact_url, scrub, PublishError};

/// The frame size proposed when neither the URL nor the broker limits it.
const DEFAULT_FRAME_MAX: u32 = 131_072;
/// Frame header (type, channel, size) and frame-end octet.
const FRAME_OVERHEAD: usize = 8;
/// Reads per poll at most before other work gets a turn.
const READS_PER_POLL: usize = 16;
/// Size of the read buffer (grown for a larger frame).
const READ_BUFFER: usize = 128 * 1024;

trait Socket: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Socket for T {}

/// Why the connection is gone, or why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WireError {
    /// The broker closed the connection (`connection.close`).
    Closed { code: u16, text: String },
    /// The broker closed the channel during a handshake (`channel.close`).
    ChannelClosed { code: u16, text: String },
    /// The socket failed, ended, or went silent; or the broker broke the protocol.
    Io(String),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Closed { code, text } => {
                write!(f, "the broker closed the connection ({code}): {text}")
            }
            WireError::ChannelClosed { code, text } => {
                write!(f, "the broker closed the channel ({code}): {text}")
            }
            WireError::Io(text) => f.write_str(text),
        }
    }
}

/// What the broker sent, in the order it arrived.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WireEvent {
    /// `basic.ack`: the publish with this delivery tag (1-based, per channel), and
    /// with `multiple` every earlier one not confirmed yet.
    Ack {
        tag: u64,
        multiple: bool,
    },
    /// `basic.nack`, as `Ack`.
    Nack {
        tag: u64,
        multiple: bool,
    },
    /// `basic.return` with its content header (the body is not kept).
    Return {
        reply_code: u16,
        reply_text: String,
        exchange: String,
        routing_key: String,
        properties: Box<BasicProperties>,
    },
    /// The broker closed the current channel (its close-ok is already sent).
    ChannelClosed {
        code: u16,
        text: String,
    },
    Blocked(String),
    Unblocked,
}

/// A `basic.return` waiting for its content header and body.
struct Returning {
    method: basic::Return,
    header: Option<AMQPContentHeader>,
    body_left: u64,
}

/// One open AMQP connection with one confirm-mode channel at a time.
pub(crate) struct Wire {
    socket: Box<dyn Socket>,
    /// Received bytes not parsed yet are `read[rlo..rhi]`.
    read: Vec<u8>,
    rlo: usize,
    rhi: usize,
    /// Encoded frames not written yet are `write[wpos..]`.
    write: Vec<u8>,
    wpos: usize,
    /// The current channel's id, and whether it is open.
    channel: u16,
    channel_open: bool,
    /// The delivery tag the next publish on the channel gets.
    next_tag: u64,
    frame_max: u32,
    heartbeat: Option<Duration>,
    last_read: Instant,
    last_write: Instant,
    timer: Pin<Box<Sleep>>,
    returning: Option<Returning>,
    blocked: bool,
    /// Why the connection is gone; reported once what came before it is handed out.
    dead: Option<WireError>,
    /// `dead` was reported by [`Wire::poll_io`] (it is reported once).
    reported: bool,
}

impl Wire {
    /// Opens the publishing connection to `config.urls[index]` (TLS and credentials
    /// as the session's) and its first confirm-mode channel.
    pub(crate) async fn connect(
        config: &PublisherConfig,
        tls: &Tls,
        index: usize,
    ) -> Result<Wire, PublishError> {
        let url = crate::connection::url_of(config, index)?;
        let redacted = redact_url(&url);
        let unreachable = |reason: String| PublishError::Unreachable {
            url: redacted.clone(),
            reason: scrub(&reason, &url),
        };
        let uri: AMQPUri = url
            .parse()
            .map_err(|e: String| unreachable(format!("the URL does not parse: {e}")))?;
        let setup = async {
            let socket = open_socket(&uri, config, tls).await?;
            let mut wire = Wire::new(socket);
            wire.handshake(&uri, &config.connection_name).await?;
            wire.open_channel().await?;
            Ok::<_, SetupError>(wire)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
            Ok(Ok(wire)) => Ok(wire),
            Ok(Err(SetupError::Config(e))) => Err(e),
            Ok(Err(SetupError::Wire(e))) => Err(classify(&redacted, &url, &e)),
            Err(_) => Err(unreachable(format!(
                "the publishing connection gave no answer within {CONNECT_TIMEOUT:?}"
            ))),
        }
    }

    fn new(socket: Box<dyn Socket>) -> Wire {
        let now = Instant::now();
        Wire {
            socket,
            read: vec![0; READ_BUFFER],
            rlo: 0,
            rhi: 0,
            write: Vec::with_capacity(64 * 1024),
            wpos: 0,
            channel: 0,
            channel_open: false,
            next_tag: 1,
            frame_max: DEFAULT_FRAME_MAX,
            heartbeat: None,
            last_read: now,
            last_write: now,
            timer: Box::pin(tokio::time::sleep_until(now)),
            returning: None,
            blocked: false,
            dead: None,
            reported: false,
        }
    }

    /// Whether the broker blocks publishing (`connection.blocked`).
    pub(crate) fn blocked(&self) -> bool {
        self.blocked
    }

    /// Whether the connection can still be used.
    pub(crate) fn is_alive(&self) -> bool {
        self.dead.is_none()
    }

    /// Gives the connection up without a word (its socket closes when dropped).
    pub(crate) fn abandon(&mut self) {
        self.dead
            .get_or_insert(WireError::Io("the connection was given up".into()));
        self.reported = true;
    }

    /// Whether the current channel is open (not closed by either side).
    pub(crate) fn channel_open(&self) -> bool {
        self.dead.is_none() && self.channel_open
    }

    /// Bytes encoded but not yet written to the socket.
    pub(crate) fn unwritten(&self) -> usize {
        self.write.len() - self.wpos
    }

    /// Encodes one `basic.publish` (method, content header, body frames) into the
    /// write buffer; returns its delivery tag. Nothing is written until
    /// [`Wire::poll_io`].
    pub(crate) fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: BasicProperties,
        body: &[u8],
    ) -> u64 {
        let ch = self.channel;
        encode_publish(&mut self.write, ch, exchange, routing_key, mandatory);
        self.push_frame(&AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties,
            },
        ));
        let chunk = (self.frame_max as usize)
            .saturating_sub(FRAME_OVERHEAD)
            .max(1);
        for piece in body.chunks(chunk) {
            encode_body(&mut self.write, ch, piece);
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        tag
    }

    /// Writes what is buffered, sends a heartbeat when due, and reads what the broker
    /// sent. Ready with the events found (in arrival order), or with the error that
    /// ended the connection once every event before it was handed out.
    pub(crate) fn poll_io(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<WireEvent>, WireError>> {
        let mut events = Vec::new();
        if self.dead.is_none() {
            if let Err(e) = self.drive(cx, &mut events) {
                self.dead = Some(e);
            }
        }
        if !events.is_empty() {
            return Poll::Ready(Ok(events));
        }
        match &self.dead {
            Some(e) if !self.reported => {
                self.reported = true;
                Poll::Ready(Err(e.clone()))
            }
            _ => Poll::Pending,
        }
    }

    fn drive(
        &mut self,
        cx: &mut Context<'_>,
        events: &mut Vec<WireEvent>,
    ) -> Result<(), WireError> {
        self.poll_write(cx)?;
        let mut waiting = false;
        for _ in 0..READS_PER_POLL {
            match self.poll_fill(cx)? {
                Poll::Ready(()) => {
                    while let Some(frame) = self.next_frame()? {
                        match self.on_frame(frame) {
                            Ok(Some(event)) => events.push(event),
                            Ok(None) => {}
                            Err(e) => {
                                // Send the close-ok it may have queued.
                                let _ = self.poll_write(cx);
                                return Err(e);
                            }
                        }
                    }
                }
                Poll::Pending => {
                    waiting = true;
                    break;
                }
            }
        }
        if !waiting && events.is_empty() {
            // More to read and nothing found yet: come back at once (no read is
            // registered to wake us).
            cx.waker().wake_by_ref();
        }
        // Replies the frames asked for (close-ok) go out at once.
        self.poll_write(cx)?;
        self.poll_heartbeat(cx)
    }

    /// Sends a heartbeat when nothing was written for half the interval; fails when
    /// nothing was read for two; arms the timer for whichever comes first.
    fn poll_heartbeat(&mut self, cx: &mut Context<'_>) -> Result<(), WireError> {
        let Some(interval) = self.heartbeat else {
            return Ok(());
        };
        loop {
            let now = Instant::now();
            if now.duration_since(self.last_read) >= interval * 2 {
                return Err(WireError::Io(format!(
                    "the broker sent nothing for {:?} (two heartbeat intervals)",
                    interval * 2
                )));
            }
            if self.unwritten() == 0 && now.duration_since(self.last_write) >= interval / 2 {
                self.push_frame(&AMQPFrame::Heartbeat);
                self.poll_write(cx)?;
                // A heartbeat the socket did not take yet counts as written: the
                // buffer is not empty, so another is not queued behind it.
                self.last_write = now;
            }
            let wake = (self.last_read + interval * 2).min(self.last_write + interval / 2);
            self.timer.as_mut().reset(wake);
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
    }

    /// Writes as much of the buffer as the socket takes now.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), WireError> {
        while self.wpos < self.write.len() {
            match Pin::new(&mut self.socket).poll_write(cx, &self.write[self.wpos..]) {
                Poll::Ready(Ok(0)) => return Err(WireError::Io("the socket took no bytes".into())),
                Poll::Ready(Ok(n)) => {
                    self.wpos += n;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => return Err(io_error("writing to the broker", &e)),
                Poll::Pending => return Ok(()),
            }
        }
        self.write.clear();
        self.wpos = 0;
        match Pin::new(&mut self.socket).poll_flush(cx) {
            Poll::Ready(Err(e)) => Err(io_error("writing to the broker", &e)),
            _ => Ok(()),
        }
    }

    /// Reads once into the buffer: Ready when bytes arrived.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Result<Poll<()>, WireError> {
        if self.rlo == self.rhi {
            self.rlo = 0;
            self.rhi = 0;
        }
        if self.rhi == self.read.len() {
            if self.rlo > 0 {
                self.read.copy_within(self.rlo..self.rhi, 0);
                self.rhi -= self.rlo;
                self.rlo = 0;
            } else {
                let len = self.read.len() * 2;
                self.read.resize(len, 0);
            }
        }
        let mut buf = ReadBuf::new(&mut self.read[self.rhi..]);
        match Pin::new(&mut self.socket).poll_read(cx, &mut buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len();
                if n == 0 {
                    return Err(WireError::Io("the broker closed the socket".into()));
                }
                self.rhi += n;
                self.last_read = Instant::now();
                Ok(Poll::Ready(()))
            }
            Poll::Ready(Err(e)) => Err(io_error("reading from the broker", &e)),
            Poll::Pending => Ok(Poll::Pending),
        }
    }

    /// The next whole frame in the buffer, if there is one.
    fn next_frame(&mut self) -> Result<Option<AMQPFrame>, WireError> {
        let (frame, used) = match split_frame(&self.read[self.rlo..self.rhi], self.frame_max)? {
            Some(found) => found,
            None => return Ok(None),
        };
        self.rlo += used;
        Ok(Some(frame))
    }

    /// Turns a frame into an event, answering what needs an answer. Frames of
    /// channels closed earlier are dropped.
    fn on_frame(&mut self, frame: AMQPFrame) -> Result<Option<WireEvent>, WireError> {
        let ch = frame.channel_id();
        match frame {
            AMQPFrame::Heartbeat => Ok(None),
            AMQPFrame::Method(0, AMQPClass::Connection(method)) => match method {
                connection::AMQPMethod::Close(close) => {
                    self.push_frame(&AMQPFrame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    ));
                    Err(WireError::Closed {
                        code: close.reply_code,
                        text: close.reply_text.to_string(),
                    })
                }
                connection::AMQPMethod::Blocked(b) => {
                    self.blocked = true;
                    Ok(Some(WireEvent::Blocked(b.reason.to_string())))
                }
                connection::AMQPMethod::Unblocked(_) => {
                    self.blocked = false;
                    Ok(Some(WireEvent::Unblocked))
                }
                connection::AMQPMethod::CloseOk(_) => {
                    Err(WireError::Io("the connection was closed".into()))
                }
                _ => Ok(None),
            },
            _ if ch != self.channel || !self.channel_open => Ok(None),
            AMQPFrame::Method(_, AMQPClass::Basic(method)) => match method {
                basic::AMQPMethod::Ack(a) => Ok(Some(WireEvent::Ack {
                    tag: a.delivery_tag,
                    multiple: a.multiple,
                })),
                basic::AMQPMethod::Nack(n) => Ok(Some(WireEvent::Nack {
                    tag: n.delivery_tag,
                    multiple: n.multiple,
                })),
                basic::AMQPMethod::Return(r) => {
                    self.returning = Some(Returning {
                        method: r,
                        header: None,
                        body_left: 0,
                    });
                    Ok(None)
                }
                _ => Ok(None),
            },
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                self.push_frame(&AMQPFrame::Method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                ));
                self.channel_open = false;
                self.returning = None;
                Ok(Some(WireEvent::ChannelClosed {
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                }))
            }
            AMQPFrame::Header(_, header) => {
                let Some(returning) = self.returning.as_mut() else {
                    return Err(WireError::Io("a content header without a return".into()));
                };
                returning.body_left = header.body_size;
                returning.header = Some(header);
                Ok(self.finish_return())
            }
            AMQPFrame::Body(_, body) => {
                let Some(returning) = self.returning.as_mut() else {
                    return Err(WireError::Io("a content body without a return".into()));
                };
                returning.body_left = returning.body_left.saturating_sub(body.len() as u64);
                Ok(self.finish_return())
            }
            _ => Ok(None),
        }
    }

    /// The return, once its header and whole body have arrived.
    fn finish_return(&mut self) -> Option<WireEvent> {
        let done = matches!(&self.returning, Some(r) if r.header.is_some() && r.body_left == 0);
        if !done {
            return None;
        }
        let Returning { method, header, .. } = self.returning.take()?;
        Some(WireEvent::Return {
            reply_code: method.reply_code,
            reply_text: method.reply_text.to_string(),
            exchange: method.exchange.to_string(),
            routing_key: method.routing_key.to_string(),
            properties: Box::new(header?.properties),
        })
    }

    fn push_frame(&mut self, frame: &AMQPFrame) {
        let buffer = std::mem::take(&mut self.write);
        match gen_frame(frame)(WriteContext::from(buffer)) {
            Ok(context) => self.write = context.write,
            // Writing into a Vec cannot run out of room; keep the connection usable.
            Err(e) => {
                self.dead
                    .get_or_insert(WireError::Io(format!("cannot encode a frame: {e}")));
            }
        }
    }

    /// Reads frames until one is a method on `ch` that `want` accepts. A connection
    /// or channel the broker closes meanwhile is the error; `basic` frames of the
    /// closing channel and blocked notices are taken in passing.
    async fn expect(
        &mut self,
        ch: u16,
        want: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, WireError> {
        loop {
            while let Some(frame) = self.next_frame()? {
                match frame {
                    AMQPFrame::Method(c, method) if c == ch && want(&method) => return Ok(method),
                    AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close)))
                        if c == ch =>
                    {
                        self.push_frame(&AMQPFrame::Method(
                            c,
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        ));
                        self.flush().await?;
                        self.channel_open = false;
                        return Err(WireError::ChannelClosed {
                            code: close.reply_code,
                            text: close.reply_text.to_string(),
                        });
                    }
                    AMQPFrame::Method(0, AMQPClass::Connection(m)) => {
                        let closing = matches!(m, connection::AMQPMethod::Close(_));
                        if let Err(e) =
                            self.on_frame(AMQPFrame::Method(0, AMQPClass::Connection(m)))
                        {
                            if closing {
                                let _ = self.flush().await;
                            }
                            self.dead = Some(e.clone());
                            return Err(e);
                        }
                    }
                    _ => {}
                }
            }
            poll_fn(|cx| {
                self.poll_write(cx)?;
                self.poll_fill(cx)
                    .map(|p| p.map(Ok))
                    .unwrap_or_else(|e| Poll::Ready(Err(e)))
            })
            .await?;
        }
    }

    /// Writes everything buffered.
    async fn flush(&mut self) -> Result<(), WireError> {
        poll_fn(|cx| {
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

    async fn call(
        &mut self,
        ch: u16,
        method: AMQPClass,
        want: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, WireError> {
        self.push_frame(&AMQPFrame::Method(ch, method));
        self.flush().await?;
        self.expect(ch, want).await
    }

    async fn handshake(&mut self, uri: &AMQPUri, name: &str) -> Result<(), WireError> {
        self.push_frame(&AMQPFrame::ProtocolHeader(
            amq_protocol::frame::ProtocolVersion::amqp_0_9_1(),
        ));
        self.flush().await?;
        let start = match self
            .expect(0, |m| {
                matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
            })
            .await
        {
            Ok(AMQPClass::Connection(connection::AMQPMethod::Start(s))) => s,
            Ok(_) => {
                return Err(WireError::Io(
                    "unexpected answer to the protocol header".into(),
                ))
            }
            Err(WireError::Io(e)) => {
                return Err(WireError::Io(format!(
                    "the broker did not start an AMQP 0-9-1 connection: {e}"
                )))
            }
            Err(e) => return Err(e),
        };
        let mechanism = uri.query.auth_mechanism.unwrap_or(SASLMechanism::Plain);
        let offered = start.mechanisms.to_string();
        if !offered.split_whitespace().any(|m| m == mechanism.name()) {
            return Err(WireError::Closed {
                code: 403,
                text: format!(
                    "ACCESS_REFUSED - the broker does not offer {} (it offers {offered})",
                    mechanism.name()
                ),
            });
        }
        let credentials = amq_protocol::auth::Credentials::new(
            uri.authority.userinfo.username.clone().into(),
            uri.authority.userinfo.password.clone().into(),
        );
        let start_ok = connection::StartOk {
            client_properties: client_properties(name),
            mechanism: ShortString::from(mechanism.name()),
            response: credentials.sasl_auth_string(mechanism),
            locale: ShortString::from("en_US"),
        };
        let tune = match self
            .call(
                0,
                AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
                |m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::Tune(_))),
            )
            .await
        {
            Ok(AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => t,
            Ok(_) => return Err(WireError::Io("unexpected answer to the login".into())),
            // A broker that does not close with a reason after a refused login
            // (without `authentication_failure_close`) just drops the socket.
            Err(WireError::Io(e)) => {
                return Err(WireError::Closed {
                    code: 403,
                    text: format!("ACCESS_REFUSED - the broker ended the connection at login: {e}"),
                })
            }
            Err(e) => return Err(e),
        };
        let frame_max = negotiate(uri.query.frame_max.unwrap_or(0), tune.frame_max);
        self.frame_max = if frame_max == 0 {
            DEFAULT_FRAME_MAX
        } else {
            frame_max
        };
        let heartbeat = match uri.query.heartbeat {
            Some(h) => h,
            None => tune.heartbeat,
        };
        self.heartbeat = (heartbeat > 0).then(|| Duration::from_secs(u64::from(heartbeat)));
        let channel_max = negotiate(
            u32::from(uri.query.channel_max.unwrap_or(0)),
            u32::from(tune.channel_max),
        );
        self.push_frame(&AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: u16::try_from(channel_max).unwrap_or(u16::MAX),
                frame_max: self.frame_max,
                heartbeat,
            })),
        ));
        self.call(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: ShortString::from(uri.vhost.as_str()),
            })),
            |m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))),
        )
        .await?;
        let now = Instant::now();
        self.last_read = now;
        self.last_write = now;
        Ok(())
    }

    /// Opens the next channel in confirm mode; its delivery tags start at 1.
    pub(crate) async fn open_channel(&mut self) -> Result<(), WireError> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        let ch = self
            .channel
            .checked_add(1)
            .filter(|c| *c < u16::MAX)
            .unwrap_or(1);
        self.channel = ch;
        self.channel_open = true;
        self.returning = None;
        self.next_tag = 1;
        self.call(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
        )
        .await?;
        self.call(
            ch,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
        )
        .await?;
        Ok(())
    }

    /// Closes the current channel and waits for the broker's close-ok: once it is
    /// here, nothing published on the channel can still be routed. Frames of the
    /// channel that arrive before it are dropped.
    pub(crate) async fn close_channel(&mut self) -> Result<(), WireError> {
        if !self.channel_open() {
            return Ok(());
        }
        let ch = self.channel;
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
        self.channel_open = false;
        self.returning = None;
        match closed {
            // The broker closed it first (both sides sent close): it is closed.
            Ok(_) | Err(WireError::ChannelClosed { .. }) => Ok(()),
            Err(e) => {
                self.dead.get_or_insert(e.clone());
                Err(e)
            }
        }
    }

    /// Closes the connection politely (waits for close-ok; the caller bounds it).
    pub(crate) async fn close(&mut self) {
        if self.dead.is_some() {
            return;
        }
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
        self.dead = Some(WireError::Io("the connection was closed".into()));
    }
}

/// A handshake failure, or a local problem found before one.
enum SetupError {
    Config(PublishError),
    Wire(WireError),
}

impl From<WireError> for SetupError {
    fn from(e: WireError) -> Self {
        SetupError::Wire(e)
    }
}

/// The smaller of two limits where 0 means none.
fn negotiate(ours: u32, theirs: u32) -> u32 {
    match (ours, theirs) {
        (0, t) => t,
        (o, 0) => o,
        (o, t) => o.min(t),
    }
}

fn client_properties(name: &str) -> FieldTable {
    let mut capabilities = FieldTable::default();
    for capability in [
        "publisher_confirms",
        "basic.nack",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        capabilities.insert(capability.into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    properties.insert("product".into(), text("outbox-relay"));
    properties.insert("version".into(), text(env!("CARGO_PKG_VERSION")));
    properties.insert("platform".into(), text("rust"));
    properties.insert("connection_name".into(), text(name));
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}

/// Connects TCP and, for `amqps`, TLS with the session's settings.
async fn open_socket(
    uri: &AMQPUri,
    config: &PublisherConfig,
    tls: &Tls,
) -> Result<Box<dyn Socket>, SetupError> {
    let host = uri.authority.host.as_str();
    let tcp = TcpStream::connect((host, uri.authority.port))
        .await
        .map_err(|e| io_error(&format!("connecting to {host}:{}", uri.authority.port), &e))?;
    let _ = tcp.set_nodelay(true);
    if uri.scheme != AMQPScheme::AMQPS {
        return Ok(Box::new(tcp));
    }
    let rustls = match tls {
        Tls::Own => crate::tls::amqps_config(config.ca_file.as_deref(), &config.auth),
        Tls::SystemRoots => crate::tls::amqps_config(None, &crate::tls::ClientAuth::default()),
    }
    .map_err(SetupError::Config)?;
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| WireError::Io(format!("the host {host} is not a TLS server name: {e}")))?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(rustls))
        .connect(name, tcp)
        .await
        .map_err(|e| io_error("the TLS handshake", &e))?;
    Ok(Box::new(stream))
}

fn io_error(doing: &str, e: &io::Error) -> WireError {
    WireError::Io(format!("{doing}: {e}"))
}

/// Sorts a failure of the publishing connection's setup as the session's are
/// sorted (`connection.rs`), its text cleared of the URL.
fn classify(redacted: &str, url: &str, error: &WireError) -> PublishError {
    let url_shown = redacted.to_string();
    let reason = scrub(&error.to_string(), url);
    match error {
        WireError::Closed { code: 403, text } if text.contains("vhost") => {
            PublishError::VirtualHost {
                url: url_shown,
                reason,
            }
        }
        WireError::Closed { code: 403, .. } => PublishError::AuthenticationRefused {
            url: url_shown,
            reason,
        },
        WireError::Closed {
            code: 530 | 402, ..
        } => PublishError::VirtualHost {
            url: url_shown,
            reason,
        },
        _ if is_certificate_error(&reason) => PublishError::TlsRefused {
            url: url_shown,
            reason,
        },
        _ => PublishError::Unreachable {
            url: url_shown,
            reason,
        },
    }
}

/// Splits the first whole frame off `bytes`: the frame and the bytes it used, or
/// `None` while it is incomplete. A frame larger than `frame_max` or not ending in
/// the frame-end octet is a protocol error.
fn split_frame(bytes: &[u8], frame_max: u32) -> Result<Option<(AMQPFrame, usize)>, WireError> {
    if bytes.len() < 7 {
        // The protocol header a broker sends back to refuse the version.
        if bytes.starts_with(b"AMQP") && bytes.len() >= 4 {
            return Err(WireError::Io("the broker refused AMQP 0-9-1".into()));
        }
        return Ok(None);
    }
    if bytes.starts_with(b"AMQP") {
        return Err(WireError::Io("the broker refused AMQP 0-9-1".into()));
    }
    let size = u32::from_be_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]) as usize;
    let limit = (frame_max.max(DEFAULT_FRAME_MAX) as usize).max(4096);
    if size > limit {
        return Err(WireError::Io(format!(
            "the broker sent a frame of {size} bytes, above the frame maximum"
        )));
    }
    let total = size + FRAME_OVERHEAD;
    if bytes.len() < total {
        return Ok(None);
    }
    if bytes[total - 1] != 0xCE {
        return Err(WireError::Io("a frame without its frame-end octet".into()));
    }
    match parse_frame(&bytes[..total]) {
        Ok((&[], frame)) => Ok(Some((frame, total))),
        Ok(_) => Err(WireError::Io("a frame with bytes after its end".into())),
        Err(e) => Err(WireError::Io(format!("a frame that does not parse: {e}"))),
    }
}

/// The `basic.publish` method frame, encoded by hand (it is on every message's path).
fn encode_publish(out: &mut Vec<u8>, ch: u16, exchange: &str, routing_key: &str, mandatory: bool) {
    let exchange = &exchange.as_bytes()[..exchange.len().min(255)];
    let routing_key = &routing_key.as_bytes()[..routing_key.len().min(255)];
    // class, method, reserved short, two short strings, the bits.
    let size = 4 + 2 + 1 + exchange.len() + 1 + routing_key.len() + 1;
    out.push(1);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(size as u32).to_be_bytes());
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&40u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.push(exchange.len() as u8);
    out.extend_from_slice(exchange);
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key);
    out.push(u8::from(mandatory));
    out.push(0xCE);
}

fn encode_body(out: &mut Vec<u8>, ch: u16, piece: &[u8]) {
    out.push(3);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(piece.len() as u32).to_be_bytes());
    out.extend_from_slice(piece);
    out.push(0xCE);
}

#[cfg(test)]
mod tests;
