//! The server's settings: wal_level, capacity, the role's REPLICATION attribute.

use super::*;

#[tokio::test]
async fn wal_level_logical_passes() {
    let db = TestDb::new("admin_wal");
    let c = db.client().await;
    assert_eq!(admin::wal_level(&c).await.unwrap(), "logical");
    check_wal_level(&c).await.unwrap();
}

/// The machine's main Postgres (127.0.0.1:5432) runs with wal_level = replica; only
/// read from it.
#[tokio::test]
async fn wal_level_replica_is_refused() {
    let c = connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres").await;
    let level = admin::wal_level(&c).await.unwrap();
    assert_ne!(
        level, "logical",
        "this test needs a server without logical WAL"
    );
    let e = check_wal_level(&c).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::WalLevel { actual } if *actual == level),
        "{e:?}"
    );
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        format!(
            "wal_level is '{level}' but logical replication needs 'logical': \
             set wal_level = logical in postgresql.conf and restart Postgres"
        )
    );
}

#[tokio::test]
async fn capacity_reads_the_limits() {
    let db = outbox_db("admin_capacity");
    let c = db.client().await;
    let capacity = admin::Capacity::read(&c).await.unwrap();
    let show = |setting: &str| db.psql(&format!("SHOW {setting}")).parse::<i64>().unwrap();
    assert_eq!(
        capacity.max_replication_slots,
        show("max_replication_slots")
    );
    assert_eq!(capacity.max_wal_senders, show("max_wal_senders"));
    assert!(capacity.slots_in_use >= 0 && capacity.wal_senders_in_use >= 0);

    // A held slot counts as a running WAL sender.
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let capacity = admin::Capacity::read(&c).await.unwrap();
    assert!(capacity.slots_in_use >= 1 && capacity.wal_senders_in_use >= 1);
}

#[tokio::test]
async fn role_without_replication_is_refused() {
    let db = outbox_db("admin_role");
    let role = TestRole::create(&db, "LOGIN");
    {
        let c = connect_as(&db, &role.name).await;
        let e = check_replication_role(&c).await.unwrap_err();
        assert!(matches!(e, AdminError::NotReplicationRole { .. }), "{e:?}");
        assert!(e.is_precondition());
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("ALTER ROLE \"{}\" REPLICATION", role.name)),
            "{msg}"
        );
        // Creating a slot is refused the same way, before the server's own error.
        let e = create_slot(&c, &unique_name("slot"), false, false)
            .await
            .unwrap_err();
        assert!(matches!(e, AdminError::NotReplicationRole { .. }), "{e:?}");
    }
    // With the attribute it passes; so does a superuser.
    db.psql(&format!("ALTER ROLE {} REPLICATION", role.name));
    check_replication_role(&connect_as(&db, &role.name).await)
        .await
        .unwrap();
    check_replication_role(&db.client().await).await.unwrap();
}

/// Both connection kinds read catalog names from `pg_catalog` only (a function
/// planted in `public` is never found), and libpq's `options` parameter reaches the
/// server as libpq sends it: as the startup packet's `options`. An `options` that
/// sets `search_path` is refused with a sentence.
#[tokio::test]
async fn sessions_search_pg_catalog_only_and_take_libpqs_options() {
    let db = TestDb::new("admin_options");
    let url = format!("{}?options=-c%20statement_timeout%3D4321", db.url());
    let opts = wal_reader::PgConnectOptions::parse(&url).unwrap();
    let c = admin::connect(&opts).await.unwrap();
    let show = |row: tokio_postgres::Row| row.get::<_, String>(0);
    assert_eq!(
        show(c.query_one("SHOW search_path", &[]).await.unwrap()),
        "pg_catalog"
    );
    assert_eq!(
        show(c.query_one("SHOW statement_timeout", &[]).await.unwrap()),
        "4321ms"
    );
    let mut r = wal_reader::conn::ReplicationConnection::connect(&opts)
        .await
        .unwrap();
    for (setting, value) in [
        ("search_path", "pg_catalog"),
        ("statement_timeout", "4321ms"),
    ] {
        let rows = r.simple_query(&format!("SHOW {setting}")).await.unwrap();
        assert_eq!(rows, vec![vec![Some(value.to_string())]], "{setting}");
    }
    r.terminate().await;

    let e = wal_reader::PgConnectOptions::parse(&format!(
        "{}?options=-c%20search_path%3Dpublic",
        db.url()
    ))
    .unwrap_err();
    assert!(
        e.to_string().contains("options may not set search_path"),
        "{e}"
    );
}
