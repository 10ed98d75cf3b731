//! The stream target (docs/streams.md), one module per topic: end to end (`stream`),
//! against a broker that refuses, enforces a frame maximum or truncates
//! (`stream_limits`), and in the deployments operators run (`stream_sources`);
//! logical messages as events exactly once into a stream (`messages`); a span per
//! event exported over OTLP (`tracing`); filter values per message, or the refusal of a
//! broker before RabbitMQ 3.13 (`filter`).
//!
//! The modules run in parallel in one process. None changes anything shared: each
//! test has its own stream; the frame maximum is lowered and frames are refused by a
//! proxy of the test's own (`testkit::stream_proxy`), never on the broker; the
//! Postgres clusters `stream_sources` crashes and promotes are its own
//! (`support::clusters`, free ports).
#![allow(clippy::unwrap_used)]

mod filter;
mod messages;
mod stream;
mod stream_limits;
mod stream_sources;
mod tracing;
