//! An exactly-once consumer of the RabbitMQ stream outbox-relay publishes to
//! (docs/streams.md): the stream offset lives in the consumer's own database.
//!
//! A stream has no acknowledgements: a consumer says where to start reading, by
//! offset. So the consumer must remember how far it got, and *where* it remembers
//! that decides what a crash does:
//!
//! - [`Tracking::Database`] (the default, exactly once): for every batch of
//!   messages, in one Postgres transaction,
//!   1. `SELECT last_offset FROM stream_offsets … FOR UPDATE`;
//!   2. apply every message whose offset is above it — here a row in
//!      `stream_effects`;
//!   3. `UPDATE stream_offsets SET last_offset = <the batch's last offset>`;
//!   4. `COMMIT`.
//!
//!   At start it reads `last_offset` and subscribes at `last_offset + 1`
//!   (`OffsetSpecification::Offset`), or at the first offset when nothing is stored.
//!   The effects and the position are committed together or not at all, so a crash at
//!   any point resumes exactly after the last applied message: nothing is applied
//!   twice and nothing is skipped.
//! - [`Tracking::Server`] (at least once): the effects are committed, then the
//!   offset is stored on the broker under the consumer's name (`store_offset`), and
//!   read back at start with `query_offset`. A crash between the commit and the
//!   store — or a store the broker never received: it is not confirmed — applies
//!   those messages again after the restart.
//!
//! [`run`] is the consume loop the binary (`src/main.rs`) runs; [`OffsetStore`] is
//! the per-batch transaction. See docs/streams.md ("Consuming the stream").

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use futures_util::{FutureExt as _, StreamExt as _};
use rabbitmq_stream_client::error::{ClientError, ConsumerCreateError, ConsumerDeliveryError};
use rabbitmq_stream_client::types::{
    Delivery, Message, OffsetSpecification, ResponseCode, SimpleValue,
};
use rabbitmq_stream_client::{Client as StreamClient, ClientOptions, Environment};
use rabbitmq_stream_client::{Consumer, TlsConfiguration};
use tokio_postgres::{Client, NoTls, Transaction};

mod endpoint;
mod store;
#[cfg(test)]
mod tests;

pub use endpoint::{redact, Endpoint};
pub use store::{
    check_schema, connect_postgres, init_schema, Applied, Event, OffsetStore, Tracking, SCHEMA_SQL,
};

/// Everything [`run`] needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub stream_url: String,
    /// CA bundle for `rabbitmq-stream+tls://` (default: the system's).
    pub ca_file: Option<String>,
    pub stream: String,
    pub postgres_url: String,
    /// The consumer's name: its row in `stream_offsets`, and with
    /// [`Tracking::Server`] the reference its offset is stored under on the broker.
    pub consumer_name: String,
    pub tracking: Tracking,
    /// Messages applied per transaction at most (those already received; the
    /// consumer never waits to fill a batch).
    pub batch_size: usize,
    /// Create the tables when missing.
    pub init: bool,
    /// Test hook: `process::exit(1)` right after the commit that brought the number of
    /// applied messages to N or more — with [`Tracking::Server`] before the offset is
    /// stored on the broker.
    pub exit_after_commit: Option<u64>,
    /// Return once no message arrived for this long (batch runs and tests).
    pub exit_when_idle: Option<Duration>,
}

/// Counters of a run, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Messages received from the broker.
    pub received: AtomicU64,
    /// Messages applied (committed).
    pub applied: AtomicU64,
    /// Messages at or below the stored offset (not applied again).
    pub skipped: AtomicU64,
    /// Failed transactions (rolled back, retried).
    pub failed: AtomicU64,
    /// The last offset stored, plus one (0: none).
    pub next_offset: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) -> u64 {
        counter.fetch_add(n, Ordering::Relaxed) + n
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "received={} applied={} skipped={} failed={}",
            self.received.load(Ordering::Relaxed),
            self.applied.load(Ordering::Relaxed),
            self.skipped.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )?;
        match self.next_offset.load(Ordering::Relaxed) {
            0 => f.write_str(" last_offset=none"),
            n => write!(f, " last_offset={}", n - 1),
        }
    }
}

/// Exponential backoff for database retries: 100 ms, 200 ms, … 5 s.
struct Backoff(u32);

impl Backoff {
    fn next(&mut self) -> Duration {
        let ms = 100u64.saturating_mul(1 << self.0.min(6)).min(5_000);
        self.0 += 1;
        Duration::from_millis(ms)
    }
}

/// Where to start reading: after `last` (the last applied offset), or at the first
/// offset when nothing was applied.
pub fn start_at(last: Option<u64>) -> OffsetSpecification {
    match last {
        Some(offset) => OffsetSpecification::Offset(offset + 1),
        None => OffsetSpecification::First,
    }
}

/// The offset stored on the broker for `name` on `stream`; `None` when there is none.
async fn query_server_offset(endpoint: &Endpoint, config: &Config) -> anyhow::Result<Option<u64>> {
    let client = StreamClient::connect(endpoint.client_options(config.ca_file.as_deref()))
        .await
        .context("connecting to query the stored offset")?;
    let result = client
        .query_offset(config.consumer_name.clone(), &config.stream)
        .await;
    let _ = client.close().await;
    match result {
        Ok(offset) => Ok(Some(offset)),
        Err(ClientError::RequestError(ResponseCode::OffsetNotFound)) => Ok(None),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "querying the offset stored on the broker for consumer {:?} on stream {:?}",
            config.consumer_name, config.stream
        ))),
    }
}

/// Subscribes to the stream at `start`.
async fn subscribe(
    endpoint: &Endpoint,
    config: &Config,
    start: OffsetSpecification,
) -> anyhow::Result<Consumer> {
    tracing::info!(url = %redact(&config.stream_url), "connecting to RabbitMQ (stream protocol)");
    let environment = endpoint
        .environment(config.ca_file.as_deref())
        .await
        .with_context(|| {
            format!(
                "cannot connect to RabbitMQ at {}; check --stream-url \
                 (STREAM_CONSUMER_STREAM_URL), the credentials, and that the \
                 rabbitmq_stream plugin is enabled",
                redact(&config.stream_url)
            )
        })?;
    let mut builder = environment.consumer().offset(start);
    if config.tracking == Tracking::Server {
        builder = builder.name(&config.consumer_name);
    }
    match builder.build(&config.stream).await {
        Ok(consumer) => Ok(consumer),
        Err(ConsumerCreateError::StreamDoesNotExist { .. })
        | Err(ConsumerCreateError::Create {
            status: ResponseCode::StreamDoesNotExist,
            ..
        }) => bail!(
            "stream {:?} does not exist; check --stream, or let the relay declare it \
             (declare_stream = true) before starting the consumer",
            config.stream
        ),
        Err(e) => Err(anyhow::Error::new(e)
            .context(format!("cannot subscribe to stream {:?}", config.stream))),
    }
}

/// Consumes until `shutdown` resolves, the stream is idle for
/// `config.exit_when_idle`, or an error. Returns an error when the broker connection
/// is lost: restart the consumer, it resumes after its stored offset.
pub async fn run(
    config: &Config,
    stats: Arc<Stats>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    if config.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let endpoint = Endpoint::parse(&config.stream_url)?;
    let mut store = open_store(config).await?;
    let last = stored_offset(&store, &endpoint, config).await?;
    let start = start_at(last);
    if let Some(l) = last {
        stats.next_offset.store(l + 1, Ordering::Relaxed);
    }
    log_start(config, last);
    let mut consumer = subscribe(&endpoint, config, start).await?;
    let handle = consumer.handle();

    tokio::pin!(shutdown);
    let result = consume(&mut consumer, &mut store, config, &stats, last, shutdown).await;
    let _ = handle.close().await;
    result
}

/// Connects to the consumer's database (creating the tables with `--init`), checks
/// its schema and opens the consumer's row in `stream_offsets`.
async fn open_store(config: &Config) -> anyhow::Result<OffsetStore> {
    let client = connect_postgres(&config.postgres_url).await?;
    if config.init {
        init_schema(&client)
            .await
            .context("creating the stream_offsets and stream_effects tables (--init)")?;
    }
    check_schema(&client).await?;
    OffsetStore::open(client, &config.consumer_name, &config.stream)
        .await
        .context("reading the consumer's row in stream_offsets")
}

/// The last applied offset, from where `config.tracking` keeps it.
async fn stored_offset(
    store: &OffsetStore,
    endpoint: &Endpoint,
    config: &Config,
) -> anyhow::Result<Option<u64>> {
    match config.tracking {
        Tracking::Database => store
            .last_offset()
            .await
            .context("reading the stored offset"),
        Tracking::Server => query_server_offset(endpoint, config).await,
    }
}

/// Logs where the run starts reading.
fn log_start(config: &Config, last: Option<u64>) {
    match last {
        Some(l) => tracing::info!(
            stream = %config.stream,
            consumer = %config.consumer_name,
            tracking = ?config.tracking,
            stored_offset = l,
            "resuming after the stored offset"
        ),
        None => tracing::info!(
            stream = %config.stream,
            consumer = %config.consumer_name,
            tracking = ?config.tracking,
            "no stored offset: reading from the first offset"
        ),
    }
}

/// What the subscription yields: a delivery, an error, or `None` when it ended.
type Received = Option<Result<Delivery, ConsumerDeliveryError>>;

/// The consume loop of [`run`]: batch by batch, apply, then record the offset.
async fn consume<S: Future<Output = ()>>(
    consumer: &mut Consumer,
    store: &mut OffsetStore,
    config: &Config,
    stats: &Stats,
    last: Option<u64>,
    mut shutdown: Pin<&mut S>,
) -> anyhow::Result<()> {
    let mut reading = Reading {
        stored: last,
        seen: last,
        first_delivery: true,
    };
    loop {
        let Some(first) = next_received(consumer, config, shutdown.as_mut()).await else {
            return Ok(());
        };
        let items = batch(consumer, first, config.batch_size);
        let events = reading.events(items, stats)?;
        Stats::add(&stats.received, events.len() as u64);
        if events.is_empty() {
            continue;
        }
        let ControlFlow::Continue(last_offset) =
            apply_batch(store, &events, config, stats, shutdown.as_mut()).await
        else {
            return Ok(());
        };
        if let Some(offset) = last_offset {
            record_offset(consumer, config, stats, offset).await?;
        }
    }
}

/// Waits for the next item of the subscription; `None` when `shutdown` resolved or
/// nothing arrived for `config.exit_when_idle`.
async fn next_received<S: Future<Output = ()>>(
    consumer: &mut Consumer,
    config: &Config,
    shutdown: Pin<&mut S>,
) -> Option<Received> {
    let next = async {
        match config.exit_when_idle {
            Some(idle) => tokio::time::timeout(idle, consumer.next()).await.ok(),
            None => Some(consumer.next().await),
        }
    };
    tokio::select! {
        biased;
        () = shutdown => {
            tracing::info!("shutting down");
            None
        }
        next = next => match next {
            None => {
                tracing::info!(idle = ?config.exit_when_idle, "stream idle; exiting");
                None
            }
            Some(item) => Some(item),
        },
    }
}

/// The batch: `first` and those already received, up to `batch_size`.
fn batch(consumer: &mut Consumer, first: Received, batch_size: usize) -> Vec<Received> {
    let mut items = vec![first];
    while items.len() < batch_size {
        match consumer.next().now_or_never() {
            Some(item) => items.push(item),
            None => break,
        }
    }
    items
}

/// How far this run read.
struct Reading {
    /// The offset stored when the run started.
    stored: Option<u64>,
    /// The highest offset applied (or found applied) in this run: redeliveries below
    /// it are skipped without a transaction.
    seen: Option<u64>,
    /// Whether no message arrived yet in this run (for the retention check).
    first_delivery: bool,
}

impl Reading {
    /// The events of a batch not applied yet (those at or below `seen` are counted
    /// as skipped); an error when the subscription ended or failed.
    fn events(&mut self, items: Vec<Received>, stats: &Stats) -> anyhow::Result<Vec<Event>> {
        let mut events = Vec::with_capacity(items.len());
        for item in items {
            match item {
                None => {
                    bail!(
                        "the broker ended the subscription (stream deleted or connection \
                         closed); restart the consumer: it resumes after its stored offset"
                    )
                }
                Some(Err(e)) => {
                    return Err(anyhow::Error::new(e).context(
                        "lost the stream connection; restart the consumer: it resumes after \
                         its stored offset",
                    ))
                }
                Some(Ok(delivery)) => {
                    if std::mem::take(&mut self.first_delivery) {
                        if let Some(l) = self.stored.filter(|l| delivery.offset() > l + 1) {
                            // The broker starts at the first offset it still has.
                            tracing::error!(
                                stored_offset = l,
                                first_offset = delivery.offset(),
                                "the messages after the stored offset and before the first \
                                 one received were removed by the stream's retention before \
                                 this consumer read them; raise max_age / max_length_bytes"
                            );
                        }
                    }
                    if self.seen.is_some_and(|s| delivery.offset() <= s) {
                        Stats::add(&stats.skipped, 1);
                        continue;
                    }
                    self.seen = Some(delivery.offset());
                    events.push(Event::from_message(delivery.offset(), delivery.message()));
                }
            }
        }
        Ok(events)
    }
}

/// Applies the batch; on a database error retries the same batch (the stream cannot
/// be skipped) after a backoff, reconnecting when the connection died. Continues
/// with the last offset applied, or breaks when `shutdown` resolved during a
/// backoff (the batch not applied).
async fn apply_batch<S: Future<Output = ()>>(
    store: &mut OffsetStore,
    events: &[Event],
    config: &Config,
    stats: &Stats,
    mut shutdown: Pin<&mut S>,
) -> ControlFlow<(), Option<u64>> {
    let mut backoff = Backoff(0);
    loop {
        let attempt = match config.tracking {
            Tracking::Database => store.apply(events).await.map(|done| {
                Stats::add(&stats.skipped, done.skipped);
                (done.applied, done.last_offset)
            }),
            Tracking::Server => store
                .apply_untracked(events)
                .await
                .map(|()| (events.len() as u64, events.last().map(|e| e.offset))),
        };
        match attempt {
            Ok((applied, last_offset)) => {
                let total = Stats::add(&stats.applied, applied);
                if let Some(n) = config.exit_after_commit {
                    if applied > 0 && total >= n {
                        tracing::warn!(
                            applied = total,
                            "--exit-after-commit: exiting after the commit"
                        );
                        std::process::exit(1);
                    }
                }
                return ControlFlow::Continue(last_offset);
            }
            Err(e) => {
                Stats::add(&stats.failed, 1);
                let wait = backoff.next();
                tracing::warn!(
                    error = %e,
                    first_offset = events[0].offset,
                    retry_in = ?wait,
                    "database error; rolled back, retrying the batch"
                );
                tokio::select! {
                    biased;
                    () = shutdown.as_mut() => {
                        tracing::info!("shutting down; the batch was not applied");
                        return ControlFlow::Break(());
                    }
                    () = tokio::time::sleep(wait) => {}
                }
                if store.client().is_closed() {
                    match connect_postgres(&config.postgres_url).await {
                        Ok(client) => {
                            tracing::info!("reconnected to Postgres");
                            store.set_client(client);
                        }
                        Err(e) => {
                            tracing::warn!(error = format!("{e:#}"), "Postgres reconnect failed")
                        }
                    }
                }
            }
        }
    }
}

/// Records that the run applied up to `offset`: on the broker with
/// [`Tracking::Server`], and in `stats`.
async fn record_offset(
    consumer: &mut Consumer,
    config: &Config,
    stats: &Stats,
    offset: u64,
) -> anyhow::Result<()> {
    if config.tracking == Tracking::Server {
        // Not confirmed by the broker: a lost store means these messages are
        // applied again after a restart (at least once).
        if let Err(e) = consumer.store_offset(offset).await {
            return Err(anyhow::Error::new(e).context(
                "storing the offset on the broker; restart the consumer (the \
                 messages since the last stored offset are applied again)",
            ));
        }
    }
    stats.next_offset.store(offset + 1, Ordering::Relaxed);
    tracing::debug!(offset, "applied up to offset");
    Ok(())
}
