//! `slot create` and `slot drop`.

use wal_reader::admin;

use super::{admin_error, sql_client};
use crate::cli::{SlotCreateArgs, SlotDropArgs};
use crate::config::Config;
use crate::error::CliError;

/// Creates the publication (if missing) and the pgoutput slot.
pub async fn create(cfg: &Config, args: &SlotCreateArgs) -> Result<(), CliError> {
    let client = sql_client(cfg).await?;
    // Server-wide problems first: no publication is worth creating without them.
    admin::check_wal_level(&client).await.map_err(admin_error)?;
    admin::check_replication_role(&client)
        .await
        .map_err(admin_error)?;
    let publication = &cfg.postgres.publication;
    if admin::ensure_publication(&client, publication, &cfg.tables())
        .await
        .map_err(admin_error)?
    {
        println!("created publication {publication}");
    } else {
        admin::check_publication(&client, publication, &cfg.tables())
            .await
            .map_err(admin_error)?;
        println!("publication {publication} exists");
    }
    let slot = &cfg.postgres.slot;
    let created = admin::create_slot(&client, slot, args.if_not_exists, args.failover)
        .await
        .map_err(admin_error)?;
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
    Ok(())
}

/// Drops the slot (refusing while a relay holds it, unless forced).
pub async fn drop(cfg: &Config, args: &SlotDropArgs) -> Result<(), CliError> {
    let client = sql_client(cfg).await?;
    let slot = &cfg.postgres.slot;
    if admin::drop_slot(&client, slot, args.if_exists, args.force)
        .await
        .map_err(admin_error)?
    {
        println!("dropped slot {slot}");
    } else {
        println!("slot {slot} does not exist; nothing to drop");
    }
    Ok(())
}
