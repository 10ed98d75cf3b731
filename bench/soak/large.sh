#!/usr/bin/env bash
# The heavy size/rate variants kept out of `cargo test`'s default run:
#   - one transaction of 1,000,000 rows (prints the relay's peak RSS, VmHWM);
#   - single-row transactions for 30 s from several connections at up to 10k tx/s
#     (prints the rate this machine reached).
#
#   bench/soak/large.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/test-services.sh >/dev/null
cargo test -p outbox-relay-tests --test faults large::heavy_ -- --ignored --nocapture --test-threads 1 2>&1 \
    | tee "${LARGE_LOG:-/tmp/outbox-relay-large.log}" \
    | grep -E 'peak RSS|tx/s|^test |report:|panicked' || true
grep -q 'test result: ok' "${LARGE_LOG:-/tmp/outbox-relay-large.log}"
