//! The headers matcher of `check --routes` ([`publisher::routing`]) against
//! RabbitMQ's own headers exchange (testkit's broker): random bindings (`x-match`
//! `all`, `any`, `all-with-x`, `any-with-x`, and none; `x-` arguments among them) and
//! random messages with string headers, as the relay sends them, seeded.
//!
//! A failure prints the seed; `OUTBOX_TEST_HEADERS_SEED=<seed>` runs the same again.
//! size: one seeded run against the broker: bind, publish, read back, compare share seed and queues
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use publisher::routing::{Binding, Destination, Exchange, Headers, Kind, Topology};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const BINDINGS: usize = 120;
const MESSAGES: usize = 80;
const KEYS: [&str; 4] = ["event_type", "aggregate_type", "x-tenant", "x-region"];
const VALUES: [&str; 2] = ["a", "b"];
const MODES: [Option<&str>; 5] = [
    None,
    Some("all"),
    Some("any"),
    Some("all-with-x"),
    Some("any-with-x"),
];

/// A random subset of the keys, each with a random value.
fn pairs(rng: &mut StdRng) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for k in KEYS {
        if rng.gen_bool(0.5) {
            out.insert(
                k.to_string(),
                VALUES[rng.gen_range(0..VALUES.len())].to_string(),
            );
        }
    }
    out
}

fn table(pairs: &BTreeMap<String, String>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(
            k.as_str().into(),
            AMQPValue::LongString(LongString::from(v.as_bytes().to_vec())),
        );
    }
    t
}

#[tokio::test]
async fn headers_matcher_agrees_with_rabbitmq() {
    let seed: u64 = match std::env::var("OUTBOX_TEST_HEADERS_SEED") {
        Ok(s) => s.parse().expect("OUTBOX_TEST_HEADERS_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    eprintln!(
        "headers routing property test: seed {seed} (OUTBOX_TEST_HEADERS_SEED={seed} repeats it)"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let bindings: Vec<(Option<&str>, BTreeMap<String, String>)> = (0..BINDINGS)
        .map(|_| (MODES[rng.gen_range(0..MODES.len())], pairs(&mut rng)))
        .collect();
    let messages: Vec<BTreeMap<String, String>> = (0..MESSAGES).map(|_| pairs(&mut rng)).collect();

    let connection = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let exchange = testkit::unique_name("headers_prop");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Headers,
            ExchangeDeclareOptions {
                auto_delete: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut model = Exchange::new(Kind::Headers);
    let mut queues = Vec::new();
    for (i, (mode, args)) in bindings.iter().enumerate() {
        let queue = format!("{exchange}_q{i}");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut arguments = args.clone();
        if let Some(m) = mode {
            arguments.insert("x-match".into(), m.to_string());
        }
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                table(&arguments),
            )
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: binding {arguments:?} refused: {e}"));
        model.bindings.push(Binding {
            destination: Destination::Queue(queue.clone()),
            routing_key: String::new(),
            arguments: arguments
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect(),
        });
        queues.push(queue);
    }

    let mut confirms = Vec::new();
    for (m, headers) in messages.iter().enumerate() {
        let confirm = channel
            .basic_publish(
                exchange.as_str().into(),
                "".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                m.to_string().as_bytes(),
                BasicProperties::default().with_headers(table(headers)),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    let mut returned = BTreeSet::new();
    for (m, confirm) in confirms.into_iter().enumerate() {
        match confirm.await.unwrap() {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(_)) => {
                returned.insert(m);
            }
            other => panic!("seed {seed}: message {m} not acked: {other:?}"),
        }
    }
    let mut reached: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for queue in &queues {
        while let Some(d) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let m: usize = std::str::from_utf8(&d.delivery.data)
                .unwrap()
                .parse()
                .unwrap();
            reached.entry(m).or_default().insert(queue.clone());
        }
    }
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.ok();

    let mut topology = Topology::default();
    topology.exchanges.insert(exchange.clone(), model);
    topology.queues.extend(queues.iter().cloned());
    let mut disagreements = Vec::new();
    for (m, headers) in messages.iter().enumerate() {
        let broker = reached.remove(&m).unwrap_or_default();
        assert_eq!(returned.contains(&m), broker.is_empty(), "seed {seed}");
        let ours = topology
            .route(
                &exchange,
                "",
                &Headers {
                    values: headers.clone(),
                    complete: true,
                },
            )
            .queues;
        for q in broker.symmetric_difference(&ours) {
            let i: usize = q.rsplit("_q").next().unwrap().parse().unwrap();
            disagreements.push(format!(
                "binding {:?} {:?}, message headers {headers:?}: RabbitMQ {}, matcher {}",
                bindings[i].0,
                bindings[i].1,
                if broker.contains(q) {
                    "routes"
                } else {
                    "does not route"
                },
                if ours.contains(q) {
                    "matches"
                } else {
                    "does not match"
                },
            ));
        }
    }
    assert!(
        disagreements.is_empty(),
        "seed {seed} (OUTBOX_TEST_HEADERS_SEED={seed} repeats it): {} disagreements, the first:\n{}",
        disagreements.len(),
        disagreements.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}
