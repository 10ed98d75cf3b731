//! Retention's markers and statements, and the deletes against a test database.

use super::*;

fn m(xmin: u64, lsn: u64) -> Marker {
    Marker {
        xmin,
        lsn: Lsn(lsn),
    }
}

#[test]
fn the_newest_passed_marker_is_used_and_older_ones_dropped() {
    let mut q = VecDeque::new();
    for (x, l) in [(10, 100), (20, 200), (30, 300)] {
        push_marker(&mut q, m(x, l));
    }
    assert_eq!(pop_usable(&mut q, Lsn(99)), None);
    assert_eq!(q.len(), 3);
    assert_eq!(pop_usable(&mut q, Lsn(250)), Some(m(20, 200)));
    assert_eq!(q, [m(30, 300)]);
    assert_eq!(pop_usable(&mut q, Lsn(300)), Some(m(30, 300)));
    assert!(q.is_empty());
}

#[test]
fn a_full_queue_keeps_its_oldest_markers() {
    let mut q = VecDeque::new();
    for i in 0..(MAX_MARKERS as u64 + 10) {
        push_marker(&mut q, m(i, i));
    }
    assert_eq!(q.len(), MAX_MARKERS);
    assert_eq!(q.front(), Some(&m(0, 0)));
    assert_eq!(
        q.back(),
        Some(&m(MAX_MARKERS as u64 + 9, MAX_MARKERS as u64 + 9))
    );
}

/// The deletion rule against a real server. A row inserted after a SAVEPOINT
/// carries its subtransaction's id, which `pg_current_snapshot()` does not list
/// among the ids in progress: `pg_visible_in_snapshot` takes it for committed
/// before the marker although its transaction commits after it.
#[tokio::test]
async fn only_rows_of_transactions_finished_before_the_marker_and_older_than_keep_go() {
    let db = testkit::TestDb::new("retention");
    db.psql("CREATE TABLE outbox (id serial PRIMARY KEY, tag text, created_at timestamptz)");
    let table = TableName::parse("outbox").unwrap();
    let keep = Duration::from_secs(3600);
    let old = "now() - interval '1 day'";
    let insert = |tag: &str, at: &str| {
        format!("INSERT INTO outbox (tag, created_at) VALUES ('{tag}', {at});")
    };
    db.psql(&insert("before", old));
    db.psql(&insert("young", "now()"));
    db.psql(&insert("no-created-at", "NULL"));
    let open = db.client().await;
    open.batch_execute(&format!(
        "BEGIN; {} SAVEPOINT s; {} RELEASE SAVEPOINT s;",
        insert("open-top", old),
        insert("open-sub", old)
    ))
    .await
    .unwrap();
    // A later id completes, so the snapshot's xmax passes the subtransaction's id.
    db.psql("SELECT pg_current_xact_id()");

    let c = db.client().await;
    let marker = take_marker(&c).await.unwrap();
    let snapshot = db.psql("SELECT pg_current_snapshot()");
    open.batch_execute("COMMIT").await.unwrap();
    db.psql(&insert("after", old));
    let fooled = db.psql(&format!(
        "SELECT pg_visible_in_snapshot(xmin::text::xid8, '{snapshot}') FROM outbox WHERE tag = 'open-sub'"
    ));
    assert_eq!(
        fooled, "t",
        "the savepoint row looks committed to the finer rule"
    );

    let tags = || db.psql("SELECT string_agg(tag, ',' ORDER BY id) FROM outbox");
    assert_eq!(
        delete_batch(&c, &table, None, keep, marker.xmin)
            .await
            .unwrap(),
        1
    );
    assert_eq!(tags(), "young,no-created-at,open-top,open-sub,after");

    let later = take_marker(&c).await.unwrap();
    assert_eq!(
        delete_batch(&c, &table, None, keep, later.xmin)
            .await
            .unwrap(),
        3
    );
    assert_eq!(tags(), "young,no-created-at");
}

/// In a partitioned table every partition numbers its rows from `(0,1)`: a young
/// row of one partition shares its ctid with an old row of another, and only the
/// old one may go.
#[tokio::test]
async fn a_batch_deletes_by_partition_and_ctid_not_by_ctid_alone() {
    let db = testkit::TestDb::new("retention_part");
    db.psql(
        "CREATE TABLE outbox (id int, tag text, created_at timestamptz) \
           PARTITION BY RANGE (created_at); \
         CREATE TABLE outbox_old PARTITION OF outbox FOR VALUES FROM (MINVALUE) TO ('2021-01-01'); \
         CREATE TABLE outbox_new PARTITION OF outbox FOR VALUES FROM ('2021-01-01') TO (MAXVALUE); \
         INSERT INTO outbox SELECT n, 'young', now() + interval '1 day' FROM generate_series(1, 5) n; \
         INSERT INTO outbox SELECT n, 'old', '2020-06-01' FROM generate_series(1, 3) n;",
    );
    assert_eq!(
        db.psql("SELECT count(*) FROM outbox_old o JOIN outbox_new y ON y.ctid = o.ctid"),
        "3",
        "the old rows' ctids are taken by young rows too"
    );
    let c = db.client().await;
    let marker = take_marker(&c).await.unwrap();
    let table = TableName::parse("outbox").unwrap();
    let keep = Duration::from_secs(3600);
    assert_eq!(
        delete_batch(&c, &table, None, keep, marker.xmin)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        db.psql("SELECT string_agg(tag || id, ',' ORDER BY id) FROM outbox"),
        "young1,young2,young3,young4,young5"
    );
}

/// Rows the relay never publishes are never deleted: those of an inheritance
/// child (pgoutput sends them under the child's name, which the relay skips) and
/// those a publication row filter (Postgres 15+) leaves out.
#[tokio::test]
async fn rows_that_are_never_published_are_never_deleted() {
    let db = testkit::TestDb::new("retention_unpub");
    db.psql(
        "CREATE TABLE outbox (id int, tag text, created_at timestamptz); \
         CREATE TABLE outbox_child (extra int) INHERITS (outbox); \
         CREATE PUBLICATION pub_plain FOR TABLE outbox WITH (publish = 'insert'); \
         CREATE PUBLICATION pub_filtered FOR TABLE ONLY outbox WHERE (tag <> 'private') \
           WITH (publish = 'insert'); \
         INSERT INTO outbox VALUES (1, 'public', '2020-01-01'), (2, 'private', '2020-01-01'), \
                                   (3, NULL, '2020-01-01'); \
         INSERT INTO outbox_child VALUES (4, 'child', '2020-01-01', 0);",
    );
    let c = db.client().await;
    let table = TableName::parse("outbox").unwrap();
    let keep = Duration::from_secs(3600);
    let tags = || db.psql("SELECT string_agg(coalesce(tag, 'null'), ',' ORDER BY id) FROM outbox");
    // The filter: only 'public' is published (a NULL tag makes the filter NULL:
    // not published either).
    let marker = take_marker(&c).await.unwrap();
    let filter = row_filter(&c, "pub_filtered", &table).await.unwrap();
    assert_eq!(
        delete_batch(&c, &table, filter.as_deref(), keep, marker.xmin)
            .await
            .unwrap(),
        1
    );
    assert_eq!(tags(), "private,null,child");
    // Without a filter, the parent's rows go, the child's stay.
    let filter = row_filter(&c, "pub_plain", &table).await.unwrap();
    assert_eq!(filter, None);
    assert_eq!(
        delete_batch(&c, &table, None, keep, marker.xmin)
            .await
            .unwrap(),
        2
    );
    assert_eq!(tags(), "child");
}

#[test]
fn the_tick_follows_keep_within_bounds() {
    assert_eq!(tick_for(Duration::from_secs(2)), TICK_MIN);
    assert_eq!(tick_for(Duration::from_secs(100)), Duration::from_secs(10));
    assert_eq!(tick_for(Duration::from_secs(7 * 86_400)), TICK_MAX);
}
