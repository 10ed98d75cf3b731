//! The relay's AMQP 0-9-1 client: one connection carries everything the relay says
//! to RabbitMQ (docs/design.md §4, "The AMQP client").
//!
//! - `frame.rs`: framing without I/O (split, check, encode);
//! - `socket.rs`: TCP and TLS;
//! - `params.rs`: what a connection takes from the configuration ([`Params`]);
//! - `handshake.rs`: protocol header, login (PLAIN, AMQPLAIN, EXTERNAL), tune, open;
//! - `dispatch.rs`: what each frame from the broker means for the state;
//! - `returns.rs`: returned messages (`basic.return`, its header and body);
//! - `channels.rs`: the request/reply methods (channel open and close, confirm
//!   select, exchange and queue declarations and bindings on the control channel,
//!   connection close);
//! - `confirms.rs`: delivery tags (their one owner);
//! - `deadlines.rs`: heartbeats and the confirm deadline, on one timer;
//! - this file: the state and the I/O loop the publisher's task drives.
//!
//! Two channels at a time: the *control* channel (1) for declarations and passive
//! checks, opened when first needed and again after the broker closed it (a passive
//! check of a missing exchange closes it); and the *publishing* channel, in confirm
//! mode, numbered from 2 and renewed on a fresh number after every failure so that
//! nothing of an old channel is mistaken for the new one's.
//!
//! Publishing never waits for the broker: `basic.publish` frames are encoded into one
//! buffer and written with as few system calls as the socket takes; what the broker
//! sends back is read in the same task and handed out as [`Event`]s in arrival
//! order: a confirm per delivery tag, returns with their properties, a closed
//! channel, blocked and unblocked. Heartbeats go out after half an interval with
//! nothing written; a broker silent for two intervals is given up.

mod channels;
mod confirms;
mod deadlines;
mod dispatch;
pub(crate) mod frame;
mod handshake;
mod params;
mod returns;
mod socket;

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{connection, AMQPClass, BasicProperties};
use amq_protocol::types::ShortString;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

pub(crate) use channels::{Declare, ExchangeFlags};
pub(crate) use confirms::Tags;
pub(crate) use handshake::{connect, ConnectError, CONNECT_TIMEOUT};
pub(crate) use params::Params;
pub(crate) use returns::Returned;
use returns::Returning;
#[cfg(test)]
pub(crate) use socket::sim_dial;
pub(crate) use socket::{host_of, ipv6_literal, Socket};

use frame::{FrameError, FRAME_MIN, FRAME_OVERHEAD};

/// Reads per poll at most before other work gets a turn.
const READS_PER_POLL: usize = 16;
/// Size of the read buffer (grown for a larger frame).
const READ_BUFFER: usize = 128 * 1024;
/// Write-buffer capacity kept once the buffer is empty: one large message does not
/// keep its size allocated for the life of the connection.
const WRITE_KEEP: usize = 1024 * 1024;
/// The control channel's number.
const CONTROL: u16 = 1;
/// The request deadline until the configuration sets one.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the connection is gone, or why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConnError {
    /// The broker closed the connection (`connection.close`).
    Closed { code: u16, text: String },
    /// The broker closed the channel of a request (`channel.close`).
    ChannelClosed { code: u16, text: String },
    /// The broker broke the protocol; the relay closed the connection with `code`.
    Protocol { code: u16, text: String },
    /// The socket failed, ended, or went silent.
    Io(String),
}

impl fmt::Display for ConnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnError::Closed { code, text } => {
                write!(f, "the broker closed the connection ({code}): {text}")
            }
            ConnError::ChannelClosed { code, text } => {
                write!(f, "the broker closed the channel ({code}): {text}")
            }
            ConnError::Protocol { code, text } => {
                write!(f, "the broker broke the protocol ({code}): {text}")
            }
            ConnError::Io(text) => f.write_str(text),
        }
    }
}

impl From<FrameError> for ConnError {
    fn from(e: FrameError) -> Self {
        ConnError::Protocol {
            code: e.code(),
            text: e.to_string(),
        }
    }
}

/// What the broker sent on the publishing channel (and the connection's notices),
/// in the order it arrived.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// The publish with this delivery tag was acked (`ack`) or nacked. A `multiple`
    /// confirm arrives as one event per tag, in ascending order.
    Confirm {
        tag: u64,
        ack: bool,
    },
    /// `basic.return`, with its content header (the body is not kept). It arrives
    /// before the confirm of the returned publish.
    Return(Box<Returned>),
    /// The broker closed the publishing channel (its close-ok is already sent).
    ChannelClosed {
        code: u16,
        text: String,
    },
    /// The relay closed the publishing channel because of what the broker sent on
    /// it (a confirm of a tag never published): its close-ok is awaited before the
    /// next channel opens.
    ChannelError(String),
    /// Publishing must stop: `connection.blocked`, or `channel.flow` off.
    Blocked(String),
    Unblocked,
}

/// A message that cannot be sent in AMQP as it is: its content header does not fit
/// one frame, or a name is longer than a short string. It is poison: no retry
/// can send it (docs/design.md §4, "Messages that cannot be framed").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unfit(pub String);

/// One AMQP connection: see the module docs.
pub(crate) struct Connection {
    /// `None` once the connection was given up: dropping the socket closes it at
    /// once, so it holds no connection slot of the broker.
    socket: Option<Box<dyn Socket>>,
    /// Index in `[rabbitmq] url` of the node this connection is to.
    pub(crate) node: usize,
    /// Received bytes not parsed yet are `read[rlo..rhi]`.
    read: Vec<u8>,
    rlo: usize,
    rhi: usize,
    /// Encoded frames not written yet are `write[wpos..]`.
    write: Vec<u8>,
    wpos: usize,
    /// The agreed frame size ([`FRAME_MIN`] until `connection.tune`).
    frame_max: u32,
    channel_max: u16,
    heartbeat: Option<Duration>,
    last_read: Instant,
    last_write: Instant,
    timer: Pin<Box<Sleep>>,
    blocked: bool,
    /// `channel.flow` turned publishing off on the publishing channel.
    flow_off: bool,
    /// The deadline of every request (`request_timeout`), and of the confirms of
    /// publishes waiting while the broker does not block the connection.
    pub(crate) request_timeout: Duration,
    /// When the oldest unconfirmed publish last had news: a confirm, or the first
    /// publish after none was waiting, or the end of a block.
    confirm_since: Instant,
    /// Returns read on the publishing channel (at most one per publish).
    returns_seen: u64,
    /// A frame other than a heartbeat was read since the timers last looked.
    answered: bool,
    /// The publishing channel the relay closed itself, whose close-ok is awaited.
    closing_channel: Option<u16>,
    /// Why the connection is gone; reported once what came before it is handed out.
    dead: Option<ConnError>,
    /// `dead` was reported by [`Connection::poll_io`] (it is reported once).
    reported: bool,
    /// Events read and not handed out yet (read while a request waited, or more
    /// than one poll's worth).
    events: VecDeque<Event>,
    /// Replies for the request under way: methods on channel 0, the control channel
    /// or a channel being opened, in arrival order (a few at most: the request takes
    /// the one it waits for and drops the others).
    replies: VecDeque<(u16, AMQPClass)>,
    /// A channel the broker closed while a request on it waited.
    closed: Option<(u16, ConnError)>,
    /// The publishing channel's number, whether it is open, its delivery tags and
    /// the return being read.
    channel: u16,
    channel_open: bool,
    tags: Tags,
    returning: Option<Returning>,
    control_open: bool,
    /// The relay sent `connection.close`: until close-ok, every other frame is
    /// discarded (AMQP 0-9-1, `connection.close`).
    closing: bool,
}

impl Connection {
    fn new(socket: Box<dyn Socket>, node: usize) -> Connection {
        let now = Instant::now();
        Connection {
            socket: Some(socket),
            node,
            read: vec![0; READ_BUFFER],
            rlo: 0,
            rhi: 0,
            write: Vec::with_capacity(64 * 1024),
            wpos: 0,
            frame_max: FRAME_MIN,
            channel_max: u16::MAX,
            heartbeat: None,
            last_read: now,
            last_write: now,
            timer: Box::pin(tokio::time::sleep_until(now)),
            blocked: false,
            flow_off: false,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            confirm_since: now,
            answered: false,
            returns_seen: 0,
            closing_channel: None,
            dead: None,
            reported: false,
            events: VecDeque::new(),
            replies: VecDeque::new(),
            closed: None,
            channel: CONTROL,
            channel_open: false,
            tags: Tags::default(),
            returning: None,
            control_open: false,
            closing: false,
        }
    }

    /// Whether the broker blocks publishing (`connection.blocked`, or `channel.flow`
    /// off on the publishing channel).
    pub(crate) fn blocked(&self) -> bool {
        self.blocked || self.flow_off
    }

    /// Queues a notice that publishing stops (`true`) or may go on, unless it
    /// cancels the last one queued: a flood of blocked and unblocked frames keeps at
    /// most one notice waiting.
    fn notice(&mut self, stop: bool, reason: String) {
        match self.events.back() {
            Some(Event::Blocked(_)) if !stop => {
                self.events.pop_back();
            }
            Some(Event::Unblocked) if stop => {
                self.events.pop_back();
            }
            Some(Event::Blocked(_)) | Some(Event::Unblocked) => {}
            _ => self.events.push_back(if stop {
                Event::Blocked(reason)
            } else {
                Event::Unblocked
            }),
        }
    }

    /// Whether the connection can still be used.
    pub(crate) fn is_alive(&self) -> bool {
        self.dead.is_none()
    }

    /// Gives the connection up without a word: its socket is closed now.
    pub(crate) fn abandon(&mut self) {
        self.fail(ConnError::Io("the connection was given up".into()));
        self.reported = true;
        self.socket = None;
    }

    /// Whether the publishing channel is open (not closed by either side).
    pub(crate) fn channel_open(&self) -> bool {
        self.dead.is_none() && self.channel_open
    }

    /// Publishes on the publishing channel whose confirms are not read yet.
    #[cfg(test)]
    pub(crate) fn unconfirmed(&self) -> usize {
        self.tags.unconfirmed()
    }

    /// The agreed frame size.
    #[cfg(test)]
    pub(crate) fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The write buffer's allocation (the tests check it is given back).
    #[cfg(test)]
    pub(crate) fn write_capacity(&self) -> usize {
        self.write.capacity()
    }

    /// The read buffer's size (the simulation checks it stays bounded).
    #[cfg(test)]
    pub(crate) fn read_buffer_len(&self) -> usize {
        self.read.len()
    }

    /// Bytes encoded but not yet written to the socket.
    pub(crate) fn unwritten(&self) -> usize {
        self.write.len() - self.wpos
    }

    /// Encodes one `basic.publish` (method, content header, body frames) on the
    /// publishing channel into the write buffer; returns its delivery tag. Nothing
    /// is written until [`Connection::poll_io`]. A message AMQP cannot carry is
    /// left out, and its reason returned.
    pub(crate) fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<u64, Unfit> {
        for (what, name) in [("exchange", exchange), ("routing key", routing_key)] {
            if name.len() > 255 {
                return Err(Unfit(format!(
                    "its {what} is {} bytes long, over AMQP's 255",
                    name.len()
                )));
            }
        }
        let ch = self.channel;
        let start = self.write.len();
        frame::encode_publish(&mut self.write, ch, exchange, routing_key, true);
        let header_at = self.write.len();
        let header = AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties,
            },
        );
        if let Err(e) = frame::encode(&mut self.write, &header) {
            self.write.truncate(start);
            return Err(Unfit(e));
        }
        let header_size = self.write.len() - header_at;
        if header_size > self.frame_max as usize {
            self.write.truncate(start);
            return Err(Unfit(format!(
                "its properties and headers take a frame of {header_size} bytes, over the broker's frame size of {} (make the headers column smaller, or raise frame_max on the broker and in the [rabbitmq] url)",
                self.frame_max
            )));
        }
        let chunk = (self.frame_max as usize)
            .saturating_sub(FRAME_OVERHEAD)
            .max(1);
        for piece in body.chunks(chunk) {
            frame::encode_body(&mut self.write, ch, piece);
        }
        if self.tags.unconfirmed() == 0 {
            self.confirm_since = Instant::now();
        }
        Ok(self.tags.publish())
    }

    /// Writes what is buffered, sends a heartbeat when due, and reads what the
    /// broker sent. Ready with the events found (in arrival order), or with the error
    /// that ended the connection once every event before it was handed out.
    pub(crate) fn poll_io(&mut self, cx: &mut Context<'_>) -> Poll<Result<Vec<Event>, ConnError>> {
        if self.dead.is_none() {
            if let Err(e) = self.drive(cx) {
                self.fail(e);
            }
        }
        if !self.events.is_empty() {
            return Poll::Ready(Ok(self.events.drain(..).collect()));
        }
        match &self.dead {
            Some(e) if !self.reported => {
                self.reported = true;
                Poll::Ready(Err(e.clone()))
            }
            _ => Poll::Pending,
        }
    }

    /// Records why the connection ended (the first reason wins).
    fn fail(&mut self, e: ConnError) {
        if self.dead.is_none() {
            if let ConnError::Protocol { code, text } = &e {
                self.send_close(*code, text);
            }
            // The close or close-ok queued goes out if the socket takes it now.
            if self.socket.is_some() {
                let _ = self.try_write();
            }
            self.dead = Some(e);
        }
    }

    /// One round of I/O: write, then take every whole frame already buffered
    /// before reading more (frames that came in the same read as a reply a
    /// request took are not left waiting for the next read), then heartbeats.
    fn drive(&mut self, cx: &mut Context<'_>) -> Result<(), ConnError> {
        self.poll_write(cx)?;
        let mut waiting = false;
        for _ in 0..READS_PER_POLL {
            self.take_frames()?;
            match self.poll_fill(cx)? {
                Poll::Ready(()) => {}
                Poll::Pending => {
                    waiting = true;
                    break;
                }
            }
        }
        self.take_frames()?;
        if !waiting && self.events.is_empty() {
            // More to read and nothing found yet: come back at once (no read is
            // registered to wake us).
            cx.waker().wake_by_ref();
        }
        // Replies the frames asked for (close-ok) go out at once.
        self.poll_write(cx)?;
        self.poll_heartbeat(cx)
    }

    /// Dispatches every whole frame in the read buffer.
    fn take_frames(&mut self) -> Result<(), ConnError> {
        while self.dead.is_none() {
            let Some((frame, used)) =
                frame::split_frame(&self.read[self.rlo..self.rhi], self.frame_max)?
            else {
                break;
            };
            self.rlo += used;
            self.on_frame(frame)?;
        }
        Ok(())
    }

    /// Writes as much of the buffer as the socket takes now.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), ConnError> {
        let Some(socket) = self.socket.as_mut() else {
            return Err(ConnError::Io("the connection was given up".into()));
        };
        while self.wpos < self.write.len() {
            match Pin::new(&mut *socket).poll_write(cx, &self.write[self.wpos..]) {
                Poll::Ready(Ok(0)) => return Err(ConnError::Io("the socket took no bytes".into())),
                Poll::Ready(Ok(n)) => {
                    self.wpos += n;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => {
                    return Err(ConnError::Io(format!("writing to the broker: {e}")))
                }
                Poll::Pending => {
                    // Give back what was written, once it is the larger part.
                    if self.wpos >= self.write.len() / 2 {
                        self.write.drain(..self.wpos);
                        self.wpos = 0;
                    }
                    return Ok(());
                }
            }
        }
        self.write.clear();
        self.wpos = 0;
        if self.write.capacity() > WRITE_KEEP {
            self.write.shrink_to(WRITE_KEEP);
        }
        match Pin::new(&mut *socket).poll_flush(cx) {
            Poll::Ready(Err(e)) => Err(ConnError::Io(format!("writing to the broker: {e}"))),
            _ => Ok(()),
        }
    }

    /// Writes what the socket takes without a task to wake (a close on the way out).
    fn try_write(&mut self) -> Result<(), ConnError> {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        self.poll_write(&mut cx)
    }

    /// Reads once into the buffer: Ready when bytes arrived. Before
    /// `connection.tune`, at most [`FRAME_MIN`] bytes are read.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Result<Poll<()>, ConnError> {
        if self.rlo == self.rhi {
            self.rlo = 0;
            self.rhi = 0;
        }
        let want = self.frame_max as usize + FRAME_OVERHEAD;
        if self.rhi == self.read.len() {
            if self.rlo > 0 {
                self.read.copy_within(self.rlo..self.rhi, 0);
                self.rhi -= self.rlo;
                self.rlo = 0;
            } else if self.read.len() < want {
                let len = (self.read.len() * 2).min(want.max(READ_BUFFER));
                self.read.resize(len, 0);
            }
        }
        let end = if self.frame_max <= FRAME_MIN {
            (self.rhi + FRAME_MIN as usize).min(self.read.len())
        } else {
            self.read.len()
        };
        let Some(socket) = self.socket.as_mut() else {
            return Err(ConnError::Io("the connection was given up".into()));
        };
        let mut buf = ReadBuf::new(&mut self.read[self.rhi..end]);
        match Pin::new(socket).poll_read(cx, &mut buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len();
                if n == 0 {
                    return Err(ConnError::Io("the broker closed the socket".into()));
                }
                self.rhi += n;
                self.last_read = Instant::now();
                Ok(Poll::Ready(()))
            }
            Poll::Ready(Err(e)) => Err(ConnError::Io(format!("reading from the broker: {e}"))),
            Poll::Pending => Ok(Poll::Pending),
        }
    }

    fn push_frame(&mut self, frame: &AMQPFrame) {
        if let Err(e) = frame::encode(&mut self.write, frame) {
            // Writing into a Vec cannot run out of room; a frame that does not encode
            // is a bug: end the connection rather than send half of it.
            self.dead.get_or_insert(ConnError::Io(e));
        }
    }

    /// Queues `connection.close` with a reply code (the relay's own close, or the
    /// answer to a protocol error).
    fn send_close(&mut self, code: u16, text: &str) {
        let mut text = text.to_string();
        outbox_event::redact::truncate_at_char(&mut text, 255);
        self.push_frame(&AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: code,
                reply_text: ShortString::from(text),
                class_id: 0,
                method_id: 0,
            })),
        ));
    }
}

#[cfg(test)]
mod sim;

/// Whether the simulations trace (`OUTBOX_SIM_TRACE`): the frames the client reads.
#[cfg(test)]
pub(crate) fn sim_trace_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("OUTBOX_SIM_TRACE").is_some())
}
#[cfg(test)]
mod tests;
