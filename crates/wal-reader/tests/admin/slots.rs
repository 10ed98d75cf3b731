//! Creating, dropping and requiring slots.

use super::*;

#[tokio::test]
async fn create_slot_reports_its_state() {
    let db = outbox_db("admin_create");
    let c = db.client().await;
    let slot = unique_name("slot");

    let created = create_slot(&c, &slot, false, false).await.unwrap();
    assert!(created.created);
    assert!(created.consistent_point > Lsn::ZERO);

    let s = slot_state(&c, &slot).await.unwrap().expect("slot exists");
    assert_eq!(s.slot_name, slot);
    assert_eq!(s.plugin.as_deref(), Some("pgoutput"));
    assert_eq!(s.slot_type, "logical");
    assert_eq!(s.database.as_deref(), Some(db.name.as_str()));
    assert!(!s.active);
    assert_eq!(s.active_pid, None);
    let confirmed = s.confirmed_flush_lsn.expect("confirmed_flush_lsn");
    assert_eq!(confirmed, created.consistent_point);
    let restart = s.restart_lsn.expect("restart_lsn");
    assert!(restart <= confirmed);
    assert_eq!(s.wal_status.as_deref(), Some("reserved"));
    assert_eq!(s.safe_wal_size, None, "max_slot_wal_keep_size is unlimited");
    assert!(!s.two_phase);
    assert!(!s.failover);
    assert!(s.current_wal_lsn >= confirmed);
    assert_eq!(
        s.retained_wal_bytes,
        Some((s.current_wal_lsn.0 - restart.0) as i64)
    );

    // The slot is usable and free.
    let required = require_slot(&c, &slot).await.unwrap();
    assert_eq!(required.slot_name, slot);
    check_slot_free(&required).await.unwrap();
    assert!(slot_state(&c, "no_such_slot").await.unwrap().is_none());
}

#[tokio::test]
async fn create_if_not_exists_keeps_the_slot() {
    let db = outbox_db("admin_create_ine");
    let c = db.client().await;
    let slot = unique_name("slot");

    let first = create_slot(&c, &slot, true, false).await.unwrap();
    assert!(first.created);
    let again = create_slot(&c, &slot, true, false).await.unwrap();
    assert!(!again.created);
    let state = slot_state(&c, &slot).await.unwrap().unwrap();
    assert_eq!(Some(again.consistent_point), state.confirmed_flush_lsn);
}

#[tokio::test]
async fn create_twice_is_a_clear_error() {
    let db = outbox_db("admin_create_twice");
    let c = db.client().await;
    let slot = unique_name("slot");

    create_slot(&c, &slot, false, false).await.unwrap();
    let e = create_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::SlotExists { slot: s } if *s == slot),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(msg.contains(&format!("\"{slot}\" already exists")), "{msg}");
    assert!(msg.contains("--if-not-exists"), "{msg}");
}

#[tokio::test]
async fn if_not_exists_still_refuses_a_slot_of_another_plugin() {
    let db = outbox_db("admin_ine_plugin");
    let c = db.client().await;
    let slot = unique_name("slot");
    db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"
    ));
    let e = create_slot(&c, &slot, true, false).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotWrongPlugin { .. }), "{e:?}");
}

#[tokio::test]
async fn failover_needs_postgres_17() {
    let db = outbox_db("admin_failover");
    let c = db.client().await;
    let slot = unique_name("slot");
    let version = admin::server_version_num(&c).await.unwrap();

    let result = create_slot(&c, &slot, false, true).await;
    if version >= 170000 {
        assert!(result.unwrap().created);
        assert!(slot_state(&c, &slot).await.unwrap().unwrap().failover);
    } else {
        let e = result.unwrap_err();
        assert!(matches!(e, AdminError::FailoverUnsupported { .. }), "{e:?}");
        assert!(e.is_precondition());
        let msg = e.to_string();
        assert!(msg.contains("Postgres 17"), "{msg}");
        assert!(msg.contains("without --failover"), "{msg}");
        assert!(
            slot_state(&c, &slot).await.unwrap().is_none(),
            "nothing created"
        );
    }
}

#[tokio::test]
async fn invalid_names_are_refused_before_the_server() {
    let db = outbox_db("admin_names");
    let c = db.client().await;
    for bad in [
        "Upper",
        "a-b",
        "x'); DROP TABLE outbox; --",
        &"s".repeat(64),
    ] {
        let e = create_slot(&c, bad, false, false).await.unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
        assert!(e.is_precondition());
        let e = drop_slot(&c, bad, true, false).await.unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
        let e = check_publication(&c, bad, &outbox_table())
            .await
            .unwrap_err();
        assert!(matches!(e, AdminError::InvalidName { .. }), "{bad}: {e:?}");
    }
    // The outbox survived.
    assert_eq!(db.psql("SELECT count(*) FROM outbox"), "0");
}

#[tokio::test]
async fn drop_slot_and_drop_if_exists() {
    let db = outbox_db("admin_drop");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();

    assert!(drop_slot(&c, &slot, false, false).await.unwrap());
    assert!(slot_state(&c, &slot).await.unwrap().is_none());

    assert!(!drop_slot(&c, &slot, true, false).await.unwrap());
    let e = drop_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotMissing { .. }), "{e:?}");
    assert!(e.to_string().contains("outbox-relay slot create"));
}

#[tokio::test]
async fn drop_refuses_a_held_slot_unless_forced() {
    let db = outbox_db("admin_drop_held");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let mut holder = SlotHolder::start(&c, &db, &slot).await;

    let state = slot_state(&c, &slot).await.unwrap().unwrap();
    assert!(state.active);
    let pid = state.active_pid.expect("active pid");

    // The state says who holds it …
    let e = check_slot_free(&state).await.unwrap_err();
    assert!(
        matches!(e, AdminError::SlotActive { pid: p, .. } if p == pid),
        "{e:?}"
    );
    // … and a plain drop refuses, naming the holder and --force.
    let e = drop_slot(&c, &slot, false, false).await.unwrap_err();
    assert!(
        matches!(e, AdminError::SlotActive { pid: p, .. } if p == pid),
        "{e:?}"
    );
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(msg.contains(&format!("pid {pid}")), "{msg}");
    assert!(msg.contains("slot drop --force"), "{msg}");
    assert!(
        slot_state(&c, &slot).await.unwrap().is_some(),
        "still there"
    );

    // Forced: the holder is terminated and the slot dropped.
    assert!(drop_slot(&c, &slot, false, true).await.unwrap());
    assert!(slot_state(&c, &slot).await.unwrap().is_none());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holder.exited() {
        assert!(Instant::now() < deadline, "pg_recvlogical survived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A role may drop its own relay's slot by force, but not terminate a process of
/// a superuser: the error says what to do instead.
#[tokio::test]
async fn force_drop_without_permission_to_terminate() {
    let db = outbox_db("admin_drop_denied");
    let c = db.client().await;
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let _holder = SlotHolder::start(&c, &db, &slot).await;
    let pid = slot_state(&c, &slot)
        .await
        .unwrap()
        .unwrap()
        .active_pid
        .unwrap();

    let role = TestRole::create(&db, "LOGIN REPLICATION");
    let rc = connect_as(&db, &role.name).await;
    let e = drop_slot(&rc, &slot, false, true).await.unwrap_err();
    assert!(
        matches!(e, AdminError::TerminateDenied { pid: p, .. } if p == pid),
        "{e:?}"
    );
    assert!(!e.is_precondition());
    assert!(e.to_string().contains("pg_signal_backend"), "{e}");
    assert!(
        slot_state(&c, &slot).await.unwrap().unwrap().active,
        "holder untouched"
    );
}

#[tokio::test]
async fn require_slot_missing() {
    let db = outbox_db("admin_req_missing");
    let c = db.client().await;
    let slot = unique_name("slot");
    let e = require_slot(&c, &slot).await.unwrap_err();
    assert!(matches!(e, AdminError::SlotMissing { .. }), "{e:?}");
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        format!(
            "replication slot \"{slot}\" does not exist: create it with `outbox-relay slot create`"
        )
    );
}

#[tokio::test]
async fn require_slot_with_another_plugin() {
    let db = outbox_db("admin_req_plugin");
    let c = db.client().await;
    let slot = unique_name("slot");
    db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"
    ));
    let e = require_slot(&c, &slot).await.unwrap_err();
    assert!(
        matches!(&e, AdminError::SlotWrongPlugin { plugin, .. } if plugin == "test_decoding"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("'test_decoding'") && msg.contains("'pgoutput'"),
        "{msg}"
    );
    assert!(msg.contains("outbox-relay slot drop"), "{msg}");
}

#[tokio::test]
async fn require_slot_of_another_database() {
    let home = outbox_db("admin_req_home");
    let other = outbox_db("admin_req_other");
    let slot = unique_name("slot");
    create_slot(&home.client().await, &slot, false, false)
        .await
        .unwrap();

    let c = other.client().await;
    let e = require_slot(&c, &slot).await.unwrap_err();
    match &e {
        AdminError::SlotOtherDatabase {
            slot_database,
            database,
            ..
        } => {
            assert_eq!(slot_database, &home.name);
            assert_eq!(database, &other.name);
        }
        _ => panic!("{e:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "point [postgres] url at database \"{}\"",
            home.name
        )),
        "{msg}"
    );
}

/// The narrow slot queries (`slot_query.rs`) read what `slot_state` reads, over a
/// connection opened by `admin::connect`; a copy starts at its original's position.
#[tokio::test]
async fn narrow_slot_queries_agree_with_the_slot_state() {
    let db = outbox_db("admin_slot_query");
    let opts = wal_reader::PgConnectOptions::parse(&testkit::pg_conninfo(&db.name)).unwrap();
    let c = admin::connect(&opts).await.unwrap();
    let slot = unique_name("slot");
    create_slot(&c, &slot, false, false).await.unwrap();
    let state = slot_state(&c, &slot).await.unwrap().expect("slot exists");

    assert_eq!(
        admin::slot_confirmed_flush(&c, &slot).await.unwrap(),
        state.confirmed_flush_lsn
    );
    assert_eq!(
        admin::slot_confirmed_flush(&c, "no_such_slot")
            .await
            .unwrap(),
        None
    );
    let retained = admin::slot_retained_wal(&c, &slot).await.unwrap();
    assert!(retained.is_some_and(|b| b >= 0.0), "{retained:?}");

    let copy = format!("{slot}_copy");
    admin::copy_slot(&c, &slot, &copy).await.unwrap();
    let copied = slot_state(&c, &copy)
        .await
        .unwrap()
        .expect("the copy exists");
    assert_eq!(copied.confirmed_flush_lsn, state.confirmed_flush_lsn);
    let mut found = admin::slots_with_prefix(&c, &slot).await.unwrap();
    found.sort();
    assert_eq!(found, [(slot.clone(), false), (copy.clone(), false)]);
    assert!(admin::slots_with_prefix(&c, "no_such_prefix_")
        .await
        .unwrap()
        .is_empty());
    let e = admin::copy_slot(&c, &slot, &copy)
        .await
        .expect_err("exists");
    assert!(matches!(e, AdminError::Sql(_)), "{e}");
    drop_slot(&c, &copy, false, false).await.unwrap();
}
