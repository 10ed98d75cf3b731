//! The scripted RabbitMQ cluster of the publisher's simulation: nodes the relay
//! dials (each up or down, each possibly at its connection limit), the
//! connections on them (`server.rs`), and what the cluster knows: its exchanges,
//! the exchanges the relay's user may not touch, and two queues, the main one (bound
//! to every exchange but the dead-letter one, for every routing key but those
//! ending `.lost`) and the dead-letter queue (bound to `dlx`). It answers
//! declarations and publishes as RabbitMQ 3.10 does, including its quirk of
//! stripping CR and LF from a declared name but not from a published one, and
//! records what the checks read: every delivery, and every refusal.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::protocol::basic;
use amq_protocol::types::AMQPValue;
use rand::rngs::StdRng;
use rand::Rng;
use tokio::time::Instant;

use super::server::{Phase, Request, Server};
use crate::amqp::engine::EventKey;
use crate::amqp::message::returned_key;

/// The dead-letter exchange's name in every schedule that has one.
pub(super) const DLX: &str = "dlx";

/// A message a queue holds.
#[derive(Debug, Clone)]
pub(super) struct Delivery {
    pub key: EventKey,
    /// The `x-outbox-error` header of a dead-letter copy.
    pub error: Option<String>,
    pub exchange: String,
    /// In the dead-letter queue (else the main one).
    pub dead: bool,
}

#[derive(Debug, Default)]
pub(super) struct Node {
    pub down_until: Option<Instant>,
    /// The next opens refused with 530 (the user's connection limit).
    pub limit: u32,
    pub frame_max: u32,
    pub heartbeat: u16,
}

impl Node {
    pub(super) fn up(&self) -> bool {
        self.down_until.is_none_or(|t| Instant::now() >= t)
    }
}

/// The cluster; see the module docs.
#[derive(Default)]
pub(super) struct Cluster {
    pub nodes: Vec<Node>,
    pub conns: Vec<Server>,
    /// Exchanges: name → type.
    pub exchanges: BTreeMap<String, String>,
    /// Exchanges the relay's user may neither declare nor publish to (403).
    pub forbidden: BTreeSet<String>,
    /// What the two queues received, in the order they received it.
    pub deliveries: Vec<Delivery>,
    /// Publishes the broker read, per event (copies to the DLX included).
    pub published: HashMap<EventKey, usize>,
    /// Events the broker refused once at least (nack, return, channel closed for
    /// them): such an event may be overtaken.
    pub refused: BTreeSet<EventKey>,
    /// Exchanges the broker refused a declaration of, or a publish to (404, 403,
    /// 406): an event of such an exchange may be poison.
    pub refused_exchanges: BTreeSet<String>,
    /// Names the relay declared or checked (the per-event bound counts them).
    pub declared: BTreeSet<String>,
    /// Dials, opens, declarations and publishes read: the relay is doing something.
    pub activity: u64,
    pub p_nack: f64,
    /// Bytes moved by connections that are gone.
    pub gone_moved: usize,
    /// Protocol violations seen on connections that are gone.
    pub violations: Vec<String>,
}

impl Cluster {
    /// A connection to `node`: the server's end of a fresh socket pair, or a
    /// refusal while the node is down.
    pub(super) fn dial(&mut self, node: usize, server: UnixStream) -> Result<(), String> {
        self.activity += 1;
        let n = &self.nodes[node];
        if !n.up() {
            return Err("connection refused (the node is down)".into());
        }
        self.conns
            .push(Server::new(server, node, n.frame_max, n.heartbeat));
        Ok(())
    }

    /// One round of I/O for every connection: a read of up to `read` bytes, the
    /// requests it brought answered, heartbeats, a write of up to `write` bytes.
    pub(super) fn io(&mut self, rng: &mut StdRng, read: usize, write: usize) {
        for i in 0..self.conns.len() {
            if !self.conns[i].open() {
                continue;
            }
            self.conns[i].read(read);
            if !self.conns[i].silent() {
                self.serve(i, rng);
            }
            self.conns[i].heartbeats();
            self.conns[i].write(write);
        }
        for c in self.conns.iter_mut().filter(|c| !c.open()) {
            self.gone_moved += c.moved;
            self.violations.append(&mut c.violations);
        }
        self.conns.retain(Server::open);
    }

    fn serve(&mut self, i: usize, rng: &mut StdRng) {
        while let Some(request) = self.conns[i].requests.pop_front() {
            if !self.conns[i].open() {
                return;
            }
            match request {
                Request::Open => self.open(i),
                Request::Declare { ch, declare } => {
                    if self.conns[i].channel_live(ch) {
                        self.declare(i, ch, declare)
                    }
                }
                Request::Publish {
                    ch,
                    tag,
                    publish,
                    header,
                    body,
                } => {
                    if self.conns[i].channel_live(ch) {
                        self.publish(i, ch, tag, publish, *header, &body, rng)
                    }
                }
            }
            if self.conns[i].silent() {
                return;
            }
        }
    }

    fn open(&mut self, i: usize) {
        self.activity += 1;
        let node = self.conns[i].node;
        if self.nodes[node].limit > 0 {
            self.nodes[node].limit -= 1;
            self.conns[i].close(
                530,
                "NOT_ALLOWED - access to vhost '/' refused for user 'guest': connection limit (1) is reached",
            );
            return;
        }
        self.conns[i].open_ok();
    }

    fn declare(&mut self, i: usize, ch: u16, d: amq_protocol::protocol::exchange::Declare) {
        self.activity += 1;
        // RabbitMQ takes CR and LF out of a declared name (and nothing else).
        let name: String = d
            .exchange
            .as_str()
            .chars()
            .filter(|c| *c != '\r' && *c != '\n')
            .collect();
        let refuse = |code, text: String| (code, text);
        let refusal = if d.passive {
            (!self.exchanges.contains_key(&name)).then(|| {
                refuse(
                    404,
                    format!("NOT_FOUND - no exchange '{name}' in vhost '/'"),
                )
            })
        } else if self.forbidden.contains(&name) {
            Some(refuse(
                403,
                format!("ACCESS_REFUSED - access to exchange '{name}' in vhost '/' refused for user 'guest'"),
            ))
        } else {
            match self.exchanges.get(&name) {
                Some(kind) if kind != d.kind.as_str() => Some(refuse(
                    406,
                    format!("PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in vhost '/': received '{}' but current is '{kind}'", d.kind),
                )),
                _ => None,
            }
        };
        match refusal {
            Some((code, text)) => {
                self.refused_exchanges.insert(d.exchange.to_string());
                self.conns[i].close_channel(ch, code, &text, 40, 10);
            }
            None => {
                // Declared or checked: both count against the relay's bound.
                self.declared.insert(d.exchange.to_string());
                if !d.passive {
                    self.exchanges
                        .entry(name)
                        .or_insert_with(|| d.kind.to_string());
                }
                self.conns[i].declare_ok(ch);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn publish(
        &mut self,
        i: usize,
        ch: u16,
        tag: u64,
        publish: basic::Publish,
        header: AMQPContentHeader,
        body: &[u8],
        rng: &mut StdRng,
    ) {
        self.activity += 1;
        let key = returned_key(&header.properties).expect("every publish names its event");
        *self.published.entry(key).or_default() += 1;
        let exchange = publish.exchange.to_string();
        let refusal = if !self.exchanges.contains_key(&exchange) {
            Some((
                404,
                format!("NOT_FOUND - no exchange '{exchange}' in vhost '/'"),
            ))
        } else if self.forbidden.contains(&exchange) {
            Some((
                403,
                format!("ACCESS_REFUSED - access to exchange '{exchange}' in vhost '/' refused for user 'guest'"),
            ))
        } else if exchange != DLX && publish.routing_key.as_str().ends_with(".poison") {
            Some((406, "PRECONDITION_FAILED - message refused".to_string()))
        } else {
            None
        };
        if let Some((code, text)) = refusal {
            if code != 406 {
                self.refused_exchanges.insert(exchange);
            }
            self.refused.insert(key);
            self.conns[i].close_channel(ch, code, &text, 60, 40);
            return;
        }
        let to_dlx = exchange == DLX;
        let lost = !to_dlx && publish.routing_key.as_str().ends_with(".lost");
        let ack = !rng.gen_bool(self.p_nack);
        if lost {
            self.refused.insert(key);
            self.conns[i].send_return(ch, &publish, header, body);
        } else if ack {
            self.deliveries.push(Delivery {
                key,
                error: header_text(&header, "x-outbox-error"),
                exchange,
                dead: to_dlx,
            });
        } else {
            self.refused.insert(key);
        }
        if tag > 0 {
            self.conns[i].decide(ch, tag, ack || lost);
        }
    }

    /// Sends some of one connection's decided confirms.
    pub(super) fn confirm(&mut self, rng: &mut StdRng) {
        let live: Vec<usize> = (0..self.conns.len())
            .filter(|i| {
                self.conns[*i].open() && !self.conns[*i].silent() && self.conns[*i].pending() > 0
            })
            .collect();
        if live.is_empty() {
            return;
        }
        let i = live[rng.gen_range(0..live.len())];
        let count = [1, 2, 5, 1000][rng.gen_range(0..4)];
        let multiple = rng.gen_bool(0.5);
        let zero = rng.gen_bool(0.3);
        self.conns[i].confirm(count, multiple, zero);
    }

    /// Every decided confirm, sent (the end of a schedule).
    pub(super) fn confirm_all(&mut self) {
        for c in &mut self.conns {
            if c.open() && !c.silent() {
                c.confirm(usize::MAX, false, false);
            }
        }
    }

    /// Bytes the connections moved so far (while it grows, they are busy).
    pub(super) fn moved(&self) -> usize {
        self.gone_moved + self.conns.iter().map(|c| c.moved).sum::<usize>()
    }

    /// Connections past the handshake.
    pub(super) fn running(&self) -> Vec<usize> {
        (0..self.conns.len())
            .filter(|i| self.conns[*i].open() && self.conns[*i].phase == Phase::Running)
            .collect()
    }

    /// Every fault over: nodes up and under their limit, nobody blocked or silent,
    /// flow on.
    pub(super) fn heal(&mut self) {
        for n in &mut self.nodes {
            n.down_until = None;
            n.limit = 0;
        }
        for c in &mut self.conns {
            c.silent_until = None;
            c.blocked_until = None;
            c.set_blocked(false);
            if c.flow_until.take().is_some() {
                c.flow(true);
            }
        }
    }

    /// Whether a fault is going on now (a node down, a connection blocked or silent).
    pub(super) fn faulty(&self) -> bool {
        self.nodes.iter().any(|n| !n.up() || n.limit > 0)
            || self
                .conns
                .iter()
                .any(|c| c.open() && (c.blocked || c.silent() || c.flow_until.is_some()))
    }

    /// Ends every fault whose time is up (blocked connections unblock, nodes come
    /// back).
    pub(super) fn tick(&mut self) {
        let now = Instant::now();
        for c in &mut self.conns {
            if c.blocked_until.is_some_and(|t| now >= t) {
                c.blocked_until = None;
                c.set_blocked(false);
            }
            if c.flow_until.is_some_and(|t| now >= t) {
                c.flow_until = None;
                c.flow(true);
            }
        }
        for n in &mut self.nodes {
            if n.down_until.is_some_and(|t| now >= t) {
                n.down_until = None;
            }
        }
    }

    /// Takes a node down for `d`: its connections end at once.
    pub(super) fn node_down(&mut self, node: usize, d: Duration) {
        self.nodes[node].down_until = Some(Instant::now() + d);
        for c in &mut self.conns {
            if c.node == node {
                c.hang_up();
            }
        }
    }
}

fn header_text(header: &AMQPContentHeader, key: &str) -> Option<String> {
    match header.properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}
