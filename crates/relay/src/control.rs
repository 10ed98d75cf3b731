//! Live control of a running relay (`ctl pause|resume|drain`, docs/design.md §9):
//! one state machine, shared by the endpoint that takes the commands and the
//! session loop that obeys them.
//!
//! ```text
//!             pause                    drain
//!   running ─────────► paused(since) ─────────► draining ─► clean stop (exit 0)
//!      ▲    ◄─────────     │                        ▲
//!      │      resume       └─ pause again: no change│
//!      └────────────────────── drain ───────────────┘
//! ```
//!
//! - The pause is a `watch<bool>` every session's reader takes
//!   (`WalReader::with_pause`): the reader finishes the open transaction, hands it
//!   on and stops reading the socket, while status updates go on. The publisher
//!   confirms what it has; the replication connection and the slot stay held. A
//!   broker or Postgres reconnect starts the next session paused, since the flag
//!   outlives sessions. Only the process forgets it: `run --paused` starts paused.
//! - Drain is the clean-stop request of SIGTERM ([`Shutdown`]), with the state
//!   `draining` for `ctl status`; it is final, so pause and resume are refused once
//!   it was asked.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::watch;
use tracing::info;

use crate::shutdown::Shutdown;

/// Where the relay is in its control state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Running,
    /// Publishing stopped at a transaction boundary, since this time.
    Paused {
        since: SystemTime,
    },
    /// Stopping cleanly (`ctl drain`, SIGTERM).
    Draining,
}

impl RunState {
    pub fn name(&self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Paused { .. } => "paused",
            RunState::Draining => "draining",
        }
    }
}

/// A control command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Pause,
    Resume,
    Drain,
}

/// What a command did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The state changed.
    Changed,
    /// The relay already was where the command leads.
    Already,
}

/// A command refused: a sentence naming why and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

/// The pure state machine: `state` and the command give the next state.
pub fn next(
    state: RunState,
    cmd: Command,
    now: SystemTime,
) -> Result<(RunState, Outcome), Refused> {
    use RunState::*;
    match (state, cmd) {
        (Draining, Command::Drain) => Ok((Draining, Outcome::Already)),
        (_, Command::Drain) => Ok((Draining, Outcome::Changed)),
        (Draining, c) => Err(Refused(format!(
            "the relay is draining: it stops after the confirms of what it read, so it cannot {}; start it again (with `run --paused` to start paused)",
            if c == Command::Pause { "pause" } else { "resume" }
        ))),
        (Running, Command::Pause) => Ok((Paused { since: now }, Outcome::Changed)),
        (p @ Paused { .. }, Command::Pause) => Ok((p, Outcome::Already)),
        (Paused { .. }, Command::Resume) => Ok((Running, Outcome::Changed)),
        (Running, Command::Resume) => Ok((Running, Outcome::Already)),
    }
}

/// The relay's control state, cheap to clone: every clone sees the same.
#[derive(Clone)]
pub struct Control {
    state: Arc<Mutex<RunState>>,
    paused: Arc<watch::Sender<bool>>,
    shutdown: Shutdown,
}

impl Control {
    /// Running, or paused from now when `paused` (`run --paused`). Drain requests
    /// `shutdown`.
    pub fn new(paused: bool, shutdown: Shutdown) -> Control {
        let state = if paused {
            RunState::Paused {
                since: SystemTime::now(),
            }
        } else {
            RunState::Running
        };
        Control {
            state: Arc::new(Mutex::new(state)),
            paused: Arc::new(watch::Sender::new(paused)),
            shutdown,
        }
    }

    /// The current state (`draining` as soon as a clean stop was requested, by
    /// `ctl drain` or a signal).
    pub fn state(&self) -> RunState {
        if self.shutdown.is_requested() {
            return RunState::Draining;
        }
        self.state.lock().map(|s| *s).unwrap_or(RunState::Running)
    }

    /// What a session's reader watches: true while paused.
    pub fn pause_watch(&self) -> watch::Receiver<bool> {
        self.paused.subscribe()
    }

    /// Applies `cmd`; logs a change.
    pub fn apply(&self, cmd: Command) -> Result<(RunState, Outcome), Refused> {
        let current = self.state();
        let Ok(mut state) = self.state.lock() else {
            return Err(Refused(
                "the control state is unusable after a panic: restart the relay".into(),
            ));
        };
        let (new, outcome) = next(current, cmd, SystemTime::now())?;
        *state = new;
        drop(state);
        // Draining leaves the readers as they are: a paused one stays at its
        // boundary, and the stop closes it there.
        if new != RunState::Draining {
            self.paused
                .send_replace(matches!(new, RunState::Paused { .. }));
        }
        if outcome == Outcome::Changed {
            match new {
                RunState::Paused { .. } => info!("pause requested: publishing stops at the next transaction boundary; the slot stays held"),
                RunState::Running => info!("resume requested: publishing continues where it stopped"),
                RunState::Draining => {
                    info!("drain requested: stopping at the next transaction boundary after the confirms");
                    self.shutdown.request();
                }
            }
        }
        Ok((new, outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A tiny xorshift generator: the same seed gives the same sequence.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Random command sequences against a model: draining is final and refuses
    /// pause/resume, a repeated pause keeps its start time, the pause flag the
    /// readers watch is true exactly while paused, and drain requests the stop.
    #[test]
    fn random_command_sequences_keep_the_invariants() {
        for seed in 1..=200u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let shutdown = Shutdown::new();
            let start_paused = rng.next() % 2 == 0;
            let control = Control::new(start_paused, shutdown.clone());
            let watch = control.pause_watch();
            let mut draining = false;
            let mut since: Option<SystemTime> = None;
            for step in 0..50 {
                let cmd = match rng.next() % 7 {
                    0..=2 => Command::Pause,
                    3..=5 => Command::Resume,
                    _ => Command::Drain,
                };
                let before = control.state();
                let result = control.apply(cmd);
                let after = control.state();
                let ctx = format!("seed {seed} step {step}: {before:?} + {cmd:?} -> {result:?}");
                if draining {
                    assert_eq!(after, RunState::Draining, "{ctx}");
                    assert_eq!(result.is_err(), cmd != Command::Drain, "{ctx}");
                }
                match (cmd, after) {
                    (Command::Drain, s) => assert_eq!(s, RunState::Draining, "{ctx}"),
                    (Command::Pause, RunState::Paused { since: s }) => {
                        if let Some(first) = since {
                            if matches!(before, RunState::Paused { .. }) {
                                assert_eq!(first, s, "a repeated pause keeps its start: {ctx}");
                            }
                        }
                        since = Some(s);
                    }
                    (Command::Resume, RunState::Running) => since = None,
                    (_, RunState::Draining) => assert!(draining, "{ctx}"),
                    _ => panic!("unexpected transition: {ctx}"),
                }
                draining |= cmd == Command::Drain;
                assert_eq!(shutdown.is_requested(), draining, "{ctx}");
                if !draining {
                    assert_eq!(
                        *watch.borrow(),
                        matches!(after, RunState::Paused { .. }),
                        "{ctx}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_signal_makes_the_state_draining() {
        let shutdown = Shutdown::new();
        let control = Control::new(false, shutdown.clone());
        shutdown.request();
        assert_eq!(control.state(), RunState::Draining);
        assert!(control.apply(Command::Pause).is_err());
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(5);
        assert_eq!(
            next(RunState::Running, Command::Pause, t),
            Ok((RunState::Paused { since: t }, Outcome::Changed))
        );
    }
}
