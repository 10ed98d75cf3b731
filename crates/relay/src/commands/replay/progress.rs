//! The replay's progress, from the publisher's watermark (what the broker confirmed):
//!
//! - stderr a terminal and `--log-format text`: an indicatif bar with the count, the
//!   rate and the ETA;
//! - otherwise (a pipe, a file, a log collector) a plain line every
//!   [`LINE_EVERY`] and a last one at the end: `replay progress: 2000 of 5000 rows
//!   confirmed (40%), 1000 rows/s, ETA 3s`; with `--log-format json` the same as a
//!   JSON log line (`message = "replay progress"`, fields `done`, `total`, `unit`,
//!   `events`, `rate_per_sec`, `eta_secs`, `elapsed_secs`, `last`).
//!
//! `--from-table` counts rows (the total is counted before it starts). `--from-lsn`
//! knows its total only in WAL bytes, so the bar and the ETA follow the WAL position
//! and the events are counted beside it (as they are handed to the publisher).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use outbox_event::Lsn;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cli::LogFormat;

/// Interval of the plain (or JSON) progress lines.
pub const LINE_EVERY: Duration = Duration::from_secs(2);

/// What the progress counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// Outbox rows confirmed (`--from-table`).
    Rows,
    /// WAL bytes of the range confirmed (`--from-lsn`), with the events beside.
    WalBytes,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Rows => "rows",
            Unit::WalBytes => "WAL bytes",
        }
    }
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Display {
    Bar,
    Lines,
    Json,
}

/// One reading of the progress.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Snapshot {
    pub done: u64,
    pub total: u64,
    pub events: Option<u64>,
    pub elapsed: Duration,
}

impl Snapshot {
    /// Units per second since the start (0 before any time has passed).
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.done as f64 / secs
        } else {
            0.0
        }
    }

    /// Seconds left at the average rate so far; `None` before anything is done.
    pub fn eta_secs(&self) -> Option<u64> {
        if self.done >= self.total {
            return Some(0);
        }
        let rate = self.rate();
        (rate > 0.0).then(|| (self.total.saturating_sub(self.done) as f64 / rate).ceil() as u64)
    }

    fn percent(&self) -> u64 {
        // An empty range is complete.
        self.done
            .saturating_mul(100)
            .checked_div(self.total)
            .unwrap_or(100)
    }

    /// The plain line (without the `replay progress: ` prefix).
    pub fn line(&self, unit: Unit) -> String {
        let eta = match self.eta_secs() {
            Some(s) => format!("ETA {s}s"),
            None => "ETA unknown".into(),
        };
        match (unit, self.events) {
            (Unit::WalBytes, Some(events)) => format!(
                "{events} events, {} of {} WAL bytes confirmed ({}%), {:.0} events/s, {eta}",
                self.done,
                self.total,
                self.percent(),
                rate_of(events, self.elapsed),
            ),
            _ => format!(
                "{} of {} {} confirmed ({}%), {:.0} {}/s, {eta}",
                self.done,
                self.total,
                unit.name(),
                self.percent(),
                self.rate(),
                unit.name(),
            ),
        }
    }
}

fn rate_of(n: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// The running display; [`Progress::finish`] once the publisher has returned.
pub(crate) struct Progress {
    task: JoinHandle<()>,
    bar: Option<ProgressBar>,
}

impl Progress {
    /// Called once the publisher has returned: its watermark sender is gone, so the
    /// task shows the last reading and ends. The wait is bounded all the same; past
    /// it, aborting loses nothing but a progress line.
    pub(crate) async fn finish(self) {
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
        if let Some(bar) = self.bar {
            bar.finish();
        }
    }
}

/// Shows the progress of `done(watermark)` out of `total` until the watermark's
/// sender is dropped. `events`, when given, is a count shown beside (`--from-lsn`).
pub(crate) fn spawn(
    mut wm: watch::Receiver<Lsn>,
    total: u64,
    unit: Unit,
    events: Option<Arc<AtomicU64>>,
    format: LogFormat,
    done: impl Fn(Lsn) -> u64 + Send + 'static,
) -> Progress {
    let display = match format {
        LogFormat::Json => Display::Json,
        LogFormat::Text if std::io::stderr().is_terminal() => Display::Bar,
        LogFormat::Text => Display::Lines,
    };
    let bar = (display == Display::Bar).then(|| new_bar(total, unit));
    let shown = bar.clone();
    let start = Instant::now();
    let task = tokio::spawn(async move {
        let mut last_line = Instant::now();
        loop {
            let snap = Snapshot {
                done: done(*wm.borrow_and_update()).min(total),
                total,
                events: events.as_ref().map(|e| e.load(Ordering::Relaxed)),
                elapsed: start.elapsed(),
            };
            if let Some(bar) = &shown {
                bar.set_position(snap.done);
                if let Some(n) = snap.events {
                    bar.set_message(format!("{n} events"));
                }
            } else if last_line.elapsed() >= LINE_EVERY {
                emit(display, unit, &snap, false);
                last_line = Instant::now();
            }
            tokio::select! {
                res = wm.changed() => if res.is_err() { break },
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
        // The publisher is done: one last reading, always shown.
        let snap = Snapshot {
            done: done(*wm.borrow()).min(total),
            total,
            events: events.as_ref().map(|e| e.load(Ordering::Relaxed)),
            elapsed: start.elapsed(),
        };
        match &shown {
            Some(bar) => bar.set_position(snap.done),
            None => emit(display, unit, &snap, true),
        }
    });
    Progress { task, bar }
}

fn new_bar(total: u64, unit: Unit) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let template = match unit {
        Unit::Rows => {
            "{spinner} replay [{bar:40}] {human_pos}/{human_len} rows confirmed, {per_sec}, ETA {eta} ({elapsed})"
        }
        Unit::WalBytes => {
            "{spinner} replay [{bar:40}] {binary_bytes}/{binary_total_bytes} of WAL confirmed, {msg}, {binary_bytes_per_sec}, ETA {eta} ({elapsed})"
        }
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    if unit == Unit::WalBytes {
        bar.set_message("0 events");
    }
    bar
}

fn emit(display: Display, unit: Unit, snap: &Snapshot, last: bool) {
    match display {
        Display::Json => tracing::info!(
            unit = unit.name(),
            done = snap.done,
            total = snap.total,
            events = snap.events,
            rate_per_sec = (snap.rate() * 10.0).round() / 10.0,
            eta_secs = snap.eta_secs(),
            elapsed_secs = snap.elapsed.as_secs(),
            last,
            "replay progress"
        ),
        _ => eprintln!("replay progress: {}", snap.line(unit)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_line() {
        let s = Snapshot {
            done: 2000,
            total: 5000,
            events: None,
            elapsed: Duration::from_secs(2),
        };
        assert_eq!(
            s.line(Unit::Rows),
            "2000 of 5000 rows confirmed (40%), 1000 rows/s, ETA 3s"
        );
    }

    #[test]
    fn wal_line_counts_events() {
        let s = Snapshot {
            done: 512,
            total: 1024,
            events: Some(30),
            elapsed: Duration::from_secs(3),
        };
        assert_eq!(
            s.line(Unit::WalBytes),
            "30 events, 512 of 1024 WAL bytes confirmed (50%), 10 events/s, ETA 3s"
        );
    }

    #[test]
    fn nothing_done_has_no_eta_and_an_empty_range_is_complete() {
        let s = Snapshot {
            done: 0,
            total: 10,
            events: None,
            elapsed: Duration::from_secs(1),
        };
        assert_eq!(s.eta_secs(), None);
        assert!(
            s.line(Unit::Rows).ends_with("ETA unknown"),
            "{}",
            s.line(Unit::Rows)
        );
        let s = Snapshot {
            done: 0,
            total: 0,
            events: None,
            elapsed: Duration::ZERO,
        };
        assert_eq!(
            s.line(Unit::Rows),
            "0 of 0 rows confirmed (100%), 0 rows/s, ETA 0s"
        );
    }
}
