//! The publication: missing, valid, without inserts, created, partitioned.

use super::*;

#[tokio::test]
async fn publication_missing() {
    let db = TestDb::new("admin_pub_missing");
    db.psql("CREATE TABLE outbox (id uuid, payload jsonb)");
    let c = db.client().await;
    let e = check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::PublicationMissing { .. }), "{e:?}");
    assert!(e.is_precondition());
    let msg = e.to_string();
    assert!(
        msg.contains("publication \"outbox_relay\" does not exist"),
        "{msg}"
    );
    assert!(msg.contains("outbox-relay slot create"), "{msg}");
    assert!(
        msg.contains(
            "CREATE PUBLICATION \"outbox_relay\" FOR TABLE public.outbox WITH (publish = 'insert')"
        ),
        "{msg}"
    );
}

#[tokio::test]
async fn publication_valid() {
    let db = outbox_db("admin_pub_ok");
    let c = db.client().await;
    check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap();
}

#[tokio::test]
async fn table_not_in_publication() {
    let db = outbox_db("admin_pub_table");
    db.psql("CREATE SCHEMA billing; CREATE TABLE billing.outbox (LIKE public.outbox)");
    let c = db.client().await;
    let tables = [
        TableName::parse("public.outbox").unwrap(),
        TableName::parse("billing.outbox").unwrap(),
    ];
    let e = check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::TableNotInPublication { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ALTER PUBLICATION outbox_relay ADD TABLE billing.outbox"),
        "{msg}"
    );
    // Following the advice fixes it.
    db.psql("ALTER PUBLICATION outbox_relay ADD TABLE billing.outbox");
    check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap();
}

#[tokio::test]
async fn configured_table_missing() {
    let db = outbox_db("admin_table_missing");
    let c = db.client().await;
    let tables = [TableName::parse("public.outbox_typo").unwrap()];
    let e = check_publication(&c, "outbox_relay", &tables)
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    assert!(e
        .to_string()
        .contains("table public.outbox_typo does not exist"));
    let e = check_columns(&c, &tables[0], &ColumnMapping::default())
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    let e = ensure_publication(&c, "other_pub", &tables)
        .await
        .unwrap_err();
    assert!(matches!(e, AdminError::TableMissing { .. }), "{e:?}");
    assert_eq!(
        db.psql("SELECT count(*) FROM pg_publication WHERE pubname = 'other_pub'"),
        "0"
    );
}

#[tokio::test]
async fn publication_without_inserts() {
    let db = TestDb::new("admin_pub_noins");
    db.psql(
        "CREATE TABLE outbox (id uuid); \
         CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'update, delete')",
    );
    let c = db.client().await;
    let e = check_publication(&c, "outbox_relay", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PublicationNoInserts { .. }),
        "{e:?}"
    );
    assert!(e
        .to_string()
        .contains("ALTER PUBLICATION outbox_relay SET (publish = 'insert')"));
}

#[tokio::test]
async fn ensure_publication_creates_an_insert_only_publication() {
    let db = TestDb::new("admin_pub_ensure");
    db.psql("CREATE TABLE outbox (id uuid)");
    let c = db.client().await;
    let publication = unique_name("pub");

    assert!(ensure_publication(&c, &publication, &outbox_table())
        .await
        .unwrap());
    assert!(!ensure_publication(&c, &publication, &outbox_table())
        .await
        .unwrap());
    check_publication(&c, &publication, &outbox_table())
        .await
        .unwrap();
    assert_eq!(
        db.psql(&format!(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate \
               FROM pg_publication WHERE pubname = '{publication}'"
        )),
        "t|f|f|f"
    );
}

#[tokio::test]
async fn ensure_publication_quotes_table_names() {
    let db = TestDb::new("admin_pub_quote");
    db.psql(r#"CREATE SCHEMA "My Schema"; CREATE TABLE "My Schema"."Out""box; x" (id uuid)"#);
    let c = db.client().await;
    let tables = [TableName {
        schema: "My Schema".into(),
        name: "Out\"box; x".into(),
    }];
    assert!(ensure_publication(&c, "quoted_pub", &tables).await.unwrap());
    check_publication(&c, "quoted_pub", &tables).await.unwrap();
    assert_eq!(
        db.psql("SELECT schemaname || '|' || tablename FROM pg_publication_tables WHERE pubname = 'quoted_pub'"),
        "My Schema|Out\"box; x"
    );
}

/// A partitioned outbox is published through its root, so events carry the
/// configured name; a publication that lists the partitions instead is named.
#[tokio::test]
async fn partitioned_outbox_is_published_via_its_root() {
    let db = TestDb::new("admin_pub_part");
    db.psql(
        "CREATE TABLE outbox (id uuid NOT NULL, aggregate_type text, aggregate_id text, \
                              event_type text, payload jsonb, created_at timestamptz NOT NULL) \
           PARTITION BY RANGE (created_at); \
         CREATE TABLE outbox_2026 PARTITION OF outbox \
           FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')",
    );
    let c = db.client().await;
    assert!(ensure_publication(&c, "part_pub", &outbox_table())
        .await
        .unwrap());
    assert_eq!(
        db.psql("SELECT pubviaroot FROM pg_publication WHERE pubname = 'part_pub'"),
        "t"
    );
    check_publication(&c, "part_pub", &outbox_table())
        .await
        .unwrap();
    check_columns(&c, &outbox_table()[0], &ColumnMapping::default())
        .await
        .unwrap();

    db.psql("CREATE PUBLICATION leaf_pub FOR TABLE outbox WITH (publish = 'insert')");
    let e = check_publication(&c, "leaf_pub", &outbox_table())
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::PartitionsNotViaRoot { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ALTER PUBLICATION leaf_pub SET (publish_via_partition_root = true)"),
        "{msg}"
    );
    db.psql("ALTER PUBLICATION leaf_pub SET (publish_via_partition_root = true)");
    check_publication(&c, "leaf_pub", &outbox_table())
        .await
        .unwrap();
}
