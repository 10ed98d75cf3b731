//! The command line and the one-shot commands, one module per topic: configuration
//! errors and exit codes (`config_cli`, `first_hour`), completions, the man page and
//! progress lines (`cli_extras`), `check`'s preconditions (`preconditions`), and the
//! recovery commands (`replay`, `replay_targets`, `skip`), and the commands with
//! logical messages (`messages`), and `[topology]` declared by `check --declare` and
//! `run` and compared by `check` (`topology`; its one policy matches only its own
//! queue), what a new user hit following the docs (`new_user`), and the README's
//! command list against `--help` (`help_docs`).
//!
//! The modules run in parallel in one process. None changes anything shared: each
//! test has its own database, slot, publication, exchange, queue, stream and role
//! (`testkit::unique_name`), its metrics listener on a free port, and reads the
//! machine's own Postgres (port 5432) only to see its `wal_level`.
#![allow(clippy::unwrap_used)]

mod cli_extras;
mod config_cli;
mod first_hour;
mod help_docs;
mod messages;
mod new_user;
mod preconditions;
mod rabbitmq4;
mod replay;
mod replay_targets;
mod routes;
mod skip;
mod topology;
