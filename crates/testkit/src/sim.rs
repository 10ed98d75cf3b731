//! The seeded simulations' one runner (the publisher's engine, its connection, its
//! whole publishing loop, and the stream target each have a simulation; they run
//! their schedules through this). One set of environment variables for all of them:
//!
//! - `OUTBOX_SIM_SEED=<seed>`: replay one schedule (with `OUTBOX_SIM_STEPS=<n>`, its
//!   first `n` steps, for the simulations that take a step limit);
//! - `OUTBOX_SIM_SCHEDULES=<n>`: run `n` schedules instead of the test's default;
//! - `OUTBOX_SIM_SURVEY=1`: run every schedule and list each failing one, instead of
//!   stopping at the first.
//!
//! A failing schedule panics with the seed, the shortest prefix of its steps that
//! still fails (when the simulation takes a step limit: found by bisection) and the
//! command that replays it.

use std::any::Any;
use std::panic::AssertUnwindSafe;

/// One simulation's schedules.
pub struct Schedules<'a> {
    /// What replays it: `cargo test -p <crate> --lib <test path>`.
    pub test_path: &'a str,
    pub krate: &'a str,
    /// Its seeds start here.
    pub base: u64,
    /// How many run in `cargo test`.
    pub default: u64,
    /// Runs one schedule (`Some(n)`: at most its first `n` steps, when the
    /// simulation takes a limit; see [`Schedules::steps`]).
    pub run: &'a dyn Fn(u64, Option<usize>),
    /// The most steps a schedule of this simulation takes, when it takes a step
    /// limit: failing seeds are then shrunk to their shortest failing prefix.
    pub steps: Option<usize>,
}

/// The text of a panic's payload.
pub fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

impl Schedules<'_> {
    /// Runs the schedules, or the one `OUTBOX_SIM_SEED` names; see the module docs.
    pub fn run(&self) {
        let limit = env_number::<usize>("OUTBOX_SIM_STEPS");
        if let Some(seed) = env_number::<u64>("OUTBOX_SIM_SEED") {
            (self.run)(seed, limit);
            return;
        }
        let schedules = env_number::<u64>("OUTBOX_SIM_SCHEDULES").unwrap_or(self.default);
        let survey = std::env::var_os("OUTBOX_SIM_SURVEY").is_some();
        let mut failed = Vec::new();
        for seed in self.base..self.base + schedules {
            let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| (self.run)(seed, None)))
            else {
                continue;
            };
            let msg = panic_text(&*panic);
            if survey {
                failed.push(format!("{seed}: {msg}"));
                continue;
            }
            let prefix = self
                .shortest(seed)
                .map_or(String::new(), |s| format!(" OUTBOX_SIM_STEPS={s}"));
            panic!(
                "schedule failed: {msg}\nreproduce: OUTBOX_SIM_SEED={seed}{prefix} cargo test -p {} --lib {}",
                self.krate, self.test_path
            );
        }
        assert!(
            failed.is_empty(),
            "{} of {schedules} schedules failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }

    /// The shortest prefix of schedule `seed` that still fails, by bisection.
    fn shortest(&self, seed: u64) -> Option<usize> {
        let most = self.steps?;
        let fails = |limit| {
            std::panic::catch_unwind(AssertUnwindSafe(|| (self.run)(seed, Some(limit)))).is_err()
        };
        if !fails(most) {
            return None;
        }
        let (mut lo, mut hi) = (0usize, most);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if fails(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A schedule fails from step 7 on: the runner names the seed and the shortest
    /// failing prefix.
    #[test]
    fn a_failing_seed_is_named_with_its_shortest_prefix() {
        let run = |seed: u64, limit: Option<usize>| {
            let steps = limit.unwrap_or(40);
            assert!(!(seed == 3 && steps >= 7), "seed 3 fails at step 7");
        };
        let schedules = Schedules {
            test_path: "x::y",
            krate: "k",
            base: 0,
            default: 5,
            run: &run,
            steps: Some(40),
        };
        let panic =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| schedules.run())).unwrap_err();
        let text = panic_text(&*panic);
        assert!(
            text.contains("OUTBOX_SIM_SEED=3 OUTBOX_SIM_STEPS=7"),
            "{text}"
        );
        assert!(text.contains("cargo test -p k --lib x::y"), "{text}");
    }
}
