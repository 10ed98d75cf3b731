//! `check`'s lines about how long the slot survives a stopped relay (issue 52, item 2;
//! docs/operations.md, "Slot safety"): `max_slot_wal_keep_size` against the server's
//! WAL rate, and Postgres 18's `idle_replication_slot_timeout`.
//!
//! ```text
//!   max_slot_wal_keep_size = -1        warn: unbounded, the disk fills instead
//!   < one hour of WAL at the rate      warn: a stop longer than that loses the slot
//!   otherwise                          ok: how many hours it holds
//!   idle_replication_slot_timeout > 0  warn: a stop longer than it loses the slot
//! ```
//!
//! The rate is `pg_stat_wal.wal_bytes` over the time since its `stats_reset`: an
//! average since the statistics were last reset (a server restart keeps them), so a
//! peak hour writes more; the line says which average it used. When the server has
//! written under 1 MiB since the reset, no rate is given and only the size is named.

use tokio_postgres::Client;

use super::{line, Status};

const NAME: &str = "max_slot_wal_keep_size";
const HOUR: f64 = 3600.0;

/// What the server says, read in one query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct WalSettings {
    /// `max_slot_wal_keep_size` in bytes; `None` when -1 (unbounded).
    pub keep_bytes: Option<u64>,
    /// Bytes of WAL per second on average since `pg_stat_wal`'s reset; `None` when
    /// too little was written to tell.
    pub rate: Option<f64>,
    /// The hours that average covers.
    pub rate_hours: f64,
    /// `idle_replication_slot_timeout` in seconds (Postgres 18; `None` before, 0 off).
    pub idle_timeout_secs: Option<u64>,
}

/// The lines for `s`: (status, name, detail).
pub(crate) fn assess(s: &WalSettings) -> Vec<(Status, &'static str, String)> {
    let rate_text = |r: f64| {
        format!(
            "{}/hour on average over the last {:.1} h (pg_stat_wal since its reset; a peak writes more)",
            size(r * HOUR),
            s.rate_hours
        )
    };
    let mut out = Vec::new();
    match (s.keep_bytes, s.rate) {
        (None, rate) => out.push((
            Status::Warn,
            NAME,
            format!(
                "-1 (unbounded): a slot left behind by a stopped relay keeps WAL until the disk fills and Postgres stops; set it to several hours of WAL{}, so that Postgres invalidates the slot first (docs/recovery.md)",
                rate.map(|r| format!(" (this server writes {})", rate_text(r)))
                    .unwrap_or_default()
            ),
        )),
        (Some(keep), Some(rate)) if (keep as f64) < rate * HOUR => out.push((
            Status::Warn,
            NAME,
            format!(
                "{} holds only {:.0} minutes of WAL at {}: a relay stopped longer than that loses its slot; raise it to at least {}",
                size(keep as f64),
                keep as f64 / rate / 60.0,
                rate_text(rate),
                size(rate * HOUR)
            ),
        )),
        (Some(keep), Some(rate)) => out.push((
            Status::Ok,
            NAME,
            format!(
                "{} holds about {:.1} hours of WAL at {}",
                size(keep as f64),
                keep as f64 / rate / HOUR,
                rate_text(rate)
            ),
        )),
        (Some(keep), None) => out.push((
            Status::Ok,
            NAME,
            format!(
                "{} (too little WAL written since pg_stat_wal's reset to tell how long it lasts)",
                size(keep as f64)
            ),
        )),
    }
    match s.idle_timeout_secs {
        Some(t) if t > 0 => out.push((
            Status::Warn,
            "idle_replication_slot_timeout",
            format!(
                "{}: Postgres invalidates a slot no relay has streamed from for longer, so a relay stopped that long loses its slot; set it to 0, or beyond the longest stop you plan for",
                duration(t)
            ),
        )),
        Some(_) => out.push((
            Status::Ok,
            "idle_replication_slot_timeout",
            "0: an idle slot is never invalidated for its idleness".to_string(),
        )),
        None => {}
    }
    out
}

/// Bytes as `status` prints them.
fn size(bytes: f64) -> String {
    crate::commands::status::human_bytes(bytes as i64)
}

fn duration(secs: u64) -> String {
    match secs {
        s if s % 86_400 == 0 => format!("{} d", s / 86_400),
        s if s % 3600 == 0 => format!("{} h", s / 3600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// Reads the settings: `None` (and a `warn` line) when the server will not say.
async fn read(client: &Client) -> Result<WalSettings, tokio_postgres::Error> {
    // pg_settings gives max_slot_wal_keep_size in MB and idle_replication_slot_timeout
    // in its unit (s); pg_stat_wal exists from Postgres 14 on, as the relay needs.
    let row = client
        .query_one(
            "SELECT (SELECT setting::bigint FROM pg_catalog.pg_settings WHERE name = 'max_slot_wal_keep_size'), \
                    w.wal_bytes::float8, \
                    EXTRACT(EPOCH FROM (pg_catalog.now() - w.stats_reset))::float8, \
                    (SELECT CASE unit WHEN 'min' THEN setting::bigint * 60 ELSE setting::bigint END \
                       FROM pg_catalog.pg_settings WHERE name = 'idle_replication_slot_timeout') \
               FROM pg_catalog.pg_stat_wal w",
            &[],
        )
        .await?;
    let keep_mb: Option<i64> = row.get(0);
    let (bytes, secs): (Option<f64>, Option<f64>) = (row.get(1), row.get(2));
    let idle: Option<i64> = row.get(3);
    let secs = secs.unwrap_or(0.0);
    let rate = match bytes {
        Some(b) if b >= 1_048_576.0 && secs >= 1.0 => Some(b / secs),
        _ => None,
    };
    Ok(WalSettings {
        keep_bytes: keep_mb.filter(|mb| *mb >= 0).map(|mb| (mb as u64) << 20),
        rate,
        rate_hours: secs / HOUR,
        idle_timeout_secs: idle.map(|s| s.max(0) as u64),
    })
}

/// Prints the lines; they never fail the check.
pub(crate) async fn lines(client: &Client) {
    match read(client).await {
        Ok(s) => {
            for (status, name, detail) in assess(&s) {
                line(status, name, &detail);
            }
        }
        Err(e) => line(
            Status::Warn,
            NAME,
            &format!("cannot read it or the WAL rate (pg_settings, pg_stat_wal): {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        keep_mb: Option<u64>,
        rate_mb_per_hour: Option<f64>,
        idle: Option<u64>,
    ) -> WalSettings {
        WalSettings {
            keep_bytes: keep_mb.map(|m| m << 20),
            rate: rate_mb_per_hour.map(|r| r * 1_048_576.0 / HOUR),
            rate_hours: 12.0,
            idle_timeout_secs: idle,
        }
    }

    #[test]
    fn each_case_gets_its_status_and_fix() {
        let unbounded = assess(&settings(None, Some(600.0), None));
        assert_eq!(unbounded.len(), 1);
        assert_eq!(unbounded[0].0, Status::Warn);
        assert!(
            unbounded[0].2.starts_with("-1 (unbounded)"),
            "{}",
            unbounded[0].2
        );
        assert!(
            unbounded[0].2.contains("600.0 MB/hour"),
            "{}",
            unbounded[0].2
        );

        // 300 MB at 600 MB/hour: 30 minutes.
        let short = assess(&settings(Some(300), Some(600.0), None));
        assert_eq!(short[0].0, Status::Warn);
        assert!(short[0].2.contains("only 30 minutes"), "{}", short[0].2);
        assert!(short[0].2.contains("at least 600.0 MB"), "{}", short[0].2);

        // 6 GB at 600 MB/hour: about 10 hours.
        let fine = assess(&settings(Some(6 * 1024), Some(600.0), Some(0)));
        assert_eq!(fine[0].0, Status::Ok);
        assert!(fine[0].2.contains("about 10.2 hours"), "{}", fine[0].2);
        assert_eq!(
            fine[1],
            (
                Status::Ok,
                "idle_replication_slot_timeout",
                "0: an idle slot is never invalidated for its idleness".into()
            )
        );

        let quiet = assess(&settings(Some(1024), None, None));
        assert_eq!(quiet[0].0, Status::Ok);
        assert!(quiet[0].2.contains("too little WAL"), "{}", quiet[0].2);

        let idle = assess(&settings(Some(6 * 1024), Some(600.0), Some(2 * 86_400)));
        assert_eq!(idle[1].0, Status::Warn);
        assert!(
            idle[1].2.starts_with("2 d: Postgres invalidates"),
            "{}",
            idle[1].2
        );
    }

    #[test]
    fn sizes_and_durations_read_as_an_operator_writes_them() {
        assert_eq!(size(1536.0 * 1024.0), "1.5 MB");
        assert_eq!(duration(3600), "1 h");
        assert_eq!(duration(90), "90 s");
        assert_eq!(duration(600), "10 min");
    }
}
