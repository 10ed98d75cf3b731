//! Exchanges chosen by events, on the wire: declared (or, without
//! `declare_exchange`, checked) on the control channel before the first publish to
//! each, as `amqp/destinations.rs` decides. A refusal makes that exchange's events
//! poison; a connection that ends meanwhile is a failure like any other, taken up
//! by the loop at once (`run.rs`).

use amq_protocol::types::ShortString;

use super::Runner;
use crate::amqp::connection::{ConnError, Declare};
use crate::amqp::destinations::Verdict;
use crate::amqp::engine::Failure;

impl Runner {
    /// The exchange of the next message to publish when it is named per event and
    /// must be declared (or checked) first.
    pub(super) fn next_undeclared_exchange(&mut self) -> Option<ShortString> {
        if !self.named_exchanges {
            return None;
        }
        let message = self.engine.peek_next_main()?;
        let name = message.exchange.as_ref()?;
        (self.destinations.verdict(name) == Verdict::Declare).then(|| name.clone())
    }

    /// Declares (or checks) `name` before the first publish to it on this
    /// connection. A refusal makes its messages poison; a lost connection, or a
    /// broker that does not answer within `request_timeout`, fails the channel.
    pub(super) async fn declare_exchange(&mut self, name: ShortString) {
        let how = if self.config.declare_exchange {
            Declare::Active
        } else {
            Declare::Passive
        };
        // An exchange of the declared `[topology]` is declared as configured there
        // (its type, flags and arguments): a plain declaration would be refused.
        let topology = self.config.topology.clone();
        let declared = match topology.as_deref().and_then(|t| t.exchange(name.as_str())) {
            Some(e) => {
                crate::amqp::topology::declare_exchange(&mut self.conn, e, Declare::Active).await
            }
            None => {
                self.conn
                    .declare_exchange(name.as_str(), &self.config.exchange_type, how)
                    .await
            }
        };
        match declared {
            Ok(()) => {
                tracing::debug!(exchange = %name, "exchange ready");
                self.destinations.declared(name);
            }
            Err(ConnError::ChannelClosed { code, text }) => {
                let why = format!(
                    "its exchange {:?} was refused: ({code}) {}; {}",
                    outbox_event::redact::printable(name.as_str()),
                    outbox_event::redact::printable(&text),
                    match code {
                        403 => "grant the relay's user configure (to declare) and write on it (docs/security.md)",
                        406 => "it exists with another type or arguments: delete it, or declare it in [topology] as it is",
                        404 if !self.config.declare_exchange => {
                            "declare it, or set declare_exchange = true"
                        }
                        _ => "see the broker's answer",
                    }
                );
                self.status
                    .set_last_answer(format!("a declaration refused ({code}) {text}"));
                tracing::error!(exchange = %outbox_event::redact::printable(name.as_str()), reason = %why,
                    "an exchange named by an event is refused; its events are poison (docs/routing.md)");
                self.destinations.refuse(name, why);
            }
            Err(e) => {
                self.status.set_last_answer(e.to_string());
                self.channel_failed(Failure::Connection(e.to_string()));
            }
        }
    }
}
