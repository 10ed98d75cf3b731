//! RabbitMQ helpers for tests: a broker handle that declares uniquely named
//! exchanges and queues (deleted by `cleanup`), and a consumer that records every
//! delivery for assertions.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::{amqp_url, unique_name};

/// One received message.
#[derive(Debug, Clone)]
pub struct Msg {
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    pub redelivered: bool,
}

impl Msg {
    /// The `message_id` property ("" when absent).
    pub fn message_id(&self) -> String {
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default()
    }

    /// A header value as text: strings as-is, integers and booleans printed.
    pub fn header(&self, key: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?;
        let value = headers.inner().get(key)?;
        Some(match value {
            AMQPValue::LongString(s) => s.to_string(),
            AMQPValue::ShortString(s) => s.as_str().to_string(),
            AMQPValue::Boolean(b) => b.to_string(),
            AMQPValue::LongLongInt(i) => i.to_string(),
            AMQPValue::LongInt(i) => i.to_string(),
            AMQPValue::LongUInt(i) => i.to_string(),
            AMQPValue::ShortInt(i) => i.to_string(),
            AMQPValue::ShortUInt(i) => i.to_string(),
            other => format!("{other:?}"),
        })
    }

    /// The body as UTF-8 text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// What a consumer received so far, shared with its task.
#[derive(Clone, Default)]
pub struct Received(Arc<Mutex<Vec<Msg>>>);

impl Received {
    /// A copy of everything received so far.
    pub fn snapshot(&self) -> Vec<Msg> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many messages were received so far.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when nothing was received.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until `pred` holds for the received messages; panics with what arrived
    /// after `timeout`.
    pub async fn wait_until(&self, timeout: Duration, pred: impl Fn(&[Msg]) -> bool) -> Vec<Msg> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let snap = self.snapshot();
            if pred(&snap) {
                return snap;
            }
            if tokio::time::Instant::now() > deadline {
                let ids: Vec<String> = snap.iter().map(|m| m.message_id()).collect();
                panic!(
                    "timed out after {timeout:?} with {} messages received: {:?}",
                    snap.len(),
                    &ids[..ids.len().min(50)]
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until at least `n` messages arrived.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Msg> {
        self.wait_until(timeout, |m| m.len() >= n).await
    }
}

/// A broker connection for a test; names it declares are removed by `cleanup`.
pub struct TestBroker {
    pub connection: Connection,
    pub channel: Channel,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl TestBroker {
    /// Connects to the test broker.
    pub async fn connect() -> TestBroker {
        Self::connect_to(&amqp_url()).await
    }

    /// Connects to the broker at `url` (e.g. another node than the test broker).
    pub async fn connect_to(url: &str) -> TestBroker {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect to RabbitMQ at {url}: {e}"));
        let channel = connection.create_channel().await.expect("open a channel");
        TestBroker {
            connection,
            channel,
            exchanges: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// A unique exchange name, remembered for cleanup (the relay may declare it).
    pub fn exchange_name(&mut self, prefix: &str) -> String {
        let name = unique_name(prefix);
        self.exchanges.push(name.clone());
        name
    }

    /// Declares a durable exchange of `kind` ("topic", "direct", "fanout", "headers").
    pub async fn declare_exchange(&mut self, name: &str, kind: &str) {
        let kind = match kind {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "headers" => ExchangeKind::Headers,
            _ => ExchangeKind::Topic,
        };
        self.channel
            .exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        if !self.exchanges.iter().any(|e| e == name) {
            self.exchanges.push(name.to_string());
        }
    }

    /// A new queue (with `arguments`) bound to `exchange` with `key`.
    pub async fn queue_bound_with(
        &mut self,
        exchange: &str,
        key: &str,
        arguments: FieldTable,
    ) -> String {
        let name = unique_name("q");
        self.channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                arguments,
            )
            .await
            .expect("declare queue");
        self.queues.push(name.clone());
        self.channel
            .queue_bind(
                name.as_str().into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind queue");
        name
    }

    /// A new queue bound to `exchange` with `key` ("#" = everything on a topic exchange).
    pub async fn queue_bound(&mut self, exchange: &str, key: &str) -> String {
        self.queue_bound_with(exchange, key, FieldTable::default())
            .await
    }

    /// Starts a consumer (auto-ack) on `queue` recording every delivery.
    pub async fn consume(&self, queue: &str) -> Received {
        let channel = self
            .connection
            .create_channel()
            .await
            .expect("open a channel");
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
            .await
            .expect("consume");
        let received = Received::default();
        let sink = received.clone();
        tokio::spawn(async move {
            let _keep = channel;
            while let Some(Ok(d)) = consumer.next().await {
                let msg = Msg {
                    exchange: d.exchange.as_str().to_string(),
                    routing_key: d.routing_key.as_str().to_string(),
                    body: d.data.to_vec(),
                    properties: d.properties.clone(),
                    redelivered: d.redelivered,
                };
                sink.0.lock().unwrap_or_else(|e| e.into_inner()).push(msg);
            }
        });
        received
    }

    /// Deletes the exchanges and queues this test declared.
    pub async fn cleanup(self) {
        for q in &self.queues {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for e in &self.exchanges {
            let _ = self
                .channel
                .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.connection.close(200, "test done".into()).await;
    }
}

/// Lowers the broker's `max_message_size` (channels opened afterwards enforce it)
/// and restores the value it found when dropped, even when the test panics. Only
/// messages over the limit notice it; it is broker-wide all the same.
pub struct MaxMessageSize(String);

/// RabbitMQ's default `max_message_size` (128 MiB).
const DEFAULT_MAX_MESSAGE_SIZE: &str = "134217728";

impl MaxMessageSize {
    pub fn set(bytes: usize) -> MaxMessageSize {
        let out = crate::rabbitmqctl_command()
            .args([
                "-q",
                "eval",
                "application:get_env(rabbit, max_message_size).",
            ])
            .output()
            .expect("run rabbitmqctl");
        let text = String::from_utf8_lossy(&out.stdout);
        // A value this small can only be a test's that was not restored: restore the
        // broker's default then.
        let original = text
            .trim()
            .strip_prefix("{ok,")
            .and_then(|s| s.strip_suffix('}'))
            .filter(|v| v.parse::<u64>().is_ok_and(|v| v >= 1 << 20))
            .unwrap_or(DEFAULT_MAX_MESSAGE_SIZE)
            .to_string();
        let guard = MaxMessageSize(original);
        set_max_message_size(&bytes.to_string());
        guard
    }
}

impl Drop for MaxMessageSize {
    fn drop(&mut self) {
        set_max_message_size(&self.0);
    }
}

fn set_max_message_size(value: &str) {
    let status = crate::rabbitmqctl_command()
        .args([
            "-q",
            "eval",
            // RabbitMQ 4 reads the limit from a persistent term set at boot; 3.x from
            // the application's environment, per channel.
            &format!(
                "application:set_env(rabbit, max_message_size, {value}), \
                 persistent_term:put(max_message_size, {value})."
            ),
        ])
        .status()
        .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl eval max_message_size failed");
}
