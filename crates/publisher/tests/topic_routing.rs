//! The topic matcher of `check --routes` ([`publisher::routing::topic_matches`])
//! against RabbitMQ's own routing (testkit's broker): random binding keys and routing
//! keys, over a small alphabet with empty words, `*` and `#`, seeded.
//!
//! One topic exchange, one queue per binding key; every routing key is published
//! with `mandatory` and confirms; then each queue says which keys reached it, and a
//! returned message says that a key reached none. Every (binding key, routing key)
//! pair must agree with the matcher.
//!
//! A failure prints the seed; `OUTBOX_TEST_TOPIC_SEED=<seed>` runs the same keys again.
//! size: one seeded run against the broker: bind, publish, read back, compare share seed and queues
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::Confirmation;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use publisher::routing::topic_matches;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Binding keys (one queue each).
const PATTERNS: usize = 300;
/// Random routing keys, besides every key of up to three words over the alphabet.
const RANDOM_KEYS: usize = 160;

const KEY_WORDS: [&str; 3] = ["a", "b", ""];
const PATTERN_WORDS: [&str; 5] = ["a", "b", "", "*", "#"];

fn random_key(rng: &mut StdRng, alphabet: &[&str], max_words: usize) -> String {
    let n = rng.gen_range(0..=max_words);
    let words: Vec<&str> = (0..n)
        .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
        .collect();
    words.join(".")
}

/// Every key of up to `max` words over [`KEY_WORDS`] (the empty key included; note
/// that one empty word and no word are the same key, "").
fn all_keys(max: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::from([String::new()]);
    let mut level = vec![Vec::<&str>::new()];
    for _ in 0..max {
        let mut next = Vec::new();
        for words in &level {
            for w in KEY_WORDS {
                let mut longer = words.clone();
                longer.push(w);
                out.insert(longer.join("."));
                next.push(longer);
            }
        }
        level = next;
    }
    out
}

#[tokio::test]
async fn topic_matcher_agrees_with_rabbitmq() {
    let seed: u64 = match std::env::var("OUTBOX_TEST_TOPIC_SEED") {
        Ok(s) => s.parse().expect("OUTBOX_TEST_TOPIC_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    eprintln!(
        "topic routing property test: seed {seed} (OUTBOX_TEST_TOPIC_SEED={seed} repeats it)"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let patterns: Vec<String> = (0..PATTERNS)
        .map(|_| random_key(&mut rng, &PATTERN_WORDS, 5))
        .collect();
    let mut keys = all_keys(3);
    while keys.len() < 40 + RANDOM_KEYS {
        keys.insert(random_key(&mut rng, &KEY_WORDS, 6));
    }
    let keys: Vec<String> = keys.into_iter().collect();

    let connection = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let exchange = testkit::unique_name("topic_prop");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                auto_delete: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut queues = Vec::new();
    for (i, pattern) in patterns.iter().enumerate() {
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
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                pattern.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        queues.push(queue);
    }

    // Publish every key (body: its index), mandatory, then collect the confirms.
    let mut confirms = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let confirm = channel
            .basic_publish(
                exchange.as_str().into(),
                key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                k.to_string().as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    let mut returned = BTreeSet::new();
    for (k, confirm) in confirms.into_iter().enumerate() {
        match confirm.await.unwrap() {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(_)) => {
                returned.insert(k);
            }
            other => panic!("seed {seed}: key {:?} not acked: {other:?}", keys[k]),
        }
    }
    // Which keys reached each queue.
    let mut reached: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for (i, queue) in queues.iter().enumerate() {
        let got = reached.entry(i).or_default();
        while let Some(m) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let k: usize = std::str::from_utf8(&m.delivery.data)
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                got.insert(k),
                "seed {seed}: a key delivered twice to one queue"
            );
        }
    }
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.ok();

    let mut disagreements = Vec::new();
    let mut matches = 0usize;
    for (k, key) in keys.iter().enumerate() {
        let mut any = false;
        for (i, pattern) in patterns.iter().enumerate() {
            let broker = reached[&i].contains(&k);
            let ours = topic_matches(pattern, key);
            any |= broker;
            matches += usize::from(broker);
            if broker != ours {
                disagreements.push(format!(
                    "binding key {pattern:?}, routing key {key:?}: RabbitMQ {}, matcher {}",
                    if broker { "routes" } else { "does not route" },
                    if ours { "matches" } else { "does not match" },
                ));
            }
        }
        assert_eq!(
            returned.contains(&k),
            !any,
            "seed {seed}: key {key:?} returned = {} but reached a queue = {any}",
            returned.contains(&k)
        );
    }
    eprintln!(
        "{} binding keys × {} routing keys: {matches} deliveries, {} keys returned",
        patterns.len(),
        keys.len(),
        returned.len()
    );
    assert!(
        disagreements.is_empty(),
        "seed {seed} (OUTBOX_TEST_TOPIC_SEED={seed} repeats it): {} disagreements, the first: \n{}",
        disagreements.len(),
        disagreements
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
