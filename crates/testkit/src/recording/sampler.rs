//! [`Sampler`]: the slot's `confirmed_flush_lsn`, sampled, with a marker dropped into
//! the consumer's queue after each sample.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::parse_lsn;

/// Samples the slot's `confirmed_flush_lsn` and drops a marker into the queue right
/// after each sample.
///
/// Why this check is sound: the relay may confirm a position only after the broker
/// acked every message below it, and RabbitMQ acks a persistent message only once it
/// is enqueued. The marker is published (on its own connection, straight to the
/// queue) *after* the position was read, so it is enqueued after every message the
/// relay had been acked for at that moment. A queue delivers in enqueue order, so
/// when the consumer receives marker *i*, every message of every transaction whose
/// commit LSN is below sample *i* must already have been received. A relay that
/// confirmed past an unacked message fails this check even when nothing crashes. The
/// consumer's own lag does not matter (the marker waits in the same queue), and a
/// marker that never arrives (broker down) simply checks nothing.
pub struct Sampler {
    samples: Arc<Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub fn start(conninfo: String, slot: String, queue: String) -> Sampler {
        Self::start_on(conninfo, slot, queue, vec![crate::amqp_url()])
    }

    /// A sampler whose markers go to the nodes of a cluster (each reconnect to the
    /// next URL of `urls`). A quorum queue orders its messages in its Raft log, so a
    /// marker enqueued after a confirm is still behind every confirmed message.
    pub fn start_on(conninfo: String, slot: String, queue: String, urls: Vec<String>) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let mut pg: Option<tokio_postgres::Client> = None;
            let mut amqp: Option<(Connection, lapin::Channel)> = None;
            let mut last = 0u64;
            let mut attempt = 0usize;
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if pg.as_ref().is_none_or(|c| c.is_closed()) {
                    pg = match tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(async move {
                                let _ = conn.await;
                            });
                            Some(c)
                        }
                        Err(_) => None,
                    };
                }
                let Some(client) = &pg else { continue };
                let Ok(Ok(row)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    client.query_opt(
                        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    ),
                )
                .await
                else {
                    pg = None;
                    continue;
                };
                let Some(lsn) = row
                    .and_then(|r| r.get::<_, Option<String>>(0))
                    .and_then(|s| parse_lsn(&s))
                else {
                    continue;
                };
                if lsn == last {
                    continue;
                }
                if amqp.as_ref().is_none_or(|(c, _)| !c.status().connected()) {
                    let url = &urls[attempt % urls.len()];
                    attempt += 1;
                    amqp = tokio::time::timeout(Duration::from_secs(5), connect_channel(url))
                        .await
                        .ok()
                        .and_then(Result::ok);
                }
                let Some((_, ch)) = &amqp else { continue };
                let idx = out.lock().unwrap().len();
                // Record first: a marker can only arrive after its sample exists.
                out.lock().unwrap().push(lsn);
                let publish = ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    b"marker",
                    BasicProperties::default().with_message_id(format!("marker:{idx}").into()),
                );
                match tokio::time::timeout(Duration::from_secs(2), publish).await {
                    Ok(Ok(_)) => last = lsn,
                    _ => amqp = None,
                }
            }
        });
        Sampler { samples, task }
    }

    pub fn samples(&self) -> Vec<u64> {
        self.samples.lock().unwrap().clone()
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

async fn connect_channel(url: &str) -> Result<(Connection, lapin::Channel), lapin::Error> {
    let c = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = c.create_channel().await?;
    Ok((c, ch))
}
