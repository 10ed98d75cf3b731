//! The drain scenarios in the report: for each transaction size, the figures a run
//! expects, the runs ([`drain_run`]) and the figures of their medians.

use super::*;

/// The scenarios that drain the preloaded WAL of each transaction size.
const DRAIN_SCENARIOS: [&str; 9] = [
    "drain",
    "drain-minimal",
    "drain-aggregate",
    "drain-hash",
    "drain-aggregate-hash",
    "drain-messages",
    "reader",
    "recvlogical",
    "stream-drain",
];

/// The drains of 100-row and of 1-row transactions. The cluster drains (when the
/// cluster is named in the environment) drain the same WAL as the single-node ones,
/// beside them in the report.
pub(super) async fn drain_scenarios(args: &Args, bin: &std::path::Path, report: &mut Report) {
    let cluster = ClusterPlan::new(args, report);
    for per_tx in [100usize, 1] {
        drain_size(args, bin, per_tx, &cluster.at(args, per_tx), report).await;
    }
}

/// The drains of `per_tx`-row transactions: [`drain_run`] `args.runs` times, then the
/// medians.
async fn drain_size(
    args: &Args,
    bin: &std::path::Path,
    per_tx: usize,
    cluster: &ClusterPlan,
    report: &mut Report,
) {
    if !DRAIN_SCENARIOS.iter().any(|s| wants(args, s)) && !cluster.any() {
        return;
    }
    let names = DrainNames::new(per_tx);
    expect_drains(args, per_tx, &names, report);
    cluster.expect(report, per_tx);
    let mut runs = Vec::new();
    let result: anyhow::Result<()> = async {
        for _ in 0..args.runs {
            runs.push(drain_run(args, bin, per_tx, cluster).await?);
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        report.fail(format!("drain {per_tx}-row tx"), &e);
        return;
    }
    let figures = DrainFigures {
        args,
        per_tx,
        names: &names,
        runs: &runs,
        cond: format!("N={}, {per_tx}-row transactions", args.events),
    };
    figures.baselines(report);
    figures.relay(report);
    figures.aggregate(report);
    figures.hashed(report);
    figures.stream_and_messages(report);
    figures.wal(report);
    for (scenario, e) in runs.iter().flat_map(|r| &r.failures) {
        report.fail(format!("{scenario} {per_tx}-row tx"), e);
    }
    figures.cluster(report);
}

/// The figures that the drains of `per_tx`-row transactions must produce.
fn expect_drains(args: &Args, per_tx: usize, names: &DrainNames, report: &mut Report) {
    if wants(args, "recvlogical") {
        report.expect(&[&names.recvlogical]);
    }
    if wants(args, "reader") {
        report.expect(&[&names.reader]);
    }
    if wants(args, "drain") {
        report.expect(&[&names.relay, &names.relay_cpu, &names.relay_rss]);
    }
    if wants(args, "drain-minimal") {
        report.expect(&[&names.minimal, &names.minimal_cpu]);
    }
    if wants(args, "drain-aggregate") {
        report.expect(&[&names.aggregate, &names.aggregate_cpu]);
        if wants(args, "drain") {
            report.expect(&[&names.aggregate_ratio]);
        } else if per_tx == 100 {
            report.skip(
                "drain-aggregate / drain ratio",
                "needs the single-channel drain in the same run: add drain to --only",
            );
        }
    }
    if wants(args, "drain-hash") {
        report.expect(&[&RelayNames::hashed(per_tx).rate]);
    }
    if wants(args, "drain-aggregate-hash") {
        report.expect(&[&RelayNames::aggregate_hashed(per_tx).rate]);
        for (other, name) in [
            ("drain", &names.hashed_ratio),
            ("drain-hash", &names.hashed_channels_ratio),
        ] {
            if wants(args, other) {
                report.expect(&[name]);
            }
        }
    }
    if wants(args, "stream-drain") {
        report.expect(&[&names.stream, &names.stream_cpu, &names.stream_rss]);
    }
    if wants(args, "drain") || wants(args, "drain-messages") {
        report.expect(&[
            &names.table_wal,
            &names.table_delete_wal,
            &names.table_total_wal,
            &names.table_size,
        ]);
    }
    if wants(args, "drain-messages") {
        report.expect(&[
            &names.messages,
            &names.messages_cpu,
            &names.messages_wal,
            &names.messages_wal_ratio,
        ]);
    }
}

/// The runs of one transaction size's drains, and what their figures are named.
struct DrainFigures<'a> {
    args: &'a Args,
    per_tx: usize,
    names: &'a DrainNames,
    runs: &'a [DrainRun],
    /// The conditions of every figure: N and the transaction size.
    cond: String,
}

impl DrainFigures<'_> {
    /// The values `f` finds in the runs (those that have one).
    fn pick(&self, f: fn(&DrainRun) -> Option<f64>) -> Vec<f64> {
        self.runs.iter().filter_map(f).collect()
    }

    /// The relay drains `f` finds in the runs.
    fn drains(&self, f: fn(&DrainRun) -> Option<RelayDrain>) -> Vec<RelayDrain> {
        self.runs.iter().filter_map(f).collect()
    }

    /// pg_recvlogical and the reader alone.
    fn baselines(&self, report: &mut Report) {
        let (names, cond) = (self.names, &self.cond);
        let recv = self.pick(|r| r.recvlogical);
        if !recv.is_empty() {
            report.add(&names.recvlogical, median(recv), "rows/s", cond);
        }
        let reader = self.pick(|r| r.reader);
        if !reader.is_empty() {
            report.add(&names.reader, median(reader), "rows/s", cond);
        }
    }

    /// The default drain, and the same with the minimal headers.
    fn relay(&self, report: &mut Report) {
        let (args, names, cond) = (self.args, self.names, &self.cond);
        let relay = self.pick(|r| r.relay.map(|m| m.rate));
        if !relay.is_empty() {
            report.add(
                &names.relay,
                median(relay),
                "events/s",
                format!(
                    "{cond}, window {}, until the queue's consumer has all",
                    args.window
                ),
            );
            let first = self.pick(|r| r.relay.map(|m| m.first));
            report.add(
                &names.relay_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = self.pick(|r| r.relay.map(|m| m.cpu_per_10k));
            report.add(&names.relay_cpu, median(cpu), "core-s", cond);
            let rss = self.pick(|r| r.relay.map(|m| m.peak_rss));
            report.add(&names.relay_rss, median(rss), "MB", cond);
        }
        let minimal = self.pick(|r| r.minimal.map(|m| m.rate));
        if !minimal.is_empty() {
            report.add(
                &names.minimal,
                median(minimal),
                "events/s",
                format!(
                    "{cond}, window {}, [message] headers = \"minimal\", until the queue's consumer has all",
                    args.window
                ),
            );
            let cpu = self.pick(|r| r.minimal.map(|m| m.cpu_per_10k));
            report.add(&names.minimal_cpu, median(cpu), "core-s", cond);
        }
    }

    /// `ordering = "aggregate"` over several channels, and its ratio to the default
    /// drain.
    fn aggregate(&self, report: &mut Report) {
        let (args, names, cond) = (self.args, self.names, &self.cond);
        let aggregate = self.pick(|r| r.aggregate.map(|m| m.rate));
        if aggregate.is_empty() {
            return;
        }
        let how = format!(
            "[rabbitmq] ordering = \"aggregate\", channels = {AGGREGATE_CHANNELS}, \
             {} distinct aggregate ids",
            args.events
        );
        report.add(
            &names.aggregate,
            median(aggregate),
            "events/s",
            format!(
                "{cond}, window {}, {how}, until the queue's consumer has all",
                args.window
            ),
        );
        let first = self.pick(|r| r.aggregate.map(|m| m.first));
        report.add(
            &names.aggregate_first,
            median(first),
            "s",
            format!("{cond}: included in the rate above"),
        );
        let cpu = self.pick(|r| r.aggregate.map(|m| m.cpu_per_10k));
        report.add(&names.aggregate_cpu, median(cpu), "core-s", cond);
        let rss = self.pick(|r| r.aggregate.map(|m| m.peak_rss));
        report.add(&names.aggregate_rss, median(rss), "MB", cond);
        // Each run's ratio (the two drains back to back on the same WAL), then
        // their median: the load of one run hits both alike.
        let ratio = self.pick(|r| Some(r.aggregate?.rate / r.relay?.rate));
        if !ratio.is_empty() {
            report.add(
                &names.aggregate_ratio,
                median(ratio),
                "×",
                format!("{cond}: the median of each run's ratio of the two rates"),
            );
        }
    }

    /// The drains into several queues behind a consistent-hash exchange, and their
    /// ratios.
    fn hashed(&self, report: &mut Report) {
        let (args, names, cond, per_tx) = (self.args, self.names, &self.cond, self.per_tx);
        let cond_hash = format!(
            "{cond}, {HASH_QUEUES} queues behind a consistent-hash exchange on the {HASH_HEADER} header"
        );
        let rate_cond = format!(
            "{cond_hash}, window {}, until the queues' consumers have all",
            args.window
        );
        let hashed = self.drains(|r| r.hashed);
        RelayNames::hashed(per_tx).add(report, &hashed, &cond_hash, &rate_cond);
        let aggregate_hashed = self.drains(|r| r.aggregate_hashed);
        let rate_cond = format!(
            "{rate_cond}, [rabbitmq] ordering = \"aggregate\", channels = {AGGREGATE_CHANNELS}"
        );
        RelayNames::aggregate_hashed(per_tx).add(report, &aggregate_hashed, &cond_hash, &rate_cond);
        // Per run, as for the aggregate ratio: against the default drain (one
        // channel, one queue: the move a user makes) and against one channel into the
        // same queues (the channels' own share).
        for (name, ratio, against) in [
            (
                &names.hashed_ratio,
                self.pick(|r| Some(r.aggregate_hashed?.rate / r.relay?.rate)),
                "the default drain (1 channel, 1 queue)",
            ),
            (
                &names.hashed_channels_ratio,
                self.pick(|r| Some(r.aggregate_hashed?.rate / r.hashed?.rate)),
                "1 channel into the same queues",
            ),
        ] {
            if !ratio.is_empty() {
                report.add(
                    name,
                    median(ratio),
                    "×",
                    format!("{cond}: the median of each run's ratio, against {against}"),
                );
            }
        }
    }

    /// The drain into a stream, and `drain-messages`.
    fn stream_and_messages(&self, report: &mut Report) {
        let (args, names, cond) = (self.args, self.names, &self.cond);
        let stream = self.pick(|r| r.stream.map(|m| m.rate));
        if !stream.is_empty() {
            report.add(
                &names.stream,
                median(stream),
                "events/s",
                format!(
                    "{cond}, window {}, until a consumer from the stream's first offset has all",
                    args.window
                ),
            );
            let first = self.pick(|r| r.stream.map(|m| m.first));
            report.add(
                &names.stream_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = self.pick(|r| r.stream.map(|m| m.cpu_per_10k));
            report.add(&names.stream_cpu, median(cpu), "core-s", cond);
            let rss = self.pick(|r| r.stream.map(|m| m.peak_rss));
            report.add(&names.stream_rss, median(rss), "MB", cond);
        }
        let messages = self.pick(|r| r.messages.map(|m| m.rate));
        if !messages.is_empty() {
            report.add(
                &names.messages,
                median(messages),
                "events/s",
                format!(
                    "{cond} each emitting the events as transactional logical messages \
                     (pg_logical_emit_message(true, 'outbox', json): outbox_emit's content), \
                     the relay with [postgres] messages = [\"outbox\"] and no table, window {}, \
                     until the queue's consumer has all",
                    args.window
                ),
            );
            let first = self.pick(|r| r.messages.map(|m| m.first));
            report.add(
                &names.messages_first,
                median(first),
                "s",
                format!("{cond}: included in the rate above"),
            );
            let cpu = self.pick(|r| r.messages.map(|m| m.cpu_per_10k));
            report.add(&names.messages_cpu, median(cpu), "core-s", cond);
            let rss = self.pick(|r| r.messages.map(|m| m.peak_rss));
            report.add(&names.messages_rss, median(rss), "MB", cond);
        }
    }

    /// The WAL each source writes per event, and what the table costs besides
    /// (docs/messages.md, "Messages or a table"). pg_current_wal_lsn() is the
    /// cluster's: anything else running on it meanwhile counts too.
    fn wal(&self, report: &mut Report) {
        let (names, cond) = (self.names, &self.cond);
        let wal_cond = format!(
            "{cond}: pg_wal_lsn_diff of pg_current_wal_lsn() before and after, over N \
             (cluster-wide)"
        );
        let table_wal = self.pick(|r| r.table.map(|t| t.insert_wal));
        if !table_wal.is_empty() {
            report.add(
                &names.table_wal,
                median(table_wal),
                "bytes",
                format!("{wal_cond}: the inserts"),
            );
            let delete = self.pick(|r| r.table.map(|t| t.delete_wal));
            report.add(
                &names.table_delete_wal,
                median(delete),
                "bytes",
                format!(
                    "{wal_cond}: DELETE FROM outbox after the drains, as retention deletes \
                     (vacuum's WAL not included)"
                ),
            );
            let total = self.pick(|r| r.table.map(|t| t.insert_wal + t.delete_wal));
            report.add(
                &names.table_total_wal,
                median(total),
                "bytes",
                format!("{wal_cond}: the inserts and the retention DELETE"),
            );
            let size = self.pick(|r| r.table.map(|t| t.size));
            report.add(
                &names.table_size,
                median(size),
                "bytes",
                format!(
                    "{cond}: pg_total_relation_size of the outbox (heap, primary key, TOAST) \
                     before the DELETE, over N: the space logical messages never use"
                ),
            );
        }
        let messages_wal = self.pick(|r| r.messages_wal);
        if !messages_wal.is_empty() {
            report.add(
                &names.messages_wal,
                median(messages_wal),
                "bytes",
                format!("{wal_cond}: the messages (nothing to delete later)"),
            );
            let ratio =
                self.pick(|r| Some(r.messages_wal? / (r.table?.insert_wal + r.table?.delete_wal)));
            report.add(
                &names.messages_wal_ratio,
                median(ratio),
                "×",
                format!("{cond}: the median of each run's ratio"),
            );
        }
    }

    /// The drains on the cluster: into a quorum queue and into a replicated stream.
    fn cluster(&self, report: &mut Report) {
        let (args, cond, per_tx) = (self.args, &self.cond, self.per_tx);
        let queue = self.drains(|r| r.cluster);
        let c = format!("{cond}, {QUEUE_COND}");
        let rate_cond = format!(
            "{c}, window {}, until the queue's consumer has all",
            args.window
        );
        RelayNames::queue(per_tx).add(report, &queue, &c, &rate_cond);
        let stream = self.drains(|r| r.cluster_stream);
        let c = format!("{cond}, {STREAM_COND}");
        let rate_cond = format!(
            "{c}, window {}, until a consumer from the stream's first offset has all",
            args.window
        );
        RelayNames::stream(per_tx).add(report, &stream, &c, &rate_cond);
    }
}

/// The figure names of one transaction size's drain.
struct DrainNames {
    recvlogical: String,
    reader: String,
    relay: String,
    relay_first: String,
    relay_cpu: String,
    relay_rss: String,
    minimal: String,
    minimal_cpu: String,
    aggregate: String,
    aggregate_first: String,
    aggregate_cpu: String,
    aggregate_rss: String,
    aggregate_ratio: String,
    hashed_ratio: String,
    hashed_channels_ratio: String,
    stream: String,
    stream_first: String,
    stream_cpu: String,
    stream_rss: String,
    messages: String,
    messages_first: String,
    messages_cpu: String,
    messages_rss: String,
    messages_wal: String,
    messages_wal_ratio: String,
    table_wal: String,
    table_delete_wal: String,
    table_total_wal: String,
    table_size: String,
}

impl DrainNames {
    fn new(per_tx: usize) -> DrainNames {
        DrainNames {
            recvlogical: format!("pg_recvlogical {per_tx}-row tx"),
            reader: format!("reader {per_tx}-row tx"),
            relay: format!("drain {per_tx}-row tx: relay"),
            relay_first: format!("drain {per_tx}-row tx: relay start → first message"),
            relay_cpu: format!("drain {per_tx}-row tx: relay CPU per 10k events"),
            relay_rss: format!("drain {per_tx}-row tx: relay peak RSS"),
            minimal: format!("drain {per_tx}-row tx: relay, minimal headers"),
            minimal_cpu: format!(
                "drain {per_tx}-row tx: relay CPU per 10k events, minimal headers"
            ),
            aggregate: aggregate_name(per_tx),
            aggregate_first: format!(
                "drain {per_tx}-row tx: relay start → first message, aggregate {AGGREGATE_CHANNELS} channels"
            ),
            aggregate_cpu: aggregate_cpu_name(per_tx),
            aggregate_rss: format!(
                "drain {per_tx}-row tx: relay peak RSS, aggregate {AGGREGATE_CHANNELS} channels"
            ),
            aggregate_ratio: aggregate_ratio_name(per_tx),
            hashed_ratio: hashed_ratio_name(per_tx),
            hashed_channels_ratio: format!(
                "hashed drain {per_tx}-row tx: aggregate {AGGREGATE_CHANNELS} channels / 1 channel, {HASH_QUEUES} queues"
            ),
            stream: format!("stream drain {per_tx}-row tx: relay"),
            stream_first: format!("stream drain {per_tx}-row tx: relay start → first message"),
            stream_cpu: format!("stream drain {per_tx}-row tx: relay CPU per 10k events"),
            stream_rss: format!("stream drain {per_tx}-row tx: relay peak RSS"),
            messages: format!("drain-messages {per_tx}-row tx: relay"),
            messages_first: format!(
                "drain-messages {per_tx}-row tx: relay start → first message"
            ),
            messages_cpu: format!("drain-messages {per_tx}-row tx: relay CPU per 10k events"),
            messages_rss: format!("drain-messages {per_tx}-row tx: relay peak RSS"),
            messages_wal: messages_wal_name(per_tx),
            messages_wal_ratio: messages_wal_ratio_name(per_tx),
            table_wal: format!("drain {per_tx}-row tx: WAL per event"),
            table_delete_wal: format!("drain {per_tx}-row tx: retention DELETE WAL per event"),
            table_total_wal: table_total_wal_name(per_tx),
            table_size: format!(
                "drain {per_tx}-row tx: table size per event (bloat messages avoid)"
            ),
        }
    }
}
