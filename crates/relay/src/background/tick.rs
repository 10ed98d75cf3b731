//! The tick-and-reconnect loop every background task shares ([`every_tick`]), and
//! what a task gives it ([`Task`]).

use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

use crate::shutdown::Shutdown;

/// What a background step asks of the loop once it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// The next tick, on the same connection (a new one if it closed).
    Tick,
    /// The connection is dropped; the next tick opens a new one.
    Reconnect,
    /// The task ends (a stop was requested in the middle of the step).
    Stop,
}

/// One background task, as [`every_tick`] runs it.
pub(crate) trait Task: Send {
    /// Opens the task's SQL connection.
    fn connect(&mut self) -> impl Future<Output = Result<Client, String>> + Send;
    /// A connection could not be opened, the `failures`-th time in a row: says so
    /// (at the level the task chose) and returns how long to wait before the next
    /// attempt (`None`: the next tick).
    fn connect_failed(&mut self, error: &str, failures: u32) -> Option<Duration>;
    /// One step on the connection.
    fn step(&mut self, client: &Client, stop: &Shutdown) -> impl Future<Output = Then> + Send;
}

/// The tick-and-reconnect loop every background task shares: on each tick of
/// `period` (a missed tick is delayed, not repeated), opens the task's connection
/// if there is none or it closed, then runs one step on it. A stop request ends a
/// wait or a connection attempt at once, never a step (which may look at `stop`
/// itself between statements).
pub(crate) async fn every_tick(mut task: impl Task, period: Duration, mut stop: Shutdown) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client: Option<Client> = None;
    let mut failures: u32 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.requested() => return,
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            let connected = tokio::select! {
                r = task.connect() => r,
                _ = stop.requested() => return,
            };
            match connected {
                Ok(c) => {
                    failures = 0;
                    client = Some(c);
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    if let Some(wait) = task.connect_failed(&e, failures) {
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = stop.requested() => return,
                        }
                        tick.reset_immediately();
                    }
                    continue;
                }
            }
        }
        let Some(c) = client.as_ref() else { continue };
        match task.step(c, &stop).await {
            Then::Tick => {}
            Then::Reconnect => client = None,
            Then::Stop => return,
        }
    }
}
