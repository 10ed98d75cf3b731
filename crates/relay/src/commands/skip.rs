//! Skipping a poison event by its message id (docs/recovery.md, "A poison message"):
//! `slot skip <MESSAGE_ID | --lsn LSN> [--yes]`, and `run --skip-through MESSAGE_ID`
//! which does the same before it starts.
//!
//! ```text
//!   the slot must be idle (Postgres moves a slot only while nobody streams from it)
//!   pending events: the slot's changes, read without consuming them (as `peek`),
//!                   after max(slot's confirmed_flush_lsn, stored position)
//!   target: the first transaction holding MESSAGE_ID (refused when several pending
//!           transactions hold it), or every one committed at or before --lsn LSN
//!   list what is skipped ─► confirm (a terminal, or --yes)
//!   pg_replication_slot_advance(slot, E)     E = end of the target transaction's commit
//!   outbox_relay_state: acked_lsn = E        (forward only, with the server's origin)
//! ```
//!
//! Both targets work the same way: an exchange or a stream, a skip is a move of the
//! positions a session starts from (docs/design.md §3), so the next session starts
//! after E and nothing of the skipped transactions is published. A transaction is
//! the unit: its other events are skipped with it (they are listed, and
//! `replay --from-table --where message_id=…` re-publishes them).

use std::collections::BTreeSet;
use std::io::{IsTerminal, Write};

use outbox_event::redact::printable;
use outbox_event::Lsn;
use publisher::message::RoutingKeyTemplate;
use tracing::warn;
use wal_reader::admin;

use super::peek::{self, Pending};
use crate::cli::SlotSkipArgs;
use crate::config::Config;
use crate::error::CliError;

/// Counts events skipped by `run --skip-through` (docs/operations.md).
pub const SKIPPED_EVENTS: &str = "outbox_relay_skipped_events_total";

/// Changes decoded first while looking for the target (doubled up to peek's bound).
const FIRST_CHANGES: i64 = 4_096;
/// Message ids the log line of a skip names.
const LOGGED_IDS: usize = 20;

/// What to skip through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The transaction holding the event with this `message_id`.
    MessageId(String),
    /// Every pending transaction committed at or before this LSN.
    Lsn(Lsn),
}

impl Target {
    /// The target `slot skip` names: a message id as given (even one that reads like
    /// an LSN), or `--lsn`.
    pub fn of(args: &SlotSkipArgs) -> Result<Target, CliError> {
        match (&args.message_id, args.lsn) {
            (_, Some(lsn)) => Ok(Target::Lsn(lsn)),
            (Some(id), None) => Ok(Target::MessageId(id.trim().to_string())),
            (None, None) => Err(CliError::Usage(
                "name the event to skip: slot skip MESSAGE_ID, or slot skip --lsn LSN".into(),
            )),
        }
    }

    fn matches(&self, p: &Pending) -> bool {
        match self {
            Target::MessageId(id) => p.event.id.as_deref() == Some(id.as_bytes()),
            Target::Lsn(lsn) => p.event.commit_lsn <= *lsn,
        }
    }

    /// The end of the last transaction to skip: the first one holding the message id
    /// (refused when several pending transactions hold it: which one is meant is not
    /// the relay's guess), or the last one committed at or before the LSN.
    fn through(&self, pending: &[Pending], slot: &str) -> Result<Lsn, CliError> {
        let matching = pending.iter().filter(|p| self.matches(p));
        let through = match self {
            Target::MessageId(_) => matching.map(|p| p.end_lsn).min(),
            Target::Lsn(_) => matching.map(|p| p.end_lsn).max(),
        };
        let through = through.ok_or_else(|| not_found(self, slot))?;
        if let Target::MessageId(id) = self {
            let commits: BTreeSet<(Lsn, Lsn)> = pending
                .iter()
                .filter(|p| self.matches(p))
                .map(|p| (p.end_lsn, p.event.commit_lsn))
                .collect();
            if commits.len() > 1 {
                return Err(ambiguous(id, &commits));
            }
        }
        Ok(through)
    }
}

/// The refusal of a message id that several pending transactions hold.
fn ambiguous(id: &str, commits: &BTreeSet<(Lsn, Lsn)>) -> CliError {
    let list: Vec<String> = commits
        .iter()
        .map(|(_, commit)| format!("commit_lsn {commit}"))
        .collect();
    CliError::Precondition(format!(
        "nothing was skipped: message_id {:?} occurs in {} pending transactions ({}); to skip through one of them, pass --lsn with its commit_lsn (every pending transaction committed at or before it is skipped)",
        printable(id),
        commits.len(),
        list.join(", ")
    ))
}

/// What a skip did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub events: usize,
    pub transactions: usize,
    /// Where the slot and the stored position are now.
    pub through: Lsn,
}

/// `slot skip`.
pub async fn skip(cfg: &Config, args: &SlotSkipArgs) -> Result<(), CliError> {
    perform(cfg, &Target::of(args)?, args.yes).await?;
    Ok(())
}

/// Finds the target, lists what is skipped, asks (unless `yes`), then moves the slot
/// and the stored position past it. Prints what it did; logs it.
pub async fn perform(cfg: &Config, target: &Target, yes: bool) -> Result<Skipped, CliError> {
    let routing = RoutingKeyTemplate::parse(&cfg.rabbitmq.routing_key)
        .map_err(publisher::PublishError::from)?;
    let client = crate::sql::connect_for_command(cfg).await?;
    let slot_name = &cfg.postgres.slot;
    let slot = admin::require_slot(&client, slot_name).await?;
    if let Some(pid) = slot.holder() {
        return Err(in_use(slot_name, pid));
    }
    // Where the next session would start: what is at or before it is published.
    let stored = crate::state::read(&client, slot_name).await.ok().flatten();
    let confirmed = slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    let from = match &stored {
        Some(row) if row.acked > confirmed && row.acked <= slot.current_wal_lsn => row.acked,
        _ => confirmed,
    };
    let found = |events: &[Pending]| match target {
        // Every occurrence is needed: an id held by several transactions is refused.
        Target::MessageId(_) => false,
        // Everything up to the LSN is needed: stop only past it.
        Target::Lsn(lsn) => events.iter().any(|p| p.event.commit_lsn > *lsn),
    };
    let pending: Vec<Pending> =
        peek::read_pending_until(&client, cfg, FIRST_CHANGES, usize::MAX, &routing, found)
            .await?
            .into_iter()
            .filter(|p| p.end_lsn > from)
            .collect();
    let through = target.through(&pending, slot_name)?;
    let skipped: Vec<&Pending> = pending.iter().filter(|p| p.end_lsn <= through).collect();
    let transactions = skipped
        .iter()
        .map(|p| p.end_lsn)
        .collect::<BTreeSet<_>>()
        .len();
    // The log line names the first few; the list above names them all.
    let ids: Vec<String> = skipped
        .iter()
        .take(LOGGED_IDS)
        .map(|p| String::from_utf8_lossy(p.event.id.as_deref().unwrap_or(b"NULL")).into_owned())
        .collect();
    println!(
        "{} pending in slot {slot_name} will be skipped, never published ({} through the commit ending at {through}):",
        count(skipped.len(), "event"),
        count(transactions, "transaction"),
    );
    for p in &skipped {
        println!(
            "  {}",
            peek::line_for_target(peek::to_line(p), p, cfg.stream())
        );
    }
    if !yes {
        confirm(skipped.len()).await?;
    }
    // The slot first: once it has moved, the skip holds even without the table.
    let moved = admin::advance_slot(&client, slot_name, through).await?;
    let now = admin::require_slot(&client, slot_name).await?;
    if !moved && now.confirmed_flush_lsn.is_none_or(|c| c < through) {
        return Err(match now.holder() {
            Some(pid) => in_use(slot_name, pid),
            None => CliError::Runtime(format!(
                "slot {slot_name} did not move to {through}: run `outbox-relay slot skip` again"
            )),
        });
    }
    store(&client, cfg, through).await;
    warn!(slot = %slot_name, through = %through, events = skipped.len(), transactions,
        message_ids = ?ids, "skipped poison events: they will never be published");
    println!(
        "skipped {}: slot {slot_name} and its stored position are at {through}; the relay resumes after it",
        count(skipped.len(), "event")
    );
    Ok(Skipped {
        events: skipped.len(),
        transactions,
        through,
    })
}

/// Moves the stored position forward to `through`, with the server's origin (so the
/// next session's checks accept it, docs/design.md §3). Without the table, or
/// without the privilege, the slot alone holds the skip: said once.
async fn store(client: &tokio_postgres::Client, cfg: &Config, through: Lsn) {
    let slot = &cfg.postgres.slot;
    let origin = match cfg.pg_options() {
        Ok(opts) => wal_reader::identify_server(&opts)
            .await
            .ok()
            .map(|(history, _)| history.origin()),
        Err(_) => None,
    };
    let result = async {
        let columns = crate::state::ensure_table(client).await?;
        let origin = origin.filter(|_| columns.history);
        crate::state::save(client, slot, through, origin).await
    }
    .await;
    if let Err(e) = result {
        eprintln!(
            "warning: the stored position in {} was not moved ({e}): the slot was, so the skip holds unless Postgres (before 17) restarts before the relay confirms a later position; then run the skip again",
            crate::state::TABLE
        );
    }
}

/// Asks on the terminal; refuses without one.
async fn confirm(events: usize) -> Result<(), CliError> {
    if !std::io::stdin().is_terminal() {
        return Err(CliError::Usage(format!(
            "nothing was skipped: stdin is not a terminal to confirm on; pass --yes to skip the {} listed above",
            count(events, "event")
        )));
    }
    print!("skip {}? [y/N] ", count(events, "event"));
    let _ = std::io::stdout().flush();
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .map_err(|e| CliError::Runtime(format!("cannot read the answer: {e}")))?
    .map_err(|e| CliError::Runtime(format!("cannot read the answer: {e}")))?;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => Err(CliError::Usage(
            "nothing was skipped: not confirmed (answer y, or pass --yes)".into(),
        )),
    }
}

fn in_use(slot: &str, pid: i32) -> CliError {
    CliError::Precondition(format!(
        "replication slot \"{slot}\" is in use by pid {pid}: stop the relay first (Postgres moves a slot only while nobody streams from it), then skip again and start the relay"
    ))
}

fn not_found(target: &Target, slot: &str) -> CliError {
    match target {
        Target::MessageId(id) => CliError::Precondition(format!(
            "no pending event of slot {slot} has message_id {:?}: it was published already, or is not committed; `outbox-relay peek` lists the pending events",
            printable(id)
        )),
        Target::Lsn(lsn) => CliError::Precondition(format!(
            "no pending transaction of slot {slot} committed at or before {lsn}: nothing to skip; `outbox-relay peek` lists the pending events"
        )),
    }
}

/// `1 event`, `3 events`.
fn count(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_an_lsn_only_with_dash_dash_lsn() {
        let args = |message_id: Option<&str>, lsn: Option<Lsn>| SlotSkipArgs {
            message_id: message_id.map(str::to_string),
            lsn,
            yes: false,
        };
        // Shaped like an LSN, yet a message id.
        assert_eq!(
            Target::of(&args(Some("cafe/0001"), None)).unwrap(),
            Target::MessageId("cafe/0001".into())
        );
        assert_eq!(
            Target::of(&args(None, Some(Lsn(0x1A2B_3C40)))).unwrap(),
            Target::Lsn(Lsn(0x1A2B_3C40))
        );
        assert!(Target::of(&args(None, None)).is_err());
        assert_eq!(count(1, "event"), "1 event");
        assert_eq!(count(2, "transaction"), "2 transactions");
    }
}
