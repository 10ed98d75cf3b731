//! The preflight's report, and the files of `sql/` applied to a fresh database.

use super::*;

#[tokio::test]
async fn preflight_reports_one_line_per_check() {
    let db = outbox_db("admin_preflight");
    let c = db.client().await;
    let slot = unique_name("slot");
    let tables = outbox_table();
    let mapping = ColumnMapping::default();
    let preflight = Preflight {
        slot: &slot,
        publication: "outbox_relay",
        tables: &tables,
        mapping: &mapping,
    };

    // No slot yet: exactly that line fails.
    let results = preflight.run(&c).await;
    let failed: Vec<_> = results.iter().filter(|r| r.failed()).collect();
    assert_eq!(failed.len(), 1, "{results:#?}");
    assert_eq!(failed[0].name, format!("slot {slot}"));
    assert!(failed[0].to_string().contains("outbox-relay slot create"));
    let names: Vec<_> = results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        &names[..5],
        [
            "server",
            "wal_level",
            "replication role",
            "publication outbox_relay",
            "table public.outbox"
        ]
    );

    // With the slot everything passes; a held slot is a warning, not a failure.
    create_slot(&c, &slot, false, false).await.unwrap();
    let results = preflight.run(&c).await;
    assert!(
        results
            .iter()
            .all(|r| matches!(r.status, CheckStatus::Ok(_))),
        "{results:#?}"
    );
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let results = preflight.run(&c).await;
    assert!(!results.iter().any(|r| r.failed()), "{results:#?}");
    let warning = results.last().unwrap();
    assert!(matches!(
        warning.status,
        CheckStatus::Warning(AdminError::SlotActive { .. })
    ));
    assert!(warning.to_string().starts_with("warn"));
}

// ------------------------------------------------------------------ sql/

#[tokio::test]
async fn outbox_sql_applies_and_passes_the_checks() {
    let db = TestDb::new("admin_sql_outbox");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    db.psql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', '1', 'created', '{}')",
    );
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "1");
}

/// The insert of an insert-then-delete transaction reaches the slot; the delete does
/// not; the table stays empty.
#[tokio::test]
async fn insert_then_delete_sql_publishes_the_insert_only() {
    let db = TestDb::new("admin_sql_itd");
    apply_sql_file(&db, "outbox_insert_then_delete.sql", &[]).unwrap();
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();

    db.psql(
        "BEGIN; \
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10', 'order', '42', 'order_paid', \
                 '{\"order_id\": 42}'); \
         DELETE FROM outbox WHERE id = '6f1c0a52-1f7e-4c1e-9a57-3f6f2f0f6a10'; \
         COMMIT;",
    );
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "0");
    // A rolled-back insert is never decoded.
    db.psql(
        "BEGIN; \
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', '43', 'order_paid', '{}'); \
         ROLLBACK;",
    );

    // pgoutput message tags of what the slot would send: B(egin), R(elation),
    // I(nsert), C(ommit) — no D(elete), nothing of the rolled-back transaction.
    let tags = db.psql(&format!(
        "SELECT string_agg(chr(get_byte(data, 0)), '' ORDER BY lsn) \
           FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
                'proto_version', '1', 'publication_names', 'outbox_relay')"
    ));
    assert_eq!(tags, "BRIC");
}

/// sql/role.sql creates a role that can do everything the relay needs, and nothing
/// that needs ownership.
#[tokio::test]
async fn role_sql_is_enough_for_the_relay() {
    let db = TestDb::new("admin_sql_role");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let name = unique_name("relay");
    let applied = apply_sql_file(&db, "role.sql", &[("relay_role", &name)]);
    let role = TestRole::adopt(&db, name);
    applied.unwrap();

    let c = connect_as(&db, &role.name).await;
    check_wal_level(&c).await.unwrap();
    check_replication_role(&c).await.unwrap();
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap();
    assert_eq!(
        c.query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    // The existing publication is used as it is …
    assert!(!ensure_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap());
    // … and creating another one needs the table owner, which the message says.
    let e = ensure_publication(&c, "relay_own_pub", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PublicationCreateDenied { .. }),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(
        msg.contains("CREATE PUBLICATION \"relay_own_pub\" FOR TABLE public.outbox WITH (publish = 'insert')"),
        "{msg}"
    );

    let slot = unique_name("slot");
    assert!(create_slot(&c, &slot, false, false).await.unwrap().created);
    require_slot(&c, &slot).await.unwrap();
    assert!(drop_slot(&c, &slot, false, false).await.unwrap());
}

#[test]
fn role_sql_defaults_to_outbox_relay() {
    let text = std::fs::read_to_string(sql_file("role.sql")).unwrap();
    assert!(text.contains("\\set relay_role outbox_relay"));
    assert!(text.contains("LOGIN REPLICATION"));
}
