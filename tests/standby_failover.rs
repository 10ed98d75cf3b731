//! Failover on a real standby, Postgres 17 and 18 (docs/failover.md,
//! docs/compatibility.md): a primary and a physical standby of the builds that
//! `scripts/pg-versions.sh` installs, a failover slot synchronised to the standby,
//! the primary crashed (`-m immediate`), the standby promoted, and the relay following
//! through a switchable TCP proxy (the stand-in for a DNS name or virtual IP). Every
//! row arrives in order; duplicates are bounded by how far the standby's copy of the
//! slot lagged: zero when it had caught up (`failover_postgres_NN`), at most the rows
//! published while it was frozen (`failover_postgres_NN_lagging_copy`).
//!
//! Each test creates its own pair of clusters (initdb, base backup with
//! `pg_backup_start`/`pg_backup_stop`) under `failover/` of the builds' folder and removes
//! them afterwards; it fails (never skips) when the builds are not installed.
#![allow(clippy::unwrap_used)]

use support::scenarios;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use scenarios::{lsn, poll, stderr, stop};
use support::*;
use tokio::net::{TcpListener, TcpStream};

/// How long the standby's slot copy may take to become sync-ready (NOTES: ≈ 25 s at
/// first on this kind of machine).
const SYNC_WAIT: Duration = Duration::from_secs(120);

/// Where `scripts/pg-versions.sh` keeps the builds and clusters (machine-wide).
fn versions_dir() -> PathBuf {
    std::env::var("OUTBOX_TEST_PG_VERSIONS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("/var/lib/outbox-relay-tests/pg-versions"))
}

/// The bin directory of the installed build of `major`.
fn bin_dir(major: u32) -> PathBuf {
    if let Ok(dir) = std::env::var(format!("OUTBOX_TEST_PG{major}_BIN")) {
        return PathBuf::from(dir);
    }
    let pkg = versions_dir().join("pkg");
    std::fs::read_dir(&pkg)
        .ok()
        .and_then(|d| {
            d.filter_map(|e| e.ok()).find(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{major}."))
            })
        })
        .map(|e| e.path().join("native/bin"))
        .unwrap_or_else(|| {
            panic!("no Postgres {major} build in {pkg:?}: run `scripts/pg-versions.sh install`")
        })
}

/// A command run as the `postgres` OS user (Postgres refuses to run as root).
fn as_postgres(program: &Path) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn ok(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One cluster of the pair.
struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
}

impl Cluster {
    fn pg_ctl(&self, args: &[&str]) -> Output {
        let log = self.data.with_extension("log");
        as_postgres(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&log)
            .args(args)
            .output()
            .unwrap()
    }

    fn psql(&self, sql: &str) -> String {
        testkit::psql_at(self.port, "postgres", sql)
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The slot's row on this server: (synced, temporary, confirmed_flush_lsn).
    fn slot(&self, slot: &str) -> Option<(bool, bool, u64)> {
        let row = self.psql(&format!(
            "SELECT synced, temporary, confirmed_flush_lsn FROM pg_replication_slots \
              WHERE slot_name = '{slot}' AND confirmed_flush_lsn IS NOT NULL"
        ));
        let f: Vec<&str> = row.split('|').collect();
        (f.len() == 3).then(|| (f[0] == "t", f[1] == "t", lsn(f[2])))
    }
}

/// A primary and a physical standby with slot synchronisation, removed on drop.
struct Pair {
    dir: PathBuf,
    primary: Cluster,
    standby: Cluster,
}

impl Pair {
    fn new(major: u32) -> Pair {
        let bin = bin_dir(major);
        let dir = versions_dir()
            .join("failover")
            .join(testkit::unique_name(&format!("pg{major}")));
        std::fs::create_dir_all(&dir).unwrap();
        ok(
            Command::new("chown")
                .arg("postgres")
                .arg(&dir)
                .output()
                .unwrap(),
            "chown",
        );
        let cluster = |name: &str| Cluster {
            bin: bin.clone(),
            data: dir.join(name),
            port: free_port(),
        };
        let pair = Pair {
            primary: cluster("primary"),
            standby: cluster("standby"),
            dir,
        };
        let p = &pair.primary;
        ok(
            as_postgres(&bin.join("initdb"))
                .arg("-D")
                .arg(&p.data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
                .args(["--locale=C.UTF-8"])
                .output()
                .unwrap(),
            "initdb",
        );
        append(
            &p.data.join("postgresql.conf"),
            &format!(
                "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = ''\n\
                 wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\n\
                 wal_sender_timeout = '10s'\nfsync = off\nhot_standby_feedback = on\n",
                p.port
            ),
        );
        append(
            &p.data.join("pg_hba.conf"),
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        );
        ok(p.pg_ctl(&["start", "-w", "-t", "60"]), "start the primary");
        p.psql("SELECT pg_create_physical_replication_slot('standby1', true)");
        pair.base_backup();
        let s = &pair.standby;
        append(
            &s.data.join("postgresql.conf"),
            &format!(
                "port = {}\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres dbname=postgres'\n\
                 primary_slot_name = 'standby1'\nhot_standby_feedback = on\nsync_replication_slots = on\n",
                s.port, p.port
            ),
        );
        std::fs::write(s.data.join("standby.signal"), "").unwrap();
        ok(
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&s.data)
                .output()
                .unwrap(),
            "chown the standby",
        );
        ok(s.pg_ctl(&["start", "-w", "-t", "60"]), "start the standby");
        // Only now (NOTES: the promoted standby would inherit it and wait for a slot
        // that does not exist there).
        p.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
        p.psql("SELECT pg_reload_conf()");
        pair
    }

    /// An online base backup of the primary into the standby's directory: files
    /// copied between `pg_backup_start` and `pg_backup_stop` in one session, the
    /// label written as `backup_label`, WAL left to streaming through the slot.
    fn base_backup(&self) {
        let (p, s) = (&self.primary, &self.standby);
        let mut session = Command::new("psql")
            .args(["-XAtq", "-vON_ERROR_STOP=1", "-h127.0.0.1", "-Upostgres"])
            .args(["-p", &p.port.to_string(), "-dpostgres"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = session.stdin.take().unwrap();
        let mut output = BufReader::new(session.stdout.take().unwrap());
        let mut line = String::new();
        writeln!(input, "SELECT pg_backup_start('outbox-relay test', true);").unwrap();
        output.read_line(&mut line).unwrap();
        assert!(line.contains('/'), "pg_backup_start: {line:?}");
        ok(
            as_postgres(Path::new("cp"))
                .arg("-a")
                .arg(&p.data)
                .arg(&s.data)
                .output()
                .unwrap(),
            "copy the data directory",
        );
        for dir in ["pg_wal", "pg_replslot"] {
            for e in std::fs::read_dir(s.data.join(dir)).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    std::fs::remove_dir_all(&path).unwrap();
                } else {
                    std::fs::remove_file(&path).unwrap();
                }
            }
        }
        std::fs::create_dir_all(s.data.join("pg_wal/archive_status")).unwrap();
        for f in ["postmaster.pid", "postmaster.opts"] {
            let _ = std::fs::remove_file(s.data.join(f));
        }
        writeln!(
            input,
            "SELECT encode(convert_to(labelfile, 'UTF8'), 'hex') FROM pg_backup_stop(false);"
        )
        .unwrap();
        line.clear();
        output.read_line(&mut line).unwrap();
        let hex = line.trim();
        let label: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        assert!(
            String::from_utf8_lossy(&label).contains("START WAL LOCATION"),
            "backup label: {hex:?}"
        );
        std::fs::write(s.data.join("backup_label"), label).unwrap();
        drop(input);
        let _ = session.wait();
    }
}

fn append(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

impl Drop for Pair {
    fn drop(&mut self) {
        for c in [&self.standby, &self.primary] {
            let _ = c.pg_ctl(&["stop", "-m", "immediate", "-w"]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TCP proxy whose target can be switched: new connections go to the current
/// target; switching closes the open ones.
struct Switch {
    port: u16,
    target: Arc<Mutex<SocketAddr>>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Switch {
    async fn start(target: SocketAddr) -> Switch {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(Mutex::new(target));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (target, conns) = (target.clone(), conns.clone());
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let to = *target.lock().unwrap();
                    conns.lock().unwrap().push(tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(to).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    }));
                }
            }
        });
        Switch {
            port,
            target,
            conns,
            task,
        }
    }

    fn switch(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = to;
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.task.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

async fn failover(major: u32, lagging: bool) {
    let started = Instant::now();
    let pair = Pair::new(major);
    let (p, s) = (&pair.primary, &pair.standby);
    eprintln!(
        "postgres {major}: primary :{} and standby :{} up ({:.1} s)",
        p.port,
        s.port,
        started.elapsed().as_secs_f64()
    );
    let proxy = Switch::start(p.addr()).await;
    let mut env = Env::with_port(p.port).await;
    let url = format!(
        "postgresql://postgres@127.0.0.1:{}/{}",
        proxy.port, env.db.name
    );
    let config = env.config_file("failover.toml", &url, &testkit::amqp_url(), "");
    let out = env.cli_with(&config, "info", &["slot", "create", "--failover"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = env.consumer().await;
    let relay = env.start_with(&config, "info", &[]);

    env.insert_seq(1, 1000, 50);
    let target = lsn(&p.psql("SELECT pg_current_wal_lsn()"));
    got.wait_for(1000, scenarios::WAIT).await;
    poll("the primary's slot to pass the last commit", || {
        p.slot(&env.slot).is_some_and(|(_, _, at)| at >= target)
    })
    .await;
    // The standby's copy: synced, no longer temporary (sync-ready), caught up.
    let sync_started = Instant::now();
    loop {
        let copy = s.slot(&env.slot);
        if copy.is_some_and(|(synced, temporary, at)| synced && !temporary && at >= target) {
            break;
        }
        assert!(
            sync_started.elapsed() < SYNC_WAIT,
            "the standby's copy of the slot is not sync-ready after {SYNC_WAIT:?}: {copy:?}"
        );
        // A running-transactions record lets the copy reach a consistent point sooner.
        p.psql("SELECT pg_log_standby_snapshot()");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "postgres {major}: standby's copy sync-ready and caught up after {:.1} s",
        sync_started.elapsed().as_secs_f64()
    );
    // `status --standby` sees the same: sync-ready, no warning about the standby.
    let standby_url = format!("postgresql://postgres@127.0.0.1:{}/{}", s.port, env.db.name);
    let standby_status = |env: &Env| {
        let out = env.cli_with(
            &config,
            "info",
            &["status", "--json", "--standby", &standby_url],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v
    };
    let v = standby_status(&env);
    assert_eq!(v["standbys"][0]["sync_ready"], true, "{v}");
    assert!(
        !v["warnings"].to_string().contains("standby"),
        "no warning about a sync-ready standby: {v}"
    );
    // A server without failover slots (the Postgres 16 cluster of pg-versions.sh)
    // named as a standby is reported and warned about, in the same call.
    let pg16 = std::env::var("OUTBOX_TEST_PG16_PORT").unwrap_or_else(|_| "55516".into());
    let old_url = format!("postgresql://postgres@127.0.0.1:{pg16}/postgres");
    let out = env.cli_with(
        &config,
        "info",
        &[
            "status",
            "--json",
            "--standby",
            &standby_url,
            "--standby",
            &old_url,
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["standbys"][0]["sync_ready"], true, "{v}");
    assert_eq!(v["standbys"][1]["sync_ready"], false, "{v}");
    assert!(
        v["warnings"].to_string().contains("runs Postgres 16"),
        "a standby without failover slots is warned about: {v}"
    );
    // With `lagging`, the copy is frozen (slot sync stopped on the standby) while
    // 500 more rows are published and confirmed on the primary.
    let mut published = 1000;
    if lagging {
        s.psql("ALTER SYSTEM SET sync_replication_slots = off");
        s.psql("SELECT pg_reload_conf()");
        poll("the standby's slot sync worker to stop", || {
            s.psql("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'slotsync worker'")
                == "0"
        })
        .await;
        env.insert_seq(1001, 500, 50);
        published = 1500;
        let target = lsn(&p.psql("SELECT pg_current_wal_lsn()"));
        got.wait_for(published, scenarios::WAIT).await;
        poll("the primary's slot to pass the last commit", || {
            p.slot(&env.slot).is_some_and(|(_, _, at)| at >= target)
        })
        .await;
    }
    let (_, _, copy_at) = s.slot(&env.slot).unwrap();
    let (_, _, primary_at) = p.slot(&env.slot).unwrap();
    if lagging {
        // `status --standby` shows how far the frozen copy trails.
        let v = standby_status(&env);
        let behind = v["standbys"][0]["behind_bytes"].as_u64().unwrap_or(0);
        assert!(behind > 0, "the frozen copy is shown behind: {v}");
    }

    // Crash the primary, promote the standby, move the "name" to it.
    ok(
        p.pg_ctl(&["stop", "-m", "immediate", "-w"]),
        "crash the primary",
    );
    ok(
        s.pg_ctl(&["promote", "-w", "-t", "60"]),
        "promote the standby",
    );
    let copy_lag = primary_at.saturating_sub(copy_at);
    if lagging {
        let (_, _, promoted_at) = s.slot(&env.slot).unwrap();
        assert_eq!(promoted_at, copy_at, "the frozen copy did not move");
        assert!(copy_lag > 0, "the copy lags the primary's slot");
    }
    proxy.switch(s.addr());
    env.db.port = s.port;
    env.insert_seq(published + 1, 1000, 50);
    let total = published + 1000;
    let dups = check_sequence(&scenarios::distinct(&got, total).await, total);
    eprintln!(
        "postgres {major}: copy {copy_lag} bytes behind at the crash; after the failover {total} rows, {dups} duplicates ({:.1} s in all)",
        started.elapsed().as_secs_f64()
    );
    // Only what the copy had not caught up with may come again (and the position the
    // relay stored in Postgres, replicated to the standby, may spare even that).
    let bound = published - 1000;
    assert!(
        dups <= bound,
        "{dups} duplicates after a failover; the copy lagged by {bound} rows"
    );
    let log = relay.log_text();
    stop(relay);
    assert!(
        s.slot(&env.slot).is_some_and(|(_, _, at)| at > copy_at),
        "the relay streams from the promoted standby's slot: {log}"
    );
    env.cleanup().await;
    drop(proxy);
    drop(pair);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_17() {
    failover(17, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_18() {
    failover(18, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_17_lagging_copy() {
    failover(17, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_18_lagging_copy() {
    failover(18, true).await;
}
