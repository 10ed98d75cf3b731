//! The drains on a 3-node RabbitMQ cluster (issue #30; docs/operations.md, "Running
//! against a cluster"): the relay, given every node's URLs, drains the same WAL as the
//! single-node drains into a quorum queue (through an exchange) and into a stream with
//! 3 replicas. The cluster is `scripts/rabbitmq-cluster.sh`'s, found through
//! `OUTBOX_TEST_CLUSTER_AMQP_URLS` and `OUTBOX_TEST_CLUSTER_STREAM_URLS`; without them
//! the cluster scenarios are skipped, with the reason in the report.
//!
//! The queue and the stream are declared through the first node, so their leader is
//! there (RabbitMQ's default leader locator is the declaring client's node), and the
//! relay connects to that node first: the figures are those of the relay publishing on
//! the leader's node, as a relay that found the leader does (docs/operations.md, "The
//! stream's leader"), with every confirm waiting for a majority of the three nodes.

use super::*;

/// The environment variables naming the cluster's nodes.
const AMQP_ENV: &str = "OUTBOX_TEST_CLUSTER_AMQP_URLS";
const STREAM_ENV: &str = "OUTBOX_TEST_CLUSTER_STREAM_URLS";
/// How long connecting to one node may take before the next is tried.
const CONNECT: Duration = Duration::from_secs(5);

/// The cluster drains a run makes (for one transaction size): the cluster's URLs for
/// each scenario that runs.
#[derive(Debug, Clone, Default)]
pub(super) struct ClusterPlan {
    pub(super) queue: Option<ClusterUrls>,
    pub(super) stream: Option<ClusterUrls>,
}

impl ClusterPlan {
    /// The cluster scenarios `--only` asks for (all by default) whose cluster is named
    /// in the environment; each one asked for but not runnable is reported as skipped.
    pub(super) fn new(args: &Args, report: &mut Report) -> ClusterPlan {
        let urls = |var: &str| -> Option<Vec<String>> {
            let v = std::env::var(var).ok()?;
            let urls: Vec<String> = v
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_string)
                .collect();
            (!urls.is_empty()).then_some(urls)
        };
        let (amqp, stream) = (urls(AMQP_ENV), urls(STREAM_ENV));
        let how = "scripts/test-services.sh starts the cluster (scripts/rabbitmq-cluster.sh) \
                   and writes its URLs to target/test-services.env";
        let mut plan = ClusterPlan::default();
        if wants(args, "cluster-drain") {
            match &amqp {
                Some(amqp) => {
                    plan.queue = Some(ClusterUrls {
                        amqp: amqp.clone(),
                        stream: Vec::new(),
                    });
                }
                None => report.skip("cluster-drain", format!("{AMQP_ENV} is not set; {how}")),
            }
        }
        if wants(args, "cluster-stream-drain") {
            match (&amqp, &stream) {
                (Some(amqp), Some(stream)) => {
                    plan.stream = Some(ClusterUrls {
                        amqp: amqp.clone(),
                        stream: stream.clone(),
                    });
                }
                _ => {
                    let missing = if amqp.is_none() { AMQP_ENV } else { STREAM_ENV };
                    report.skip(
                        "cluster-stream-drain",
                        format!("{missing} is not set; {how}"),
                    );
                }
            }
        }
        if args.quick && (plan.queue.is_some() || plan.stream.is_some()) {
            report.skip(
                "cluster drains, 1-row tx",
                "--quick runs the cluster drains on the 100-row transactions only",
            );
        }
        plan
    }

    pub(super) fn any(&self) -> bool {
        self.queue.is_some() || self.stream.is_some()
    }

    /// The plan for one transaction size: a quick run drains the cluster only once (on
    /// the 100-row transactions), to keep the CI smoke run short.
    pub(super) fn at(&self, args: &Args, per_tx: usize) -> ClusterPlan {
        if args.quick && per_tx == 1 {
            ClusterPlan::default()
        } else {
            self.clone()
        }
    }

    /// Expects the figures of the drains this plan makes.
    pub(super) fn expect(&self, report: &mut Report, per_tx: usize) {
        for (runs, names) in [
            (self.queue.is_some(), RelayNames::queue(per_tx)),
            (self.stream.is_some(), RelayNames::stream(per_tx)),
        ] {
            if runs {
                report.expect(&[&names.rate, &names.cpu, &names.rss]);
            }
        }
    }
}

/// The figure names of one relay drain on the cluster, in the single-node drains'
/// shape.
pub(super) struct RelayNames {
    pub(super) rate: String,
    first: String,
    cpu: String,
    rss: String,
}

impl RelayNames {
    fn new(prefix: &str, per_tx: usize) -> RelayNames {
        RelayNames {
            rate: format!("{prefix} {per_tx}-row tx: relay"),
            first: format!("{prefix} {per_tx}-row tx: relay start → first message"),
            cpu: format!("{prefix} {per_tx}-row tx: relay CPU per 10k events"),
            rss: format!("{prefix} {per_tx}-row tx: relay peak RSS"),
        }
    }

    pub(super) fn queue(per_tx: usize) -> RelayNames {
        RelayNames::new("cluster drain", per_tx)
    }

    pub(super) fn stream(per_tx: usize) -> RelayNames {
        RelayNames::new("cluster stream drain", per_tx)
    }

    /// `drain-hash`: one channel, several queues behind a consistent-hash exchange.
    pub(super) fn hashed(per_tx: usize) -> RelayNames {
        RelayNames::new("hashed drain", per_tx)
    }

    /// `drain-aggregate-hash`: per-aggregate order on several channels into the same.
    pub(super) fn aggregate_hashed(per_tx: usize) -> RelayNames {
        RelayNames::new(
            &format!("hashed drain, aggregate {AGGREGATE_CHANNELS} channels,"),
            per_tx,
        )
    }

    /// Adds the medians of `runs` (when there are any): the rate under `rate_cond`,
    /// the rest under `cond`.
    pub(super) fn add(
        &self,
        report: &mut Report,
        runs: &[RelayDrain],
        cond: &str,
        rate_cond: &str,
    ) {
        if runs.is_empty() {
            return;
        }
        let pick = |f: fn(&RelayDrain) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
        report.add(&self.rate, median(pick(|r| r.rate)), "events/s", rate_cond);
        report.add(
            &self.first,
            median(pick(|r| r.first)),
            "s",
            format!("{cond}: included in the rate above"),
        );
        report.add(&self.cpu, median(pick(|r| r.cpu_per_10k)), "core-s", cond);
        report.add(&self.rss, median(pick(|r| r.peak_rss)), "MB", cond);
    }
}

/// The conditions of the cluster figures after the transaction size's.
pub(super) const QUEUE_COND: &str =
    "3-node cluster, quorum queue (3 members), the relay given the 3 nodes' URLs";
pub(super) const STREAM_COND: &str =
    "3-node cluster, stream with 3 replicas, the relay given the 3 nodes' stream URLs";

/// An AMQP connection to the first of `urls` that answers.
async fn connect_first(urls: &[String]) -> anyhow::Result<Connection> {
    for url in urls {
        if let Ok(Ok(c)) = tokio::time::timeout(
            CONNECT,
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        {
            return Ok(c);
        }
    }
    bail!(
        "no node of the cluster answers on AMQP ({} URLs in {AMQP_ENV}); start it with \
         scripts/rabbitmq-cluster.sh start, or unset {AMQP_ENV} to skip the cluster scenarios",
        urls.len()
    )
}

/// A quorum queue with a member on each of the 3 nodes, bound to a fresh exchange, with
/// a counting consumer.
async fn quorum_sink(c: &ClusterUrls) -> anyhow::Result<Sink> {
    let conn = connect_first(&c.amqp).await?;
    let mut queue_args = FieldTable::default();
    queue_args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    queue_args.insert("x-quorum-initial-group-size".into(), AMQPValue::LongInt(3));
    Sink::on(conn, queue_args, false).await
}

/// A fresh stream with 3 replicas (`x-initial-cluster-size`, declared over AMQP as
/// RabbitMQ 3.10 takes it), read from its first offset through the first node.
async fn replicated_stream_sink(c: &ClusterUrls) -> anyhow::Result<StreamSink> {
    let conn = connect_first(&c.amqp).await?;
    let stream = testkit::unique_name("bcstream");
    let mut stream_args = FieldTable::default();
    stream_args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("stream")),
    );
    stream_args.insert("x-initial-cluster-size".into(), AMQPValue::LongInt(3));
    let declared = async {
        let ch = conn.create_channel().await?;
        ch.queue_declare(
            stream.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            stream_args,
        )
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = conn.close(200, "declared".into()).await;
    declared.with_context(|| format!("declare the stream {stream} with 3 replicas"))?;
    let url = c.stream.first().context("no stream URL")?;
    let client = testkit::stream::try_client_at(url, CONNECT)
        .await
        .with_context(|| {
            format!("the cluster's first node does not answer on its stream port ({STREAM_ENV})")
        })?;
    StreamSink::on(client, stream).await
}

/// The relay draining `slot` into a quorum queue on the cluster.
pub(super) async fn cluster_queue_drain(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    c: &ClusterUrls,
) -> anyhow::Result<RelayDrain> {
    let sink = quorum_sink(c).await?;
    let target = Target::ClusterExchange(&sink.exchange, c);
    let result = drive(
        args,
        bin,
        db,
        slot,
        target,
        ConfigExtra::default(),
        &sink.count,
        &sink.first,
    )
    .await;
    sink.cleanup().await;
    result
}

/// The relay draining `slot` into a stream with 3 replicas on the cluster.
pub(super) async fn cluster_stream_drain(
    args: &Args,
    bin: &std::path::Path,
    db: &BenchDb,
    slot: &str,
    c: &ClusterUrls,
) -> anyhow::Result<RelayDrain> {
    let sink = replicated_stream_sink(c).await?;
    let target = Target::ClusterStream(&sink.stream, c);
    let result = drive(
        args,
        bin,
        db,
        slot,
        target,
        ConfigExtra::default(),
        &sink.count,
        &sink.first,
    )
    .await;
    sink.cleanup().await;
    result
}
