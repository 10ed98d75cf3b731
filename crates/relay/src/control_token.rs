//! The per-start control token (docs/security.md, "Control"): a random secret the
//! relay makes at every start and writes, readable by its own user only, where `ctl`
//! on the same host finds it. Control needs it (or the configured credentials), so a
//! user who cannot read the file cannot pause, drain or reload the relay, and a web
//! page cannot either.
//!
//! ```text
//!   run:  token = 32 random bytes (hex) ─► file (0600, written whole by a rename)
//!         ─► removed at exit if it still holds this token
//!   ctl:  read the file ─► GET /control/proof?nonce=N on the connection it will use
//!         ─► the relay answers HMAC-SHA256(token, N); ctl checks it
//!         ─► only then `Authorization: Bearer <token>` on the same connection
//! ```
//!
//! The proof is the peer check: a process that took the port (after the relay
//! exited, or before it started) cannot answer it, so the token never reaches it.
//! An answer proves only knowledge of this start's random token, so asking for
//! proofs teaches nothing about it.
//!
//! Where the file is, unless `[relay] control_token_file` names it: the first of
//! `/run/outbox-relay/` (the Debian unit's `RuntimeDirectory=`; an `emptyDir` in
//! Kubernetes), `$XDG_RUNTIME_DIR/`, and `<temp>/outbox-relay-<uid>/` (made 0700),
//! as `control-<port>.token`. The relay and `ctl` compute the same path when they
//! run as the same user on the same host.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::rand::SecureRandom;

/// The route that proves the token (answered by crate::endpoint::guard).
pub const PROOF_PATH: &str = "/control/proof";
/// The header every state-changing control request carries: a header no browser
/// sends cross-site without asking first (a preflight the endpoint never grants).
pub const CONTROL_HEADER: &str = "x-outbox-relay-control";
/// The shared run-time directory of a system installation.
const SYSTEM_DIR: &str = "/run/outbox-relay";
/// What the HMAC of a proof covers before the nonce.
const PROOF_CONTEXT: &[u8] = b"outbox-relay control proof\n";

/// Where the control token file is: `configured` (`[relay] control_token_file`)
/// when set, else the default for the endpoint's `port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenFile {
    pub path: PathBuf,
    /// Named by `control_token_file`: a failure to write it stops `run`.
    pub configured: bool,
    /// The directory is the user's own (made 0700 if missing, refused if another
    /// user owns it or others may enter it): the defaults under `$XDG_RUNTIME_DIR`
    /// and the temporary directory.
    pub private_dir: bool,
}

impl TokenFile {
    pub fn new(configured: &str, port: u16) -> TokenFile {
        if !configured.trim().is_empty() {
            return TokenFile {
                path: PathBuf::from(configured.trim()),
                configured: true,
                private_dir: false,
            };
        }
        let name = format!("control-{port}.token");
        let (dir, private_dir) = if Path::new(SYSTEM_DIR).is_dir() {
            (PathBuf::from(SYSTEM_DIR), false)
        } else {
            match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
                Some(dir) if dir.is_absolute() && dir.is_dir() => (dir.join("outbox-relay"), true),
                _ => (private_temp_dir(), true),
            }
        };
        TokenFile {
            path: dir.join(name),
            configured: false,
            private_dir,
        }
    }
}

/// `<temp>/outbox-relay-<uid>`: the user's own directory under a shared one.
fn private_temp_dir() -> PathBuf {
    let uid =
        std::fs::metadata("/proc/self").map_or_else(|_| "user".into(), |m| m.uid().to_string());
    std::env::temp_dir().join(format!("outbox-relay-{uid}"))
}

/// A new random token: 32 bytes, hex.
pub fn generate() -> Result<String, String> {
    random_hex(32).map_err(|()| "the system's random generator failed".to_string())
}

/// A nonce for a proof: 32 random bytes, hex.
pub fn nonce() -> Result<String, String> {
    random_hex(32).map_err(|()| "the system's random generator failed".to_string())
}

fn random_hex(bytes: usize) -> Result<String, ()> {
    let mut buf = vec![0u8; bytes];
    ring::rand::SystemRandom::new()
        .fill(&mut buf)
        .map_err(|_| ())?;
    Ok(hex(&buf))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// True for a nonce a client may send: 32 to 128 hex digits.
pub fn valid_nonce(nonce: &str) -> bool {
    (32..=128).contains(&nonce.len()) && nonce.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The relay's answer to `nonce`: HMAC-SHA256 over it, keyed by the token, hex.
pub fn proof(token: &str, nonce: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    hex(ring::hmac::sign(&key, &[PROOF_CONTEXT, nonce.as_bytes()].concat()).as_ref())
}

/// True when `answer` is the proof of `token` for `nonce` (compared in constant time).
pub fn verify(token: &str, nonce: &str, answer: &str) -> bool {
    let Some(tag) = unhex(answer.trim()) else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    ring::hmac::verify(&key, &[PROOF_CONTEXT, nonce.as_bytes()].concat(), &tag).is_ok()
}

/// The written token file; removed when dropped (the relay exits) if it still holds
/// this token (a later relay may have written its own).
#[derive(Debug)]
pub struct Written {
    path: PathBuf,
    token: String,
}

impl Drop for Written {
    fn drop(&mut self) {
        if read_raw(&self.path).is_ok_and(|t| t == self.token) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `token` to `file`: readable by this user only, whole (a new file renamed
/// over the old), in a directory others cannot write (the default one is made 0700).
pub fn write(file: &TokenFile, token: &str) -> Result<Written, String> {
    let path = &file.path;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if file.private_dir {
        private_dir(dir)?;
    } else if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let temp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("token"),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&temp);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .and_then(|mut f| f.write_all(format!("{token}\n").as_bytes()))
        .and_then(|()| std::fs::rename(&temp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(format!("cannot write {} ({e})", path.display()));
    }
    Ok(Written {
        path: path.clone(),
        token: token.to_string(),
    })
}

/// Makes `dir` (0700) if missing; refuses it when it is not a directory of this
/// user's that others cannot enter (someone else made it first).
fn private_dir(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create {} ({e})", dir.display()))?;
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{} ({e})", dir.display()))?;
    let own = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    let foreign = own.is_some_and(|u| u != meta.uid());
    if !meta.is_dir() || foreign || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} is not a directory of this user's that only it may enter",
            dir.display()
        ));
    }
    Ok(())
}

/// The token in `path` for `ctl`: refused when group or others may read or write
/// the file (someone changed it: it is not the relay's).
pub fn read(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "its mode is {:03o}, not 0600 as the relay writes it",
            meta.permissions().mode() & 0o777
        ));
    }
    read_raw(path)
}

fn read_raw(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let token = text.trim();
    if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("it does not hold a control token".into());
    }
    Ok(token.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_proof_checks_only_with_its_token_and_nonce() {
        let token = generate().unwrap();
        let other = generate().unwrap();
        let n = nonce().unwrap();
        assert!(valid_nonce(&n));
        let p = proof(&token, &n);
        assert!(verify(&token, &n, &p));
        assert!(!verify(&other, &n, &p));
        assert!(!verify(&token, &nonce().unwrap(), &p));
        assert!(!verify(&token, &n, "zz"));
        assert!(!valid_nonce("abc") && !valid_nonce(&"g".repeat(64)));
    }

    #[test]
    fn the_file_is_private_whole_and_removed_with_its_token() {
        let dir = std::env::temp_dir().join(testkit::unique_name("ctltoken"));
        let file = TokenFile {
            path: dir.join("sub").join("control-1.token"),
            configured: false,
            private_dir: true,
        };
        let token = generate().unwrap();
        let written = write(&file, &token).unwrap();
        let mode = std::fs::metadata(&file.path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let dir_mode = std::fs::metadata(dir.join("sub"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        assert_eq!(read(&file.path).unwrap(), token);
        // A file others may read is not the relay's.
        std::fs::set_permissions(&file.path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read(&file.path).is_err());
        drop(written);
        assert!(!file.path.exists());
        // A later relay's file stays when an earlier one exits.
        let first = write(&file, &generate().unwrap()).unwrap();
        let second = write(&file, &token).unwrap();
        drop(first);
        assert_eq!(read(&file.path).unwrap(), token);
        drop(second);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_configured_path_wins_and_the_default_names_the_port() {
        let t = TokenFile::new(" /x/y.token ", 9187);
        assert_eq!(t.path, PathBuf::from("/x/y.token"));
        assert!(t.configured);
        let d = TokenFile::new("", 9187);
        assert!(!d.configured);
        assert!(d.path.ends_with("control-9187.token"), "{d:?}");
    }
}
