//! Fault injection: the real relay binary between Postgres and RabbitMQ while things
//! break, with a consumer that checks what arrived (docs/design.md §1): every committed row
//! present, first occurrences in commit order, duplicates within the bound, rolled
//! back rows absent, and — sampled throughout — the slot's `confirmed_flush_lsn`
//! never past a message the broker had not acked (see `harness::Sampler`).
//!
//! Tests that change the broker for everyone (stop_app, memory alarm) hold
//! `testkit::BROKER` (re-exported as `harness::BROKER`) for writing; all others hold
//! it for reading. Tests that restart or crash Postgres use the fault cluster (55433)
//! and hold `harness::FAULT_PG`.
//! `amqp_edges` (issue 40) follows the same rule: its memory alarm holds `BROKER` for
//! writing, its other tests (own users, exchanges and queues; the node with small
//! frames of scripts/rabbitmq-cluster.sh) for reading; so do its tests of issue 49
//! (exchanges chosen by events, faults through their own proxies, a user limited to
//! one connection).
//! `messages` (issue 42) runs the relay's and Postgres's faults with logical messages
//! in the load, under the same rule (its crashes on the fault cluster, `FAULT_PG`).
//! `control` (issue 44) pauses, resumes and drains a relay under load; its pause
//! across a broker restart holds `BROKER` for writing, the others for reading.
//! docs/reliability.md maps each guarantee to the test that proves it.
#![allow(clippy::unwrap_used)]

#[path = "faults/harness.rs"]
mod harness;

#[path = "faults/kills.rs"]
mod kills;

#[path = "faults/broker.rs"]
mod broker;

#[path = "faults/postgres.rs"]
mod postgres;

#[path = "faults/large.rs"]
mod large;

#[path = "faults/soak.rs"]
mod soak;

#[path = "faults/stream.rs"]
mod stream;

#[path = "faults/aggregate.rs"]
mod aggregate;

#[path = "faults/amqp_edges.rs"]
mod amqp_edges;

#[path = "faults/messages.rs"]
mod messages;

#[path = "faults/control.rs"]
mod control;
