//! The scripted broker of the connection's simulation, on the other end of the
//! socket pair: it reads what the client wrote a random number of bytes at a time
//! (or not at all for a while), answers the handshake and the requests as
//! RabbitMQ does, checks every publish byte for byte against what the client
//! published, and queues what it sends (confirms, returns in several body frames,
//! notices, closes) into a buffer the schedule writes to the socket in random
//! pieces. Frames are encoded with the connection's own codec (`frame::encode`).

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;

use amq_protocol::frame::{parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, AMQPClass};
use amq_protocol::types::{FieldTable, LongString, ShortString};
use rand::rngs::StdRng;
use rand::Rng;
use tokio::time::Instant;

use super::super::frame::{self, FRAME_OVERHEAD};
use super::model::{End, Model};

mod acts;

/// The publishing channel as the broker sees it.
struct PubChannel {
    ch: u16,
    /// The client's channel generation it belongs to (`Model::gens`).
    gen: usize,
    confirm: bool,
    /// The broker sent `channel.close`: everything but close and close-ok is dropped.
    closing: bool,
    /// The client closed it (or answered the broker's close): it is gone.
    closed: bool,
    /// Tags read so far.
    received: u64,
    /// Decided, confirm not sent yet: tag → ack.
    pending: BTreeMap<u64, bool>,
    /// The publish being read: method, then its header and body.
    content: Option<(basic::Publish, Option<AMQPContentHeader>, Vec<u8>)>,
}

pub(super) struct Broker {
    sock: Option<UnixStream>,
    input: Vec<u8>,
    got_header: bool,
    out: Vec<u8>,
    opos: usize,
    pub(super) frame_max: u32,
    pub(super) heartbeat: u16,
    channel_max: u16,
    secure: bool,
    pubch: Option<PubChannel>,
    opens: usize,
    control_open: bool,
    /// The broker's last answer to a passive declaration was a refusal.
    pub(super) refused_declare: Option<bool>,
    /// The broker sent `connection.close` / the client did.
    pub(super) closing: bool,
    pub(super) client_closing: bool,
    /// The client answered the broker's close.
    pub(super) close_ok: bool,
    pub(super) eof: bool,
    pub(super) blocked: bool,
    /// Reading stops until `turns` gets here; a turn is a step of the schedule
    /// or of a request.
    pub(super) paused_until: u64,
    pub(super) turns: u64,
    pub(super) read_total: usize,
    pub(super) last_read: Instant,
    /// The broker wrote bytes the client has not been polled for yet.
    pub(super) wrote: bool,
    /// Frames the broker sent that ask for a reply (requests, closes).
    pub(super) asked: usize,
}

impl Broker {
    pub(super) fn new(sock: UnixStream, rng: &mut StdRng) -> Broker {
        Broker {
            sock: Some(sock),
            input: Vec::new(),
            got_header: false,
            out: Vec::new(),
            opos: 0,
            frame_max: rng.gen_range(4096..=131_072),
            heartbeat: if rng.gen_bool(0.5) {
                0
            } else {
                rng.gen_range(1..=4)
            },
            channel_max: [0, 2, 3, 5, 2047][rng.gen_range(0..5)],
            secure: rng.gen_bool(0.2),
            pubch: None,
            opens: 0,
            control_open: false,
            refused_declare: None,
            closing: false,
            client_closing: false,
            close_ok: false,
            eof: false,
            blocked: false,
            paused_until: 0,
            turns: 0,
            read_total: 0,
            last_read: Instant::now(),
            wrote: false,
            asked: 0,
        }
    }

    pub(super) fn queued(&self) -> usize {
        self.out.len() - self.opos
    }

    /// Whether the broker's socket is still open.
    pub(super) fn open(&self) -> bool {
        self.sock.is_some()
    }

    pub(super) fn send(&mut self, frame: &AMQPFrame) {
        if self.sock.is_none() {
            return;
        }
        super::trace(|| format!("broker sends {frame:?}"));
        frame::encode(&mut self.out, frame).expect("the broker's frame encodes");
    }

    fn send_method(&mut self, ch: u16, method: AMQPClass) {
        self.send(&AMQPFrame::Method(ch, method));
    }

    /// Writes at most `n` queued bytes; whatever the socket takes.
    pub(super) fn write(&mut self, n: usize) -> usize {
        let Some(sock) = self.sock.as_mut() else {
            return 0;
        };
        let end = self.out.len().min(self.opos.saturating_add(n));
        if end == self.opos {
            return 0;
        }
        match sock.write(&self.out[self.opos..end]) {
            Ok(k) => {
                self.opos += k;
                if self.opos == self.out.len() {
                    self.out.clear();
                    self.opos = 0;
                }
                self.wrote |= k > 0;
                k
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
            Err(_) => {
                // The client closed its end.
                self.out.clear();
                self.opos = 0;
                0
            }
        }
    }

    /// Writes everything queued that the socket takes now.
    pub(super) fn write_all(&mut self) {
        while self.queued() > 0 && self.write(usize::MAX) > 0 {}
    }

    /// Closes the broker's end of the socket.
    pub(super) fn hang_up(&mut self) {
        self.sock = None;
        self.out.clear();
        self.opos = 0;
    }

    /// Reads at most `n` bytes and takes the frames in them; the bytes read.
    pub(super) fn read(&mut self, n: usize, model: &mut Model, rng: &mut StdRng) -> usize {
        if self.turns < self.paused_until || self.eof {
            return 0;
        }
        let Some(sock) = self.sock.as_mut() else {
            return 0;
        };
        let at = self.input.len();
        self.input.resize(at + n.min(64 * 1024), 0);
        let got = match sock.read(&mut self.input[at..]) {
            Ok(0) => {
                self.eof = true;
                0
            }
            Ok(k) => k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
            Err(_) => {
                self.eof = true;
                0
            }
        };
        self.input.truncate(at + got);
        if got > 0 {
            self.read_total += got;
            self.last_read = Instant::now();
            self.take_frames(model, rng);
        }
        got
    }

    /// Reads until the socket has nothing more (unless reading is paused).
    pub(super) fn read_all(&mut self, model: &mut Model, rng: &mut StdRng) {
        while self.read(usize::MAX, model, rng) > 0 {}
    }

    fn take_frames(&mut self, model: &mut Model, rng: &mut StdRng) {
        if !self.got_header {
            if self.input.len() < 8 {
                return;
            }
            assert_eq!(&self.input[..8], b"AMQP\x00\x00\x09\x01", "protocol header");
            self.input.drain(..8);
            self.got_header = true;
            self.asked += 1;
            self.send_method(0, start());
        }
        let mut at = 0;
        while let Some((frame, used)) = self.split(&self.input[at..]) {
            at += used;
            self.on_frame(frame, model, rng);
        }
        self.input.drain(..at);
    }

    /// The first whole frame the client sent: its size checked against the agreed
    /// `frame_max` (4,096 before tune-ok), then parsed by the codec.
    fn split(&self, bytes: &[u8]) -> Option<(AMQPFrame, usize)> {
        if bytes.len() < 7 {
            return None;
        }
        let size = u32::from_be_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]) as usize;
        let total = size + FRAME_OVERHEAD;
        assert!(
            total <= self.frame_max as usize,
            "the client sent a frame of {total} bytes, over frame_max {}",
            self.frame_max
        );
        if bytes.len() < total {
            return None;
        }
        if bytes[0] == 3 {
            // A body frame is its bytes (the codec copies them one by one, slow in a
            // debug build).
            assert_eq!(bytes[total - 1], 0xCE, "a body frame without its end octet");
            let ch = u16::from_be_bytes([bytes[1], bytes[2]]);
            return Some((AMQPFrame::Body(ch, bytes[7..total - 1].to_vec()), total));
        }
        match parse_frame(&bytes[..total]) {
            Ok((&[], frame)) => Some((frame, total)),
            other => panic!("the client sent a frame that does not parse: {other:?}"),
        }
    }

    fn on_frame(&mut self, frame: AMQPFrame, model: &mut Model, rng: &mut StdRng) {
        super::trace(|| format!("broker reads {frame:?}"));
        if self.closing || self.client_closing {
            // Closing: only close and close-ok count (AMQP 0-9-1 §4.2.4 and 2.2.4).
            match frame {
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) => {
                    self.close_ok = true;
                    self.hang_up();
                }
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                    if !self.closing {
                        panic!("the client sent connection.close twice: {c:?}");
                    }
                    // Crossing closes: answer it, or just hang up.
                    if rng.gen_bool(0.5) {
                        self.send_method(
                            0,
                            conn_method(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                        );
                        self.write_all();
                    }
                    self.hang_up();
                }
                _ => {}
            }
            return;
        }
        match frame {
            AMQPFrame::Heartbeat => {}
            AMQPFrame::Method(0, AMQPClass::Connection(m)) => self.on_connection(m, model),
            AMQPFrame::Method(ch, AMQPClass::Channel(m)) => self.on_channel(ch, m, model),
            AMQPFrame::Method(1, AMQPClass::Exchange(exchange::AMQPMethod::Declare(d))) => {
                assert!(
                    self.control_open,
                    "a declaration on a closed control channel"
                );
                if d.passive && rng.gen_bool(0.3) {
                    self.refused_declare = Some(true);
                    self.control_open = false;
                    self.send_method(1, channel_close(404, "NOT_FOUND - no exchange"));
                } else {
                    self.refused_declare = Some(false);
                    let ok = exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {});
                    self.send_method(1, AMQPClass::Exchange(ok));
                }
            }
            AMQPFrame::Method(ch, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))) => {
                let p = self.pubch.as_mut().filter(|p| p.ch == ch && !p.closed);
                let p = p.expect("confirm.select on a channel not open");
                p.confirm = true;
                let ok = confirm::AMQPMethod::SelectOk(confirm::SelectOk {});
                self.send_method(ch, AMQPClass::Confirm(ok));
            }
            AMQPFrame::Method(ch, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => {
                let c = self.pubch.as_mut().filter(|c| c.ch == ch && !c.closed);
                let c = c.expect("a publish on a channel that is not open");
                assert!(c.confirm, "a publish before confirm.select-ok");
                assert!(
                    c.content.is_none(),
                    "a publish before the last one's content"
                );
                c.content = Some((p, None, Vec::new()));
            }
            AMQPFrame::Header(ch, header) => {
                let c = self.pubch.as_mut().filter(|c| c.ch == ch);
                let content = c.and_then(|c| c.content.as_mut());
                let content = content.expect("a content header without its publish");
                assert!(content.1.is_none(), "two content headers");
                content.1 = Some(header);
                self.arrived(model, rng);
            }
            AMQPFrame::Body(ch, body) => {
                let c = self.pubch.as_mut().filter(|c| c.ch == ch);
                let content = c.and_then(|c| c.content.as_mut());
                let content = content.expect("a content body without its publish");
                assert!(content.1.is_some(), "a body before its header");
                content.2.extend_from_slice(&body);
                self.arrived(model, rng);
            }
            other => panic!("the client sent a frame a broker does not expect: {other:?}"),
        }
    }

    fn on_connection(&mut self, m: connection::AMQPMethod, model: &mut Model) {
        match m {
            connection::AMQPMethod::StartOk(s) => {
                assert!(s.mechanism.as_str() == "PLAIN", "mechanism {}", s.mechanism);
                self.asked += 1;
                if self.secure {
                    self.secure = false;
                    let challenge = LongString::from("prove it");
                    let secure = connection::Secure { challenge };
                    self.send_method(0, conn_method(connection::AMQPMethod::Secure(secure)));
                } else {
                    self.tune();
                }
            }
            connection::AMQPMethod::SecureOk(_) => {
                self.asked += 1;
                self.tune();
            }
            connection::AMQPMethod::TuneOk(t) => {
                assert_eq!(t.frame_max, self.frame_max, "the agreed frame_max");
                assert_eq!(t.heartbeat, self.heartbeat, "the agreed heartbeat");
            }
            connection::AMQPMethod::Open(_) => {
                self.asked += 1;
                let ok = connection::OpenOk {};
                self.send_method(0, conn_method(connection::AMQPMethod::OpenOk(ok)));
            }
            connection::AMQPMethod::Close(c) => {
                if c.reply_code != 200 || !model.client_closed {
                    assert!(model.ends.contains(&End::Protocol(c.reply_code)), "{c:?}");
                }
                self.client_closing = true;
                self.send_method(
                    0,
                    conn_method(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.write_all();
                self.hang_up();
            }
            other => panic!("the client sent {other:?}"),
        }
    }

    fn tune(&mut self) {
        let tune = connection::Tune {
            channel_max: self.channel_max,
            frame_max: self.frame_max,
            heartbeat: self.heartbeat,
        };
        self.send_method(0, conn_method(connection::AMQPMethod::Tune(tune)));
    }

    fn on_channel(&mut self, ch: u16, m: channel::AMQPMethod, model: &mut Model) {
        let ok = |m| AMQPClass::Channel(m);
        match m {
            channel::AMQPMethod::Open(_) if ch == 1 => {
                assert!(!self.control_open, "channel 1 opened twice");
                self.control_open = true;
                self.send_method(1, ok(channel::AMQPMethod::OpenOk(channel::OpenOk {})));
            }
            channel::AMQPMethod::Open(_) => {
                if let Some(p) = &self.pubch {
                    assert!(
                        p.closed,
                        "channel {ch} opened while channel {} is open",
                        p.ch
                    );
                }
                assert!(
                    self.channel_max == 0 || ch <= self.channel_max,
                    "channel {ch} over channel_max {}",
                    self.channel_max
                );
                assert!(
                    self.opens < model.gens.len(),
                    "a channel the client did not open"
                );
                self.pubch = Some(PubChannel {
                    ch,
                    gen: self.opens,
                    confirm: false,
                    closing: false,
                    closed: false,
                    received: 0,
                    pending: BTreeMap::new(),
                    content: None,
                });
                self.opens += 1;
                self.send_method(ch, ok(channel::AMQPMethod::OpenOk(channel::OpenOk {})));
            }
            channel::AMQPMethod::Close(_) => {
                if ch == 1 {
                    self.control_open = false;
                } else {
                    let p = self.pubch.as_mut().filter(|p| p.ch == ch && !p.closed);
                    let p = p.expect("closing a channel that is not open");
                    p.closed = true;
                }
                // Also when it crosses the broker's own close (AMQP 0-9-1 §2.2.4).
                self.send_method(ch, ok(channel::AMQPMethod::CloseOk(channel::CloseOk {})));
            }
            channel::AMQPMethod::CloseOk(_) => {
                if ch != 1 {
                    let p = self.pubch.as_mut().filter(|p| p.ch == ch && p.closing);
                    let p = p.expect("close-ok for a close the broker did not send");
                    p.closed = true;
                }
            }
            other => panic!("the client sent {other:?} on channel {ch}"),
        }
    }

    /// A publish whose content is complete: checked against the client's, given
    /// its tag, returned (now) or not, and its confirm decided.
    fn arrived(&mut self, model: &mut Model, rng: &mut StdRng) {
        let Some(c) = self.pubch.as_mut() else {
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
        if c.closing {
            // Content completed after the broker's close is dropped.
            return;
        }
        c.received += 1;
        let tag = c.received;
        let gen = &mut model.gens[c.gen];
        let msg = gen
            .msgs
            .get_mut((tag - 1) as usize)
            .unwrap_or_else(|| panic!("the broker read tag {tag} the client never published"));
        assert_eq!(
            publish.exchange.as_str(),
            msg.exchange,
            "exchange of tag {tag}"
        );
        assert_eq!(
            publish.routing_key.as_str(),
            msg.routing_key,
            "routing key of tag {tag}"
        );
        assert!(publish.mandatory, "publishes are mandatory");
        assert!(
            header.properties == msg.properties,
            "properties of tag {tag}"
        );
        assert!(
            body == msg.body,
            "the body of tag {tag} ({} bytes) differs",
            body.len()
        );
        msg.body = Vec::new();
        let ack = rng.gen_bool(0.9);
        c.pending.insert(tag, ack);
        if rng.gen_bool(0.15) {
            msg.returned = true;
            let (ch, gen) = (c.ch, c.gen);
            model.returns.push_back((gen, tag));
            self.send_return(ch, publish, header, &body, rng);
        }
    }
}

fn conn_method(m: connection::AMQPMethod) -> AMQPClass {
    AMQPClass::Connection(m)
}

fn channel_close(code: u16, text: &str) -> AMQPClass {
    AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
        reply_code: code,
        reply_text: ShortString::from(text),
        class_id: 0,
        method_id: 0,
    }))
}

fn start() -> AMQPClass {
    conn_method(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: FieldTable::default(),
        mechanisms: LongString::from("PLAIN AMQPLAIN"),
        locales: LongString::from("en_US"),
    }))
}
