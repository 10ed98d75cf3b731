//! Finding the *tail*: the `(commit_lsn, tx_index)` of the named producer's last
//! stored message (publishing id `last`), read from the end of the stream.
//!
//! A consumer first subscribes at `Last` (the last chunk) and reads until the stream
//! is idle. If the message is not there (other producers wrote after it, or its
//! chunk is older), it reads the window of offsets just before that chunk, then a
//! window twice as large before that one, and so on down to the first offset: at most
//! about twice the distance from the end to the message is read. Not finding it at
//! all (retention deleted it, or the stream was replaced) is a definite error: the
//! relay cannot know which events are stored.

use std::collections::HashMap;
use std::time::Duration;

use outbox_event::Lsn;
use rabbitmq_stream_client::types::{Message, OffsetSpecification, ResponseKind};
use rabbitmq_stream_client::Client;
use tokio::sync::mpsc;

use super::connection::{self, classify};
use super::message::tail_of;
use super::StreamConfig;
use crate::error::PublishError;

/// `(commit_lsn, tx_index)` of the last event the producer stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tail {
    pub commit_lsn: Lsn,
    pub tx_index: u64,
}

/// The first window read before the last chunk.
const FIRST_WINDOW: u64 = 4096;
/// How long a read waits for the next chunk before taking the stream as read.
const IDLE: Duration = Duration::from_millis(700);
/// Chunks requested ahead.
const CREDIT: u16 = 8;
const SUBSCRIPTION: u8 = 1;

/// Finds the tail of `producer`, whose last publishing id is `last`.
pub(super) async fn find(
    config: &StreamConfig,
    url_index: usize,
    producer: &str,
    last: u64,
) -> Result<Tail, PublishError> {
    let mut reader = Reader::open(config, url_index).await?;
    let result = search(&mut reader, config, producer, last).await;
    reader.close().await;
    result
}

async fn search(
    reader: &mut Reader,
    config: &StreamConfig,
    producer: &str,
    last: u64,
) -> Result<Tail, PublishError> {
    let mut found = None;
    let scan = |offset: u64, message: &Message, found: &mut Option<Tail>| {
        let _ = offset;
        if let Some(tail) = tail_of(message, producer, last) {
            *found = Some(tail);
            return true;
        }
        false
    };
    // The last chunk, and whatever is committed after it while we read.
    let first = reader
        .read(config, OffsetSpecification::Last, None, |o, m| {
            scan(o, m, &mut found)
        })
        .await?;
    if let Some(tail) = found {
        return Ok(tail);
    }
    let Some(mut end) = first else {
        return Err(not_found(config, producer, last));
    };
    let mut window = FIRST_WINDOW;
    while end > 0 {
        let start = end.saturating_sub(window);
        reader
            .read(
                config,
                OffsetSpecification::Offset(start),
                Some(end),
                |o, m| scan(o, m, &mut found),
            )
            .await?;
        if let Some(tail) = found {
            tracing::debug!(start, end, "found the producer's last message");
            return Ok(tail);
        }
        end = start;
        window = window.saturating_mul(2);
    }
    Err(not_found(config, producer, last))
}

fn not_found(config: &StreamConfig, producer: &str, last: u64) -> PublishError {
    PublishError::Stream {
        stream: config.stream.clone(),
        reason: format!(
            "the broker says producer {producer:?} last stored publishing id {last}, but no message of it with that id is in the stream (deleted by retention, or the stream was replaced): the relay cannot tell which events are stored; delete the producer's state by recreating the stream, or use another producer reference"
        ),
    }
}

/// A consumer connection reading chunks.
struct Reader {
    client: Client,
    chunks: mpsc::UnboundedReceiver<Result<(u64, Vec<Message>), String>>,
    url: String,
    subscribed: bool,
}

impl Reader {
    async fn open(config: &StreamConfig, url_index: usize) -> Result<Reader, PublishError> {
        let client = connection::open(config, url_index).await?;
        let (tx, chunks) = mpsc::unbounded_channel();
        let forward = move |item: rabbitmq_stream_client::types::MessageResult| {
            let tx = tx.clone();
            async move {
                match item {
                    Some(Ok(response)) => {
                        if let ResponseKind::Deliver(d) = response.kind() {
                            let _ = tx.send(Ok((d.chunk_first_offset, d.messages)));
                        }
                    }
                    Some(Err(e)) => {
                        let _ = tx.send(Err(e.to_string()));
                    }
                    None => {
                        let _ = tx.send(Err("connection closed".into()));
                    }
                }
                Ok(())
            }
        };
        client.set_handler(forward).await;
        Ok(Reader {
            client,
            chunks,
            url: config.urls[url_index].clone(),
            subscribed: false,
        })
    }

    /// Reads from `from` until `visit` returns true, every offset from `from` to
    /// `until` has been seen, or nothing arrives for [`IDLE`]. Returns the lowest
    /// chunk offset delivered.
    async fn read(
        &mut self,
        config: &StreamConfig,
        from: OffsetSpecification,
        until: Option<u64>,
        mut visit: impl FnMut(u64, &Message) -> bool,
    ) -> Result<Option<u64>, PublishError> {
        if self.subscribed {
            let _ = self.client.unsubscribe(SUBSCRIPTION).await;
            // Chunks of the previous subscription may still be queued.
            while self.chunks.try_recv().is_ok() {}
        }
        let response = self
            .client
            .subscribe(
                SUBSCRIPTION,
                &config.stream,
                from.clone(),
                CREDIT,
                HashMap::new(),
            )
            .await
            .map_err(|e| classify(&self.url, &e))?;
        if !response.is_ok() {
            return Err(PublishError::Stream {
                stream: config.stream.clone(),
                reason: format!("cannot read it: {:?}", response.code()),
            });
        }
        self.subscribed = true;
        let mut first: Option<u64> = None;
        // Chunks do not always arrive in offset order: a window is read once every
        // offset in it was seen.
        let start = match from {
            OffsetSpecification::Offset(o) => o,
            _ => 0,
        };
        let mut seen_in_window = 0u64;
        loop {
            let chunk = match tokio::time::timeout(IDLE, self.chunks.recv()).await {
                Err(_) | Ok(None) => return Ok(first),
                Ok(Some(Err(reason))) => {
                    return Err(PublishError::Unreachable {
                        url: crate::error::redact_url(&self.url),
                        reason,
                    })
                }
                Ok(Some(Ok(chunk))) => chunk,
            };
            let (chunk_first, messages) = chunk;
            first = Some(first.map_or(chunk_first, |f| f.min(chunk_first)));
            for (k, message) in messages.iter().enumerate() {
                let offset = chunk_first + k as u64;
                if visit(offset, message) {
                    return Ok(first);
                }
                if let Some(until) = until {
                    if (start..until).contains(&offset) {
                        seen_in_window += 1;
                    }
                    if seen_in_window >= until - start {
                        return Ok(first);
                    }
                }
            }
            let _ = self.client.credit(SUBSCRIPTION, 1).await;
        }
    }

    async fn close(self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.client.close()).await;
    }
}
