//! A recording consumer: an AMQP consumer with manual acks that records every
//! delivery ([`Rec`]) and reconnects when the broker goes away (prefetch, a delay
//! before each ack and the recording of every header are options:
//! [`Consumer::builder`]); the sampler of a slot's `confirmed_flush_lsn` that drops
//! markers into the same queue ([`Sampler`], with the `postgres` feature); and the
//! consumer-side checker of docs/design.md §1's guarantees ([`check`],
//! [`check_with`]). The fault and cluster tests use them, tests/delivery/broker_shapes
//! the consumer.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use crate::{parse_lsn, unique_name};

mod check;
#[cfg(feature = "postgres")]
mod sampler;

pub use check::{check, check_grouped, check_with, Report};
#[cfg(feature = "postgres")]
pub use sampler::Sampler;

/// One recorded delivery.
#[derive(Debug, Clone)]
pub struct Rec {
    pub id: String,
    /// `aggregate_type` header; without it (`[message] headers = "minimal"`) the
    /// first word of the routing key (of `x-original-routing-key` when present).
    pub kind: String,
    /// `aggregate_id` header: the row's sequence number; without it, the body's
    /// `seq` (-1 when neither).
    pub seq: i64,
    /// `commit_lsn` header (0 when missing).
    pub commit_lsn: u64,
    pub body_len: usize,
    /// Set for the sampler's markers: the sample's index.
    pub marker: Option<usize>,
    /// The broker flagged this, the first delivery of the message to this consumer,
    /// as redelivered: it had been delivered on a connection that broke before the
    /// consumer saw it (see [`check_with`]).
    pub redelivered: bool,
    /// When the consumer received it.
    pub at: Instant,
    /// Every header as text, when the consumer records them
    /// ([`Builder::headers`]); empty otherwise.
    pub headers: HashMap<String, String>,
}

impl Rec {
    /// Commit order: commit LSN, then insert order inside the transaction.
    pub fn key(&self) -> (u64, i64) {
        (self.commit_lsn, self.seq)
    }
}

/// A consumer with manual acks that reconnects when the broker goes away (so broker
/// restarts lose nothing on the consumer side), and skips the broker's own
/// redeliveries of messages it already recorded (those are not the relay's
/// duplicates).
pub struct Consumer {
    recs: Arc<Mutex<Vec<Rec>>>,
    /// Distinct relay messages so far (kept by the task: counting on demand over a
    /// million records would slow the consumer down).
    distinct: Arc<AtomicUsize>,
    /// Slept before each ack (a slow consumer); changed by [`Consumer::set_ack_delay`].
    ack_delay_ms: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

/// The options of a [`Consumer`]: [`Consumer::builder`].
pub struct Builder {
    queue: String,
    urls: Vec<String>,
    prefetch: u16,
    ack_delay_ms: u64,
    headers: bool,
}

impl Builder {
    /// Each (re)connect goes to the next URL of `urls` (the nodes of a cluster), so
    /// that the consumer moves on when its node dies. Default: the test broker.
    pub fn urls(mut self, urls: Vec<String>) -> Builder {
        self.urls = urls;
        self
    }

    /// The channel's prefetch (default 2000).
    pub fn prefetch(mut self, prefetch: u16) -> Builder {
        self.prefetch = prefetch;
        self
    }

    /// Sleeps this long before each ack (default 0; [`Consumer::set_ack_delay`]
    /// changes it while the consumer runs).
    pub fn ack_delay_ms(mut self, ms: u64) -> Builder {
        self.ack_delay_ms = ms;
        self
    }

    /// Records every header of every delivery in [`Rec::headers`] (off by default:
    /// the fault tests record a million deliveries).
    pub fn headers(mut self) -> Builder {
        self.headers = true;
        self
    }

    pub fn start(self) -> Consumer {
        let Builder {
            queue,
            urls,
            prefetch,
            ack_delay_ms,
            headers,
        } = self;
        let recs = Arc::new(Mutex::new(Vec::new()));
        let sink = recs.clone();
        let distinct = Arc::new(AtomicUsize::new(0));
        let counter = distinct.clone();
        let ack_delay_ms = Arc::new(AtomicU64::new(ack_delay_ms));
        let delay = ack_delay_ms.clone();
        let task = tokio::spawn(async move {
            let session = Session {
                queue: &queue,
                prefetch,
                headers,
                sink: &sink,
                distinct: &counter,
                ack_delay_ms: &delay,
            };
            // (message id, marker) deliveries seen, to drop broker redeliveries.
            let mut seen: HashSet<String> = HashSet::new();
            let mut last_error = String::new();
            let mut attempt = 0usize;
            loop {
                let url = &urls[attempt % urls.len()];
                attempt += 1;
                if let Err(e) = session.consume_once(url, &mut seen).await {
                    let e = e.to_string();
                    if e != last_error {
                        eprintln!("consumer on {queue}: {e}; reconnecting");
                        last_error = e;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        Consumer {
            recs,
            distinct,
            ack_delay_ms,
            task,
        }
    }
}

impl Consumer {
    pub fn start(queue: String) -> Consumer {
        Self::builder(queue).start()
    }

    /// A consumer on the nodes of a cluster: each (re)connect goes to the next URL of
    /// `urls`, so that it moves on when its node dies.
    pub fn start_on(queue: String, urls: Vec<String>) -> Consumer {
        Self::builder(queue).urls(urls).start()
    }

    /// A consumer on `queue` of the test broker with prefetch 2000, no ack delay and
    /// no headers recorded, until changed.
    pub fn builder(queue: String) -> Builder {
        Builder {
            queue,
            urls: vec![crate::amqp_url()],
            prefetch: 2000,
            ack_delay_ms: 0,
            headers: false,
        }
    }

    /// Changes the delay slept before each ack.
    pub fn set_ack_delay(&self, ms: u64) {
        self.ack_delay_ms.store(ms, Ordering::SeqCst);
    }

    pub fn snapshot(&self) -> Vec<Rec> {
        self.recs.lock().unwrap().clone()
    }

    /// [`Consumer::snapshot`] with arrival times.
    pub fn snapshot_timed(&self) -> Vec<(Rec, Instant)> {
        self.snapshot()
            .into_iter()
            .map(|r| {
                let at = r.at;
                (r, at)
            })
            .collect()
    }

    /// Distinct relay messages received (markers excluded).
    pub fn distinct(&self) -> usize {
        self.distinct.load(Ordering::SeqCst)
    }

    /// Relay messages received (markers excluded), duplicates included.
    pub fn total(&self) -> usize {
        self.recs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.marker.is_none())
            .count()
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

/// What one connection of a consumer's task works with.
struct Session<'a> {
    queue: &'a str,
    prefetch: u16,
    headers: bool,
    sink: &'a Mutex<Vec<Rec>>,
    distinct: &'a AtomicUsize,
    ack_delay_ms: &'a AtomicU64,
}

impl Session<'_> {
    async fn consume_once(
        &self,
        url: &str,
        seen: &mut HashSet<String>,
    ) -> Result<(), lapin::Error> {
        // A dead node answers nothing: give up on it after a while.
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| {
            lapin::Error::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "timed out connecting to {}",
                    url.rsplit('@').next().unwrap_or("")
                ),
            ))
        })??;
        let ch = conn.create_channel().await?;
        ch.basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let mut stream = ch
            .basic_consume(
                self.queue.into(),
                unique_name("ctag").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        while let Some(d) = stream.next().await {
            let d = d?;
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_string())
                .unwrap_or_default();
            let marker = id.strip_prefix("marker:").and_then(|n| n.parse().ok());
            // A delivery flagged redelivered whose message we already recorded is the
            // broker repeating itself after our consumer connection broke before the
            // ack: not a duplicate publish by the relay.
            if !(d.redelivered && seen.contains(&id)) {
                if seen.insert(id.clone()) && marker.is_none() {
                    self.distinct.fetch_add(1, Ordering::SeqCst);
                }
                let rec = self.record(&d, id, marker);
                self.sink.lock().unwrap().push(rec);
            }
            let delay = self.ack_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            d.ack(BasicAckOptions::default()).await?;
        }
        Ok(())
    }

    fn record(&self, d: &lapin::message::Delivery, id: String, marker: Option<usize>) -> Rec {
        let table = d.properties.headers().as_ref().map(|h| h.inner());
        let header = |k: &str| table?.get(k).and_then(text);
        // With `[message] headers = "minimal"` there is no aggregate_type or
        // aggregate_id header: the kind is the routing key's first word and the
        // sequence number is in the body (a marker has neither).
        let relayed = marker.is_none();
        let kind = header("aggregate_type")
            .or_else(|| {
                let key = header("x-original-routing-key")
                    .unwrap_or_else(|| d.routing_key.as_str().to_string());
                relayed.then(|| key.split('.').next().unwrap_or_default().to_string())
            })
            .unwrap_or_default();
        // Rows that share an aggregate (`[rabbitmq] ordering = "aggregate"` tests)
        // have an aggregate id that is not their number: that is in the body too.
        let body_seq = || {
            serde_json::from_slice::<serde_json::Value>(&d.data)
                .ok()
                .and_then(|body| body.get("seq")?.as_i64())
        };
        let seq = match header("aggregate_id") {
            Some(id) => id.parse().ok().or_else(|| relayed.then(body_seq).flatten()),
            None if relayed => body_seq(),
            None => None,
        }
        .unwrap_or(-1);
        let headers = match table {
            Some(t) if self.headers => t
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), any_text(v)))
                .collect(),
            _ => HashMap::new(),
        };
        Rec {
            kind,
            seq,
            commit_lsn: header("commit_lsn")
                .and_then(|s| parse_lsn(&s))
                .unwrap_or(0),
            body_len: d.data.len(),
            redelivered: d.redelivered,
            id,
            marker,
            at: Instant::now(),
            headers,
        }
    }
}

/// A string or integer header as text.
fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        AMQPValue::LongLongInt(i) => Some(i.to_string()),
        AMQPValue::LongInt(i) => Some(i.to_string()),
        _ => None,
    }
}

/// Any header as text (the value's debug form for the kinds [`text`] does not read).
fn any_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        other => text(other).unwrap_or_else(|| format!("{other:?}")),
    }
}
