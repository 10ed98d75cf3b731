#!/usr/bin/env bash
# The test command: prepares the services the tests need (idempotent), then runs the
# whole workspace's tests against them. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/test-services.sh >/dev/null
set -a
# shellcheck disable=SC1091
. target/test-services.env
set +a
exec cargo test --workspace --locked "$@"
