//! Postgres clusters of a test's own, made from the builds `scripts/pg-versions.sh`
//! installs: a fresh primary ([`Cluster::fresh`]: a new cluster, its own system
//! identifier and WAL), a primary with a physical standby ([`Pair`], slot
//! synchronisation on Postgres 17+), and a TCP proxy whose target can be switched
//! ([`Switch`], the stand-in for a DNS name or a virtual IP). Everything is removed
//! when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::scenarios::lsn;

/// How long the standby's slot copy may take to become sync-ready (NOTES: ≈ 25 s at
/// first on this kind of machine).
pub const SYNC_WAIT: Duration = Duration::from_secs(120);

/// Where `scripts/pg-versions.sh` keeps the builds and clusters (machine-wide).
pub fn versions_dir() -> PathBuf {
    std::env::var("OUTBOX_TEST_PG_VERSIONS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("/var/lib/outbox-relay-tests/pg-versions"))
}

/// The bin directory of the installed build of `major`.
pub fn bin_dir(major: u32) -> PathBuf {
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
pub fn as_postgres(program: &Path) -> Command {
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

pub fn ok(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub use testkit::free_port;

/// One cluster of the pair.
pub struct Cluster {
    pub bin: PathBuf,
    pub data: PathBuf,
    pub port: u16,
}

impl Cluster {
    pub fn pg_ctl(&self, args: &[&str]) -> Output {
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

    pub fn psql(&self, sql: &str) -> String {
        testkit::psql_at(self.port, "postgres", sql)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The slot's row on this server: (synced, temporary, confirmed_flush_lsn).
    pub fn slot(&self, slot: &str) -> Option<(bool, bool, u64)> {
        let row = self.psql(&format!(
            "SELECT synced, temporary, confirmed_flush_lsn FROM pg_replication_slots \
              WHERE slot_name = '{slot}' AND confirmed_flush_lsn IS NOT NULL"
        ));
        let f: Vec<&str> = row.split('|').collect();
        (f.len() == 3).then(|| (f[0] == "t", f[1] == "t", lsn(f[2])))
    }
}

/// A fresh cluster of Postgres `major` (initdb, `wal_level = logical`, trust on
/// loopback), removed on drop: a new cluster with its own system identifier.
pub struct Fresh {
    dir: PathBuf,
    pub cluster: Cluster,
}

impl Fresh {
    pub fn new(major: u32) -> Fresh {
        let bin = bin_dir(major);
        let dir = versions_dir()
            .join("fresh")
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
        let cluster = Cluster {
            bin: bin.clone(),
            data: dir.join("data"),
            port: free_port(),
        };
        cluster.initdb();
        ok(
            cluster.pg_ctl(&["start", "-w", "-t", "60"]),
            "start the cluster",
        );
        Fresh { dir, cluster }
    }
}

impl Drop for Fresh {
    fn drop(&mut self) {
        let _ = self.cluster.pg_ctl(&["stop", "-m", "immediate", "-w"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Cluster {
    /// `initdb` and the settings every cluster of the tests has.
    fn initdb(&self) {
        ok(
            as_postgres(&self.bin.join("initdb"))
                .arg("-D")
                .arg(&self.data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
                .args(["--locale=C.UTF-8"])
                .output()
                .unwrap(),
            "initdb",
        );
        append(
            &self.data.join("postgresql.conf"),
            &format!(
                "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = ''\n\
                 wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\n\
                 wal_sender_timeout = '10s'\nfsync = off\nhot_standby_feedback = on\n",
                self.port
            ),
        );
        append(
            &self.data.join("pg_hba.conf"),
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        );
    }

    /// The server's current WAL position.
    pub fn wal(&self) -> u64 {
        lsn(&self.psql("SELECT pg_current_wal_lsn()"))
    }
}

/// A primary and a physical standby with slot synchronisation, removed on drop.
pub struct Pair {
    dir: PathBuf,
    pub primary: Cluster,
    pub standby: Cluster,
}

impl Pair {
    pub fn new(major: u32) -> Pair {
        Self::with(major, true)
    }

    /// A pair whose primary waits for the standby's copy of failover slots before it
    /// confirms (`synchronized_standby_slots`) when `synchronized`; without it the
    /// relay can confirm positions the standby has not received (an asynchronous
    /// failover can then lose WAL the relay acked).
    pub fn with(major: u32, synchronized: bool) -> Pair {
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
        p.initdb();
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
        // Only now (the promoted standby would inherit it and wait for a slot that
        // does not exist there).
        if synchronized {
            p.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
            p.psql("SELECT pg_reload_conf()");
        }
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

pub fn append(path: &Path, text: &str) {
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
pub struct Switch {
    pub port: u16,
    target: Arc<Mutex<SocketAddr>>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Switch {
    pub async fn start(target: SocketAddr) -> Switch {
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

    pub fn switch(&self, to: SocketAddr) {
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
