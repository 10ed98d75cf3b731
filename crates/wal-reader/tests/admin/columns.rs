//! The mapped columns of the outbox table, and the publication's column lists.

use super::*;

#[tokio::test]
async fn columns_of_the_default_table() {
    let db = outbox_db("admin_cols");
    let c = db.client().await;
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    assert_eq!(cols.id.type_oid, oid::UUID);
    assert_eq!(cols.aggregate_type.type_oid, oid::TEXT);
    assert_eq!(cols.payload.type_oid, oid::JSONB);
    assert!(cols.payload.not_null);
    assert_eq!(cols.headers.as_ref().map(|h| h.type_oid), Some(oid::JSONB));
    assert!(cols.correlation_id.is_none());
    check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap();
}

#[tokio::test]
async fn headers_column_may_be_absent() {
    let db = outbox_db("admin_cols_noheaders");
    db.psql("ALTER TABLE outbox DROP COLUMN headers");
    let c = db.client().await;
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    assert!(cols.headers.is_none());
}

#[tokio::test]
async fn mapped_column_missing() {
    let db = outbox_db("admin_cols_missing");
    let c = db.client().await;
    let mapping = ColumnMapping {
        event_type: "kind".into(),
        ..ColumnMapping::default()
    };
    let e = check_columns(&c, &outbox_table()[0], &mapping)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AdminError::ColumnMissing { column, key: "event_type", .. } if column == "kind"),
        "{e:?}"
    );
    assert!(e.is_precondition());
    assert_eq!(
        e.to_string(),
        "table public.outbox has no column \"kind\": add the column, or set [mapping] \
         event_type to the name of the column that holds the event_type"
    );

    // A custom mapping that matches the table passes and reports the types.
    db.psql("ALTER TABLE outbox RENAME COLUMN event_type TO kind; ALTER TABLE outbox ADD COLUMN trace text");
    let mapping = ColumnMapping {
        correlation_id: Some("trace".into()),
        ..mapping
    };
    let cols = check_columns(&c, &outbox_table()[0], &mapping)
        .await
        .unwrap();
    assert_eq!(cols.event_type.name, "kind");
    assert_eq!(cols.correlation_id.map(|c| c.type_oid), Some(oid::TEXT));
}

#[tokio::test]
async fn column_left_out_of_the_publication() {
    let db = TestDb::new("admin_cols_list");
    apply_sql_file(&db, "outbox.sql", &[]).unwrap();
    let c = db.client().await;
    if admin::server_version_num(&c).await.unwrap() < 150000 {
        return; // no column lists before Postgres 15
    }
    db.psql(
        "ALTER PUBLICATION outbox_relay SET TABLE outbox \
         (id, aggregate_type, aggregate_id, event_type, headers)",
    );
    let cols = check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();
    let e = check_published_columns(&c, "outbox_relay", &cols)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AdminError::ColumnNotPublished { column, key: "payload", .. } if column == "payload"),
        "{e:?}"
    );
}
