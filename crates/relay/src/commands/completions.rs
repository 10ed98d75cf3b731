//! `completions <SHELL>` and the hidden `man`: shell completion scripts and the man
//! page, generated from the clap definitions in `cli` (so they never drift from the
//! parser). Both print to stdout and need no configuration: `main` runs them before
//! loading it.
//!
//! The man page is one page, `outbox-relay(1)`: the top-level synopsis and options,
//! then a COMMANDS section with every command's synopsis and options (clap_mangen
//! alone would point at one page per command), the environment and the exit status.
//! The committed copy, docs/man/outbox-relay.1, is compared with a fresh rendering
//! by a test; regenerate it with `cargo run -p outbox-relay -- man > docs/man/outbox-relay.1`.

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;
use clap_mangen::roff::{bold, roman, Roff};
use clap_mangen::Man;

use crate::cli::Cli;
use crate::error::CliError;

/// The binary's name, as the completion scripts complete it.
pub const BIN_NAME: &str = "outbox-relay";

/// Writes the completion script for `shell` to stdout.
pub fn completions(shell: Shell) -> Result<(), CliError> {
    let mut out = Vec::new();
    write_completions(shell, &mut out);
    write_stdout(&out)
}

/// Writes the man page (roff) to stdout.
pub fn man() -> Result<(), CliError> {
    let page =
        man_page().map_err(|e| CliError::Runtime(format!("cannot render the man page: {e}")))?;
    write_stdout(&page)
}

fn write_stdout(bytes: &[u8]) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(bytes)
        .and_then(|()| stdout.flush())
        .map_err(|e| CliError::Runtime(format!("cannot write to stdout: {e}")))
}

/// The completion script for `shell`.
pub fn write_completions(shell: Shell, out: &mut dyn Write) {
    clap_complete::generate(shell, &mut Cli::command(), BIN_NAME, out);
}

/// Arguments every command inherits from the top level (shown once, at the top).
const INHERITED: &[&str] = &["config", "log_format", "help", "version"];

/// The man page, `outbox-relay(1)`, in roff.
pub fn man_page() -> std::io::Result<Vec<u8>> {
    // The page documents the release, not the build: no commit in its VERSION section.
    let mut cmd = Cli::command().long_version(None::<&'static str>);
    cmd.build();
    let top = Man::new(cmd.clone());
    let mut out = Vec::new();
    top.render_title(&mut out)?;
    top.render_name_section(&mut out)?;
    top.render_synopsis_section(&mut out)?;
    top.render_description_section(&mut out)?;
    top.render_options_section(&mut out)?;

    let mut roff = Roff::default();
    roff.control("SH", ["COMMANDS"]);
    roff.to_writer(&mut out)?;
    for sub in leaf_commands(&cmd) {
        let name = sub
            .get_bin_name()
            .unwrap_or_else(|| sub.get_name())
            .to_string();
        let mut sub = sub.clone();
        for id in INHERITED {
            if sub.get_arguments().any(|a| a.get_id().as_str() == *id) {
                sub = sub.mut_arg(*id, |a| a.hide(true));
            }
        }
        let mut roff = Roff::default();
        roff.control("SS", [name.as_str()]);
        if let Some(about) = sub.get_long_about().or_else(|| sub.get_about()) {
            roff.text([roman(about.to_string())]);
        }
        roff.to_writer(&mut out)?;
        let page = Man::new(sub.clone());
        let mut part = Vec::new();
        page.render_synopsis_section(&mut part)?;
        if sub.get_arguments().any(|a| !a.is_hide_set()) {
            page.render_options_section(&mut part)?;
        }
        // Each command's synopsis and options sit under its own sub-heading.
        let part = String::from_utf8_lossy(&part)
            .replace(".SH SYNOPSIS\n", ".PP\n")
            .replace(".SH OPTIONS\n", ".PP\n");
        out.extend_from_slice(part.as_bytes());
    }

    let mut roff = Roff::default();
    roff.control("SH", ["ENVIRONMENT"]);
    roff.control("TP", []);
    roff.text([bold("OUTBOX_RELAY_<SECTION>_<KEY>")]);
    roff.text([roman(
        "Overrides the configuration key <key> of [<section>], e.g. OUTBOX_RELAY_POSTGRES_URL. \
         An unknown OUTBOX_RELAY_* variable is an error.",
    )]);
    roff.control("TP", []);
    roff.text([bold("RUST_LOG")]);
    roff.text([roman(
        "The log filter (default: info), e.g. info,outbox_relay=debug.",
    )]);
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in [
        (
            "0",
            "Success (for run: stopped cleanly by SIGTERM or SIGINT).",
        ),
        ("1", "A runtime failure."),
        (
            "2",
            "Bad usage, configuration or an unmet precondition: the message names the fix.",
        ),
    ] {
        roff.control("TP", []);
        roff.text([bold(code)]);
        roff.text([roman(meaning)]);
    }
    roff.to_writer(&mut out)?;
    top.render_version_section(&mut out)?;
    // Every rendered part starts with roff's quote-string definition: keep the first.
    let text = String::from_utf8_lossy(&out);
    let (head, rest) = text.split_at(text.find(AQ_PREAMBLE).map_or(0, |i| i + AQ_PREAMBLE.len()));
    Ok(format!("{head}{}", rest.replace(AQ_PREAMBLE, "")).into_bytes())
}

/// What the roff crate writes at the start of every document.
const AQ_PREAMBLE: &str = ".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n";

/// The visible commands that run something (`slot create`, not `slot`), in
/// definition order.
fn leaf_commands(cmd: &clap::Command) -> Vec<&clap::Command> {
    let mut out = Vec::new();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        if sub.has_subcommands() {
            out.extend(leaf_commands(sub));
        } else {
            out.push(sub);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn script(shell: Shell) -> String {
        let mut out = Vec::new();
        write_completions(shell, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn bash_completes_every_command_and_option() {
        let s = script(Shell::Bash);
        for word in [
            "run",
            "slot",
            "create",
            "drop",
            "status",
            "peek",
            "replay",
            "check",
            "completions",
            "--from-table",
            "--from-lsn",
            "--if-not-exists",
            "--log-format",
        ] {
            assert!(s.contains(word), "bash completions lack {word}");
        }
        assert!(s.contains("complete -F _outbox__relay"), "{s}");
    }

    #[test]
    fn every_shell_renders() {
        for shell in [
            Shell::Bash,
            Shell::Zsh,
            Shell::Fish,
            Shell::Elvish,
            Shell::PowerShell,
        ] {
            let s = script(shell);
            assert!(s.contains("replay"), "{shell}: {s}");
        }
    }

    #[test]
    fn man_page_documents_every_command() {
        let page = String::from_utf8(man_page().unwrap()).unwrap();
        assert!(page.contains("\n.TH outbox-relay 1 "), "{page}");
        for heading in [
            ".SS \"outbox-relay slot create\"",
            ".SS \"outbox-relay replay\"",
            ".SS \"outbox-relay completions\"",
            ".SH ENVIRONMENT",
            ".SH \"EXIT STATUS\"",
        ] {
            assert!(page.contains(heading), "no {heading} in\n{page}");
        }
        assert!(
            !page.contains("outbox\\-relay\\-run(1)"),
            "points at a page that does not exist"
        );
    }

    /// The committed docs/man/outbox-relay.1 is what the clap definitions render.
    #[test]
    fn committed_man_page_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/man/outbox-relay.1");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        let fresh = String::from_utf8(man_page().unwrap()).unwrap();
        assert!(
            committed == fresh,
            "docs/man/outbox-relay.1 is stale (the command line changed): regenerate it with `cargo run -p outbox-relay -- man > docs/man/outbox-relay.1` and commit it"
        );
    }
}
