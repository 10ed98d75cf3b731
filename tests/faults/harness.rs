// Shared by two test binaries (faults, cluster), each using a part of it.
#![allow(dead_code, unused_imports)]
//! The fault suite's world: a database (on the ordinary or the fault cluster), the
//! relay's connections optionally through TCP proxies, a reconnecting consumer that
//! records every delivery, a sampler of the slot's `confirmed_flush_lsn`, and the
//! consumer-side checker.
//!
//! Files: `harness/world.rs` the world (`World`, `Cluster`, `Proxies`);
//! `harness/faults.rs` the faults themselves (the broker stopped, the memory alarm, a
//! Postgres restart) and the background load. The recording consumer, the sampler
//! and the checker are testkit's (`testkit::recording`), as are the broker lock
//! (`testkit::BROKER`) and the Postgres helpers; they are re-exported here under
//! the names the tests use.

use std::time::Duration;

#[path = "harness/faults.rs"]
mod faults;
#[path = "harness/world.rs"]
mod world;

pub use faults::*;
pub use world::*;

pub use testkit::recording::{check, check_grouped, check_with, Consumer, Rec, Report, Sampler};
/// Broker-changing tests (stop_app, memory alarm) take it for writing, every other
/// test for reading, so they never overlap inside this binary (testkit's one lock).
pub use testkit::BROKER;
pub use testkit::{parse_lsn, try_psql};

pub const WAIT: Duration = Duration::from_secs(300);

pub fn insert_sql(from: u64, to: u64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {to}) AS s(n) ORDER BY s.n"
    )
}
