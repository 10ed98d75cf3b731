//! End-to-end scenarios parameterised by the Postgres cluster they run against (its
//! port): `delivery/e2e.rs` and `cli/replay.rs` run some of them on the tests' own
//! cluster, `compat/versions.rs` runs every one of them on each supported major
//! (docs/compatibility.md). Each scenario has its own database, slot and exchange.
//! The helpers they share are here, the scenarios in `scenarios/` by what they
//! exercise (delivery, the operator's commands, logical messages), re-exported here.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use testkit::amqp::{Msg, Received};
use testkit::TestDb;

use crate::*;

pub const WAIT: Duration = Duration::from_secs(60);
pub const WINDOW_ENV: &str = "OUTBOX_RELAY_RELAY_REPLAY_WINDOW";

/// `X/Y` → u64, panicking on anything else.
pub fn lsn(text: &str) -> u64 {
    testkit::parse_lsn(text).unwrap_or_else(|| panic!("not an LSN: {text:?}"))
}

pub fn lsn_text(v: u64) -> String {
    format!("{:X}/{:X}", v >> 32, v & 0xFFFF_FFFF)
}

pub use crate::{stderr, stdout};

/// A slot's confirmed_flush_lsn, or None if the slot does not exist.
pub fn confirmed(env: &Env, slot: &str) -> Option<u64> {
    let v = env.db.psql(&format!(
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"
    ));
    (!v.trim().is_empty()).then(|| lsn(&v))
}

/// The temporary slots of `replay` still present.
pub fn replay_slots(env: &Env) -> Vec<String> {
    env.db
        .psql(&format!(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE '{}\\_replay\\_%'",
            env.slot
        ))
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}

/// The replay window's anchor slot.
pub fn anchor(env: &Env) -> String {
    format!("{}_anchor", env.slot)
}

/// Polls until `f` is true, panicking with `what` after WAIT.
pub async fn poll(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn is_replay(m: &Msg) -> bool {
    m.header("replay").as_deref() == Some("true")
}

/// Inserts one transaction of one row with aggregate_id `id`; returns nothing (the
/// commit LSN is read from the delivered message's header).
pub fn insert_one(env: &Env, id: &str) {
    env.insert_tx(&[("t", id, "e", "{}")]);
}

/// The `id` (and so the `message_id`) of row number `n` of [`insert_numbered`].
pub fn numbered_id(n: usize) -> String {
    format!("00000000-0000-0000-0000-{n:012}")
}

/// Inserts rows `from..from + n` in one transaction, in that order, with id
/// [`numbered_id`] and aggregate_id the number.
pub fn insert_numbered(env: &Env, from: usize, n: usize) {
    env.db.psql(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT ('00000000-0000-0000-0000-' || lpad(s.n::text, 12, '0'))::uuid,
                'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
           FROM generate_series({from}, {}) AS s(n) ORDER BY s.n",
        from + n - 1
    ));
}

/// Waits until `n` distinct messages arrived, lets stray copies arrive, and returns
/// everything received.
pub async fn distinct(got: &Received, n: usize) -> Vec<Msg> {
    got.wait_until(WAIT, |m| {
        m.iter()
            .map(|x| x.message_id())
            .collect::<HashSet<_>>()
            .len()
            >= n
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    got.snapshot()
}

/// Stops the relay with SIGTERM and asserts it exits 0.
pub fn stop(relay: Relay) {
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "clean stop exits 0: {log}");
}

mod commands;
mod delivery;
mod messages;

pub use commands::{peek, replay_range, slot_status_and_drop};
pub use delivery::{clean_stop, happy_path, idle_wal, sigkill_restart};
pub use messages::{
    logical_messages, metric, produce_sql, MESSAGES_ENV, MESSAGE_PRODUCER, PRODUCED_IDS,
};
