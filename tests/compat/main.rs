//! The Postgres builds of `scripts/pg-versions.sh` (docs/compatibility.md): the
//! end-to-end scenarios on every supported major (`versions`) and failover on a real
//! standby (`standby_failover`). Both fail, never skip, when the builds are missing.
//!
//! The modules run in parallel in one process. `versions` uses the per-major
//! clusters of `scripts/pg-versions.sh` and restarts none of them; the pairs that
//! `standby_failover` crashes and promotes are its own (`support::clusters`, free
//! ports), so neither disturbs the other. `messages` (logical messages as events on
//! each major) and `emit` (sql/outbox_messages.sql against roles prepared before it)
//! use the per-major clusters as `versions` does, in databases and roles of their own.
#![allow(clippy::unwrap_used)]

mod emit;
mod failover_setup;
mod messages;
mod slot_safety;
mod standby_failover;
mod versions;
