#!/usr/bin/env bash
# Chaos soak: steady load through the real relay while it is SIGKILLed, the broker
# connection is cut and the fault Postgres cluster (55433) is restarted or crashed at
# random, with the consumer-side checker (no loss, commit order, rolled-back rows
# absent, confirmed_flush_lsn never past an unacked message) running throughout.
#
#   bench/soak/soak.sh [MINUTES]      (default 10)
#
# Needs the test services (scripts/test-services.sh). It changes nothing on the
# shared broker itself (cuts go through a TCP proxy) but restarts the fault cluster.
# Prints a final "SOAK REPORT" line: events, duplicates, max lag, violations (0, or
# the run fails with the violation).
set -euo pipefail
cd "$(dirname "$0")/../.."
MINUTES="${1:-10}"
bash scripts/test-services.sh >/dev/null
SOAK_MINUTES="$MINUTES" cargo test -p outbox-relay-tests --test faults soak::chaos_soak \
    -- --ignored --exact --nocapture 2>&1 | tee "${SOAK_LOG:-/tmp/outbox-relay-soak.log}" \
    | grep -E '^(SOAK REPORT|soak:|test |report:)|panicked|violation' || true
grep -q '^SOAK REPORT' "${SOAK_LOG:-/tmp/outbox-relay-soak.log}"
