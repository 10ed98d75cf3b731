//! Exponential backoff with jitter, written once for the program: the publisher's
//! retries after a broker failure and the relay's session restarts both use it.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff: `initial * 2^(attempt-1)` capped at `max`, scaled by
/// `jitter` (0.5–1.0).
pub fn backoff(initial: Duration, max: Duration, attempt: u32, jitter: f64) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    let base = initial.saturating_mul(1u32 << exp).min(max);
    base.mul_f64(jitter.clamp(0.0, 1.0))
}

/// A random factor in [0.5, 1.0], so that retries of many clients do not align.
pub fn jitter() -> f64 {
    #[cfg(test)]
    if let Some(j) = sim_jitter::next() {
        return j;
    }
    rand::thread_rng().gen_range(0.5..=1.0)
}

/// The simulations' jitter: seeded, so that a schedule replays exactly.
#[cfg(test)]
pub(crate) mod sim_jitter {
    use std::cell::RefCell;

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    thread_local! {
        static RNG: RefCell<Option<StdRng>> = const { RefCell::new(None) };
    }

    /// Seeds this thread's jitter (`None`: random again).
    pub(crate) fn seed(seed: Option<u64>) {
        RNG.with(|r| *r.borrow_mut() = seed.map(StdRng::seed_from_u64));
    }

    pub(super) fn next() -> Option<f64> {
        RNG.with(|r| r.borrow_mut().as_mut().map(|r| r.gen_range(0.5..=1.0)))
    }
}

/// The delay before retry `attempt` (1-based): [`backoff`] with a random [`jitter`].
pub fn delay(initial: Duration, max: Duration, attempt: u32) -> Duration {
    backoff(initial, max, attempt, jitter())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let i = Duration::from_millis(100);
        let m = Duration::from_secs(2);
        assert_eq!(backoff(i, m, 1, 1.0), Duration::from_millis(100));
        assert_eq!(backoff(i, m, 2, 1.0), Duration::from_millis(200));
        assert_eq!(backoff(i, m, 4, 1.0), Duration::from_millis(800));
        assert_eq!(backoff(i, m, 10, 1.0), m);
        assert_eq!(backoff(i, m, 100, 1.0), m);
        assert_eq!(backoff(i, m, 2, 0.5), Duration::from_millis(100));
    }
}
