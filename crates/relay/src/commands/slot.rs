//! `slot create` and `slot drop`. With `[relay] replay_window` set, `slot create`
//! also creates the anchor slot ([`crate::anchor`]); `slot drop` drops it, and any
//! replay slots left behind by a killed `replay`.

use wal_reader::admin;

use crate::cli::{SlotCreateArgs, SlotDropArgs};
use crate::config::Config;
use crate::error::CliError;

/// Creates the publication (if missing) and the pgoutput slot.
pub async fn create(cfg: &Config, args: &SlotCreateArgs) -> Result<(), CliError> {
    let client = crate::sql::connect_for_command(cfg).await?;
    // Server-wide problems first: no publication is worth creating without them.
    admin::check_wal_level(&client).await?;
    admin::check_replication_role(&client).await?;
    if args.failover {
        let version = admin::server_version_num(&client).await?;
        if version < 170000 {
            // create_slot says the same; checking first creates nothing on refusal.
            return admin::create_slot(&client, &cfg.postgres.slot, args.if_not_exists, true)
                .await
                .map(|_| ())
                .map_err(CliError::from);
        }
    }
    let publication = &cfg.postgres.publication;
    if admin::ensure_publication(&client, publication, &cfg.tables()).await? {
        println!("created publication {publication}");
    } else {
        admin::check_publication(&client, publication, &cfg.tables()).await?;
        println!("publication {publication} exists");
    }
    let slot = &cfg.postgres.slot;
    let created = admin::create_slot(&client, slot, args.if_not_exists, args.failover).await?;
    if created.created {
        println!(
            "created slot {slot} at {} (events committed after this point will be relayed)",
            created.consistent_point
        );
    } else {
        println!(
            "slot {slot} exists (confirmed up to {})",
            created.consistent_point
        );
    }
    store_position(&client, slot, created).await;
    if cfg.replay_window().is_some() {
        crate::anchor::validate(cfg)?;
        let anchor = crate::anchor::anchor_slot_name(slot);
        match crate::anchor::create(&client, slot).await? {
            Some(at) => {
                println!("created anchor slot {anchor} at {at} (keeps WAL for the replay window)")
            }
            None => println!("anchor slot {anchor} exists"),
        }
    }
    Ok(())
}

/// The table of the stored acked position (docs/design.md §3): created if missing; a
/// new slot's row starts at its consistent point with the slot's identity. Without
/// the privilege the slot is still usable, at the cost the warning names.
async fn store_position(client: &tokio_postgres::Client, slot: &str, created: admin::SlotCreated) {
    let res = async {
        crate::state::ensure_table(client).await?;
        if created.created {
            crate::state::record_new_slot(
                client,
                slot,
                created.consistent_point,
                created.restart_lsn,
            )
            .await?;
        }
        Ok::<_, crate::state::StateError>(())
    }
    .await;
    match res {
        Ok(()) if created.created => println!(
            "stored position of slot {slot} in {} starts at {}",
            crate::state::TABLE,
            created.consistent_point
        ),
        Ok(()) => println!("table {} exists", crate::state::TABLE),
        Err(e) => eprintln!(
            "warning: cannot keep the acked position in {} ({e}): {}",
            crate::state::TABLE,
            crate::state::COST
        ),
    }
}

/// Drops the slot (refusing while a relay holds it, unless forced).
pub async fn drop(cfg: &Config, args: &SlotDropArgs) -> Result<(), CliError> {
    let client = crate::sql::connect_for_command(cfg).await?;
    let slot = &cfg.postgres.slot;
    if admin::drop_slot(&client, slot, args.if_exists, args.force).await? {
        println!("dropped slot {slot}");
    } else {
        println!("slot {slot} does not exist; nothing to drop");
    }
    // The replay window's anchor and stale replay copies go with the slot.
    let anchor = crate::anchor::anchor_slot_name(slot);
    if admin::slot_state(&client, &anchor).await?.is_some()
        && admin::drop_slot(&client, &anchor, true, args.force).await?
    {
        println!("dropped anchor slot {anchor}");
    }
    for (stale, _) in crate::commands::replay::replay_slots(&client, slot).await? {
        if admin::drop_slot(&client, &stale, true, args.force).await? {
            println!("dropped replay slot {stale}");
        }
    }
    Ok(())
}
