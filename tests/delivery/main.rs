//! Delivery to an exchange end to end, one module per topic: what arrives (`e2e`),
//! retention, log correlation and URL lists (`around`), CloudEvents (`cloudevents`),
//! logical messages (`messages`), an exchange per event (`routing`), broker refusals during a restart (`broker_restart`), dead letters, a held slot and
//! a nack storm (`broker_shapes`), and operating the relay (`observability`).
//!
//! The modules run in parallel in one process. One test changes the broker for
//! everyone: `observability::refused` lowers RabbitMQ's `max_message_size`
//! (`testkit::amqp::MaxMessageSize`). It holds [`testkit::BROKER`] for writing and
//! every other test here holds it for reading, so none of them overlaps it. The rest
//! is each test's own: vhosts (`broker_restart`), exchanges, queues, users, roles,
//! proxies and listeners on free ports.
#![allow(clippy::unwrap_used)]

mod around;
mod broker_restart;
mod broker_shapes;
mod cloudevents;
mod e2e;
mod messages;
mod observability;
mod routing;
mod tracing;
