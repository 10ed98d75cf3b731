//! The publisher against the real RabbitMQ (testkit's broker, guest/guest).
//!
//! Every test uses its own exchange and queue names and deletes them at the end.
//! All RabbitMQ tests live in this one binary because one of them
//! (`blocked_broker_freezes_the_watermark`) raises a broker-wide memory alarm: it
//! takes `testkit::BROKER` for writing while every other test holds it for reading,
//! so within this crate it never overlaps another test. Its blocked window is a few
//! seconds, and the alarm is lifted by a guard even if the test panics.
#![allow(clippy::unwrap_used)]

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use outbox_event::{Lsn, WalBatch, WalItem};
use publisher::{Publisher, PublisherConfig};
use support::*;
// The broker lock: this binary holds every RabbitMQ test, so it covers them all.
use testkit::BROKER;

mod connect;
mod failures;
mod messages;
mod publishing;
