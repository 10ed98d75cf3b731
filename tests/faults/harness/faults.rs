//! The faults: the broker stopped (`rabbitmqctl stop_app`), its memory alarm, a
//! restart or crash of the fault cluster; and the background load that retries
//! through them.

use std::process::Command;
use std::time::Duration;

use super::*;

fn rabbitmqctl(args: &[&str]) -> String {
    let out = testkit::rabbitmqctl_command().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rabbitmqctl stop_app` until dropped (then `start_app`).
pub struct BrokerStopped;

impl BrokerStopped {
    pub fn stop() -> BrokerStopped {
        rabbitmqctl(&["stop_app"]);
        BrokerStopped
    }
}

impl Drop for BrokerStopped {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command().arg("start_app").output();
        let _ = testkit::rabbitmqctl_command()
            .args(["await_startup", "--timeout", "60"])
            .output();
    }
}

/// The memory alarm raised (`set_vm_memory_high_watermark 0`) until dropped; the
/// value found before is restored.
pub struct MemoryAlarm {
    restore: Vec<String>,
}

impl MemoryAlarm {
    pub fn raise() -> MemoryAlarm {
        let env = rabbitmqctl(&["environment"]);
        let line = env
            .lines()
            .find(|l| l.contains("{vm_memory_high_watermark,"))
            .expect("vm_memory_high_watermark in rabbitmqctl environment");
        let value = line
            .split("{vm_memory_high_watermark,")
            .nth(1)
            .unwrap()
            .trim_end_matches([',', ' ', ']'])
            .trim_end_matches('}')
            .to_string();
        let restore = if let Some(abs) = value.strip_prefix("{absolute,") {
            vec![
                "absolute".to_string(),
                abs.trim_end_matches('}').trim_matches('"').to_string(),
            ]
        } else {
            vec![value]
        };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        MemoryAlarm { restore }
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let mut args = vec!["set_vm_memory_high_watermark".to_string()];
        args.extend(self.restore.iter().cloned());
        let _ = testkit::rabbitmqctl_command().args(&args).output();
    }
}

/// `pg_ctlcluster <v> outbox_fault restart -m <mode>`.
pub async fn restart_fault_cluster(mode: &str) {
    let mode = mode.to_string();
    tokio::task::spawn_blocking(move || {
        let (v, name) = testkit::pg_fault_cluster();
        let out = Command::new("pg_ctlcluster")
            .args([v.as_str(), name.as_str(), "restart", "-m", mode.as_str()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctlcluster restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    })
    .await
    .unwrap();
}

/// Peak resident set of a process (VmHWM) in kB.
pub fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Held by tests that restart or crash the fault cluster (one at a time).
pub static FAULT_PG: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A pseudo-random number in `0..n` (no need for a random number crate).
pub fn rand_below(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = nanos ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x % n.max(1)
}

/// Background load: rows `from..from+n` in transactions of `per_tx`, pausing
/// `pause` between transactions, retrying through Postgres restarts (each batch is
/// guarded, so a retry after an unknown outcome cannot insert it twice).
pub fn load(
    port: u16,
    db: String,
    from: u64,
    n: u64,
    per_tx: u64,
    pause: Duration,
) -> tokio::task::JoinHandle<()> {
    load_with(port, db, from, n, per_tx, pause, |i, end| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
               FROM generate_series({i}, {end}) AS s(n)
              WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{i}')
              ORDER BY s.n"
        )
    })
}

/// [`load`] with the statement of each transaction (rows `i..=end`) given by `sql`,
/// which must guard itself against a retry the same way.
pub fn load_with(
    port: u16,
    db: String,
    from: u64,
    n: u64,
    per_tx: u64,
    pause: Duration,
    sql: impl Fn(u64, u64) -> String + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx - 1).min(from + n - 1);
            let sql = sql(i, end);
            while !try_psql(port, &db, &sql) {
                std::thread::sleep(Duration::from_millis(200));
            }
            i = end + 1;
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    })
}
