use serde_json::json;

use super::*;

fn q(name: &str, key: &str) -> Binding {
    Binding {
        destination: Destination::Queue(name.into()),
        routing_key: key.into(),
        arguments: BTreeMap::new(),
    }
}

fn e2e(name: &str, key: &str) -> Binding {
    Binding {
        destination: Destination::Exchange(name.into()),
        routing_key: key.into(),
        arguments: BTreeMap::new(),
    }
}

fn hq(name: &str, args: serde_json::Value) -> Binding {
    let serde_json::Value::Object(map) = args else {
        panic!("an object")
    };
    Binding {
        destination: Destination::Queue(name.into()),
        routing_key: String::new(),
        arguments: map.into_iter().collect(),
    }
}

fn topology(exchanges: Vec<(&str, Kind, Vec<Binding>)>) -> Topology {
    let mut t = Topology::default();
    for (name, kind, bindings) in exchanges {
        for b in &bindings {
            if let Destination::Queue(q) = &b.destination {
                t.queues.insert(q.clone());
            }
        }
        let mut x = Exchange::new(kind);
        x.bindings = bindings;
        t.exchanges.insert(name.into(), x);
    }
    t
}

fn queues(r: &Route) -> Vec<&str> {
    r.queues.iter().map(String::as_str).collect()
}

fn headers(pairs: &[(&str, &str)]) -> Headers {
    Headers {
        values: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        complete: true,
    }
}

#[test]
fn topic_words_follow_rabbitmq() {
    assert_eq!(topic_words(""), Vec::<&str>::new());
    assert_eq!(topic_words("a"), ["a"]);
    assert_eq!(topic_words("a."), ["a", ""]);
    assert_eq!(topic_words("."), ["", ""]);
    assert_eq!(topic_words("a..b"), ["a", "", "b"]);
}

#[test]
fn topic_matching() {
    let cases: &[(&str, &str, bool)] = &[
        ("order.created", "order.created", true),
        ("order.created", "order.updated", false),
        ("order.*", "order.created", true),
        ("order.*", "order", false),
        ("order.*", "order.a.b", false),
        ("order.#", "order", true),
        ("order.#", "order.a.b", true),
        ("#", "", true),
        ("#", "a.b.c", true),
        ("*", "", false),
        ("*", "a", true),
        ("", "", true),
        ("", "a", false),
        ("a", "", false),
        // Empty words are words.
        ("*", ".", false),
        ("*.*", ".", true),
        ("a.*", "a.", true),
        ("a.#", "a.", true),
        ("#.", "", false),
        ("#.", "a.", true),
        ("#.#", "", true),
        ("#.*.#", "", false),
        ("#.*.#", "x", true),
        ("*.#.*", "a", false),
        ("*.#.*", "a.b", true),
        ("#.b.#", "a.b.c", true),
        ("#.b.#", "b", true),
        ("#.b.#", "a.c", false),
        // Only whole words are wildcards.
        ("a*", "ab", false),
        ("a*", "a*", true),
        ("a#", "a", false),
        ("a.#b", "a.x", false),
    ];
    for (pattern, key, expected) in cases {
        assert_eq!(
            topic_matches(pattern, key),
            *expected,
            "pattern {pattern:?} key {key:?}"
        );
    }
}

#[test]
fn direct_fanout_and_topic_exchanges() {
    let t = topology(vec![
        (
            "d",
            Kind::Direct,
            vec![q("qa", "a"), q("qb", "b"), q("qa2", "a")],
        ),
        ("f", Kind::Fanout, vec![q("f1", "ignored"), q("f2", "")]),
        (
            "t",
            Kind::Topic,
            vec![q("t1", "a.*"), q("t2", "#"), q("t3", "b.#")],
        ),
    ]);
    let h = Headers::default();
    assert_eq!(queues(&t.route("d", "a", &h)), ["qa", "qa2"]);
    assert_eq!(t.route("d", "c", &h).verdict(), Verdict::Unroutable);
    assert_eq!(queues(&t.route("f", "anything", &h)), ["f1", "f2"]);
    assert_eq!(queues(&t.route("t", "a.x", &h)), ["t1", "t2"]);
    assert_eq!(queues(&t.route("t", "b", &h)), ["t2", "t3"]);
}

#[test]
fn headers_exchange_modes() {
    let t = topology(vec![(
        "h",
        Kind::Headers,
        vec![
            hq(
                "all",
                json!({"x-match": "all", "event_type": "created", "aggregate_type": "order"}),
            ),
            hq("default_all", json!({"event_type": "created"})),
            hq(
                "any",
                json!({"x-match": "any", "event_type": "deleted", "aggregate_type": "order"}),
            ),
            hq(
                "ignores_x",
                json!({"x-match": "all", "event_type": "created", "x-tenant": "t1"}),
            ),
            hq(
                "with_x",
                json!({"x-match": "all-with-x", "event_type": "created", "x-tenant": "t1"}),
            ),
            hq(
                "any_with_x",
                json!({"x-match": "any-with-x", "x-tenant": "t1"}),
            ),
            hq("any_only_x", json!({"x-match": "any", "x-tenant": "t1"})),
            hq("all_empty", json!({})),
            hq("number", json!({"xid": 42})),
        ],
    )]);
    let r = t.route(
        "h",
        "",
        &headers(&[
            ("event_type", "created"),
            ("aggregate_type", "order"),
            ("xid", "42"),
        ]),
    );
    assert_eq!(
        queues(&r),
        [
            "all",
            "all_empty",
            "any",
            "default_all",
            "ignores_x",
            "number"
        ]
    );
    let r = t.route(
        "h",
        "",
        &headers(&[("event_type", "created"), ("x-tenant", "t1"), ("xid", "7")]),
    );
    assert_eq!(
        queues(&r),
        [
            "all_empty",
            "any_with_x",
            "default_all",
            "ignores_x",
            "with_x"
        ]
    );
    let r = t.route("h", "", &headers(&[("aggregate_type", "invoice")]));
    assert_eq!(queues(&r), ["all_empty"]);
}

#[test]
fn headers_that_vary_per_row_are_not_evaluated() {
    let t = topology(vec![(
        "h",
        Kind::Headers,
        vec![hq(
            "tenant",
            json!({"x-match": "all", "event_type": "created", "tenant": "t1"}),
        )],
    )]);
    let mut h = headers(&[("event_type", "created")]);
    h.complete = false;
    let r = t.route("h", "", &h);
    assert_eq!(r.verdict(), Verdict::NotEvaluated);
    // A known mismatch decides it whatever the unknown header holds.
    let mut h = headers(&[("event_type", "deleted")]);
    h.complete = false;
    assert_eq!(t.route("h", "", &h).verdict(), Verdict::Unroutable);
}

#[test]
fn exchange_to_exchange_bindings_are_followed_with_cycles_cut() {
    let t = topology(vec![
        (
            "outbox",
            Kind::Topic,
            vec![e2e("orders", "order.#"), e2e("audit", "#")],
        ),
        (
            "orders",
            Kind::Direct,
            vec![
                q("billing", "order.created"),
                e2e("outbox", "order.created"),
            ],
        ),
        (
            "audit",
            Kind::Fanout,
            vec![q("audit_log", ""), e2e("audit", "")],
        ),
    ]);
    let h = Headers::default();
    let r = t.route("outbox", "order.created", &h);
    assert_eq!(queues(&r), ["audit_log", "billing"]);
    assert_eq!(r.exchanges.len(), 3);
    let r = t.route("outbox", "order.deleted", &h);
    assert_eq!(queues(&r), ["audit_log"]);
}

#[test]
fn alternate_exchange_takes_what_routes_nowhere() {
    let mut t = topology(vec![
        (
            "main",
            Kind::Direct,
            vec![q("known", "k"), e2e("dead_end", "to_dead_end")],
        ),
        ("dead_end", Kind::Direct, vec![]),
        ("unrouted", Kind::Fanout, vec![q("unrouted_q", "")]),
    ]);
    let h = Headers::default();
    assert_eq!(t.route("main", "other", &h).verdict(), Verdict::Unroutable);
    t.exchanges.get_mut("main").unwrap().alternate = Some("unrouted".into());
    assert_eq!(queues(&t.route("main", "other", &h)), ["unrouted_q"]);
    assert_eq!(queues(&t.route("main", "k", &h)), ["known"]);
    // Routed to an exchange that routes nowhere: not the first one's alternate.
    assert_eq!(
        t.route("main", "to_dead_end", &h).verdict(),
        Verdict::Unroutable
    );
    // ... but that exchange's own alternate, if it has one.
    t.exchanges.get_mut("dead_end").unwrap().alternate = Some("unrouted".into());
    assert_eq!(queues(&t.route("main", "to_dead_end", &h)), ["unrouted_q"]);
}

#[test]
fn consistent_hash_and_unknown_types_are_never_routed() {
    let t = topology(vec![
        ("outbox", Kind::Topic, vec![e2e("hash", "#")]),
        (
            "hash",
            Kind::of("x-consistent-hash", &BTreeMap::new()),
            vec![q("h1", "1"), q("h2", "1")],
        ),
        ("weird", Kind::Other("x-weird".into()), vec![q("w", "")]),
    ]);
    let h = Headers::default();
    let r = t.route("outbox", "a", &h);
    assert_eq!(r.verdict(), Verdict::NotEvaluated);
    assert!(r.queues.is_empty());
    assert!(r.not_evaluated[0].contains("x-consistent-hash"));
    assert_eq!(t.route("weird", "a", &h).verdict(), Verdict::NotEvaluated);
}

#[test]
fn delayed_message_exchange_routes_as_its_delayed_type() {
    let args: BTreeMap<String, Value> = [("x-delayed-type".to_string(), json!("direct"))].into();
    assert_eq!(Kind::of("x-delayed-message", &args), Kind::Direct);
    assert_eq!(
        Kind::of("x-delayed-message", &BTreeMap::new()),
        Kind::Other("x-delayed-message".into())
    );
}

#[test]
fn missing_internal_and_default_exchanges() {
    let mut t = topology(vec![("i", Kind::Fanout, vec![q("iq", "")])]);
    t.exchanges.get_mut("i").unwrap().internal = true;
    let h = Headers::default();
    let r = t.route("i", "", &h);
    assert_eq!(r.verdict(), Verdict::Unroutable);
    assert!(r.notes[0].contains("internal"));
    let r = t.route("nope", "", &h);
    assert_eq!(r.verdict(), Verdict::Unroutable);
    assert!(r.notes[0].contains("does not exist"));
    // The default exchange: by queue name.
    assert_eq!(queues(&t.route("", "iq", &h)), ["iq"]);
    assert_eq!(t.route("", "other", &h).verdict(), Verdict::NotEvaluated);
    t.queues_complete = true;
    assert_eq!(t.route("", "other", &h).verdict(), Verdict::Unroutable);
}

#[test]
fn an_exchange_under_an_unread_policy_is_not_evaluated_when_it_routes_nowhere() {
    let mut t = topology(vec![("orders", Kind::Direct, vec![q("billing", "paid")])]);
    t.exchanges.get_mut("orders").unwrap().unread_policy = Some("ae".into());
    // A key its bindings route is decided whatever the policy says.
    let r = t.route("orders", "paid", &Headers::default());
    assert_eq!(queues(&r), ["billing"]);
    assert!(r.not_evaluated.is_empty());
    // A key they do not route may reach the policy's alternate exchange: unknown.
    let r = t.route("orders", "refunded", &Headers::default());
    assert!(r.queues.is_empty());
    assert_eq!(r.not_evaluated.len(), 1, "{r:?}");
    assert!(r.not_evaluated[0].contains("\"ae\""), "{r:?}");
}

#[test]
fn merge_adds_what_is_missing_only() {
    let mut a = Topology::default();
    a.exchanges.insert("x".into(), Exchange::new(Kind::Topic));
    let mut b = Topology::default();
    let mut x = Exchange::new(Kind::Direct);
    x.bindings.push(q("q", "k"));
    b.exchanges.insert("x".into(), x.clone());
    b.exchanges.insert("y".into(), x);
    b.queues.insert("q".into());
    a.merge(b.clone());
    a.merge(b);
    assert_eq!(a.exchanges["x"].kind, Kind::Topic);
    assert_eq!(a.exchanges["x"].bindings.len(), 1);
    assert_eq!(a.exchanges.len(), 2);
}

/// The broker's defaults are added where missing, never over a declared one.
#[test]
fn broker_defaults_fill_in_only() {
    let mut t = Topology::default();
    t.exchanges
        .insert("amq.topic".into(), Exchange::new(Kind::Fanout));
    t.add_broker_defaults();
    assert_eq!(t.exchanges["amq.topic"].kind, Kind::Fanout);
    assert_eq!(t.exchanges["amq.match"].kind, Kind::Headers);
    assert_eq!(t.exchanges.len(), 5);
}
