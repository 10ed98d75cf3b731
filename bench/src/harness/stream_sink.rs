//! The stream consumer of the stream figures: a client on the stream port, and a
//! stream read from its first offset, counting the messages it holds.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rabbitmq_stream_client::types::{MessageResult, OffsetSpecification, ResponseKind};
use rabbitmq_stream_client::Client as StreamClient;
use testkit::unique_name;
use tokio::sync::mpsc;

/// A client on the stream port (`OUTBOX_TEST_STREAM_URL`); an error instead of the
/// test helper's panic when the broker is unreachable.
pub async fn stream_client() -> anyhow::Result<StreamClient> {
    tokio::spawn(testkit::stream::client()).await.map_err(|_| {
        // Host and port only: the URL's user info may hold a password.
        let url = testkit::stream::stream_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let host = rest
            .rsplit_once('@')
            .map_or(rest, |(_, r)| r)
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string();
        anyhow::anyhow!(
            "cannot connect to the RabbitMQ stream port at {host} (is rabbitmq_stream enabled? OUTBOX_TEST_STREAM_URL sets the URL)"
        )
    })
}

/// A fresh stream with a consumer reading it from the first offset, counting the
/// messages it holds.
pub struct StreamSink {
    pub stream: String,
    pub count: Arc<AtomicUsize>,
    /// When the first message arrived.
    pub first: Arc<OnceLock<Instant>>,
    client: StreamClient,
}

impl StreamSink {
    pub async fn new() -> anyhow::Result<StreamSink> {
        let stream = unique_name("bstream");
        let client = stream_client().await?;
        let response = client
            .create_stream(&stream, HashMap::new())
            .await
            .context("create stream")?;
        if !response.is_ok() {
            bail!("creating stream {stream}: {:?}", response.code());
        }
        Self::on(client, stream).await
    }

    /// A consumer on `client` reading the existing `stream` from its first offset
    /// (e.g. a replicated stream declared over AMQP); [`StreamSink::cleanup`] deletes it.
    pub async fn on(client: StreamClient, stream: String) -> anyhow::Result<StreamSink> {
        let count = Arc::new(AtomicUsize::new(0));
        let (credit_tx, mut credit_rx) = mpsc::unbounded_channel::<()>();
        let first = Arc::new(OnceLock::new());
        let (counted, first_at) = (count.clone(), first.clone());
        // Chunks may arrive twice or out of order (client 0.4 on RabbitMQ 3.10, see
        // testkit::stream::read): count each chunk once.
        let seen = Arc::new(Mutex::new(HashSet::new()));
        let handler = move |item: MessageResult| {
            let (counted, seen, credit_tx) = (counted.clone(), seen.clone(), credit_tx.clone());
            let first_at = first_at.clone();
            async move {
                if let Some(Ok(response)) = item {
                    if let ResponseKind::Deliver(d) = response.kind() {
                        let new = seen
                            .lock()
                            .map(|mut s| s.insert(d.chunk_first_offset))
                            .unwrap_or(false);
                        if new {
                            let _ = first_at.set(Instant::now());
                            counted.fetch_add(d.messages.len(), Ordering::Relaxed);
                        }
                        let _ = credit_tx.send(());
                    }
                }
                Ok(())
            }
        };
        client.set_handler(handler).await;
        let response = client
            .subscribe(
                STREAM_SUBSCRIPTION,
                &stream,
                OffsetSpecification::First,
                STREAM_CREDIT,
                HashMap::new(),
            )
            .await
            .context("subscribe to the stream")?;
        if !response.is_ok() {
            bail!("subscribing to stream {stream}: {:?}", response.code());
        }
        let credit_client = client.clone();
        tokio::spawn(async move {
            while credit_rx.recv().await.is_some() {
                if credit_client.credit(STREAM_SUBSCRIPTION, 1).await.is_err() {
                    break;
                }
            }
        });
        Ok(StreamSink {
            stream,
            count,
            first,
            client,
        })
    }

    /// Waits until the stream holds `n` messages; errors after `timeout`.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            let have = self.count.load(Ordering::Relaxed);
            if have >= n {
                return Ok(Instant::now());
            }
            if Instant::now() > deadline {
                bail!("timed out with {have} of {n} messages in the stream");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Deletes the stream.
    pub async fn cleanup(self) {
        let _ = self.client.unsubscribe(STREAM_SUBSCRIPTION).await;
        let _ = self.client.delete_stream(&self.stream).await;
        let _ = self.client.close().await;
    }
}

const STREAM_SUBSCRIPTION: u8 = 1;
/// Chunks the consumer asks for ahead.
const STREAM_CREDIT: u16 = 32;
