//! Broker refusals mid-run, as a RabbitMQ restart produces them: while a node boots
//! (or its vhost is being re-created) connections get 530 "vhost not found" or 403
//! "access refused". Once the relay has been connected, those are retried with backoff
//! like an unreachable broker; only the very first connection of the process may turn
//! them into exit 2 (docs/reliability.md, "Broker refusals during a restart").
//!
//! Each test has a vhost of its own (`rabbitmqctl add_vhost`), deleted by a guard on
//! drop, so nothing else on the broker is disturbed.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use support::{Env, Relay};
use testkit::unique_name;

const PATIENCE: Duration = Duration::from_secs(120);

fn rabbitmqctl(args: &[&str]) {
    let out = testkit::rabbitmqctl_command().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A vhost of the test's own with full permissions for guest; deleted on drop.
struct Vhost(String);

impl Vhost {
    fn create() -> Vhost {
        let vhost = Vhost(unique_name("relay_vh"));
        vhost.add();
        vhost
    }

    fn add(&self) {
        rabbitmqctl(&["add_vhost", &self.0]);
        self.grant();
    }

    fn grant(&self) {
        rabbitmqctl(&["set_permissions", "-p", &self.0, "guest", ".*", ".*", ".*"]);
    }

    /// Deletes the vhost (RabbitMQ closes its connections).
    fn delete(&self) {
        rabbitmqctl(&["delete_vhost", &self.0]);
    }

    /// Revokes guest's permissions and closes the vhost's connections, so that every
    /// reconnect is refused with 403 until [`Vhost::grant`].
    fn revoke(&self) {
        rabbitmqctl(&["clear_permissions", "-p", &self.0, "guest"]);
        rabbitmqctl(&[
            "close_all_connections",
            "-p",
            &self.0,
            "test revokes access",
        ]);
    }

    fn url(&self) -> String {
        testkit::amqp_url_for("guest", "guest", &self.0)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command()
            .args(["delete_vhost", &self.0])
            .output();
    }
}

/// A consumer in the test's vhost that (re)declares the exchange, its queue and the
/// binding every time it connects, so it follows the vhost being deleted and
/// re-created, and records the `aggregate_id` (the row's seq) of every delivery.
struct VhostConsumer {
    seqs: Arc<Mutex<HashSet<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl VhostConsumer {
    fn start(url: String, exchange: String, queue: String) -> VhostConsumer {
        let seqs = Arc::new(Mutex::new(HashSet::new()));
        let sink = seqs.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Err(e) = consume_once(&url, &exchange, &queue, &sink).await {
                    eprintln!("consumer: {e}; reconnecting");
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        VhostConsumer { seqs, task }
    }

    fn has_all(&self, from: u64, to: u64) -> bool {
        let seqs = self.seqs.lock().unwrap();
        (from..=to).all(|s| seqs.contains(&s))
    }
}

impl Drop for VhostConsumer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn consume_once(
    url: &str,
    exchange: &str,
    queue: &str,
    sink: &Mutex<HashSet<u64>>,
) -> Result<(), lapin::Error> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            unique_name("ctag").as_str().into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = consumer.next().await {
        let d = delivery?;
        let seq =
            d.properties
                .headers()
                .as_ref()
                .and_then(|h| match h.inner().get("aggregate_id") {
                    Some(AMQPValue::LongString(s)) => s.to_string().parse().ok(),
                    _ => None,
                });
        if let Some(seq) = seq {
            sink.lock().unwrap().insert(seq);
        }
    }
    Ok(())
}

/// Fails at once when the relay has exited (the defect: exit 2 on a broker refusal).
fn assert_running(relay: &mut Relay) {
    if let Some(status) = relay.child.try_wait().unwrap() {
        panic!(
            "the relay exited ({status}) instead of retrying:\n{}",
            relay.log_text()
        );
    }
}

/// Waits until rows `from..=to` arrived, checking all along that the relay runs.
async fn wait_rows(relay: &mut Relay, consumer: &VhostConsumer, from: u64, to: u64) {
    let deadline = Instant::now() + PATIENCE;
    while !consumer.has_all(from, to) {
        assert_running(relay);
        assert!(
            Instant::now() < deadline,
            "rows {from}..={to} did not all arrive:\n{}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sleeps `d`, checking that the relay keeps running meanwhile.
async fn keep_running_for(relay: &mut Relay, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        assert_running(relay);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_deleted_and_recreated_mid_run_is_retried() {
    let _shared = testkit::BROKER.read().await;
    let vhost = Vhost::create();
    let env = Env::new().await;
    env.create_slot();
    let queue = unique_name("q");
    let consumer = VhostConsumer::start(vhost.url(), env.exchange.clone(), queue.clone());
    let config = env.config_file("vhost.toml", &env.db.url(), &vhost.url(), "");
    let mut relay = env.start_with(&config, "info", &[]);

    env.insert_seq(1, 50, 10);
    wait_rows(&mut relay, &consumer, 1, 50).await;

    // The vhost goes away: its connections are closed, reconnects get 530 / 403.
    vhost.delete();
    keep_running_for(&mut relay, Duration::from_secs(3)).await;
    vhost.add();
    env.insert_seq(51, 50, 10);
    wait_rows(&mut relay, &consumer, 51, 100).await;

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    drop(consumer);
    drop(vhost);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_cleared_mid_run_are_retried() {
    let _shared = testkit::BROKER.read().await;
    let vhost = Vhost::create();
    let env = Env::new().await;
    env.create_slot();
    let queue = unique_name("q");
    let consumer = VhostConsumer::start(vhost.url(), env.exchange.clone(), queue.clone());
    let config = env.config_file("perm.toml", &env.db.url(), &vhost.url(), "");
    let mut relay = env.start_with(&config, "info", &[]);

    env.insert_seq(1, 50, 10);
    wait_rows(&mut relay, &consumer, 1, 50).await;

    // Access revoked: every reconnect is refused with 403 ACCESS_REFUSED.
    vhost.revoke();
    env.insert_seq(51, 50, 10);
    keep_running_for(&mut relay, Duration::from_secs(3)).await;
    vhost.grant();
    env.insert_seq(101, 50, 10);
    wait_rows(&mut relay, &consumer, 51, 150).await;

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    drop(consumer);
    drop(vhost);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_vhost_at_startup_is_still_exit_2() {
    let _shared = testkit::BROKER.read().await;
    let env = Env::new().await;
    env.create_slot();
    let url = testkit::amqp_url_for("guest", "guest", &unique_name("no_vh"));
    let config = env.config_file("missing.toml", &env.db.url(), &url, "");
    let mut relay = env.start_with(&config, "info", &[]);
    let code = relay.wait(Duration::from_secs(60));
    let log = relay.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("virtual host"), "{log}");
    env.cleanup().await;
}
