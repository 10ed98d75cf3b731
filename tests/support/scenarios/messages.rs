//! Logical messages as events (docs/messages.md): the end-to-end scenario, and the
//! producer of mixed rows and messages that the fault and stream tests share.

use super::*;

/// `[postgres] messages = ["outbox"]` (docs/messages.md), as the environment sets it.
pub const MESSAGES_ENV: (&str, &str) = ("OUTBOX_RELAY_POSTGRES_MESSAGES", "[\"outbox\"]");

/// The value of the Prometheus sample `name{labels}` in a `/metrics` body.
pub fn metric(body: &str, name: &str, labels: &str) -> Option<f64> {
    body.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix('{')?
            .strip_prefix(labels)?
            .strip_prefix("} ")?
            .trim()
            .parse()
            .ok()
    })
}

/// The call `pg_logical_emit_message(transactional, prefix, content)`, the content a
/// JSON text literal written as is.
fn emit_call(transactional: bool, prefix: &str, content: &str) -> String {
    format!("pg_catalog.pg_logical_emit_message({transactional}, '{prefix}', '{content}'::text)")
}

/// An event's content for a logical message of `aggregate_type = 'order'`; `extra`
/// is appended inside the object (`,"id":…`, `,"headers":…`).
fn message_content(aggregate_id: &str, event_type: &str, extra: &str) -> String {
    format!(
        r#"{{"aggregate_type":"order","aggregate_id":"{aggregate_id}","event_type":"{event_type}","payload":{{"n":"{event_type}"}}{extra}}}"#
    )
}

/// Logical messages as events (docs/messages.md, issue 42) with `[postgres] messages
/// = ["outbox"]`: a transaction that mixes outbox rows, messages with a derived and
/// with their own id, a non-transactional message and one of another prefix arrives
/// as its rows and relayed messages, in the order written, with one commit LSN; a
/// rolled-back transaction's row and message never arrive (its non-transactional
/// message, which Postgres decodes all the same, neither); a transaction of one
/// message alone arrives. The ignored messages are counted on `/metrics`
/// (`outbox_relay_messages_ignored_total{reason}`: 2 non-transactional, 1 of another
/// prefix), and the non-transactional ones logged once (at most once a minute). The
/// derived id is `outbox-relay/<system identifier>/<database>/<LSN>` with the LSN
/// `pg_logical_emit_message` returned.
pub async fn logical_messages(port: u16) {
    let mut env = Env::with_port(port).await;
    let listen = testkit::free_addr();
    let vars = [
        MESSAGES_ENV,
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", listen.as_str()),
    ];
    let out = env.cli_env(&["slot", "create"], &vars);
    assert!(out.status.success(), "{}", stderr(&out));
    // The LSNs pg_logical_emit_message returned, by event type (not published).
    env.db
        .psql("CREATE TABLE emitted (event_type text PRIMARY KEY, lsn pg_lsn NOT NULL)");
    let got = env.consumer().await;
    let relay = env.start_env(&[], &vars);
    write_transactions(&env);

    let msgs = got.wait_for(7, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let msgs_after = got.snapshot();
    assert_eq!(msgs_after.len(), 7, "nothing else arrives: {msgs_after:#?}");
    let types: Vec<String> = msgs
        .iter()
        .map(|m| m.header("event_type").unwrap_or_default())
        .collect();
    assert_eq!(
        types,
        [
            "row-1",
            "message-2",
            "row-3",
            "message-4",
            "row-5",
            "message-6",
            "row-7"
        ],
        "in the order written"
    );
    // Transaction A: one commit LSN and xid, tx_index counting rows and messages.
    let a = &msgs[..5];
    let index: Vec<String> = a.iter().map(|m| m.header("tx_index").unwrap()).collect();
    assert_eq!(index, ["0", "1", "2", "3", "4"]);
    for m in a {
        assert_eq!(m.header("commit_lsn"), a[0].header("commit_lsn"), "{m:?}");
        assert_eq!(m.header("xid"), a[0].header("xid"), "{m:?}");
    }
    let commits: Vec<u64> = [0, 5, 6]
        .iter()
        .map(|&i| lsn(&msgs[i].header("commit_lsn").unwrap()))
        .collect();
    assert!(commits.windows(2).all(|w| w[0] < w[1]), "{commits:?}");
    assert_ids(&env, &msgs);
    assert_like_a_row(&msgs);
    assert_ignored(&listen, &relay).await;
    stop(relay);
    env.cleanup().await;
}

/// The transactions of [`logical_messages`]: A mixes rows, relayed messages and two
/// that are no events; B is rolled back; C is one message alone, D one row.
fn write_transactions(env: &Env) {
    let row = |n: usize| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{}', 'order', 'a', 'row-{n}', '{{\"n\": {n}}}')",
            numbered_id(n)
        )
    };
    let relayed = |event_type: &str, extra: &str| {
        format!(
            "INSERT INTO emitted SELECT '{event_type}', {}",
            emit_call(true, "outbox", &message_content("a", event_type, extra))
        )
    };
    let select = |transactional: bool, prefix: &str, aggregate_id: &str, event_type: &str| {
        format!(
            "SELECT {}",
            emit_call(
                transactional,
                prefix,
                &message_content(aggregate_id, event_type, "")
            )
        )
    };
    // Transaction A: rows and messages interleaved, and two that are no events.
    let other_prefix = select(true, "other-tool", "ot", "other-prefix");
    let non_transactional = select(false, "outbox", "nt", "non-transactional-1");
    env.db.psql(&format!(
        "BEGIN; {}; {}; {non_transactional}; {other_prefix}; {}; {}; {}; COMMIT;",
        row(1),
        relayed("message-2", r#","headers":{"tenant":"acme"}"#),
        row(3),
        relayed("message-4", r#","id":"own-id-4""#),
        row(5),
    ));
    // Transaction B, rolled back: a row, a message, and a non-transactional message.
    let message = select(true, "outbox", "rb", "rolled-back-message");
    let non_transactional = select(false, "outbox", "nt", "non-transactional-2");
    env.db.psql(&format!(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'rb', 'rolled-back-row', '{{}}');
         {message}; {non_transactional}; ROLLBACK;"
    ));
    // C: a transaction of one message alone; D: one row.
    env.db.psql(&relayed("message-6", ""));
    env.db.psql(&row(7));
}

/// The message ids: the rows', the derived ones (from the LSN the emit returned,
/// recorded in `emitted`), the own one.
fn assert_ids(env: &Env, msgs: &[Msg]) {
    let system_id = env
        .db
        .psql("SELECT system_identifier FROM pg_control_system()");
    let emitted = |event_type: &str| {
        env.db.psql(&format!(
            "SELECT lsn FROM emitted WHERE event_type = '{event_type}'"
        ))
    };
    let derived = |event_type: &str| {
        format!(
            "outbox-relay/{}/{}/{}",
            system_id.trim(),
            env.db.name,
            emitted(event_type).trim()
        )
    };
    let ids: Vec<String> = msgs.iter().map(|m| m.message_id()).collect();
    assert_eq!(
        ids,
        [
            numbered_id(1),
            derived("message-2"),
            numbered_id(3),
            "own-id-4".to_string(),
            numbered_id(5),
            derived("message-6"),
            numbered_id(7),
        ]
    );
}

/// A message's event as a row's (`msgs[1]` against the row `msgs[0]`): table header,
/// headers object, body, routing.
fn assert_like_a_row(msgs: &[Msg]) {
    let m = &msgs[1];
    assert_eq!(m.header("outbox_table").as_deref(), Some("message:outbox"));
    assert_eq!(
        msgs[0].header("outbox_table").as_deref(),
        Some("public.outbox")
    );
    assert_eq!(m.header("tenant").as_deref(), Some("acme"));
    assert_eq!(m.header("aggregate_type").as_deref(), Some("order"));
    assert_eq!(m.header("aggregate_id").as_deref(), Some("a"));
    assert_eq!(m.text(), r#"{"n":"message-2"}"#);
    assert_eq!(m.routing_key, "order.message-2");
    assert_eq!(
        m.properties.content_type().as_ref().map(|c| c.as_str()),
        Some("application/json")
    );
}

/// The ignored messages, counted by reason on `/metrics` at `listen`; the
/// non-transactional ones logged once.
async fn assert_ignored(listen: &str, relay: &Relay) {
    let name = "outbox_relay_messages_ignored_total";
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        if let Some((200, body)) = http_get(listen, "/metrics").await {
            let counts = (
                metric(&body, name, "reason=\"non_transactional\""),
                metric(&body, name, "reason=\"other_prefix\""),
            );
            if counts == (Some(2.0), Some(1.0)) {
                break;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: 2 non_transactional and 1 other_prefix expected; last scrape:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = relay.log_text();
    assert_eq!(
        log.matches("a non-transactional logical message with a relayed prefix was ignored")
            .count(),
        1,
        "logged once a minute: {log}"
    );
    assert!(
        !log.contains("other-tool"),
        "other prefixes are not logged: {log}"
    );
}

/// A producer of events for the fault and stream tests (SQL to run once in the
/// test's database, which has the default outbox): `produce(a, b, with_rows)` writes
/// events `a..=b` in the calling transaction, each either an outbox row (with rows,
/// two of every three) or a transactional logical message of prefix `outbox` (every
/// fifth of those with an `id` of its own), in that order, `aggregate_type = 'seq'`
/// and `aggregate_id` the event's number. `produced` (no published table) records
/// each number and, for a message, the LSN `pg_logical_emit_message` returned and
/// its own id. Each call first emits a non-transactional message with the prefix
/// `outbox` and a transactional one of another prefix: neither is an event.
pub const MESSAGE_PRODUCER: &str = r#"
CREATE TABLE produced (seq bigint PRIMARY KEY, lsn pg_lsn, own_id text);
CREATE FUNCTION produce(a bigint, b bigint, with_rows boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  own text;
BEGIN
  PERFORM pg_catalog.pg_logical_emit_message(false, 'outbox',
    '{"aggregate_type":"nontx","aggregate_id":"0","event_type":"tick","payload":{}}'::text);
  PERFORM pg_catalog.pg_logical_emit_message(true, 'other-tool', 'not an event'::text);
  FOR s IN a..b LOOP
    IF with_rows AND s % 3 <> 0 THEN
      INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
      VALUES ('seq', s::text, 'tick', jsonb_build_object('seq', s));
      INSERT INTO produced (seq) VALUES (s);
    ELSE
      own := CASE WHEN s % 5 = 0 THEN 'own-' || s END;
      INSERT INTO produced (seq, lsn, own_id) VALUES (s,
        pg_catalog.pg_logical_emit_message(true, 'outbox', jsonb_strip_nulls(jsonb_build_object(
          'aggregate_type', 'seq', 'aggregate_id', s::text, 'event_type', 'tick',
          'payload', jsonb_build_object('seq', s), 'id', own))::text),
        own);
    END IF;
  END LOOP;
END $$;
"#;

/// One transaction of [`MESSAGE_PRODUCER`]: events `from..=to`, unless an earlier
/// attempt committed them (so that a retry after an unknown outcome cannot produce
/// them twice).
pub fn produce_sql(from: u64, to: u64, with_rows: bool) -> String {
    format!(
        "SELECT produce({from}, {to}, {with_rows})
          WHERE NOT EXISTS (SELECT 1 FROM produced WHERE seq = {from})"
    )
}

/// `seq|id` of every event [`MESSAGE_PRODUCER`] committed: a row's id, a message's
/// own id or the id the relay derives for it, `outbox-relay/<system
/// identifier>/<database>/<LSN of the message>` (docs/messages.md).
pub const PRODUCED_IDS: &str = "SELECT o.aggregate_id::bigint, o.id::text
       FROM outbox o JOIN produced p ON p.seq::text = o.aggregate_id AND p.lsn IS NULL
      WHERE o.aggregate_type = 'seq'
     UNION ALL
     SELECT seq, coalesce(own_id, 'outbox-relay/'
            || (SELECT system_identifier FROM pg_control_system()) || '/'
            || current_database() || '/' || lsn::text)
       FROM produced WHERE lsn IS NOT NULL";
