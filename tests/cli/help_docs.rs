//! The help and the README agree (issue 55): the README's command list names only
//! commands and flags that `--help` offers, and every command `--help` offers is in
//! it; the help says what wins over RUST_LOG and how a running relay is stopped and
//! reloaded.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use support::*;

/// `outbox-relay <args> --help`, which must succeed.
fn help(args: &[&str]) -> String {
    let out = Command::new(bin())
        .args(args)
        .arg("--help")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?} --help: {}", stderr(&out));
    stdout(&out)
}

/// The subcommands a help text lists under `Commands:` (without `help`).
fn commands_of(help: &str) -> BTreeSet<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every `--flag` in a text.
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let name: String = rest[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '-')
            .collect();
        let before = rest[..at].chars().last();
        if !name.is_empty() && !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-') {
            flags.insert(format!("--{name}"));
        }
        rest = &rest[at + 2 + name.len()..];
    }
    flags
}

/// One command of the README's list: its subcommands and every flag on its lines.
#[derive(Debug, Default)]
struct Listed {
    subcommands: BTreeSet<String>,
    flags: BTreeSet<String>,
}

/// The README's `## Commands` block: the global flags, and each command (a line
/// indented by two spaces; its synopsis ends at three spaces) with what its lines
/// (and the more indented lines under it) list.
fn readme_commands() -> (BTreeSet<String>, BTreeMap<String, Listed>) {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let block: Vec<&str> = readme
        .lines()
        .skip_while(|l| *l != "## Commands")
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect();
    assert!(
        block
            .first()
            .is_some_and(|l| l.starts_with("outbox-relay ")),
        "no command list under ## Commands in the README: {block:?}"
    );
    let global = flags_in(block[0]);
    let mut commands: BTreeMap<String, Listed> = BTreeMap::new();
    let mut current = None;
    for line in &block[1..] {
        let own = line
            .strip_prefix("  ")
            .filter(|l| l.starts_with(|c: char| c.is_ascii_lowercase()));
        if let Some(own) = own {
            let synopsis = own.split("   ").next().unwrap_or(own);
            let mut words = synopsis
                .split_whitespace()
                .filter(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                .filter(|w| !w.starts_with('-'));
            let command = words.next().unwrap().to_string();
            let listed = commands.entry(command.clone()).or_default();
            listed.subcommands.extend(words.map(str::to_string));
            current = Some(command);
        }
        let command = current.as_ref().expect("a command line first");
        let listed = commands.get_mut(command).unwrap();
        listed.flags.extend(flags_in(line));
    }
    (global, commands)
}

/// Each way the lists could drift: a command, subcommand or flag the README names
/// that the help does not offer, or a command the help offers that the README lacks.
#[test]
fn the_readme_lists_what_help_offers() {
    let top = help(&[]);
    let (global, listed) = readme_commands();
    let top_flags = flags_in(&top);
    for flag in &global {
        assert!(top_flags.contains(flag), "README: {flag} is not in --help");
    }
    let offered = commands_of(&top);
    let in_readme: BTreeSet<String> = listed.keys().cloned().collect();
    assert_eq!(
        offered, in_readme,
        "--help's commands (left) and the README's (right) differ"
    );
    for (command, listed) in &listed {
        let own = help(&[command.as_str()]);
        let subcommands = commands_of(&own);
        let mut texts = vec![own];
        for sub in &listed.subcommands {
            assert!(
                subcommands.contains(sub),
                "README: `{command} {sub}` is not in `{command} --help`"
            );
            texts.push(help(&[command.as_str(), sub.as_str()]));
        }
        for sub in &subcommands {
            assert!(
                listed.subcommands.contains(sub),
                "`{command} --help` offers `{sub}`, which the README does not list"
            );
        }
        let offered: BTreeSet<String> = texts.iter().flat_map(|t| flags_in(t)).collect();
        for flag in &listed.flags {
            assert!(
                offered.contains(flag) || global.contains(flag),
                "README: `{command}` lists {flag}, which its --help does not offer"
            );
        }
    }
}

/// `--log-format`'s help names `[relay] log_filter`, which wins over RUST_LOG, and
/// `run --help` names the two other ways a running relay is stopped or reloaded.
#[test]
fn help_names_log_filter_drain_and_sighup() {
    let top: String = help(&[]).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        top.contains("The level comes from [relay] log_filter when it is set (a reload can change it), else from RUST_LOG, else info"),
        "{top}"
    );
    let run: String = help(&["run"])
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        run.contains("until SIGTERM/SIGINT or `ctl drain`")
            && run.contains("SIGHUP (or `ctl reload`) rereads the configuration file"),
        "{run}"
    );
}
