//! What this binary is: its version, the commit it was built from and its target
//! triple (set by build.rs). Shown by `--version`, logged when `run` starts and
//! exported as the metric `outbox_relay_build_info` (docs/operations.md).

/// The package version (Cargo.toml).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit (12 hex digits), or `unknown` when built without git.
pub const GIT_SHA: &str = env!("RELAY_BUILD_GIT_SHA");
/// The target triple, e.g. `x86_64-unknown-linux-gnu`.
pub const TARGET: &str = env!("RELAY_BUILD_TARGET");
/// `outbox-relay --version`: `0.1.0 (git 0123456789ab, x86_64-unknown-linux-gnu)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("RELAY_BUILD_GIT_SHA"),
    ", ",
    env!("RELAY_BUILD_TARGET"),
    ")"
);

/// Logs what runs (the first line `run` logs), so a log names the build it comes from.
pub fn log() {
    tracing::info!(
        version = VERSION,
        git_sha = GIT_SHA,
        target = TARGET,
        "outbox-relay build"
    );
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::Parser;

    use super::*;
    use crate::cli::Cli;

    #[test]
    fn version_flags_print_the_version_and_long_adds_commit_and_target() {
        let long = Cli::try_parse_from(["outbox-relay", "--version"]).unwrap_err();
        assert_eq!(long.kind(), ErrorKind::DisplayVersion);
        assert_eq!(
            long.to_string().trim(),
            format!("outbox-relay {VERSION} (git {GIT_SHA}, {TARGET})")
        );
        let short = Cli::try_parse_from(["outbox-relay", "-V"]).unwrap_err();
        assert_eq!(short.to_string().trim(), format!("outbox-relay {VERSION}"));
    }

    /// Built in a git checkout (as the tests are), the commit is HEAD's.
    #[test]
    fn the_commit_is_the_checkouts_head() {
        if std::env::var_os("RELAY_GIT_SHA").is_some() {
            return; // set by hand: build.rs takes it as it is
        }
        let head = std::process::Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output();
        match head {
            Ok(out) if out.status.success() => {
                assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), GIT_SHA)
            }
            _ => assert_eq!(GIT_SHA, "unknown"),
        }
    }
}
