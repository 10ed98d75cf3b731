//! Against a 3-node RabbitMQ cluster (scripts/rabbitmq-cluster.sh; docs/operations.md,
//! "Running against a cluster"): the relay binary, given all three nodes' URLs,
//! publishes a steady load of mixed transaction sizes to a quorum queue (through an
//! exchange) or to a 3-replica stream while nodes die, pause, restart and are cut off.
//! After the faults the consumer's view is checked exactly (docs/design.md §1):
//! - every committed row present, first occurrences in commit order;
//! - duplicates within the documented bound (`max_in_flight` per fault) for the queue,
//!   none for the stream;
//! - the slot's confirmed position never past a message the cluster had not stored
//!   (markers behind the sampled position for the queue, the broker's stored publishing
//!   id at the sampled position for the stream).
//!
//! How long publishing paused at each fault (the longest time the slot's confirmed
//! position stood still while rows were being committed) and the duplicates each
//! fault cost are printed (`fault ...` lines; docs/operations.md has the figures).
//!
//! The tests change the cluster (kill, pause, partition nodes) and restore it on drop
//! ([`nodes::Restore`]) even when they fail; only this binary uses the cluster, and its tests
//! hold [`CLUSTER`] so that they run one at a time. The `heavy_` tests (rolling restart,
//! 20 s partition) are `#[ignore]`d: `cargo test -p outbox-relay-tests --test cluster --
//! --ignored` (docs/reliability.md).
//!
//! Modules: `nodes` (the cluster script, restoring, the relay's node), `load` (the
//! loader and the samplers), `world` (one test's database, queue or stream and relay
//! configuration), `faults` (injecting one and measuring it), and the tests: `queue`
//! (a quorum queue) and `stream` (a 3-replica stream, and its leader).
#![allow(clippy::unwrap_used)]

#[path = "../faults/harness.rs"]
mod harness;

mod faults;
mod load;
mod nodes;
mod queue;
mod stream;
mod world;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use support::stream::{assert_exactly_once, read_stream_at, StreamMsg};
use support::{bin, Relay, OUTBOX_DDL};
use testkit::{unique_name, TestDb};

use harness::{check_with, parse_lsn, try_psql, Consumer, Report, Sampler};

use faults::*;
use load::*;
use nodes::*;
use world::*;

/// Held by every test of this binary: one at a time on the cluster.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MAX_IN_FLIGHT: usize = 1000;
/// The relay's AMQP heartbeat in these tests (`rabbitmq.heartbeat_secs`).
const HEARTBEAT_SECS: u64 = 2;
/// How long a paused node stays stopped: longer than the heartbeat.
const PAUSE: Duration = Duration::from_secs(6);
/// How long a partitioned node stays cut off.
const PARTITION: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL of the node the relay is connected to.
    KillConnected,
    /// SIGKILL of the queue's or stream's leader.
    KillLeader,
    /// SIGSTOP of the node the relay is connected to for [`PAUSE`], then SIGCONT.
    PauseConnected,
    /// Each node stopped cleanly and started again, in turn.
    RollingRestart,
    /// The node the relay is connected to cut off from the other two for [`PARTITION`].
    Partition,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    QuorumQueue,
    Stream,
}
