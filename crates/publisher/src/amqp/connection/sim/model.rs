//! What the connection may report, as the simulation knows it: every publish the
//! client made on each channel, what the broker decided and sent for it, and the
//! notices and the end of the connection the broker sent. Every event the
//! connection hands out is checked against it ([`Model::take`]); once everything
//! sent has been read, [`Model::check_delivered`] checks that nothing was lost.

use std::collections::VecDeque;

use amq_protocol::protocol::BasicProperties;

use super::super::{ConnError, Event};

/// One publish the client made.
pub(super) struct Msg {
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) properties: BasicProperties,
    /// Emptied once the broker compared what it read with it.
    pub(super) body: Vec<u8>,
    /// The broker sent its confirm: ack (`true`) or nack.
    pub(super) decided: Option<bool>,
    /// The broker sent a `basic.return` for it.
    pub(super) returned: bool,
    /// The client handed out its confirm / its return.
    pub(super) confirmed: bool,
    pub(super) return_seen: bool,
}

/// One publishing channel of the client (one `open_channel`): its tags are the
/// indexes of `msgs` from 1.
#[derive(Default)]
pub(super) struct Gen {
    pub(super) msgs: Vec<Msg>,
    /// The broker sent `channel.close` with this code and text.
    pub(super) broker_closed: Option<(u16, String)>,
    /// The client handed out `Event::ChannelClosed`.
    pub(super) closed_seen: bool,
    /// The client closed it (`close_channel`).
    pub(super) client_closed: bool,
    /// The broker confirmed a tag never published on it; the client said so
    /// (`Event::ChannelError`) and closed it.
    pub(super) bad_tag: bool,
    pub(super) error_seen: bool,
}

/// How the broker ended the connection.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum End {
    /// `connection.close` with this code and text.
    Closed(u16, String),
    /// A protocol violation the client must close with this code.
    Protocol(u16),
    /// The broker's socket was closed.
    Eof,
}

#[derive(Default)]
pub(super) struct Model {
    pub(super) gens: Vec<Gen>,
    /// The returns the broker sent, in order: (channel generation, tag).
    pub(super) returns: VecDeque<(usize, u64)>,
    /// `connection.blocked` (its reason) and `unblocked` (`None`) sent, not yet
    /// handed out.
    pub(super) notices: VecDeque<Option<String>>,
    /// Blocked as the broker last said, and as the client last handed out: notices
    /// alternate, and a blocked and unblocked both read before the client hands
    /// them out cancel out (a flood keeps at most one waiting).
    pub(super) broker_blocked: bool,
    pub(super) client_blocked: bool,
    /// The ways the broker ended the connection (the client reports one).
    pub(super) ends: Vec<End>,
    /// The client's `poll_io` reported the end of the connection.
    pub(super) reported: Option<ConnError>,
    /// A request returned the end of the connection (it counts as reported).
    pub(super) request_saw_end: bool,
    /// The client closed the connection itself (`close`).
    pub(super) client_closed: bool,
}

impl Model {
    pub(super) fn end(&mut self, end: End) {
        self.ends.push(end);
    }

    /// The current channel generation.
    pub(super) fn current(&self) -> usize {
        self.gens.len().checked_sub(1).expect("no channel opened")
    }

    /// Checks the events `poll_io` handed out, in order (invariants (a) and (b)).
    pub(super) fn take(&mut self, events: Vec<Event>) {
        for event in events {
            match event {
                Event::Confirm { tag, ack } => self.confirm(tag, ack),
                Event::Return(r) => {
                    let g = self.current();
                    while matches!(self.returns.front(), Some((rg, _)) if *rg < g) {
                        self.returns.pop_front();
                    }
                    let (rg, tag) = self
                        .returns
                        .pop_front()
                        .unwrap_or_else(|| panic!("a return the broker never sent: {r:?}"));
                    let msg = &mut self.gens[rg].msgs[(tag - 1) as usize];
                    assert!(!msg.confirmed, "tag {tag} returned after its confirm");
                    assert_eq!(
                        (r.reply_code, &r.exchange, &r.routing_key),
                        (312, &msg.exchange, &msg.routing_key),
                        "the return of tag {tag}"
                    );
                    assert!(
                        r.properties == msg.properties,
                        "the return of tag {tag} lost properties: {:?} != {:?}",
                        r.properties,
                        msg.properties
                    );
                    msg.return_seen = true;
                }
                Event::ChannelClosed { code, text } => {
                    let g = self.current();
                    let gen = &mut self.gens[g];
                    assert_eq!(
                        gen.broker_closed.as_ref(),
                        Some(&(code, text.clone())),
                        "a channel close the broker did not send ({code} {text})"
                    );
                    assert!(!gen.closed_seen, "the channel close handed out twice");
                    gen.closed_seen = true;
                }
                Event::Blocked(reason) => {
                    assert!(!self.client_blocked, "blocked twice in a row");
                    assert_eq!(reason, "low on memory", "blocked");
                    self.client_blocked = true;
                    self.notices.clear();
                }
                Event::Unblocked => {
                    assert!(self.client_blocked, "unblocked twice in a row");
                    self.client_blocked = false;
                    self.notices.clear();
                }
                Event::ChannelError(text) => {
                    let g = self.current();
                    let gen = &mut self.gens[g];
                    assert!(gen.bad_tag, "a channel error without a bad confirm: {text}");
                    assert!(!gen.error_seen, "the channel error handed out twice");
                    gen.error_seen = true;
                }
            }
        }
    }

    fn confirm(&mut self, tag: u64, ack: bool) {
        let g = self.current();
        let gen = &mut self.gens[g];
        assert!(
            !gen.closed_seen && !gen.error_seen,
            "a confirm of tag {tag} after the channel closed"
        );
        let published = gen.msgs.len();
        let msg = usize::try_from(tag)
            .ok()
            .and_then(|t| t.checked_sub(1))
            .and_then(|i| gen.msgs.get_mut(i))
            .unwrap_or_else(|| {
                panic!("a confirm of tag {tag}, never published on the channel ({published} were)")
            });
        assert!(!msg.confirmed, "tag {tag} confirmed twice");
        assert_eq!(
            msg.decided,
            Some(ack),
            "tag {tag} reported {} but the broker sent {:?}",
            if ack { "acked" } else { "nacked" },
            msg.decided
        );
        assert!(
            !msg.returned || msg.return_seen,
            "tag {tag} confirmed before its return was handed out"
        );
        msg.confirmed = true;
    }

    /// Once everything the broker sent was read and handed out: every confirm of
    /// the open channel, every return, notice, channel close and the end of the
    /// connection reached the client's user.
    pub(super) fn check_delivered(&self, alive: bool) {
        if !self.ends.is_empty() {
            if !self.client_closed {
                assert!(
                    self.reported.is_some() || self.request_saw_end,
                    "the broker ended the connection ({:?}) and the client did not say",
                    self.ends
                );
            }
            return;
        }
        if !alive {
            return;
        }
        assert_eq!(
            self.client_blocked, self.broker_blocked,
            "the last notice lost (sent: {:?})",
            self.notices
        );
        let Some(gen) = self.gens.last() else {
            return;
        };
        if gen.client_closed || gen.bad_tag {
            return;
        }
        if gen.broker_closed.is_some() {
            assert!(
                gen.closed_seen,
                "the broker closed the channel and the client did not say"
            );
        }
        for (i, msg) in gen.msgs.iter().enumerate() {
            if msg.decided.is_some() {
                assert!(
                    msg.confirmed,
                    "tag {} confirmed by the broker, never handed out",
                    i + 1
                );
            }
            if msg.returned {
                assert!(
                    msg.return_seen,
                    "the return of tag {} never handed out",
                    i + 1
                );
            }
        }
    }
}
