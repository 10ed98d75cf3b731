//! What the broker sent back, handed to the engine: confirms, returns (matched by
//! their own headers), a closed channel (a 404 or 403 of an exchange an event chose
//! is that event's problem, `amqp/destinations.rs`), blocked and unblocked; and the
//! counters, latency and traces of what settled.

use opentelemetry::KeyValue;

use super::{now_micros, Runner};
use crate::amqp::connection::{ConnError, Event, Returned as Return};
use crate::amqp::engine::{Failure, Returned, Settled, Target};
use crate::amqp::message::{returned_key, OutboundMessage};
use crate::status;

impl Runner {
    pub(super) fn on_io(&mut self, io: Result<Vec<Event>, ConnError>) {
        let events = match io {
            Ok(events) => events,
            Err(error) => {
                self.status.set_last_answer(error.to_string());
                self.channel_failed(Failure::Connection(error.to_string()));
                return;
            }
        };
        for event in events {
            match event {
                Event::Confirm { tag, ack } => {
                    if !ack {
                        self.report.nacked += 1;
                        metrics::counter!(status::EVENTS_NACKED).increment(1);
                        self.status
                            .set_last_answer("a nack (the broker did not take a message)");
                    }
                    self.engine.confirmed(tag, ack);
                }
                Event::Return(returned) => {
                    let returned = self.returned(*returned);
                    self.engine.returned(returned);
                }
                Event::ChannelClosed { code, text } => self.channel_closed(code, text),
                Event::ChannelError(text) => {
                    self.status.set_last_answer(text.clone());
                    self.channel_failed(Failure::Channel { code: None, text });
                }
                Event::Blocked(reason) => {
                    if !self.blocked {
                        tracing::warn!(%reason, "rabbitmq blocked publishing (resource alarm); holding the watermark until it unblocks");
                    }
                    self.status
                        .set_last_answer(format!("connection.blocked ({reason})"));
                    self.blocked = true;
                    self.status.set_blocked(true);
                }
                Event::Unblocked => {
                    if self.blocked {
                        tracing::info!("rabbitmq unblocked publishing; resuming");
                    }
                    self.blocked = false;
                    self.status.set_blocked(false);
                }
            }
        }
        self.count_settled();
    }

    /// The broker closed the publishing channel. A 404 (no such exchange) or 403
    /// (access refused) naming an exchange an event chose refuses that exchange:
    /// it is declared once more, and a second refusal makes its events poison. The
    /// configured exchange and the dead-letter exchange are the operator's: an
    /// outage, retried.
    fn channel_closed(&mut self, code: u16, text: String) {
        self.status
            .set_last_answer(format!("the channel closed by the broker ({code}) {text}"));
        if matches!(code, 403 | 404) {
            let named = self
                .destinations
                .named_in(&text)
                .or_else(|| self.sole_publish_exchange());
            if let Some(name) = named {
                let why = format!(
                    "the broker refused a publish to its exchange {:?} ({code}) {}, also after declaring it again; {}",
                    outbox_event::redact::printable(&name),
                    outbox_event::redact::printable(&text),
                    if code == 403 {
                        "grant the relay's user write on it, or fix the row (docs/security.md)"
                    } else {
                        "it was deleted, or is not the exchange declared (docs/routing.md)"
                    }
                );
                if self.destinations.publish_refused(&name, &why) {
                    tracing::warn!(exchange = %outbox_event::redact::printable(&name), code, reason = %outbox_event::redact::printable(&text),
                        "the broker refused a publish to an exchange an event chose; declaring it once more before its next publish, its events are poison if refused again (docs/routing.md)");
                }
            }
        }
        self.channel_failed(Failure::Channel {
            code: Some(code),
            text: format!("({code}) {text}"),
        });
    }

    /// The exchange of the one publish outstanding, when it is an event's own (a
    /// refusal that names no exchange is then that publish's).
    fn sole_publish_exchange(&self) -> Option<String> {
        let seq = self.engine.sole_publish()?;
        let message = self.engine.message(seq)?;
        let name = message.exchange.as_ref()?;
        (name != &self.exchange).then(|| name.to_string())
    }

    /// A returned message, identified by its own headers (never by the confirm it
    /// arrived on: see `engine.rs`).
    fn returned(&mut self, r: Return) -> Returned {
        let Return {
            reply_text: reply,
            exchange,
            routing_key,
            properties,
            ..
        } = r;
        let target = match &self.dead_letter {
            Some(dlx) if dlx.as_str() == exchange => Target::DeadLetter,
            _ => Target::Exchange,
        };
        let key = returned_key(&properties);
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if self.dead_letter.is_none() || target == Target::DeadLetter {
            tracing::debug!(%exchange, %routing_key, %message_id, %reply, "message returned unroutable");
            self.status.set_last_answer(format!(
                "a return: unroutable (exchange {exchange:?}, routing key {:?}; bind a queue or set dead_letter_exchange)",
                outbox_event::redact::printable(&routing_key)
            ));
        }
        Returned {
            key,
            target,
            exchange,
            routing_key,
        }
    }

    fn count_settled(&mut self) {
        let now = now_micros();
        for settled in self.engine.take_settled() {
            match settled {
                Settled::Acked { message, target } => {
                    let latency = now.saturating_sub(message.event.commit_time_micros);
                    metrics::histogram!(status::PUBLISH_LATENCY)
                        .record(latency.max(0) as f64 / 1e6);
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        trace_published(&message);
                    }
                    self.report.acked += 1;
                    metrics::counter!(status::EVENTS_ACKED).increment(1);
                    if target == Target::DeadLetter {
                        self.report.dead_lettered += 1;
                        metrics::counter!(status::EVENTS_DEAD_LETTERED).increment(1);
                    }
                    if let Some(span) = &message.trace {
                        if target == Target::DeadLetter {
                            let dlx = self.dead_letter.as_ref().map_or("", |d| d.as_str());
                            span.event(
                                "dead_lettered",
                                vec![KeyValue::new("exchange", dlx.to_string())],
                            );
                        }
                        span.end();
                    }
                    self.failures = 0;
                }
                Settled::Returned { seq } => {
                    if let Some(span) = self.engine.message(seq).and_then(|m| m.trace.as_ref()) {
                        span.event("returned", Vec::new());
                    }
                    self.report.returned += 1;
                    metrics::counter!(status::EVENTS_RETURNED).increment(1);
                }
            }
        }
    }
}

/// One debug event per acked message, with the fields a trace is correlated by.
fn trace_published(message: &OutboundMessage) {
    tracing::debug!(
        message_id = message.message_id(),
        commit_lsn = %message.key().commit_lsn,
        tx_index = message.key().index,
        xid = message.event.xid,
        routing_key = message.routing_key.as_str(),
        "message published"
    );
}
