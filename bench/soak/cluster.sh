#!/usr/bin/env bash
# The heavy cluster tests kept out of `cargo test`'s default run (tests/cluster/):
# a rolling restart of all three nodes and a 20 s partition of the relay's node, with a
# quorum queue and with a 3-replica stream. Prints what each fault cost (pause,
# duplicates) and the cluster's memory.
#
#   bench/soak/cluster.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/test-services.sh >/dev/null
set -a
# shellcheck disable=SC1091
. target/test-services.env
set +a
cargo test --locked -p outbox-relay-tests --test cluster heavy_ -- --ignored --nocapture --test-threads 1 2>&1 \
    | tee "${CLUSTER_LOG:-/tmp/outbox-relay-cluster.log}" \
    | grep -E '^fault |^test |report:|messages for|panicked' || true
bash scripts/rabbitmq-cluster.sh rss
grep -q 'test result: ok' "${CLUSTER_LOG:-/tmp/outbox-relay-cluster.log}"
