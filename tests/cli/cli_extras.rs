//! The command line's extras (issue #19): shell completions, the man page, and the
//! progress lines of a long `replay` when stderr is not a terminal.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use support::scenarios::{
    anchor, confirmed, insert_numbered, lsn_text, poll, stderr, stdout, stop, WAIT, WINDOW_ENV,
};
use support::*;

/// Runs the binary with an environment that could not load any configuration: the
/// generators must not need one.
fn generate(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env("OUTBOX_RELAY_NO_SUCH_KEY", "x")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

#[test]
fn bash_completions_name_every_command() {
    let out = generate(&["completions", "bash"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let script = stdout(&out);
    assert!(script.contains("complete -F _outbox__relay"), "{script}");
    for command in [
        "run",
        "slot",
        "status",
        "peek",
        "replay",
        "check",
        "completions",
    ] {
        assert!(
            script.contains(&format!("outbox__relay,{command})")),
            "no {command} in the bash completions"
        );
    }
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}

#[test]
fn every_supported_shell_gets_a_script() {
    for (shell, marker) in [
        ("zsh", "#compdef outbox-relay"),
        ("fish", "complete -c outbox-relay"),
        ("elvish", "edit:completion:arg-completer[outbox-relay]"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let out = generate(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        assert!(stdout(&out).contains(marker), "{shell}: {}", stdout(&out));
    }
}

#[test]
fn an_unknown_shell_is_a_usage_error_listing_the_known_ones() {
    let out = generate(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("invalid value 'tcsh'"), "{err}");
    assert!(
        err.contains("[possible values: bash, elvish, fish, powershell, zsh]"),
        "{err}"
    );
    assert!(stdout(&out).is_empty());
}

#[test]
fn the_man_page_is_the_committed_one() {
    let out = generate(&["man"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let committed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/man/outbox-relay.1"),
    )
    .unwrap();
    assert!(
        stdout(&out) == committed,
        "docs/man/outbox-relay.1 is stale: cargo run -p outbox-relay -- man > docs/man/outbox-relay.1"
    );
}

/// `replay progress: D of T rows confirmed (P%), R rows/s, ETA Ns` → (D, T).
fn text_progress(err: &str) -> Vec<(u64, u64)> {
    err.lines()
        .filter_map(|l| l.strip_prefix("replay progress: "))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(
                (words[1], words[3], words[4]),
                ("of", "rows", "confirmed"),
                "{l}"
            );
            assert!(l.contains(" rows/s, ETA "), "{l}");
            (words[0].parse().unwrap(), words[2].parse().unwrap())
        })
        .collect()
}

/// A table replay whose stderr is a pipe prints plain progress lines (at least the
/// last one) whose counts only grow and end at the rows replayed; with
/// `--log-format json` the same as JSON log lines.
#[tokio::test]
async fn a_table_replay_without_a_terminal_prints_progress_lines() {
    const ROWS: u64 = 5000;
    let mut env = Env::new().await;
    env.db.psql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
         SELECT 'p', n::text, 'e', jsonb_build_object('n', n), '2024-03-01T00:00:00Z'::timestamptz + n * interval '1 ms'
           FROM generate_series(1, {ROWS}) n"
    ));
    let got = env.consumer().await;

    let out = env.cli(&["replay", "--from-table"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("replayed {ROWS} rows")),
        "{}",
        stdout(&out)
    );
    let lines = text_progress(&stderr(&out));
    assert!(!lines.is_empty(), "no progress line in:\n{}", stderr(&out));
    assert!(lines.iter().all(|&(_, total)| total == ROWS), "{lines:?}");
    assert!(lines.windows(2).all(|w| w[0].0 <= w[1].0), "{lines:?}");
    assert_eq!(lines.last().unwrap().0, ROWS, "{lines:?}");
    assert!(
        stderr(&out).contains(&format!(
            "replay progress: {ROWS} of {ROWS} rows confirmed (100%), "
        )),
        "{}",
        stderr(&out)
    );
    got.wait_for(ROWS as usize, WAIT).await;

    let out = env.cli(&["--log-format", "json", "replay", "--from-table"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        text_progress(&err).is_empty(),
        "plain lines in JSON mode:\n{err}"
    );
    let progress: Vec<serde_json::Value> = err
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"))
        })
        .filter(|v| v["message"] == "replay progress")
        .collect();
    assert!(!progress.is_empty(), "no progress line in:\n{err}");
    let last = progress.last().unwrap();
    assert_eq!(last["done"], ROWS, "{last}");
    assert_eq!(last["total"], ROWS, "{last}");
    assert_eq!(last["unit"], "rows", "{last}");
    assert_eq!(last["last"], true, "{last}");
    assert_eq!(last["eta_secs"], 0, "{last}");
    assert!(last["rate_per_sec"].as_f64().unwrap() > 0.0, "{last}");
    assert_eq!(
        progress.iter().filter(|v| v["last"] == true).count(),
        1,
        "{err}"
    );
    let done: Vec<u64> = progress
        .iter()
        .map(|v| v["done"].as_u64().unwrap())
        .collect();
    assert!(done.windows(2).all(|w| w[0] <= w[1]), "{done:?}");
    let msgs = got.wait_for(2 * ROWS as usize, WAIT).await;
    assert_eq!(msgs.len(), 2 * ROWS as usize);
    env.cleanup().await;
}

/// `replay progress: E events, D of T WAL bytes confirmed (P%), R events/s, ETA Ns` → (E, D, T).
fn wal_progress(err: &str) -> Vec<(u64, u64, u64)> {
    err.lines()
        .filter_map(|l| l.strip_prefix("replay progress: "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(
                (w[1], w[3], w[5], w[6]),
                ("events,", "of", "WAL", "bytes"),
                "{l}"
            );
            assert!(l.contains(" events/s, ETA "), "{l}");
            (
                w[0].parse().unwrap(),
                w[2].parse().unwrap(),
                w[4].parse().unwrap(),
            )
        })
        .collect()
}

/// A WAL replay whose stderr is a pipe prints the events beside the WAL bytes
/// confirmed; the last line counts every event replayed.
#[tokio::test]
async fn a_wal_replay_without_a_terminal_prints_progress_lines() {
    const ROWS: usize = 300;
    let mut env = Env::new().await;
    let window = [(WINDOW_ENV, "1h")];
    let out = env.cli_env(&["slot", "create"], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    let from = confirmed(&env, &anchor(&env)).unwrap();
    let got = env.consumer().await;
    let relay = env.start_env(&[], &window);
    insert_numbered(&env, 1, ROWS);
    got.wait_for(ROWS, WAIT).await;
    let end = confirmed(&env, &env.slot).unwrap();
    poll("the live slot to pass the rows", || {
        confirmed(&env, &env.slot).unwrap() > end
    })
    .await;
    let out = env.cli_env(&["replay", "--from-lsn", &lsn_text(from)], &window);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("replayed {ROWS} events")),
        "{}",
        stdout(&out)
    );
    let lines = wal_progress(&stderr(&out));
    assert!(!lines.is_empty(), "no progress line in:\n{}", stderr(&out));
    assert!(
        lines
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1),
        "{lines:?}"
    );
    let (events, done, total) = *lines.last().unwrap();
    assert_eq!(events, ROWS as u64, "{lines:?}");
    assert!(done > 0 && done <= total, "{lines:?}");
    got.wait_for(2 * ROWS, WAIT).await;
    stop(relay);
    env.cleanup().await;
}
