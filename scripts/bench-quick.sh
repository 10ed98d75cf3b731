#!/usr/bin/env bash
# A smoke run of the benchmark harness (bench/, issue #17): every scenario with
# small numbers and one run (`outbox-bench --quick`), on DEBUG builds so CI needs no
# release build. Writes the report to $CARGO_TARGET_DIR/bench-quick.md (never to
# docs/benchmarks.md) and exits non-zero if any scenario failed or produced no
# figure. The figures of a debug build are not benchmarks; see docs/benchmarks.md.
#
# Needs the services of scripts/test-services.sh and their environment, e.g.:
#   set -a; . target/test-services.env; set +a; bash scripts/bench-quick.sh
# Extra arguments go to the harness (e.g. --only stream-raw,stream-drain).
#
# lapin-light, drain-aggregate (issue #33; the relay with [rabbitmq] ordering =
# "aggregate", channels = 4), drain-hash and drain-aggregate-hash (the same into 4
# queues behind a consistent-hash exchange) run here too, as every scenario does:
# ≈ 8.5 s for the first two (2 s and 6.4 s measured on 2026-12-05 at load average
# 7-8), and two short drains more.
#
# drain-messages (issue #42) runs here too: the same 20,000 events in the same
# transaction sizes as drain, emitted as transactional logical messages into a
# database of their own, drained by the relay with [postgres] messages = ["outbox"];
# beside it the WAL bytes per event of both loads, and the table's retention DELETE
# WAL and size per event. `--only drain,drain-messages` runs just the comparison
# (76 s with the build on 2026-12-06, one run of each transaction size).
#
# steady and steady-high run their two latency baselines (issue #40: pg_recvlogical's
# commit → receipt, a raw publisher's publish → delivery) for 1 s each here, at the
# same rates as the relay (1,000/s and 10,000/s): the whole run took 94 s on
# 2026-12-06 at load average 4-8.
#
# The cluster drains (cluster-drain, cluster-stream-drain) run once each, on the
# 100-row transactions, when the 3-node cluster's URLs are known: from the environment,
# else from target/test-services.env (scripts/test-services.sh starts the cluster and
# writes them there); without them the report says they were skipped.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -z "${OUTBOX_TEST_CLUSTER_AMQP_URLS:-}" && -f "$root/target/test-services.env" ]]; then
  while IFS= read -r line; do
    case "$line" in
      OUTBOX_TEST_CLUSTER_AMQP_URLS=* | OUTBOX_TEST_CLUSTER_STREAM_URLS=*) export "$line" ;;
    esac
  done < "$root/target/test-services.env"
fi
target="${CARGO_TARGET_DIR:-$root/target}"
out="$target/bench-quick.md"
started=$(date +%s)

cargo build --locked -p outbox-relay --bin outbox-relay -p outbox-bench --bin outbox-bench
built=$(date +%s)

rm -f "$out"
rc=0
OUTBOX_BENCH_RELAY_BIN="$target/debug/outbox-relay" \
    "$target/debug/outbox-bench" --quick --out "$out" "$@" || rc=$?
finished=$(date +%s)

if [[ $rc -eq 0 && ! -s "$out" ]]; then
    echo "bench-quick: the harness wrote no report to $out" >&2
    rc=1
fi
echo "bench-quick: build $((built - started)) s, run $((finished - built)) s, total $((finished - started)) s; report: $out"
if [[ $rc -ne 0 ]]; then
    echo "bench-quick: FAILED (exit $rc)" >&2
fi
exit "$rc"
