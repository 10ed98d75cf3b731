//! One connection of the scripted broker, on the far end of a socket pair: the
//! server's half of AMQP 0-9-1 as RabbitMQ speaks it to a publisher (handshake,
//! channels, confirm mode, declarations on any channel, publishes read frame by
//! frame, confirms, returns, closes, heartbeats), with the faults the schedule
//! asks for. What a publish means (routing, refusals) is the cluster's
//! (`broker.rs`): this file only speaks the protocol.
//! size: the server's AMQP 0-9-1 is one `impl Server` over one connection's buffers and channels

use std::collections::{BTreeMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use amq_protocol::frame::{parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, AMQPClass};
use amq_protocol::types::{FieldTable, LongString, ShortString};
use tokio::time::Instant;

use super::super::super::connection::frame::{self, FRAME_OVERHEAD};

/// Where the handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Header,
    StartOk,
    TuneOk,
    Open,
    Running,
}

/// What the connection asks of the cluster: the frames it read that mean
/// something beyond the protocol.
#[derive(Debug)]
pub(super) enum Request {
    /// `connection.open` (the cluster answers: open-ok, or 530).
    Open,
    /// `exchange.declare` on `ch`.
    Declare { ch: u16, declare: exchange::Declare },
    /// A whole publish on `ch` with its delivery tag (0 outside confirm mode).
    Publish {
        ch: u16,
        tag: u64,
        publish: basic::Publish,
        header: Box<AMQPContentHeader>,
        body: Vec<u8>,
    },
}

#[derive(Debug, Default)]
struct Chan {
    confirm: bool,
    next_tag: u64,
    /// Decided, not sent: tag → ack.
    pending: BTreeMap<u64, bool>,
    content: Option<(basic::Publish, Option<AMQPContentHeader>, Vec<u8>)>,
    /// The broker sent `channel.close`: everything but close/close-ok is dropped.
    closing: bool,
    /// The client acknowledged `channel.flow(false)`, the last flow sent.
    flow_off: bool,
    /// What the last `channel.flow` sent said.
    flow_sent_active: bool,
}

/// One server-side connection.
pub(super) struct Server {
    pub(super) node: usize,
    sock: Option<UnixStream>,
    input: Vec<u8>,
    out: Vec<u8>,
    opos: usize,
    pub(super) phase: Phase,
    pub(super) frame_max: u32,
    /// What the broker proposes in `connection.tune`, and what was agreed.
    pub(super) offered_heartbeat: u16,
    pub(super) heartbeat: u16,
    chans: BTreeMap<u16, Chan>,
    /// Channels whose closes crossed (the client's close-ok may follow).
    crossed: Vec<u16>,
    /// The broker blocked the connection: it stops reading once blocked.
    pub(super) blocked: bool,
    /// When the schedule unblocks it, and turns `channel.flow` on again.
    pub(super) blocked_until: Option<Instant>,
    pub(super) flow_until: Option<Instant>,
    /// Answers nothing (heartbeats still go out) until then.
    pub(super) silent_until: Option<Instant>,
    /// The broker sent `connection.close`: it waits for close-ok.
    pub(super) closing: bool,
    last_recv: Instant,
    last_sent: Instant,
    /// Requests for the cluster, in arrival order.
    pub(super) requests: VecDeque<Request>,
    /// Frames that violated the protocol (the checks fail on any).
    pub(super) violations: Vec<String>,
    /// Publishes read while `channel.flow` was off (a protocol violation).
    pub(super) flow_violations: usize,
    /// Bytes read and written so far.
    pub(super) moved: usize,
    /// Where a read lands first (allocated once).
    scratch: Vec<u8>,
    /// The client said why it closed (`connection.close` from the client).
    pub(super) client_close: Option<(u16, String)>,
}

impl Server {
    pub(super) fn new(sock: UnixStream, node: usize, frame_max: u32, heartbeat: u16) -> Server {
        let now = Instant::now();
        Server {
            node,
            sock: Some(sock),
            input: Vec::new(),
            out: Vec::new(),
            opos: 0,
            phase: Phase::Header,
            frame_max,
            offered_heartbeat: heartbeat,
            heartbeat: 0,
            chans: BTreeMap::new(),
            crossed: Vec::new(),
            blocked: false,
            blocked_until: None,
            flow_until: None,
            silent_until: None,
            closing: false,
            last_recv: now,
            last_sent: now,
            requests: VecDeque::new(),
            violations: Vec::new(),
            flow_violations: 0,
            client_close: None,
            moved: 0,
            scratch: vec![0; 64 * 1024],
        }
    }

    /// Bytes queued, not yet written.
    pub(super) fn queued(&self) -> usize {
        self.out.len() - self.opos
    }

    pub(super) fn open(&self) -> bool {
        self.sock.is_some()
    }

    pub(super) fn silent(&self) -> bool {
        self.silent_until.is_some_and(|t| Instant::now() < t)
    }

    /// Closes the socket without a word.
    pub(super) fn hang_up(&mut self) {
        self.sock = None;
        self.out.clear();
        self.opos = 0;
    }

    pub(super) fn send(&mut self, frame: &AMQPFrame) {
        if self.sock.is_none() {
            return;
        }
        super::trace(|| format!("broker node {} sends {frame:?}", self.node));
        frame::encode(&mut self.out, frame).expect("the broker's frame encodes");
    }

    pub(super) fn send_method(&mut self, ch: u16, method: AMQPClass) {
        self.send(&AMQPFrame::Method(ch, method));
    }

    /// Writes at most `n` queued bytes.
    pub(super) fn write(&mut self, n: usize) {
        let Some(sock) = self.sock.as_mut() else {
            return;
        };
        let end = self.out.len().min(self.opos.saturating_add(n));
        if end == self.opos {
            return;
        }
        match sock.write(&self.out[self.opos..end]) {
            Ok(k) => {
                self.opos += k;
                self.moved += k;
                if k > 0 {
                    self.last_sent = Instant::now();
                }
                if self.opos == self.out.len() {
                    self.out.clear();
                    self.opos = 0;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => self.hang_up(),
        }
    }

    /// Reads at most `n` bytes (nothing while blocked: RabbitMQ stops reading a
    /// blocked publisher's socket) and takes the whole frames.
    pub(super) fn read(&mut self, n: usize) {
        if self.blocked && self.phase == Phase::Running {
            return;
        }
        let Some(sock) = self.sock.as_mut() else {
            return;
        };
        let want = n.clamp(1, self.scratch.len());
        let got = match sock.read(&mut self.scratch[..want]) {
            Ok(0) => {
                self.hang_up();
                return;
            }
            Ok(k) => k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
            Err(_) => {
                self.hang_up();
                return;
            }
        };
        self.input.extend_from_slice(&self.scratch[..got]);
        self.moved += got;
        if got > 0 {
            self.last_recv = Instant::now();
            self.take_frames();
        }
    }

    /// Heartbeats: one out after half an interval of silence; the client given up
    /// (socket closed, as RabbitMQ does) after two intervals without a byte from it.
    pub(super) fn heartbeats(&mut self) {
        if self.heartbeat == 0 || self.sock.is_none() || self.phase != Phase::Running {
            return;
        }
        let interval = Duration::from_secs(u64::from(self.heartbeat));
        let now = Instant::now();
        if now.duration_since(self.last_recv) >= interval * 2 && !self.blocked {
            super::trace(|| {
                format!(
                    "broker node {}: missed heartbeats from the client",
                    self.node
                )
            });
            // A client alive misses no heartbeat: not while it backs off, nor while
            // it waits for anything (RabbitMQ would close the connection).
            self.violations.push(format!(
                "missed heartbeats from the client ({}s agreed)",
                self.heartbeat
            ));
            self.hang_up();
            return;
        }
        if now.duration_since(self.last_sent) >= interval / 2 && self.out.len() == self.opos {
            self.send(&AMQPFrame::Heartbeat);
            self.write(usize::MAX);
        }
    }

    fn take_frames(&mut self) {
        if self.phase == Phase::Header {
            if self.input.len() < 8 {
                return;
            }
            if &self.input[..8] != b"AMQP\x00\x00\x09\x01" {
                self.violations.push("a bad protocol header".into());
                self.hang_up();
                return;
            }
            self.input.drain(..8);
            self.phase = Phase::StartOk;
            self.send_method(0, start());
        }
        let mut at = 0;
        while let Some((frame, used)) = self.split(at) {
            at += used;
            self.on_frame(frame);
            if self.sock.is_none() {
                break;
            }
        }
        self.input.drain(..at.min(self.input.len()));
    }

    fn split(&mut self, at: usize) -> Option<(AMQPFrame, usize)> {
        let bytes = self.input.get(at..)?;
        if bytes.len() < 7 {
            return None;
        }
        let size = u32::from_be_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]) as usize;
        let total = size + FRAME_OVERHEAD;
        let limit = if self.phase == Phase::Running {
            self.frame_max
        } else {
            frame::FRAME_MIN.max(self.frame_max)
        };
        if total > limit as usize {
            self.violations
                .push(format!("a frame of {total} bytes over frame_max {limit}"));
            return None;
        }
        if bytes.len() < total {
            return None;
        }
        if bytes[0] == 3 {
            let ch = u16::from_be_bytes([bytes[1], bytes[2]]);
            return Some((AMQPFrame::Body(ch, bytes[7..total - 1].to_vec()), total));
        }
        match parse_frame(&bytes[..total]) {
            Ok((&[], frame)) => Some((frame, total)),
            other => {
                self.violations
                    .push(format!("a frame that does not parse: {other:?}"));
                None
            }
        }
    }

    fn on_frame(&mut self, frame: AMQPFrame) {
        super::trace(|| format!("broker node {} reads {frame:?}", self.node));
        if self.closing {
            if let AMQPFrame::Method(0, AMQPClass::Connection(m)) = frame {
                match m {
                    connection::AMQPMethod::CloseOk(_) => self.hang_up(),
                    connection::AMQPMethod::Close(_) => {
                        self.send_method(
                            0,
                            conn(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                        );
                        self.write(usize::MAX);
                        self.hang_up();
                    }
                    _ => {}
                }
            }
            return;
        }
        match frame {
            AMQPFrame::Heartbeat => {}
            AMQPFrame::Method(0, AMQPClass::Connection(m)) => self.on_connection(m),
            AMQPFrame::Method(ch, AMQPClass::Channel(m)) => self.on_channel(ch, m),
            AMQPFrame::Method(ch, method) if self.chans.get(&ch).is_some_and(|c| c.closing) => {
                let _ = method;
            }
            AMQPFrame::Method(ch, AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))) => {
                if !self.chans.contains_key(&ch) {
                    self.violations
                        .push(format!("a declaration on closed channel {ch}"));
                    return;
                }
                self.requests.push_back(Request::Declare { ch, declare: d });
            }
            AMQPFrame::Method(ch, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))) => {
                let Some(c) = self.chans.get_mut(&ch) else {
                    self.violations
                        .push(format!("confirm.select on closed channel {ch}"));
                    return;
                };
                c.confirm = true;
                c.next_tag = 1;
                let ok = confirm::AMQPMethod::SelectOk(confirm::SelectOk {});
                self.send_method(ch, AMQPClass::Confirm(ok));
            }
            AMQPFrame::Method(ch, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => {
                let Some(c) = self.chans.get_mut(&ch) else {
                    self.violations
                        .push(format!("a publish on closed channel {ch}"));
                    return;
                };
                if c.flow_off {
                    self.flow_violations += 1;
                }
                if c.content.is_some() {
                    self.violations
                        .push("a publish before the last one's content".into());
                }
                c.content = Some((p, None, Vec::new()));
            }
            AMQPFrame::Header(ch, header) => {
                let closing = self.chans.get(&ch).is_some_and(|c| c.closing);
                let Some(content) = self.chans.get_mut(&ch).and_then(|c| c.content.as_mut()) else {
                    if !closing {
                        self.violations
                            .push(format!("a content header without a publish on {ch}"));
                    }
                    return;
                };
                content.1 = Some(header);
                self.arrived(ch);
            }
            AMQPFrame::Body(ch, body) => {
                let closing = self.chans.get(&ch).is_some_and(|c| c.closing);
                let Some(content) = self.chans.get_mut(&ch).and_then(|c| c.content.as_mut()) else {
                    if !closing {
                        self.violations
                            .push(format!("a content body without a publish on {ch}"));
                    }
                    return;
                };
                content.2.extend_from_slice(&body);
                self.arrived(ch);
            }
            other => self
                .violations
                .push(format!("a frame a broker does not expect: {other:?}")),
        }
    }

    fn on_connection(&mut self, m: connection::AMQPMethod) {
        match m {
            connection::AMQPMethod::StartOk(_) => {
                self.phase = Phase::TuneOk;
                let tune = connection::Tune {
                    channel_max: 2047,
                    frame_max: self.frame_max,
                    heartbeat: self.offered_heartbeat,
                };
                self.send_method(0, conn(connection::AMQPMethod::Tune(tune)));
            }
            connection::AMQPMethod::TuneOk(t) => {
                self.heartbeat = t.heartbeat;
                self.frame_max = t.frame_max;
                self.phase = Phase::Open;
            }
            connection::AMQPMethod::Open(_) => self.requests.push_back(Request::Open),
            connection::AMQPMethod::Close(c) => {
                self.client_close = Some((c.reply_code, c.reply_text.to_string()));
                self.send_method(
                    0,
                    conn(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.write(usize::MAX);
                self.hang_up();
            }
            other => self.violations.push(format!("the client sent {other:?}")),
        }
    }

    fn on_channel(&mut self, ch: u16, m: channel::AMQPMethod) {
        match m {
            channel::AMQPMethod::Open(_) => {
                if self.chans.contains_key(&ch) {
                    self.violations.push(format!("channel {ch} opened twice"));
                    return;
                }
                self.chans.insert(
                    ch,
                    Chan {
                        flow_sent_active: true,
                        ..Chan::default()
                    },
                );
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                );
            }
            channel::AMQPMethod::Close(_) => {
                // Crossing the broker's own close, both sides answer (AMQP 0-9-1
                // §2.2.4): the client's close-ok may still come.
                if self.chans.remove(&ch).is_some_and(|c| c.closing) {
                    self.crossed.push(ch);
                }
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
            }
            channel::AMQPMethod::CloseOk(_) => {
                if self.chans.get(&ch).is_some_and(|c| c.closing) {
                    self.chans.remove(&ch);
                } else if let Some(at) = self.crossed.iter().position(|c| *c == ch) {
                    self.crossed.remove(at);
                } else {
                    self.violations.push(format!(
                        "close-ok for channel {ch} the broker did not close"
                    ));
                }
            }
            channel::AMQPMethod::FlowOk(f) => {
                // The answer to the last flow sent counts (a flow-ok of an earlier
                // one may cross a later flow).
                if let Some(c) = self.chans.get_mut(&ch) {
                    c.flow_off = !f.active && !c.flow_sent_active;
                }
            }
            other => self
                .violations
                .push(format!("the client sent {other:?} on channel {ch}")),
        }
    }

    fn arrived(&mut self, ch: u16) {
        let Some(c) = self.chans.get_mut(&ch) else {
            return;
        };
        let Some((_, Some(header), body)) = &c.content else {
            return;
        };
        if (body.len() as u64) < header.body_size {
            return;
        }
        let Some((publish, Some(header), body)) = c.content.take() else {
            return;
        };
        let tag = if c.confirm {
            let t = c.next_tag;
            c.next_tag += 1;
            t
        } else {
            0
        };
        self.requests.push_back(Request::Publish {
            ch,
            tag,
            publish,
            header: Box::new(header),
            body,
        });
    }

    // ---- what the cluster answers through

    /// Whether channel `ch` is open and not closing (a request on it counts).
    pub(super) fn channel_live(&self, ch: u16) -> bool {
        self.chans.get(&ch).is_some_and(|c| !c.closing)
    }

    /// Closes channel `ch` from the broker's side (its publishes in flight are lost).
    pub(super) fn close_channel(
        &mut self,
        ch: u16,
        code: u16,
        text: &str,
        class: u16,
        method: u16,
    ) {
        if let Some(c) = self.chans.get_mut(&ch) {
            if c.closing {
                return;
            }
            c.closing = true;
            c.pending.clear();
            c.content = None;
        }
        self.send_method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: code,
                reply_text: ShortString::from(text),
                class_id: class,
                method_id: method,
            })),
        );
    }

    /// Closes the connection from the broker's side.
    pub(super) fn close(&mut self, code: u16, text: &str) {
        if self.closing || self.sock.is_none() {
            return;
        }
        self.closing = true;
        self.send_method(
            0,
            conn(connection::AMQPMethod::Close(connection::Close {
                reply_code: code,
                reply_text: ShortString::from(text),
                class_id: 0,
                method_id: 0,
            })),
        );
    }

    pub(super) fn open_ok(&mut self) {
        self.phase = Phase::Running;
        self.send_method(
            0,
            conn(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        );
    }

    pub(super) fn declare_ok(&mut self, ch: u16) {
        let ok = exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {});
        self.send_method(ch, AMQPClass::Exchange(ok));
    }

    /// Records the confirm of `tag` on `ch`, to be sent by [`Server::confirm`].
    pub(super) fn decide(&mut self, ch: u16, tag: u64, ack: bool) {
        if let Some(c) = self.chans.get_mut(&ch) {
            if c.confirm && !c.closing {
                c.pending.insert(tag, ack);
            }
        }
    }

    /// Sends confirms of `ch`: the lowest `count` decided ones, one by one or, when
    /// they agree, as one `multiple` (now and then with tag 0: all outstanding).
    pub(super) fn confirm(&mut self, count: usize, multiple: bool, tag_zero: bool) {
        let chans: Vec<u16> = self.chans.keys().copied().collect();
        for ch in chans {
            let Some(c) = self.chans.get_mut(&ch) else {
                continue;
            };
            if c.closing || c.pending.is_empty() {
                continue;
            }
            let taken: Vec<(u64, bool)> = c
                .pending
                .iter()
                .take(count)
                .map(|(t, a)| (*t, *a))
                .collect();
            for (t, _) in &taken {
                c.pending.remove(t);
            }
            // Every tag published on the channel is decided when it arrives, so the
            // decided ones are all it has unconfirmed: a `multiple` of the lowest
            // covers exactly these, and is right when they agree.
            let same = taken.iter().all(|(_, a)| *a == taken[0].1);
            let everything = c.pending.is_empty();
            if multiple && same {
                let (tag, ack) = taken[taken.len() - 1];
                let tag = if tag_zero && everything && ack {
                    0
                } else {
                    tag
                };
                self.send_confirm(ch, tag, true, ack);
            } else {
                for (tag, ack) in taken {
                    self.send_confirm(ch, tag, false, ack);
                }
            }
        }
    }

    fn send_confirm(&mut self, ch: u16, tag: u64, multiple: bool, ack: bool) {
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

    /// `basic.return` of a publish, with its header and body in frames of `piece`.
    pub(super) fn send_return(
        &mut self,
        ch: u16,
        publish: &basic::Publish,
        header: AMQPContentHeader,
        body: &[u8],
    ) {
        let r = basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: publish.exchange.clone(),
            routing_key: publish.routing_key.clone(),
        });
        self.send_method(ch, AMQPClass::Basic(r));
        self.send(&AMQPFrame::Header(ch, header));
        let piece = (self.frame_max as usize)
            .saturating_sub(FRAME_OVERHEAD)
            .max(1);
        for chunk in body.chunks(piece) {
            self.send(&AMQPFrame::Body(ch, chunk.to_vec()));
        }
    }

    /// `channel.flow` on every publishing channel.
    pub(super) fn flow(&mut self, active: bool) {
        let chans: Vec<u16> = self.chans.keys().copied().filter(|c| *c != 1).collect();
        for ch in chans {
            if let Some(c) = self.chans.get_mut(&ch) {
                c.flow_sent_active = active;
                if active {
                    c.flow_off = false;
                }
            }
            self.send_method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active })),
            );
        }
    }

    pub(super) fn set_blocked(&mut self, blocked: bool) {
        if self.blocked == blocked || self.phase != Phase::Running {
            return;
        }
        self.blocked = blocked;
        let m = if blocked {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: ShortString::from("low on memory"),
            })
        } else {
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.send_method(0, conn(m));
    }

    /// Confirms decided and not sent on any channel.
    pub(super) fn pending(&self) -> usize {
        self.chans.values().map(|c| c.pending.len()).sum()
    }
}

fn conn(m: connection::AMQPMethod) -> AMQPClass {
    AMQPClass::Connection(m)
}

fn start() -> AMQPClass {
    conn(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: FieldTable::default(),
        mechanisms: LongString::from("PLAIN AMQPLAIN"),
        locales: LongString::from("en_US"),
    }))
}
