#![allow(clippy::unwrap_used)]

use super::*;
use clap::CommandFactory;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("outbox-relay").chain(args.iter().copied()))
}

#[test]
fn definition_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn globals_anywhere() {
    let cli = parse(&["check", "--config", "x.toml", "--log-format", "json"]).unwrap();
    assert_eq!(cli.config, Some(PathBuf::from("x.toml")));
    assert_eq!(cli.log_format, LogFormat::Json);
    assert!(matches!(cli.command, Command::Check(_)));
    let cli = parse(&["check"]).unwrap();
    assert_eq!(cli.config, None);
    assert_eq!(cli.log_format, LogFormat::Text);
}

#[test]
fn run_start_lsn() {
    let cli = parse(&["run", "--start-lsn", "16/B374D848"]).unwrap();
    let Command::Run(args) = cli.command else {
        panic!("not run")
    };
    assert_eq!(args.start_lsn, Some(Lsn(0x16_B374_D848)));
    let e = parse(&["run", "--start-lsn", "nope"]).unwrap_err();
    assert_eq!(e.exit_code(), 2);
}

#[test]
fn slot_commands() {
    let cli = parse(&["slot", "create", "--if-not-exists", "--failover"]).unwrap();
    let Command::Slot(SlotCommand::Create(a)) = cli.command else {
        panic!("not slot create")
    };
    assert!(a.if_not_exists && a.failover);
    let cli = parse(&["slot", "drop", "--if-exists", "--force"]).unwrap();
    let Command::Slot(SlotCommand::Drop(a)) = cli.command else {
        panic!("not slot drop")
    };
    assert!(a.if_exists && a.force);
    assert!(parse(&["slot"]).is_err());
    assert!(parse(&["slot", "drop", "--failover"]).is_err());
}

#[test]
fn status_and_peek() {
    let Command::Status(s) = parse(&["status", "--json"]).unwrap().command else {
        panic!("not status")
    };
    assert!(s.json);
    let Command::Peek(p) = parse(&["peek"]).unwrap().command else {
        panic!("not peek")
    };
    assert_eq!((p.limit, p.json), (DEFAULT_PEEK_LIMIT, false));
    let Command::Peek(p) = parse(&["peek", "--limit", "5", "--json"]).unwrap().command else {
        panic!("not peek")
    };
    assert_eq!((p.limit, p.json), (5, true));
    assert!(parse(&["peek", "--limit", "0"]).is_err());
    assert!(parse(&["peek", "--limit", "-3"]).is_err());
}

#[test]
fn completions_take_a_known_shell() {
    let Command::Completions(c) = parse(&["completions", "zsh"]).unwrap().command else {
        panic!("not completions")
    };
    assert_eq!(c.shell, clap_complete::Shell::Zsh);
    let e = parse(&["completions", "tcsh"]).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let text = e.to_string();
    assert!(
        text.contains("invalid value 'tcsh'")
            && text.contains("bash, elvish, fish, powershell, zsh"),
        "{text}"
    );
    assert!(parse(&["completions"]).is_err());
    assert!(matches!(parse(&["man"]).unwrap().command, Command::Man));
}

fn replay(args: &[&str]) -> Result<ReplayArgs, clap::Error> {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    match parse(&all)?.command {
        Command::Replay(r) => Ok(r),
        other => panic!("not replay: {other:?}"),
    }
}

#[test]
fn replay_from_lsn() {
    let r = replay(&["--from-lsn", "0/10", "--to-lsn", "0/20"]).unwrap();
    assert_eq!(
        r.source().unwrap(),
        ReplaySource::Wal {
            from: Lsn(0x10),
            to: Some(Lsn(0x20))
        }
    );
    let r = replay(&["--from-lsn", "0/20", "--to-lsn", "0/10"]).unwrap();
    assert_eq!(r.source().unwrap_err().exit_code(), 2);
}

#[test]
fn replay_from_table() {
    let r = replay(&[
        "--from-table",
        "--since",
        "2024-05-01T12:00:00Z",
        "--until",
        "2024-05-02T00:00:00Z",
    ])
    .unwrap();
    let ReplaySource::Table { since, until } = r.source().unwrap() else {
        panic!("not a table replay")
    };
    let since = since.unwrap();
    assert_eq!(
        humantime::format_rfc3339(since).to_string(),
        "2024-05-01T12:00:00Z"
    );
    assert!(until.unwrap() > since);
    let r = replay(&[
        "--from-table",
        "--since",
        "2024-05-02T00:00:00Z",
        "--until",
        "2024-05-01T00:00:00Z",
    ])
    .unwrap();
    assert!(matches!(r.source(), Err(CliError::Usage(_))));
    assert!(replay(&["--from-table", "--since", "yesterday"]).is_err());
}

#[test]
fn replay_groups_are_exclusive_and_required() {
    for bad in [
        &[][..],
        &["--from-lsn", "0/1", "--from-table"][..],
        &["--to-lsn", "0/1"][..],
        &["--since", "2024-05-01T12:00:00Z"][..],
        &["--from-lsn", "0/1", "--since", "2024-05-01T12:00:00Z"][..],
        &["--from-table", "--to-lsn", "0/1"][..],
    ] {
        let e = replay(bad).expect_err(&format!("{bad:?} accepted"));
        assert_eq!(e.exit_code(), 2, "{bad:?}");
    }
}
