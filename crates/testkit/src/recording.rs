//! A recording consumer: an AMQP consumer with manual acks that records every
//! delivery ([`Rec`]) and reconnects when the broker goes away; the sampler of a
//! slot's `confirmed_flush_lsn` that drops markers into the same queue
//! ([`Sampler`], with the `postgres` feature); and the consumer-side checker of
//! docs/design.md §1's guarantees ([`check`], [`check_with`]). The fault and cluster
//! tests use them.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    pub kind: String,
    pub seq: i64,
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
    task: tokio::task::JoinHandle<()>,
}

impl Consumer {
    pub fn start(queue: String) -> Consumer {
        Self::start_on(queue, vec![crate::amqp_url()])
    }

    /// A consumer on the nodes of a cluster: each (re)connect goes to the next URL of
    /// `urls`, so that it moves on when its node dies.
    pub fn start_on(queue: String, urls: Vec<String>) -> Consumer {
        let recs = Arc::new(Mutex::new(Vec::new()));
        let sink = recs.clone();
        let distinct = Arc::new(AtomicUsize::new(0));
        let counter = distinct.clone();
        let task = tokio::spawn(async move {
            // (message id, marker) deliveries seen, to drop broker redeliveries.
            let mut seen: HashSet<String> = HashSet::new();
            let mut last_error = String::new();
            let mut attempt = 0usize;
            loop {
                let url = &urls[attempt % urls.len()];
                attempt += 1;
                if let Err(e) = consume_once(url, &queue, &sink, &counter, &mut seen).await {
                    let e = e.to_string();
                    if e != last_error {
                        eprintln!("consumer: {e}; reconnecting");
                        last_error = e;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        Consumer {
            recs,
            distinct,
            task,
        }
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

async fn consume_once(
    url: &str,
    queue: &str,
    sink: &Arc<Mutex<Vec<Rec>>>,
    distinct: &AtomicUsize,
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
    ch.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut stream = ch
        .basic_consume(
            queue.into(),
            unique_name("ctag").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while let Some(d) = stream.next().await {
        let d = d?;
        let p = &d.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default();
        let header = |k: &str| -> Option<String> {
            match p.headers().as_ref()?.inner().get(k)? {
                AMQPValue::LongString(s) => Some(s.to_string()),
                AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
                AMQPValue::LongLongInt(i) => Some(i.to_string()),
                AMQPValue::LongInt(i) => Some(i.to_string()),
                _ => None,
            }
        };
        let marker = id.strip_prefix("marker:").and_then(|n| n.parse().ok());
        // A delivery flagged redelivered whose message we already recorded is the
        // broker repeating itself after our consumer connection broke before the ack:
        // not a duplicate publish by the relay.
        if !(d.redelivered && seen.contains(&id)) {
            if seen.insert(id.clone()) && marker.is_none() {
                distinct.fetch_add(1, Ordering::SeqCst);
            }
            sink.lock().unwrap().push(Rec {
                kind: header("aggregate_type").unwrap_or_default(),
                seq: header("aggregate_id")
                    .and_then(|s| s.parse().ok())
                    .or_else(|| body_seq(&d.data))
                    .unwrap_or(-1),
                commit_lsn: header("commit_lsn")
                    .and_then(|s| parse_lsn(&s))
                    .unwrap_or(0),
                body_len: d.data.len(),
                redelivered: d.redelivered,
                id,
                marker,
                at: Instant::now(),
            });
        }
        d.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

/// The `seq` of a body `{"seq": N, ...}`: the row's number when its aggregate id is
/// not (rows that share an aggregate, `[rabbitmq] ordering = "aggregate"`).
fn body_seq(body: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(body).ok()?;
    let rest = &text[text.find("\"seq\":")? + 6..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}
