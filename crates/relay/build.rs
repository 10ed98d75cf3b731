//! Build information for `--version`, the start-up log line and the metric
//! `outbox_relay_build_info` (docs/operations.md, "Metrics and health"):
//!
//! - `RELAY_GIT_SHA`: the commit the binary is built from. Taken from the
//!   environment variable of the same name when it is set (a build without a git
//!   checkout, such as a container build whose context has no `.git`, passes it in),
//!   else from `git rev-parse HEAD`, else `unknown`.
//! - `RELAY_BUILD_TARGET`: the target triple the binary is built for.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=RELAY_GIT_SHA");
    let sha = std::env::var("RELAY_GIT_SHA")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().to_string())
        .or_else(git_sha)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=RELAY_BUILD_GIT_SHA={sha}");
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".to_string());
    println!("cargo:rustc-env=RELAY_BUILD_TARGET={target}");
}

/// The checked-out commit (12 hex digits), or `None` without git or a repository.
/// Rebuilds when HEAD moves: the files git changes then are watched.
fn git_sha() -> Option<String> {
    let sha = git(&["rev-parse", "--short=12", "HEAD"])?;
    // HEAD itself (a checkout), the branch it points to (a commit), and packed-refs
    // (where a branch's position may live instead).
    for path in ["HEAD", "packed-refs"] {
        watch(git(&["rev-parse", "--git-path", path]));
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(git(&["rev-parse", "--git-path", &branch]));
    }
    Some(sha)
}

fn watch(path: Option<String>) {
    if let Some(path) = path.map(PathBuf::from).filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}
