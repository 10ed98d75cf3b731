//! The relay draining a backlog, and large transactions.

use super::*;

#[derive(Default)]
pub(super) struct DrainRun {
    pub(super) recvlogical: Option<f64>,
    pub(super) reader: Option<f64>,
    /// The relay publishing to a queue (through an exchange).
    pub(super) relay: Option<RelayDrain>,
    /// The same with `[message] headers = "minimal"`.
    pub(super) minimal: Option<RelayDrain>,
    /// The same with `[rabbitmq] ordering = "aggregate"` over [`AGGREGATE_CHANNELS`]
    /// channels.
    pub(super) aggregate: Option<RelayDrain>,
    /// The relay on one channel, into [`HASH_QUEUES`] queues behind a consistent-hash
    /// exchange on the aggregate id.
    pub(super) hashed: Option<RelayDrain>,
    /// `ordering = "aggregate"` over [`AGGREGATE_CHANNELS`] channels into the same
    /// shape: each aggregate on one channel and in one queue.
    pub(super) aggregate_hashed: Option<RelayDrain>,
    /// The relay publishing to a stream.
    pub(super) stream: Option<RelayDrain>,
    /// The relay publishing to a quorum queue on the cluster.
    pub(super) cluster: Option<RelayDrain>,
    /// The relay publishing to a 3-replica stream on the cluster.
    pub(super) cluster_stream: Option<RelayDrain>,
    /// `drain-messages`: the relay draining the same number of events written as
    /// logical messages (docs/messages.md) into a queue.
    pub(super) messages: Option<RelayDrain>,
    /// The table's WAL and size, per event: the load (the inserts), the retention
    /// `DELETE` of the rows after the drains, and the table's size before it.
    pub(super) table: Option<TableCost>,
    /// WAL bytes per event of the `drain-messages` load.
    pub(super) messages_wal: Option<f64>,
    /// The drains that failed on their own (scenario, error): the cluster drains and
    /// `drain-aggregate`, reported without losing the other figures of the run.
    pub(super) failures: Vec<(&'static str, anyhow::Error)>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct RelayDrain {
    pub(super) rate: f64,
    /// Seconds from starting the relay to the first message at the consumer.
    pub(super) first: f64,
    pub(super) cpu_per_10k: f64,
    pub(super) peak_rss: f64,
}

/// What the outbox table costs per event, beside the relay's drain: what logical
/// messages avoid (docs/messages.md, "Messages or a table").
#[derive(Debug, Clone, Copy)]
pub(super) struct TableCost {
    /// WAL bytes of the inserts (`pg_current_wal_lsn()` before and after the load).
    pub(super) insert_wal: f64,
    /// WAL bytes of `DELETE FROM outbox` run after the drains (what retention writes).
    pub(super) delete_wal: f64,
    /// `pg_total_relation_size` of the outbox before that delete.
    pub(super) size: f64,
}

/// What the `drain-messages` relay adds to its `[postgres]` section: the load's
/// prefix, and no outbox table (its database has none).
pub(super) fn messages_keys() -> String {
    format!("messages = [{MESSAGE_PREFIX:?}]\ntables = []")
}

/// The channels of the `drain-aggregate` scenario's relay.
pub(super) const AGGREGATE_CHANNELS: usize = 4;

/// The queues behind the consistent-hash exchange of `drain-hash` and
/// `drain-aggregate-hash`.
pub(super) const HASH_QUEUES: usize = 4;

/// What the `drain-aggregate` scenario adds to the relay's `[rabbitmq]` section: events
/// of one aggregate stay in order on one of [`AGGREGATE_CHANNELS`] channels (the
/// preloaded rows' aggregate ids are all distinct, so they spread over all of them).
pub(super) fn aggregate_keys() -> String {
    format!("ordering = \"aggregate\"\nchannels = {AGGREGATE_CHANNELS}")
}

/// One database, six slots over the same WAL: pg_recvlogical, the reader, the relay
/// to a queue (with all headers, with the minimal ones, and with per-aggregate ordering
/// over several channels), the relay to a stream; and one more for each drain on the
/// cluster that `cluster` plans. Then the table's own costs (the load's WAL, the
/// retention DELETE's, its size) and `drain-messages`: the same events as logical
/// messages in a database of their own.
pub(super) async fn drain_run(
    args: &Args,
    bin: &std::path::Path,
    per_tx: usize,
    cluster: &ClusterPlan,
) -> anyhow::Result<DrainRun> {
    let n = args.events;
    let db = BenchDb::new();
    let recv_slot = db.create_slot();
    let reader_slot = db.create_slot();
    let relay_slot = db.create_slot();
    let stream_slot = db.create_slot();
    let minimal_slot = db.create_slot();
    let aggregate_slot = db.create_slot();
    let hashed_slot = db.create_slot();
    let aggregate_hashed_slot = db.create_slot();
    let cluster_slot = cluster.queue.as_ref().map(|_| db.create_slot());
    let cluster_stream_slot = cluster.stream.as_ref().map(|_| db.create_slot());
    let insert_wal = db.preload(n, per_tx);
    let end_lsn = db.current_lsn();
    let mut out = DrainRun::default();

    if wants(args, "recvlogical") {
        out.recvlogical = Some(recvlogical_rate(&db, &recv_slot, &end_lsn, n)?);
    }

    if wants(args, "reader") {
        out.reader = Some(reader_rate(&db, reader_slot, &end_lsn, n).await?);
    }

    if wants(args, "drain") {
        let extra = ConfigExtra::default();
        out.relay = Some(queue_drain(args, bin, &db, &relay_slot, extra).await?);
    }

    // Right after the single-channel drain, so that all see the same load: the relay
    // on several channels and into several queues, each failing on its own.
    let slots = [&aggregate_slot, &hashed_slot, &aggregate_hashed_slot];
    optional_drains(args, bin, &db, slots.map(String::as_str), &mut out).await;

    if wants(args, "drain-minimal") {
        let extra = ConfigExtra {
            sections: "[message]\nheaders = \"minimal\"",
            ..Default::default()
        };
        out.minimal = Some(queue_drain(args, bin, &db, &minimal_slot, extra).await?);
    }

    if wants(args, "stream-drain") {
        let sink = StreamSink::new().await?;
        let target = Target::Stream(&sink.stream);
        let result = drive(
            args,
            bin,
            &db,
            &stream_slot,
            target,
            ConfigExtra::default(),
            &sink.count,
            &sink.first,
        )
        .await;
        sink.cleanup().await;
        out.stream = Some(result?);
    }

    if let (Some(c), Some(slot)) = (&cluster.queue, &cluster_slot) {
        match cluster_queue_drain(args, bin, &db, slot, c).await {
            Ok(m) => out.cluster = Some(m),
            Err(e) => out.failures.push(("cluster-drain", e)),
        }
    }
    if let (Some(c), Some(slot)) = (&cluster.stream, &cluster_stream_slot) {
        match cluster_stream_drain(args, bin, &db, slot, c).await {
            Ok(m) => out.cluster_stream = Some(m),
            Err(e) => out.failures.push(("cluster-stream-drain", e)),
        }
    }

    // After every drain of the table (its WAL would slow their reading): what the
    // table costs beyond the inserts, retention's DELETE and the space, for the
    // comparison with logical messages.
    if wants(args, "drain") || wants(args, "drain-messages") {
        let size = db.outbox_bytes();
        let delete_wal = db.delete_outbox();
        out.table = Some(TableCost {
            insert_wal: insert_wal as f64 / n as f64,
            delete_wal: delete_wal as f64 / n as f64,
            size: size as f64 / n as f64,
        });
    }

    if wants(args, "drain-messages") {
        match messages_drain(args, bin, per_tx).await {
            Ok((m, wal)) => {
                out.messages = Some(m);
                out.messages_wal = Some(wal);
            }
            Err(e) => out.failures.push(("drain-messages", e)),
        }
    }
    Ok(out)
}

/// The drains that fail on their own, beside the other figures of the run (into
/// `out`): the relay on several channels, and the same two relays into several
/// queues (a consistent-hash exchange on the aggregate id), where the broker's work
/// spreads over several queue processes; on `slots`, in that order.
async fn optional_drains(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    [aggregate_slot, hashed_slot, aggregate_hashed_slot]: [&str; 3],
    out: &mut DrainRun,
) {
    let keys = aggregate_keys();
    let aggregate = ConfigExtra {
        rabbitmq: &keys,
        ..Default::default()
    };
    type Field = fn(&mut DrainRun) -> &mut Option<RelayDrain>;
    let optional: [(&'static str, bool, ConfigExtra<'_>, &str, Field); 3] = [
        ("drain-aggregate", false, aggregate, aggregate_slot, |o| {
            &mut o.aggregate
        }),
        (
            "drain-hash",
            true,
            ConfigExtra::default(),
            hashed_slot,
            |o| &mut o.hashed,
        ),
        (
            "drain-aggregate-hash",
            true,
            aggregate,
            aggregate_hashed_slot,
            |o| &mut o.aggregate_hashed,
        ),
    ];
    for (scenario, hashed, extra, slot, field) in optional {
        if !wants(args, scenario) {
            continue;
        }
        let result = if hashed {
            hashed_drain(args, bin, db, slot, extra).await
        } else {
            queue_drain(args, bin, db, slot, extra).await
        };
        match result {
            Ok(m) => *field(out) = Some(m),
            Err(e) => out.failures.push((scenario, e)),
        }
    }
}

/// pg_recvlogical alone draining `slot` up to `end_lsn` (`n` events): its rate.
fn recvlogical_rate(db: &BenchDb, slot: &str, end_lsn: &str, n: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let status = recvlogical(db, slot)
        .args(["--no-loop", "-E", end_lsn, "-f", "/dev/null"])
        .status()
        .context("run pg_recvlogical")?;
    if !status.success() {
        bail!("pg_recvlogical failed");
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// The WAL reader alone draining `slot` up to `end_lsn` (`n` events): its rate.
async fn reader_rate(db: &BenchDb, slot: String, end_lsn: &str, n: usize) -> anyhow::Result<f64> {
    let end: Lsn = end_lsn.parse()?;
    let cfg = ReaderConfig {
        conn: PgConnectOptions::parse(&db.db.conninfo())?,
        slot,
        publication: db.publication.clone(),
        tables: vec![TableName::parse("public.outbox").context("table")?],
        messages: Vec::new(),
        mapping: ColumnMapping::default(),
        start_lsn: None,
        status_interval: Duration::from_secs(1),
        max_in_flight: 10_000,
    };
    let start = Instant::now();
    let reader = WalReader::start(cfg).await?;
    let (tx, mut rx) = mpsc::channel(64);
    let (acked, acked_rx) = watch::channel(Lsn::ZERO);
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(reader.run(tx, acked_rx, stop_rx));
    let mut events = 0usize;
    'outer: while let Some(batch) = rx.recv().await {
        for item in batch {
            match item {
                WalItem::Event(_) => events += 1,
                WalItem::Commit(c) => {
                    if c.end_lsn >= end || events >= n {
                        let _ = acked.send(c.end_lsn);
                        break 'outer;
                    }
                }
                WalItem::Keepalive(_) => {}
            }
        }
    }
    let elapsed = start.elapsed();
    let _ = stop.send(true);
    while rx.recv().await.is_some() {}
    drop(acked);
    let _ = task.await;
    if events < n {
        bail!("reader saw {events} of {n} events");
    }
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// `drain-messages`: a database of its own without an outbox table, `args.events`
/// transactional logical messages emitted in transactions of `per_tx` (the content
/// `outbox_emit` writes for the rows the table drain inserts), then the relay with
/// `[postgres] messages` draining them into a queue. Returns the drain and the load's
/// WAL bytes per event.
async fn messages_drain(
    args: &Args,
    bin: &std::path::Path,
    per_tx: usize,
) -> anyhow::Result<(RelayDrain, f64)> {
    let n = args.events;
    let db = BenchDb::without_table();
    let slot = db.create_slot();
    let wal = db.preload_messages(n, per_tx);
    let keys = messages_keys();
    let extra = ConfigExtra {
        postgres: &keys,
        ..Default::default()
    };
    let drained = queue_drain(args, bin, &db, &slot, extra).await?;
    Ok((drained, wal as f64 / n as f64))
}

/// The relay draining `slot` into a queue, `extra` added to its config.
pub(super) async fn queue_drain(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    extra: ConfigExtra<'_>,
) -> anyhow::Result<RelayDrain> {
    let sink = Sink::new(false).await?;
    let target = Target::Exchange(&sink.exchange);
    let result = drive(args, bin, db, slot, target, extra, &sink.count, &sink.first).await;
    sink.cleanup().await;
    result
}

/// The relay draining `slot` into [`HASH_QUEUES`] queues behind a consistent-hash
/// exchange on the `aggregate_id` header, `extra` added to its config.
async fn hashed_drain(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    extra: ConfigExtra<'_>,
) -> anyhow::Result<RelayDrain> {
    let sink = Sink::hashed(HASH_QUEUES).await.context(
        "a consistent-hash exchange (is the plugin rabbitmq_consistent_hash_exchange \
         enabled? scripts/test-services.sh enables it)",
    )?;
    // The exchange is the operator's (a plugin type, with its `hash-header`
    // argument): the relay only checks that it exists (docs/streams.md).
    let keys = format!("{}\ndeclare_exchange = false", extra.rabbitmq);
    let extra = ConfigExtra {
        rabbitmq: &keys,
        ..extra
    };
    let target = Target::Exchange(&sink.exchange);
    let result = drive(args, bin, db, slot, target, extra, &sink.count, &sink.first).await;
    sink.cleanup().await;
    result
}

/// Starts the relay on `slot` towards `target` (`extra` added to its config), waits
/// until the sink behind `count`/`first` holds all `args.events`, stops the relay and
/// measures the drain. The caller cleans its sink up, whatever the result.
#[allow(clippy::too_many_arguments)]
pub(super) async fn drive(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    target: Target<'_>,
    extra: ConfigExtra<'_>,
    count: &std::sync::atomic::AtomicUsize,
    first: &std::sync::OnceLock<Instant>,
) -> anyhow::Result<RelayDrain> {
    let n = args.events;
    let start = Instant::now();
    let mut relay = RelayProc::start_with(bin, db, slot, target, args.window, extra)?;
    let end = wait_relay(count, n, wait(args), &mut relay).await?;
    let first = first.get().copied().unwrap_or(end);
    let measured = relay_drain(&relay, n, start, first, end);
    relay.stop();
    Ok(measured)
}

/// `pg_recvlogical` streaming `slot` of `db` with pgoutput (protocol 1, the bench's
/// publication), as the relay reads it; the caller adds where it ends and its output.
pub(super) fn recvlogical(db: &BenchDb, slot: &str) -> std::process::Command {
    let mut c = std::process::Command::new("pg_recvlogical");
    c.args(["-d", &db.db.conninfo(), "--slot", slot, "--start"])
        .args(["-o", "proto_version=1", "-o"])
        .arg(format!("publication_names={}", db.publication));
    c
}

/// The rate, start-up time, CPU per 10k events and peak RSS of a relay started at
/// `start` that delivered its first event at `first` and all `n` at `end`.
pub(super) fn relay_drain(
    relay: &RelayProc,
    n: usize,
    start: Instant,
    first: Instant,
    end: Instant,
) -> RelayDrain {
    let cpu = relay.cpu_seconds();
    // The table rounds to 0.01 core-s per 10k (1 µs per event): finer here, for
    // comparisons such as tracing on and off (docs/benchmarks.md, "Tracing").
    eprintln!(
        "relay CPU: {cpu:.2} s for {n} events, {:.2} µs per event",
        cpu / n as f64 * 1e6
    );
    RelayDrain {
        rate: n as f64 / (end - start).as_secs_f64(),
        first: (first - start).as_secs_f64(),
        cpu_per_10k: cpu / n as f64 * 10_000.0,
        peak_rss: relay.peak_rss_mb(),
    }
}

/// A fresh database with a slot, a fresh sink (`measure_latency`: see [`Sink::new`]),
/// and the relay between them, given `settle` to start streaming.
pub(super) async fn relay_to_sink(
    args: &Args,
    bin: &std::path::Path,
    measure_latency: bool,
    settle: Duration,
) -> anyhow::Result<(BenchDb, Sink, RelayProc)> {
    let db = BenchDb::new();
    let slot = db.create_slot();
    let sink = Sink::new(measure_latency).await?;
    let relay = RelayProc::start(
        bin,
        &db,
        &slot,
        Target::Exchange(&sink.exchange),
        args.window,
    )?;
    tokio::time::sleep(settle).await;
    Ok((db, sink, relay))
}

/// `large`: one transaction of `args.large_rows` rows.
pub(super) async fn large_scenario(args: &Args, bin: &std::path::Path, report: &mut Report) {
    if !wants(args, "large") {
        return;
    }
    report.expect(&["large tx: commit → all received", "large tx relay peak RSS"]);
    if let Err(e) = large(args, bin, report).await {
        report.fail("large", &e);
    }
}

pub(super) async fn large(
    args: &Args,
    bin: &std::path::Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (db, sink, mut relay) = relay_to_sink(args, bin, false, Duration::from_secs(1)).await?;
    let n = args.large_rows;
    let start = Instant::now();
    let name = db.db.name.clone();
    tokio::task::spawn_blocking(move || {
        testkit::psql(
            &name,
            &format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'bench', n::text, 'tick', {PAYLOAD_SQL} FROM generate_series(1, {n}) AS s(n)"
            ),
        )
    })
    .await?;
    let committed = Instant::now();
    let end = wait_relay(&sink.count, n, wait(args), &mut relay).await?;
    let cond = format!("one transaction of {n} rows, window {}", args.window);
    report.add(
        "large tx: commit → all received",
        (end - committed).as_secs_f64(),
        "s",
        &cond,
    );
    report.add(
        "large tx: insert + relay total",
        (end - start).as_secs_f64(),
        "s",
        &cond,
    );
    report.add("large tx relay peak RSS", relay.peak_rss_mb(), "MB", &cond);
    relay.stop();
    sink.cleanup().await;
    Ok(())
}
