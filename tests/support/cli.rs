//! The binary run by hand, without a test database: in a directory of its own, with
//! an environment stripped of everything that could configure it (for the tests of
//! configuration errors and of what a command does before it connects).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::bin;

/// A fresh directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("outbox-relay-cli-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `name` in the directory and returns its path.
    pub fn file(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Default for TempDir {
    fn default() -> TempDir {
        TempDir::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary in `cwd` with `env` on top of a parent environment stripped of
/// `OUTBOX_RELAY_*` and `RUST_LOG`. A command still running after `limit` (`run`
/// waiting for an unreachable Postgres, as a service should) is killed; its output
/// so far is returned.
pub fn relay_in(cwd: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut cmd = Command::new(bin());
    cmd.current_dir(cwd).args(args).env_remove("RUST_LOG");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("OUTBOX_RELAY_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}
