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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use futures_util::{FutureExt as _, StreamExt as _};
use rabbitmq_stream_client::error::{ClientError, ConsumerCreateError};
use rabbitmq_stream_client::types::{Message, OffsetSpecification, ResponseCode, SimpleValue};
use rabbitmq_stream_client::{Client as StreamClient, ClientOptions, Environment};
use rabbitmq_stream_client::{Consumer, TlsConfiguration};
use tokio_postgres::{Client, NoTls, Transaction};

/// The consumer's tables (idempotent DDL): its position per stream, and the example's
/// side effect.
///
/// `stream_effects` deliberately has no unique key on the offset or the message id,
/// so a consumer that applied a message twice shows up as duplicate rows instead of
/// as an error.
pub const SCHEMA_SQL: &str = "\
CREATE TABLE IF NOT EXISTS stream_offsets (
    consumer    text        NOT NULL,
    stream      text        NOT NULL,
    -- The offset of the last message applied; NULL: none yet (start at the first).
    last_offset bigint,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream)
);
CREATE TABLE IF NOT EXISTS stream_effects (
    id             bigserial   PRIMARY KEY,
    consumer       text        NOT NULL,
    stream         text        NOT NULL,
    stream_offset  bigint      NOT NULL,
    message_id     text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    commit_lsn     text,
    tx_index       bigint,
    payload        jsonb       NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now()
);";

/// One message of the stream, with the fields docs/streams.md describes.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Its offset in the stream.
    pub offset: u64,
    /// The `message-id` property: the outbox row id.
    pub message_id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// The outbox table, `schema.name`.
    pub table: Option<String>,
    /// The transaction's commit position, `X/Y`.
    pub commit_lsn: Option<String>,
    /// The position of the row in its transaction, from 0.
    pub tx_index: Option<u64>,
    pub xid: Option<u64>,
    /// A copy added by `outbox-relay replay` (application property `replay`).
    pub replay: bool,
    /// The body as JSON; a body that is not JSON is kept as a JSON string.
    pub payload: serde_json::Value,
}

/// An application property value as text (strings as they are, numbers printed).
fn text(value: &SimpleValue) -> Option<String> {
    Some(match value {
        SimpleValue::String(s) => s.clone(),
        SimpleValue::Ulong(v) => v.to_string(),
        SimpleValue::Uint(v) => v.to_string(),
        SimpleValue::Long(v) => v.to_string(),
        SimpleValue::Int(v) => v.to_string(),
        SimpleValue::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

impl Event {
    /// Reads the message delivered at `offset`.
    pub fn from_message(offset: u64, message: &Message) -> Event {
        let message_id = message
            .properties()
            .and_then(|p| p.message_id.as_ref())
            .map(|id| {
                // The id's type is not exported by the client, but converts by
                // reference to its variants' types (the relay sends a string).
                if let Ok(s) = <&String>::try_from(id) {
                    s.clone()
                } else if let Ok(n) = <&u64>::try_from(id) {
                    n.to_string()
                } else if let Ok(n) = <&i64>::try_from(id) {
                    n.to_string()
                } else {
                    format!("{id:?}")
                }
            });
        let app = message.application_properties();
        let prop = |key: &str| app.and_then(|a| a.get(key)).and_then(text);
        let body = message.data().unwrap_or_default();
        let payload = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(_) => serde_json::Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        Event {
            offset,
            message_id,
            aggregate_type: prop("aggregate_type"),
            aggregate_id: prop("aggregate_id"),
            event_type: prop("event_type"),
            table: prop("table"),
            commit_lsn: prop("commit_lsn"),
            tx_index: prop("tx_index").and_then(|v| v.parse().ok()),
            xid: prop("xid").and_then(|v| v.parse().ok()),
            replay: prop("replay").as_deref() == Some("true"),
            payload,
        }
    }
}

/// Where the consumer keeps its position in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tracking {
    /// In `stream_offsets`, in the transaction that applies the messages: exactly once.
    Database,
    /// On the broker (`store_offset` under the consumer name, after the commit): at
    /// least once.
    Server,
}

/// What one [`OffsetStore::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// Messages applied (and committed).
    pub applied: u64,
    /// Messages at or below the stored offset: applied before, nothing done.
    pub skipped: u64,
    /// The stored offset after the commit.
    pub last_offset: Option<u64>,
}

/// Inserts the example's side effect of `event`: one `stream_effects` row.
async fn insert_effect(
    tx: &Transaction<'_>,
    consumer: &str,
    stream: &str,
    event: &Event,
) -> Result<(), tokio_postgres::Error> {
    let payload = event.payload.to_string();
    tx.execute(
        "INSERT INTO stream_effects (consumer, stream, stream_offset, message_id, \
           aggregate_type, aggregate_id, event_type, commit_lsn, tx_index, payload) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::text::jsonb)",
        &[
            &consumer,
            &stream,
            &to_i64(event.offset),
            &event.message_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &event.event_type,
            &event.commit_lsn,
            &event.tx_index.map(to_i64),
            &payload,
        ],
    )
    .await?;
    Ok(())
}

/// Offsets and tx indexes fit a bigint (they count messages).
fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The position and the effects of one consumer on one stream, on one Postgres
/// connection.
pub struct OffsetStore {
    client: Client,
    consumer: String,
    stream: String,
}

impl OffsetStore {
    /// Wraps a connected client and makes sure the consumer's `stream_offsets` row
    /// exists (with no offset when new), so that [`OffsetStore::apply`] always has a
    /// row to lock.
    pub async fn open(
        client: Client,
        consumer: impl Into<String>,
        stream: impl Into<String>,
    ) -> Result<OffsetStore, tokio_postgres::Error> {
        let store = OffsetStore {
            client,
            consumer: consumer.into(),
            stream: stream.into(),
        };
        store.ensure_row().await?;
        Ok(store)
    }

    async fn ensure_row(&self) -> Result<(), tokio_postgres::Error> {
        self.client
            .execute(
                "INSERT INTO stream_offsets (consumer, stream) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
                &[&self.consumer, &self.stream],
            )
            .await?;
        Ok(())
    }

    /// The underlying client (e.g. to check `is_closed`).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Replaces a broken connection.
    pub fn set_client(&mut self, client: Client) {
        self.client = client;
    }

    /// The offset of the last applied message, `None` when nothing was applied yet.
    pub async fn last_offset(&self) -> Result<Option<u64>, tokio_postgres::Error> {
        let row = self
            .client
            .query_opt(
                "SELECT last_offset FROM stream_offsets WHERE consumer = $1 AND stream = $2",
                &[&self.consumer, &self.stream],
            )
            .await?;
        let last: Option<i64> = row.and_then(|r| r.get(0));
        Ok(last.and_then(|v| u64::try_from(v).ok()))
    }

    /// Applies the messages of `events` above the stored offset and stores the new
    /// offset, all in one transaction, committed before this returns. On error the
    /// transaction is rolled back (nothing of it remains): call again with the same
    /// events.
    ///
    /// The stored offset is read `FOR UPDATE`: a second instance of the same consumer
    /// applying the same messages at the same time waits for this transaction, then
    /// finds them applied and skips them.
    pub async fn apply(&mut self, events: &[Event]) -> Result<Applied, tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        let select = "SELECT last_offset FROM stream_offsets \
                      WHERE consumer = $1 AND stream = $2 FOR UPDATE";
        let row = match tx
            .query_opt(select, &[&self.consumer, &self.stream])
            .await?
        {
            Some(row) => row,
            None => {
                // Deleted since `open` (a reset by deleting the row): start over.
                tx.execute(
                    "INSERT INTO stream_offsets (consumer, stream) VALUES ($1, $2) \
                     ON CONFLICT DO NOTHING",
                    &[&self.consumer, &self.stream],
                )
                .await?;
                tx.query_one(select, &[&self.consumer, &self.stream])
                    .await?
            }
        };
        let stored: Option<i64> = row.get(0);
        let mut last = stored.and_then(|v| u64::try_from(v).ok());
        let mut done = Applied::default();
        for event in events {
            if last.is_some_and(|l| event.offset <= l) {
                done.skipped += 1;
                continue;
            }
            insert_effect(&tx, &self.consumer, &self.stream, event).await?;
            last = Some(event.offset);
            done.applied += 1;
        }
        if done.applied > 0 {
            tx.execute(
                "UPDATE stream_offsets SET last_offset = $3, updated_at = now() \
                 WHERE consumer = $1 AND stream = $2",
                &[&self.consumer, &self.stream, &last.map(to_i64)],
            )
            .await?;
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        done.last_offset = last;
        Ok(done)
    }

    /// [`Tracking::Server`]: applies every message of `events` in one transaction,
    /// without recording a position (the caller stores it on the broker afterwards).
    pub async fn apply_untracked(&mut self, events: &[Event]) -> Result<(), tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        for event in events {
            insert_effect(&tx, &self.consumer, &self.stream, event).await?;
        }
        tx.commit().await
    }
}

/// Creates `stream_offsets` and `stream_effects` when missing.
pub async fn init_schema(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(SCHEMA_SQL).await
}

/// Fails with a message naming the fix when a table the consumer needs is missing.
pub async fn check_schema(client: &Client) -> anyhow::Result<()> {
    for table in ["stream_offsets", "stream_effects"] {
        let row = client
            .query_one("SELECT to_regclass($1)::text", &[&table])
            .await
            .context("checking the consumer's tables")?;
        let found: Option<String> = row.get(0);
        if found.is_none() {
            bail!(
                "table {table} does not exist in the consumer's database; run once with \
                 --init to create it (or apply the DDL of docs/streams.md yourself)"
            );
        }
    }
    Ok(())
}

/// Connects to Postgres (libpq URL or key=value conninfo); errors name the setting.
pub async fn connect_postgres(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.with_context(|| {
        format!(
            "cannot connect to Postgres at {}; check --postgres-url \
             (STREAM_CONSUMER_POSTGRES_URL) and that the server is running",
            redact(url)
        )
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "Postgres connection closed");
        }
    });
    Ok(client)
}

/// A URL or conninfo with its password replaced by `***`, for logs and errors.
pub fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if let Some((userinfo, host)) = authority.rsplit_once('@') {
            if let Some((user, _password)) = userinfo.split_once(':') {
                return format!("{scheme}://{user}:***@{host}{path}");
            }
        }
        return url.to_string();
    }
    // key=value conninfo: hide the value of password=.
    url.split(' ')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A parsed `rabbitmq-stream[+tls]://user:password@host:port/vhost` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    pub user: String,
    pub password: String,
    pub host: String,
    pub port: u16,
    pub vhost: String,
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Endpoint {
    /// Parses a stream URL; the error names the fix.
    pub fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("rabbitmq-stream+tls://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("rabbitmq-stream://") {
            (false, r)
        } else {
            bail!(
                "{} is not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL; fix the \
                 scheme of --stream-url",
                redact(url)
            );
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            Some(u) => {
                let (user, password) = u.split_once(':').unwrap_or((u, ""));
                (percent_decode(user), percent_decode(password))
            }
            None => ("guest".to_string(), "guest".to_string()),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => match p.parse::<u16>() {
                Ok(port) => (h, port),
                Err(_) => bail!("{} has an invalid port; fix --stream-url", redact(url)),
            },
            None => (hostport, if tls { 5551 } else { 5552 }),
        };
        if host.is_empty() {
            bail!("{} has no host; fix --stream-url", redact(url));
        }
        let path = path.split(['?', '#']).next().unwrap_or_default();
        let vhost = if path.is_empty() {
            "/".to_string()
        } else {
            percent_decode(path)
        };
        Ok(Endpoint {
            tls,
            user,
            password,
            host: host.to_string(),
            port,
            vhost,
        })
    }

    fn tls(&self, ca_file: Option<&str>) -> TlsConfiguration {
        let mut tls = TlsConfiguration::default();
        tls.enable(self.tls);
        if self.tls {
            tls.trust_certificates(false);
            tls.add_root_certificates_path(
                ca_file
                    .unwrap_or("/etc/ssl/certs/ca-certificates.crt")
                    .to_string(),
            );
        }
        tls
    }

    fn client_options(&self, ca_file: Option<&str>) -> ClientOptions {
        ClientOptions::builder()
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .v_host(&self.vhost)
            .tls(self.tls(ca_file))
            .build()
    }

    /// A stream-client environment on this endpoint.
    pub async fn environment(&self, ca_file: Option<&str>) -> Result<Environment, ClientError> {
        Environment::builder()
            .host(&self.host)
            .port(self.port)
            .username(&self.user)
            .password(&self.password)
            .virtual_host(&self.vhost)
            .tls(self.tls(ca_file))
            .build()
            .await
    }
}

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
    let client = connect_postgres(&config.postgres_url).await?;
    if config.init {
        init_schema(&client)
            .await
            .context("creating the stream_offsets and stream_effects tables (--init)")?;
    }
    check_schema(&client).await?;
    let mut store = OffsetStore::open(client, &config.consumer_name, &config.stream)
        .await
        .context("reading the consumer's row in stream_offsets")?;

    let last = match config.tracking {
        Tracking::Database => store
            .last_offset()
            .await
            .context("reading the stored offset")?,
        Tracking::Server => query_server_offset(&endpoint, config).await?,
    };
    let start = start_at(last);
    if let Some(l) = last {
        stats.next_offset.store(l + 1, Ordering::Relaxed);
    }
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
    let mut consumer = subscribe(&endpoint, config, start).await?;
    let handle = consumer.handle();

    // The highest offset applied (or found applied) in this run: redeliveries below
    // it are skipped without a transaction.
    let mut seen = last;
    // Whether a message arrived yet in this run (for the retention check).
    let mut first_delivery = true;
    let mut backoff = Backoff(0);
    tokio::pin!(shutdown);
    let result = 'outer: loop {
        let next = async {
            match config.exit_when_idle {
                Some(idle) => tokio::time::timeout(idle, consumer.next()).await.ok(),
                None => Some(consumer.next().await),
            }
        };
        let first = tokio::select! {
            biased;
            () = &mut shutdown => {
                tracing::info!("shutting down");
                break Ok(());
            }
            next = next => match next {
                None => {
                    tracing::info!(idle = ?config.exit_when_idle, "stream idle; exiting");
                    break Ok(());
                }
                Some(item) => item,
            },
        };
        // The batch: this message and those already received, up to batch_size.
        let mut items = vec![first];
        while items.len() < config.batch_size {
            match consumer.next().now_or_never() {
                Some(item) => items.push(item),
                None => break,
            }
        }
        let mut events = Vec::with_capacity(items.len());
        for item in items {
            match item {
                None => {
                    break 'outer Err(anyhow::anyhow!(
                        "the broker ended the subscription (stream deleted or connection \
                         closed); restart the consumer: it resumes after its stored offset"
                    ))
                }
                Some(Err(e)) => {
                    break 'outer Err(anyhow::Error::new(e).context(
                        "lost the stream connection; restart the consumer: it resumes after \
                         its stored offset",
                    ))
                }
                Some(Ok(delivery)) => {
                    if std::mem::take(&mut first_delivery) {
                        if let Some(l) = last.filter(|l| delivery.offset() > l + 1) {
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
                    if seen.is_some_and(|s| delivery.offset() <= s) {
                        Stats::add(&stats.skipped, 1);
                        continue;
                    }
                    seen = Some(delivery.offset());
                    events.push(Event::from_message(delivery.offset(), delivery.message()));
                }
            }
        }
        Stats::add(&stats.received, events.len() as u64);
        if events.is_empty() {
            continue;
        }
        // Apply the batch; on a database error retry the same batch (the stream
        // cannot be skipped) after a backoff, reconnecting when the connection died.
        let last_offset = loop {
            let attempt = match config.tracking {
                Tracking::Database => store.apply(&events).await.map(|done| {
                    Stats::add(&stats.skipped, done.skipped);
                    (done.applied, done.last_offset)
                }),
                Tracking::Server => store
                    .apply_untracked(&events)
                    .await
                    .map(|()| (events.len() as u64, events.last().map(|e| e.offset))),
            };
            match attempt {
                Ok((applied, last_offset)) => {
                    backoff = Backoff(0);
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
                    break last_offset;
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
                        () = &mut shutdown => {
                            tracing::info!("shutting down; the batch was not applied");
                            break 'outer Ok(());
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
                                tracing::warn!(
                                    error = format!("{e:#}"),
                                    "Postgres reconnect failed"
                                )
                            }
                        }
                    }
                }
            }
        };
        if let Some(offset) = last_offset {
            if config.tracking == Tracking::Server {
                // Not confirmed by the broker: a lost store means these messages are
                // applied again after a restart (at least once).
                if let Err(e) = consumer.store_offset(offset).await {
                    break Err(anyhow::Error::new(e).context(
                        "storing the offset on the broker; restart the consumer (the \
                         messages since the last stored offset are applied again)",
                    ));
                }
            }
            stats.next_offset.store(offset + 1, Ordering::Relaxed);
            tracing::debug!(offset, "applied up to offset");
        }
    };
    let _ = handle.close().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stream_urls() {
        let e = Endpoint::parse("rabbitmq-stream://relay:p%40ss@mq1:5553/prod").expect("valid");
        assert_eq!(
            e,
            Endpoint {
                tls: false,
                user: "relay".into(),
                password: "p@ss".into(),
                host: "mq1".into(),
                port: 5553,
                vhost: "prod".into(),
            }
        );
        let e = Endpoint::parse("rabbitmq-stream+tls://mq1").expect("valid");
        assert!(e.tls);
        assert_eq!(e.port, 5551);
        assert_eq!(e.vhost, "/");
        assert_eq!(e.user, "guest");
        let e = Endpoint::parse("rabbitmq-stream://u:p@h:5552/%2f").expect("valid");
        assert_eq!(e.vhost, "/");
        let err = Endpoint::parse("amqp://u:secret@h/").expect_err("wrong scheme");
        let text = err.to_string();
        assert!(text.contains("--stream-url"), "{text}");
        assert!(!text.contains("secret"), "{text}");
        let err = Endpoint::parse("rabbitmq-stream://u:secret@h:port/").expect_err("port");
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("rabbitmq-stream://guest:secret@127.0.0.1:5552/%2f"),
            "rabbitmq-stream://guest:***@127.0.0.1:5552/%2f"
        );
        assert_eq!(
            redact("host=db user=app password=hunter2 dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
    }

    #[test]
    fn starts_after_the_stored_offset() {
        assert!(matches!(start_at(None), OffsetSpecification::First));
        assert!(matches!(
            start_at(Some(41)),
            OffsetSpecification::Offset(42)
        ));
        assert!(matches!(start_at(Some(0)), OffsetSpecification::Offset(1)));
    }

    #[test]
    fn reads_relay_messages() {
        let message = Message::builder()
            .body(br#"{"a":1}"#.to_vec())
            .properties()
            .message_id("00000000-0000-0000-0000-0000000000a1".to_string())
            .content_type("application/json")
            .message_builder()
            .application_properties()
            .insert("aggregate_type", "order")
            .insert("aggregate_id", "o-1")
            .insert("event_type", "created")
            .insert("table", "public.outbox")
            .insert("commit_lsn", "0/16B3748")
            .insert("tx_index", SimpleValue::from(3u64))
            .insert("xid", SimpleValue::from(750u64))
            .insert("tenant", "acme")
            .message_builder()
            .build();
        let e = Event::from_message(7, &message);
        assert_eq!(e.offset, 7);
        assert_eq!(
            e.message_id.as_deref(),
            Some("00000000-0000-0000-0000-0000000000a1")
        );
        assert_eq!(e.aggregate_type.as_deref(), Some("order"));
        assert_eq!(e.aggregate_id.as_deref(), Some("o-1"));
        assert_eq!(e.event_type.as_deref(), Some("created"));
        assert_eq!(e.table.as_deref(), Some("public.outbox"));
        assert_eq!(e.commit_lsn.as_deref(), Some("0/16B3748"));
        assert_eq!(e.tx_index, Some(3));
        assert_eq!(e.xid, Some(750));
        assert!(!e.replay);
        assert_eq!(e.payload, serde_json::json!({"a": 1}));

        let plain = Message::builder().body(b"plain".to_vec()).build();
        let e = Event::from_message(0, &plain);
        assert_eq!(e.message_id, None);
        assert_eq!(e.payload, serde_json::json!("plain"));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let mut b = Backoff(0);
        let waits: Vec<u64> = (0..10).map(|_| b.next().as_millis() as u64).collect();
        assert_eq!(waits[0], 100);
        assert_eq!(waits[1], 200);
        assert_eq!(*waits.last().expect("some"), 5_000);
    }
}
